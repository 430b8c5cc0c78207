"""Downstream evaluation in the loop (the `eval` group): lm-eval's tasks scored by the run's model in its layout at
eval.every steps and the last, logged as eval/<task>/<metric>."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hpctrain.core.config import EvalConfig, EvalMode
from hpctrain.core.errors import ConfigError
from hpctrain.core.shard_format import read_manifest
from hpctrain.models.cross_entropy import IGNORE_INDEX

# Compiled blocks recompile for every new shape: their batches' lengths are rounded up to a multiple of this. Eager
# ones take the batch's longest (rounding to 16 cost 18 % more tokens and 16 % of the throughput, `bench eval`).
PAD_COMPILED = 64


class Scorer:
    """lm-eval's rows scored by the step's model: longest first, `rows` at a time, batch j on data-parallel rank
    j % dp (every rank runs as many forwards: FSDP gathers with its peers), the scores summed over dp so that every
    rank returns all of them (`dp_mesh` None: one process)."""

    def __init__(self, step, dp_mesh, rows: int, max_length: int, pad_to: int = 1):
        self.step, self.dp_mesh, self.rows, self.max_length, self.pad_to = step, dp_mesh, rows, max_length, pad_to

    def __call__(self, rows: Sequence[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """`rows`: (tokens of context + continuation, how many of the last are the continuation) each."""
        if not rows:
            return []
        out = torch.zeros((len(rows), 2), dtype=torch.float64)
        for idx in self._shares(rows):
            # (a rank without a batch left scores one row all the same: a forward in step with the others)
            scores = self.step.score(*_padded([rows[i] for i in idx or [0]], self.max_length, self.pad_to))
            if idx:
                out[idx] = scores
        if self._dp() > 1:
            dist.all_reduce(out, group=self.dp_mesh.get_group())
        return [(ll, bool(greedy)) for ll, greedy in out.tolist()]

    def _dp(self) -> int:
        return self.dp_mesh.size() if self.dp_mesh is not None else 1

    def _shares(self, rows):
        """This rank's batches (row indices), longest rows first, batch j on rank j % dp; as many on every rank:
        an empty one where a rank has none left."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        batches = [order[i:i + self.rows] for i in range(0, len(order), self.rows)]
        dp, me = self._dp(), self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0
        for r in range(math.ceil(len(batches) / dp)):
            j = r * dp + me
            yield batches[j] if j < len(batches) else []


class Generator(Scorer):
    """Greedy continuations by the step's model, split over dp as Scorer's rows (every rank runs as many forwards:
    a batch ends when every row of every rank's batch is done), gathered on every rank."""

    def __call__(self, rows: Sequence[tuple[list[int], int]], done) -> list[list[int]]:
        """`rows`: (context tokens, tokens to generate at most); `done(i, tokens)`: row i may stop."""
        if not rows:
            return []
        mine: dict[int, list[int]] = {}
        for idx in self._shares(rows):  # (none: forwards in step with the others all the same)
            mine.update(zip(idx, self._greedy([rows[i] for i in idx] or [rows[0]], idx, done)))
        if self._dp() > 1:
            every = [None] * self._dp()
            dist.all_gather_object(every, mine, group=self.dp_mesh.get_group())
            mine = {k: v for part in every for k, v in part.items()}
        return [mine[i] for i in range(len(rows))]

    def _greedy(self, batch, idx, done) -> list[list[int]]:
        lengths = [len(context) for context, _ in batch]
        steps = self._agreed(max(n for _, n in batch), dist.ReduceOp.MAX)
        tokens = torch.zeros((len(batch), max(lengths) + steps), dtype=torch.int64)
        for i, (context, _) in enumerate(batch):
            tokens[i, :len(context)] = torch.tensor(context)
        made: list[list[int]] = [[] for _ in batch]
        for _ in range(steps):
            nxt = self.step.next_tokens(tokens[:, :max(lengths)], torch.tensor(lengths) - 1)
            for i, (_, n) in enumerate(batch):
                if len(made[i]) < n and not (idx and done(idx[i], made[i])):
                    made[i].append(int(nxt[i]))
                tokens[i, lengths[i]] = nxt[i]
                lengths[i] += 1
            finished = not idx or all(len(m) >= n or done(k, m) for k, m, (_, n) in zip(idx, made, batch))
            if self._agreed(int(finished), dist.ReduceOp.MIN):
                break
        return made

    def _agreed(self, value: int, op) -> int:
        """`value` reduced over the data-parallel ranks (all of them decide together)."""
        if self._dp() == 1:
            return value
        t = torch.tensor([value])
        dist.all_reduce(t, op=op, group=self.dp_mesh.get_group())
        return int(t.item())


def _padded(rows: Sequence[tuple[list[int], int]], max_length: int, pad_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] inputs, [B, T] targets, -100 where nothing is scored: the context and the padding); T the longest
    row's, rounded up to a multiple of `pad_to`."""
    length = max(len(tokens) for tokens, _ in rows) - 1
    length = min(-(-length // pad_to) * pad_to, max_length)
    inputs = torch.zeros((len(rows), length), dtype=torch.int64)
    targets = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.int64)
    for i, (tokens, n_cont) in enumerate(rows):
        n = len(tokens) - 1
        inputs[i, :n] = torch.tensor(tokens[:-1])
        targets[i, n - n_cont:n] = torch.tensor(tokens[-n_cont:])
    return inputs, targets


def tokenizer_of(data_dir: str):
    """The shards' tokenizer as transformers loads it — what an export carries and lm-eval's hf model reads."""
    from transformers import AutoTokenizer

    manifest = read_manifest(data_dir)
    path = os.path.dirname(os.path.join(data_dir, manifest.tokenizer.path))
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"eval.tasks need the shards' tokenizer as transformers reads it ({path}): "
                          f"{' '.join(str(e).split())[:200]}") from None


def max_length(ecfg: EvalConfig, seq_len: int) -> int:
    return ecfg.max_length or seq_len


def check_scoring_layout(layout) -> None:
    """A layout that can score requests: not a pipeline split by context parallelism."""
    if layout.pipelined and layout.cp > 1:
        raise ConfigError(f"eval.tasks scored with parallel.pp={layout.pp} and cp={layout.cp}: a pipeline scores in its "
                          "training shape, which context parallelism splits; score in a layout without pp or cp "
                          "(eval.mode=job with 'eval.job_args=[parallel=fsdp]', or `hpctrain eval ... parallel=fsdp`)")


def check(ecfg: EvalConfig, layout, data_dir: str, seq_len: int, max_seq_len: int) -> None:
    """The eval group before a run starts: lengths the model and layout can score, the tokenizer, the tasks (known,
    loadable, none sampling); one-line ConfigError."""
    if not ecfg.tasks:
        return
    if ecfg.every < 0 or ecfg.batch_size < 1 or (ecfg.limit is not None and ecfg.limit <= 0) or \
            (ecfg.num_fewshot is not None and ecfg.num_fewshot < 0) or (ecfg.max_length is not None and ecfg.max_length < 1):
        raise ConfigError(f"eval.every={ecfg.every}, eval.batch_size={ecfg.batch_size}, eval.limit={ecfg.limit}, "
                          f"eval.num_fewshot={ecfg.num_fewshot}, eval.max_length={ecfg.max_length}: need every >= 0 (0: "
                          "the last step only), batch_size >= 1, limit > 0 or null, num_fewshot >= 0 or null, "
                          "max_length >= 1 or null")
    length = max_length(ecfg, seq_len)
    if length > max_seq_len:
        raise ConfigError(f"eval.max_length={length} exceeds model.max_seq_len={max_seq_len}: lower eval.max_length")
    if layout.pipelined and length > seq_len:
        raise ConfigError(f"eval.max_length={length} with parallel.pp={layout.pp}: a pipeline scores in its training "
                          f"shape, at most train.seq_len={seq_len} tokens; lower eval.max_length")
    if ecfg.mode == EvalMode.loop:
        check_scoring_layout(layout)
    tokenizer_of(data_dir)
    from hpctrain.evaluation import harness  # (lm-eval: imported only where tasks are asked for)

    harness.check_tasks(ecfg, length)


class DownstreamEval:
    """The in-loop component: due at eval.every steps and the last; every rank runs it, the main rank logs."""

    def __init__(self, ecfg: EvalConfig, last_step: int, step, dp_mesh, data_dir: str, seq_len: int, metrics,
                 samples_dir: str | None, compiled: bool = False):
        """`samples_dir`: where eval.log_samples writes (the main rank's; None elsewhere); `compiled`: the model's
        blocks are (parallel.compile)."""
        self.ecfg, self.last_step, self.metrics, self.samples_dir = ecfg, last_step, metrics, samples_dir
        self.enabled = bool(ecfg.tasks) and EvalMode(ecfg.mode) == EvalMode.loop  # (job: eval_jobs.EvalJobs)
        self.tokenizer = tokenizer_of(data_dir) if ecfg.tasks else None
        self.max_length = max_length(ecfg, seq_len)
        self.scorer = Scorer(step, dp_mesh, step.score_rows(ecfg.batch_size), self.max_length,
                             PAD_COMPILED if compiled else 1)
        self.generator = Generator(step, dp_mesh, step.score_rows(ecfg.batch_size), self.max_length)

    def due(self, step: int) -> bool:
        return self.enabled and ((self.ecfg.every and step % self.ecfg.every == 0) or step == self.last_step)

    def run(self, state) -> dict:
        """Score the model now and log eval/<task>/<metric> at the run's step."""
        record = {"step": state.step, **self.score(state.step)}
        self.metrics.log(record)
        return record

    def score(self, step: int) -> dict[str, float]:
        """eval/<task>/<metric> of the model as it is (every rank; the scores on every rank whose LOCAL_RANK is
        0); with eval.log_samples each request's answers in <samples_dir>/step-<step>/."""
        from hpctrain.evaluation import harness

        lm = harness.HpctrainLM(self.tokenizer, self.scorer, self.max_length, self.generator)
        results = harness.evaluate(lm, self.ecfg, log_samples=self.ecfg.log_samples)
        if self.ecfg.log_samples and self.samples_dir:
            harness.write_samples(results, os.path.join(self.samples_dir, f"step-{step}"))
        return harness.scores(results)
