"""The training split as the step consumes it: the shard stream at the run's position, bound to the run's
tokenizer and data lanes, timed (the loop's data wait)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from hpctrain.core.config import DataConfig, OnMaxEpochs, TrainConfig
from hpctrain.core.errors import TrainingError
from hpctrain.data.loader import DataError, ShardStream, check_files, choose_lanes, read_manifest
from hpctrain.data.mixture import (
    MixtureStream,
    Schedule,
    Source,
    check_nonempty,
    check_sources,
    weights_valid,
)
from hpctrain.runs.resolve import RunShape
from hpctrain.training.step import Groups

log = logging.getLogger("hpctrain")


def eval_microbatches(n_samples: int, eval_batches: int, shape) -> int:
    """How many micro-batches an evaluation covers: train.eval_batches global batches of the validation split,
    fewer when the split is shorter, a multiple of dp so that every rank runs as many."""
    wanted = eval_batches * shape.global_batch // shape.micro_batch
    return min(wanted, n_samples // shape.micro_batch) // shape.dp * shape.dp


@dataclass(frozen=True)
class ValSplit:
    """The validation split as an evaluation reads it: in order (the same samples in every layout), in the run's
    micro-batches, train.eval_batches global batches of it."""

    data_dir: str
    shape: RunShape
    seed: int
    on_corrupt: str
    eval_batches: int

    @classmethod
    def of(cls, data_dir: str, shape: RunShape, data: DataConfig, train: TrainConfig) -> ValSplit:
        return cls(data_dir, shape, train.seed, data.on_corrupt, train.eval_batches)

    @classmethod
    def per_source(cls, shape: RunShape, data: DataConfig, train: TrainConfig) -> dict[str, ValSplit]:
        """A mixture's sources whose validation split holds an evaluation (a micro-batch per dp rank at least), by
        name: each is evaluated apart (val_loss/<source>)."""
        out = {}
        for source in sources(data):
            split = cls(source.path, shape, train.seed, data.on_corrupt, train.eval_batches)
            if eval_microbatches(read_manifest(source.path).num_samples("val"), train.eval_batches, shape):
                out[source.name] = split
            else:
                log.warning("source %r has no validation split large enough for an evaluation (train.micro_batch x "
                            "dp samples): no val_loss/%s", source.name, source.name)
        return out

    def stream(self) -> ShardStream:
        return ShardStream(self.data_dir, "val", self.shape.micro_batch, self.seed, loop=False, shuffle=False,
                           on_corrupt=self.on_corrupt)

    def _batches(self, stream: ShardStream) -> Iterator[torch.Tensor]:
        n = eval_microbatches(stream.manifest.num_samples("val"), self.eval_batches, self.shape)
        return (batch for _, batch in zip(range(n), stream))

    def share(self, dp_rank: int) -> Iterator[torch.Tensor]:
        """This data-parallel rank's share of an evaluation: micro-batch j goes to rank j % dp."""
        dp = self.shape.dp
        return (batch for j, batch in enumerate(self._batches(self.stream())) if j % dp == dp_rank)

    def text_bytes(self) -> tuple[int, int] | None:
        """(targets, the UTF-8 bytes of text they stand for) over a whole evaluation, every rank's share: what turns
        the mean token loss into bits per byte. None, with a warning, where the shards' tokenizer cannot be read."""
        from data_prep.tokenizer import load_tokenizer, token_bytes

        stream = self.stream()
        try:
            table = torch.tensor(token_bytes(load_tokenizer(os.path.join(self.data_dir,
                                                                         stream.manifest.tokenizer.path))))
        except DataError as e:
            log.warning("no val_bpb: %s", e)
            return None
        targets = nbytes = 0
        for batch in self._batches(stream):
            targets += batch[:, 1:].numel()
            nbytes += int(table[batch[:, 1:].long()].sum())
        return targets, nbytes


def check_bound(run: dict, dcfg: DataConfig, seed: int, data_dir: str, manifest=None, dp: int | None = None) -> None:
    """A run state (`RunState.state_dict()`, or the `run` of a checkpoint's trainer_state.json) against this run's
    `data` group, train.seed, shards and data-parallel size `dp` (given): the tokenizer the weights were trained on
    and what fixes the order of the samples (lanes, seed, shuffling) cannot change on resume, and the lanes must
    divide among the dp ranks (one TrainingError line)."""
    manifest = manifest or read_manifest(data_dir)
    was = run.get("tokenizer_sha256")
    if was not in (None, manifest.tokenizer.sha256):
        raise TrainingError(f"the shards in {data_dir} were tokenised with a different tokenizer than this run's "
                            f"checkpoints (sha256 {manifest.tokenizer.sha256[:12]} vs {was[:12]}): point data.path "
                            "at shards built with the run's tokenizer, or start a new run_dir")
    lanes = run.get("data_lanes")
    if lanes is not None and dcfg.lanes is not None and dcfg.lanes != lanes:
        raise TrainingError(f"data.lanes={dcfg.lanes} but this run was trained with {lanes} lanes: drop the "
                            f"override or set data.lanes={lanes} (lanes fix the sample order)")
    if lanes is not None and dp and lanes % dp:
        fits = [d for d in range(1, lanes + 1) if lanes % d == 0]
        raise TrainingError(f"this run reads its data through {lanes} lanes, which dp={dp} ranks cannot share (lanes "
                            f"fix the sample order): resume at a dp among {fits}, or start over (train.resume=never)")
    step = run.get("step") or 0
    bound = [("train.seed", run.get("data_seed"), seed), ("data.shuffle", run.get("data_shuffle"), bool(dcfg.shuffle))]
    if step and "data_mixture" in run:  # (a checkpoint older than mixtures records neither; one shard set None)
        bound += [("data.sources", run["data_mixture"] or [], mixture(dcfg) or []),
                  # the phases begun by the step it resumes at (later ones may change)
                  ("data.schedule", _begun(run.get("data_schedule"), step), _begun(phases(dcfg), step))]
    for key, was, now in bound:
        if was is not None and was != now:
            raise TrainingError(f"{key}={now} but this run was trained with {key}={was}, which fixes the order of its "
                                f"samples: drop the override or set {key}={was} (or start over: train.resume=never)")


def mixture(dcfg: DataConfig) -> list | None:
    """data.sources as the run state records them ([[name, weight], ...]; None for one shard set)."""
    return [[s.name, float(s.weight)] for s in dcfg.sources] or None


def phases(dcfg: DataConfig) -> list | None:
    """data.schedule as the run state records them: [[step, [a weight per source, in data.sources' order]], ...]
    (None without one); DataError (one line) for a phase naming no source of the mixture or out of order."""
    if not dcfg.schedule:
        return None
    names = [s.name for s in dcfg.sources]
    if not names:
        raise DataError("data.schedule changes the weights of data.sources, and there are none: list the sources")
    out = []
    for phase in dcfg.schedule:
        unknown = sorted(set(phase.weights) - set(names))
        if unknown:
            raise DataError(f"data.schedule at step {phase.step} names {unknown}, not among data.sources {names}: "
                            "fix the name")
        if phase.step < 2 or (out and phase.step <= out[-1][0]):
            raise DataError(f"data.schedule steps {[p.step for p in dcfg.schedule]}: each >= 2 (data.sources' weights "
                            "are step 1's) and later than the one before")
        weights = [float(phase.weights.get(name, 0.0)) for name in names]
        if not weights_valid(weights):
            raise DataError(f"data.schedule at step {phase.step}: weights {dict(zip(names, weights))}: every weight "
                            "must be >= 0 and one > 0, all finite")
        out.append([int(phase.step), weights])
    return out


def _begun(schedule: list | None, step: int) -> list:
    """[step, weights] of the phases begun by `step` (a recorded phase's start sample left out)."""
    return [p[:2] for p in schedule or () if p[0] <= step]


def phase_starts(dcfg: DataConfig, global_batch: int, step: int = 0, samples: int = 0,
                 recorded: list | None = None) -> list:
    """data.schedule as the run state records it: [[step, [weight per source], global sample where it begins], ...]
    for a run at `step` and global sample `samples`. A phase begins at its step: one already begun keeps the sample
    `recorded` for it (the run state's), a later one begins global_batch samples a step from the run's position, so
    neither a rollback's skipped window nor a train.global_batch changed on resume moves a phase off its step. For a
    new run, step k (from 1) trains on samples [(k - 1)·global_batch, k·global_batch)."""
    began = {p[0]: p[2] for p in recorded or () if len(p) > 2 and p[0] <= step}
    return [[s, weights, began.get(s, (s - 1) * global_batch) if s <= step  # (no start recorded: a new run's)
             else samples + (s - 1 - step) * global_batch] for s, weights in phases(dcfg) or ()]


def check_epochs(stream: MixtureStream, dcfg: DataConfig, max_steps: int, global_batch: int) -> None:
    """data.max_epochs: no source of the mixture gives more epochs over train.max_steps (DataError, or a warning with
    data.on_max_epochs=warn); each source's epochs are logged at every logged step (data_epochs/<source>)."""
    if dcfg.max_epochs is None:
        return
    epochs = stream.counts(max_steps * global_batch) / stream.epoch_samples
    for source, e in zip(stream.sources, epochs):
        if e > dcfg.max_epochs:
            msg = (f"source {source.name!r} ({source.path}) would give {e:.2f} epochs over train.max_steps={max_steps} "
                   f"(data.max_epochs={dcfg.max_epochs}): give it more data or a smaller weight, raise data.max_epochs, "
                   "or set data.on_max_epochs=warn")
            if OnMaxEpochs(dcfg.on_max_epochs) == OnMaxEpochs.error:
                raise DataError(msg)
            log.warning(msg)


def mixture_summary(dcfg: DataConfig, max_steps: int, global_batch: int, seq_len: int) -> str:
    """The mixture as `plan` prints it: each source's weight, samples and tokens over train.max_steps and the epochs
    of its train split they make (where its manifest can be read here), and the schedule's phases."""
    total, mixed = max_steps * global_batch, sources(dcfg)
    schedule = Schedule([(0, [s.weight for s in mixed]), *schedule_samples(dcfg, global_batch)])
    lines = [f"\ndata mixture over train.max_steps={max_steps} ({total} samples of {seq_len} tokens):"]
    for source, n in zip(mixed, schedule.counts(len(mixed), 1, total).sum(axis=1)):
        try:
            per_epoch = read_manifest(source.path).num_samples("train")
            epochs = f", {n / per_epoch:.2f} epochs of its {per_epoch} samples"
        except (DataError, OSError):
            epochs = " (its shards are not readable here: epochs unknown)"
        lines.append(f"  {source.name:12} weight {source.weight:g}: {n} samples, {n * seq_len / 1e9:.4f}B tokens{epochs}")
    for step, weights in phases(dcfg) or ():
        lines.append(f"  from step {step}: " + ", ".join(f"{s.name} {w:g}" for s, w in zip(mixed, weights)))
    return "\n".join(lines)


def schedule_samples(dcfg: DataConfig, global_batch: int, recorded: list | None = None) -> list[tuple[int, list]]:
    """The phases as MixtureStream takes them: (global sample where each begins, its weights), from the run state's
    record (`phase_starts`), else a new run's."""
    return [(start, weights) for _, weights, start in recorded or phase_starts(dcfg, global_batch)]


def sources(dcfg: DataConfig) -> list[Source]:
    return [Source(s.name, os.path.expanduser(s.path), float(s.weight)) for s in dcfg.sources]


def data_lanes(dcfg: DataConfig, dp: int, manifest) -> int:
    """The lanes a new run reads with: data.lanes, else chosen for `manifest`'s shards — for a mixture, as many as its
    smallest source allows (every source is read through all of them; an error names the source)."""
    if not dcfg.sources:
        return choose_lanes(dcfg.lanes, dp, manifest)
    lanes = []
    for source in sources(dcfg):
        m = read_manifest(source.path)
        check_nonempty(source, m, "train")
        try:
            lanes.append(choose_lanes(dcfg.lanes, dp, m))
        except DataError as e:
            raise DataError(f"source {source.name!r} ({source.path}): {e}") from None
    return min(lanes)


def check_mixture(dcfg: DataConfig, shape: RunShape, train: TrainConfig, data_dir: str, manifest) -> None:
    """data.sources before any spawn: mixable with data.path (its tokenizer and blocks), each source's train shards
    there and enough for the lanes, the weights, the epochs; with evaluations, each source's val shards there."""
    mixed = sources(dcfg)
    check_sources([Source("data.path", data_dir, 1.0), *mixed], [manifest, *(read_manifest(s.path) for s in mixed)])
    stream = MixtureStream(mixed, "train", shape.micro_batch, train.seed, shuffle=dcfg.shuffle,
                           lanes=data_lanes(dcfg, shape.dp, manifest), dp_size=shape.dp,
                           global_batch=shape.global_batch, on_corrupt=dcfg.on_corrupt,
                           schedule=schedule_samples(dcfg, shape.global_batch))
    check_epochs(stream, dcfg, train.max_steps, shape.global_batch)
    for source in mixed if train.eval_every else ():
        check_files(source.path, read_manifest(source.path), "val")


def bind_run(dcfg: DataConfig, seed: int, data_dir: str, state, shape: RunShape) -> int:
    """Check the shards and the sample order against what the run was trained on (`check_bound`), record them in
    the run state; return the data lanes (a mixture's: as many as its smallest source allows)."""
    manifest = read_manifest(data_dir)
    check_bound(state.state_dict(), dcfg, seed, data_dir, manifest)
    state.tokenizer_sha256 = manifest.tokenizer.sha256
    state.data_lanes = state.data_lanes or data_lanes(dcfg, shape.dp, manifest)
    state.data_seed, state.data_shuffle, state.data_mixture = seed, bool(dcfg.shuffle), mixture(dcfg)
    state.data_schedule = phase_starts(dcfg, shape.global_batch, state.step, state.samples, state.data_schedule) or None
    return state.data_lanes


class TrainFeed:
    """Micro-batches of this data-parallel rank, from the run's sample position on."""

    def __init__(self, dcfg: DataConfig, seed: int, data_dir: str, shape, state, device: torch.device, dp_mesh):
        """`dcfg`: the `data` group; `seed`: train.seed; `dp_mesh`: the ranks the global batch is split over
        (`Layout.batch_mesh`)."""
        lanes = bind_run(dcfg, seed, data_dir, state, shape)
        pin = device.type == "cuda" if dcfg.pin_memory is None else dcfg.pin_memory

        def stream(start_sample: int) -> ShardStream | MixtureStream:
            if dcfg.sources:
                return MixtureStream(
                    sources(dcfg), "train", shape.micro_batch, seed, start_sample=start_sample, shuffle=dcfg.shuffle,
                    lanes=lanes, dp_rank=dp_mesh.get_local_rank(), dp_size=shape.dp, global_batch=shape.global_batch,
                    pin_memory=pin, on_corrupt=dcfg.on_corrupt,
                    schedule=schedule_samples(dcfg, shape.global_batch, state.data_schedule))
            return ShardStream(
                data_dir, "train", shape.micro_batch, seed, start_sample=start_sample,
                shuffle=dcfg.shuffle, num_workers=dcfg.num_workers, lanes=lanes,
                dp_rank=dp_mesh.get_local_rank(), dp_size=shape.dp, global_batch=shape.global_batch,
                pin_memory=pin, on_corrupt=dcfg.on_corrupt, prefetch=dcfg.prefetch)

        self._make_stream, self.stream = stream, stream(state.samples)
        self.dcfg, self.state, self.dp_mesh, self.grad_accum, self.shape = dcfg, state, dp_mesh, shape.grad_accum, shape
        self._it, self._wait, self._corrupt_before = iter(self.stream), 0.0, 0

    def seek(self, samples: int) -> None:
        """Continue from global sample position `samples` (a rollback skipping a data window: the run state is the
        checkpoint's, at `samples`; the phases it has not begun begin at their steps from there)."""
        self._it.close()  # its loader workers stop
        self.state.data_schedule = phase_starts(self.dcfg, self.shape.global_batch, self.state.step, samples,
                                                self.state.data_schedule) or None
        self._corrupt_before += self.stream.corrupt_shards
        self.stream = self._make_stream(samples)
        self._it = iter(self.stream)

    def next_step(self):
        """The step's micro-batches, pulled one at a time as the step consumes them: memory stays one
        micro-batch whatever the accumulation."""
        return itertools.islice(self._timed(), self.grad_accum)

    def _timed(self):
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(self._it)
            except StopIteration:
                return
            finally:
                self._wait += time.perf_counter() - t0
            yield batch

    @property
    def source_names(self) -> list[str]:
        """A mixture's sources, in data.sources' order (none for one shard set)."""
        return [s.name for s in self.stream.sources] if isinstance(self.stream, MixtureStream) else []

    def step_groups(self, samples: int) -> Groups | None:
        """The source of each of this rank's samples in the step starting at global sample `samples`, in the order
        `next_step` delivers them (global samples ≡ dp rank mod dp); None for one shard set."""
        if not isinstance(self.stream, MixtureStream):
            return None
        local = self.shape.global_batch // self.shape.dp
        g = samples + self.dp_mesh.get_local_rank() + np.arange(local) * self.shape.dp
        return Groups(torch.from_numpy(self.stream.schedule.source(g)), len(self.stream.sources))

    def take_wait(self) -> float:
        """Seconds spent waiting for data since the last call."""
        wait, self._wait = self._wait, 0.0
        return wait

    def figures(self, samples: int) -> dict:
        """What a logged step records of the data at global sample `samples`: shards skipped as corrupt on all
        ranks (collective over dp) and, for a mixture, each source's samples, target tokens and epochs so far."""
        out = {"data_corrupt_shards": self.corrupt_total()}
        if isinstance(self.stream, MixtureStream):
            counts = self.stream.counts(samples)
            for source, n, epochs in zip(self.stream.sources, counts, counts / self.stream.epoch_samples):
                out[f"data_samples/{source.name}"] = int(n)
                out[f"data_tokens/{source.name}"] = int(n) * (self.stream.block_len - 1)
                out[f"data_epochs/{source.name}"] = round(float(epochs), 4)
        return out

    @property
    def corrupt_shards(self) -> int:
        return self._corrupt_before + self.stream.corrupt_shards

    def corrupt_total(self) -> int:
        """Shards skipped as corrupt on all data-parallel ranks (collective over dp)."""
        n = torch.tensor([self.corrupt_shards], dtype=torch.int64)
        if self.dp_mesh.size() > 1:
            torch.distributed.all_reduce(n, group=self.dp_mesh.get_group())
        return int(n.item())
