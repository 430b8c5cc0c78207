"""When the run saves, what a checkpoint holds, and where a run resumes from."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hpctrain.core.config import ClusterConfig, TrainConfig, signal_number
from hpctrain.core.errors import TrainingError
from hpctrain.parallel.norms import all_finite
from hpctrain.parallel.vote import OverlappedVote, any_rank
from hpctrain.runtime.job import in_slurm_job
from hpctrain.storage import checkpoint
from hpctrain.training.cadence import Cadence
from hpctrain.training.optimizer import Schedule, hyperparameters, reapply
from hpctrain.training.precision import AgreedGradScaler
from hpctrain.training.spikes import LossSpikeGuard
from hpctrain.training.state import RunState
from hpctrain.training.step import params_finite

log = logging.getLogger("hpctrain")


def checkpoint_bytes(tcfg: TrainConfig, params: float, optim_state: float) -> float:
    """A checkpoint of `params` parameters: fp32 parameters and the optimizer's state (on disk: every rank's share
    once); 0 with train.checkpointing=false."""
    return 4 * params + optim_state if tcfg.checkpointing else 0


def host_copy_bytes(tcfg: TrainConfig, params: float, optim_state: float, shard: int) -> float:
    """train.ckpt_async copies each rank's share of a checkpoint to host memory and keeps it between saves: host
    memory per rank, beside the device's."""
    return checkpoint_bytes(tcfg, params, optim_state) / shard if tcfg.ckpt_async else 0


class SignalLead:
    """Under Slurm: whether a save at the time limit's warning signal, `lead_s` (cluster.signal_lead_s) before the
    kill, can finish; such a save killed, the requeued run resumes from the checkpoint before it. A stop takes effect
    one step after the step its signal arrives in (StopSignals' overlapped vote, started right after each step), so
    at worst the signal finds a periodic save under way (its write, or an asynchronous one, still to finish) and an
    evaluation still to run, then two steps, then the stop's own save: 2 steps + an evaluation + 2 writes, from the
    longest step (after the first) and evaluation seen and each save's write. Said at the first save that has them,
    warned (once) at a save that would not fit."""

    def __init__(self, lead_s: float | None, signame: str, main: bool):
        self.lead_s, self.signame, self.main = lead_s, signame, main
        self.step_s = self.eval_s = 0.0
        self._steps = 0
        self._told = self._warned = False

    @classmethod
    def of(cls, cluster: ClusterConfig, main: bool) -> SignalLead:
        """Inside a Slurm job, its time limit's warning (cluster.signal, cluster.signal_lead_s); else nothing to
        check."""
        return cls(cluster.signal_lead_s if in_slurm_job() else None,
                   signal_number(cluster.signal).name.removeprefix("SIG"), main)

    def after_step(self, step_s: float) -> None:
        self._steps += 1
        if self._steps > 1:  # (the first builds and compiles)
            self.step_s = max(self.step_s, step_s)

    def after_eval(self, eval_s: float) -> None:
        self.eval_s = max(self.eval_s, eval_s)

    def after_write(self, write_s: float) -> None:
        if self.lead_s is None or not self.main or self._warned or not self.step_s:
            return
        need = 2 * self.step_s + self.eval_s + 2 * write_s
        how = (f"two steps of {self.step_s:.2f} s, " + (f"an evaluation of {self.eval_s:.2f} s, " if self.eval_s else "")
               + f"and two writes of {write_s:.2f} s: one the signal may find under way, then its own")
        if need > self.lead_s:
            self._warned = True
            more = 10 * math.ceil(1.25 * need / 10)
            log.warning("a save at the time limit's warning signal could need about %.0f s (%s), more than "
                        "cluster.signal_lead_s=%g: it would be killed and the requeued run resume from the checkpoint "
                        "before; submit with cluster.signal_lead_s=%d (an sbatch template: --signal=%s@%d)",
                        need, how, self.lead_s, more, self.signame, more)
        elif not self._told:
            self._told = True
            log.info("a save at the time limit's warning signal needs at most about %.1f s (%s) of the %g s "
                     "cluster.signal_lead_s gives", need, how, self.lead_s)


class _NonFinite(Exception):
    """The weights of a checkpoint being written are not all finite (on some rank)."""


@dataclass
class _Write:
    """A checkpoint being written in the background."""

    step: int
    future: Future  # its result: when the background thread was done with it
    started: float


class Checkpointer:
    """Saves the model and optimizer (sharded, DCP) with the JSON state of the run's other stateful parts.

    `parts`: name -> object with `state_dict()` / `load_state_dict()` that every checkpoint must hold;
    `optional`: the same, None where this run has none (an fp16 loss scaler). `enabled=False`
    (train.checkpointing=false, for benchmarks): nothing is written, but the weights are still checked finite
    whenever a save was due, so a diverged run still fails.

    `asynchronous` (train.ckpt_async): a save pauses training only while the state is copied to host memory (made
    by the first save, then reused; pinned on GPU); a background thread checks the copy's weights finite and writes
    it, with its own gloo group; rank 0's thread renames it complete and moves `latest` once DCP's coordinator has
    every rank's shards and the metadata on disk, so a crash at any point resumes from the previous one. At most
    one write is in flight; the ranks agree after each step (`poll`) whether every rank's write has finished, so a
    failed write (or non-finite weights) stops every rank at the same step.
    `stall_s` / `write_s`: how long each save held training back, and how long each took to reach the disk.
    """

    def __init__(self, run_dir: str, t: TrainConfig, model, optimizer, parts: dict, optional: dict | None = None,
                 timeout_s: float = 600.0, expected: dict | None = None, mtbf_s: float | None = None,
                 lead: SignalLead | None = None):
        """`t`: the run's `train` config (ckpt_every, ckpt_keep, max_steps, checkpointing, ckpt_async,
        ckpt_write_threads); `timeout_s`: the background writes' group timeout; `expected`: the whole model's
        weights (ModelSpec.weights), which a checkpoint must hold exactly to be loaded; `mtbf_s`: the job's mean
        time between failures (for ckpt_every=auto); `lead`: the time limit's warning, checked against each write."""
        self.run_dir, self.keep, self.last_step = run_dir, t.ckpt_keep, t.max_steps
        # (auto without checkpoints has no save to measure: the weights are then checked at the end only)
        self.cadence = Cadence(t.ckpt_every if t.checkpointing or t.ckpt_every != "auto" else 0, mtbf_s)
        self.enabled, self.threads = t.checkpointing, t.ckpt_write_threads
        self.asynchronous = t.ckpt_async and t.checkpointing
        self.model, self.optimizer, self.timeout_s = model, optimizer, timeout_s
        self.parts, self.optional, self.expected = parts, optional or {}, expected
        self._settings = hyperparameters(optimizer)  # as built from optim.*: they win over a checkpoint's
        self.lead = lead or SignalLead(None, "", False)
        self.stall_s: list[float] = []
        self.write_s: list[float] = []
        self._writing: _Write | None = None
        self._done = OverlappedVote()
        self._stager = self._group = None
        if self.asynchronous:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=gpu))
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-checkpoint")

    def due(self, step: int, stopping: bool = False) -> bool:
        return bool(stopping or self.cadence.due(step) or step == self.last_step)

    def save(self, step: int) -> None:
        """Checkpoint `step` (collective). Asynchronous: after the previous write has finished."""
        t0 = time.perf_counter()
        self.wait()
        if not self.asynchronous and not params_finite(self.model):
            raise self._nonfinite(step)
        if not self.enabled:
            return
        doc = {name: part.state_dict() for name, part in self.parts.items()}
        doc.update({name: part.state_dict() if part is not None else None for name, part in self.optional.items()})
        if self.asynchronous:
            doc = json.loads(json.dumps(doc))  # a copy: the parts move on while the write runs
            if self._group is None:  # made at the first save (collective), destroyed by close()
                self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            tmp = checkpoint.begin(self.run_dir, step)
            staged = self._stager.stage(checkpoint.state_of(self.model, self.optimizer))
            self._writing = _Write(step, self._writer.submit(self._write, staged, tmp, step, doc), t0)
            self.stall_s.append(time.perf_counter() - t0)
            log.info("checkpoint step %d: training held %.2f s (copy to host memory); writing in the background",
                     step, self.stall_s[-1])
        else:
            path = checkpoint.save(self.run_dir, step, self.model, self.optimizer, doc, self.keep, self.threads)
            self.stall_s.append(time.perf_counter() - t0)
            self.write_s.append(self.stall_s[-1])
            log.info("checkpoint %s written in %.2f s", path, self.write_s[-1])
            self.lead.after_write(self.write_s[-1])
        self.cadence.saved(step, self.stall_s[-1])

    def _write(self, staged: dict, tmp: str, step: int, trainer_state: dict) -> float:
        """The background thread: the host copy's weights checked finite on every rank, then written; rank 0
        publishes it, since DCP's coordinator returns only once every rank's shards and the metadata are written."""
        if not all_finite(list(staged["model"].values()), self._group):
            raise _NonFinite
        checkpoint.write(staged, tmp, self.threads, self._group)
        if dist.get_rank() == 0:
            checkpoint.publish(self.run_dir, step, trainer_state, self.keep)
        return time.perf_counter()

    def _nonfinite(self, step: int) -> TrainingError:
        return TrainingError(
            f"the parameters are not finite after step {step}; no checkpoint written (the last good one: "
            f"{checkpoint.latest(self.run_dir) or 'none'}): lower optim.lr or raise optim.warmup_steps, then "
            "resume from it with train.resume=PATH")

    def poll(self) -> None:
        """After each step (collective): once every rank has finished the write in flight, take its outcome."""
        if self._writing is None:
            return
        answer = self._done.collect()
        if answer is not None and not answer[0]:
            self.wait()
        else:
            self._done.start([0 if self._writing.future.done() else 1])

    def wait(self) -> None:
        """Wait for the write in flight, if any (collective); a write that failed on any rank ends the run on all."""
        w, self._writing = self._writing, None
        if w is None:
            return
        self._done.drop(drain=True)
        error = finished = None
        try:
            finished = w.future.result()
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            error = e
        if any_rank(error is not None):
            raise self._failed(w.step, error)
        self.write_s.append(finished - w.started)
        log.info("checkpoint step %d written in %.2f s (in the background)", w.step, self.write_s[-1])
        self.lead.after_write(self.write_s[-1])

    def _failed(self, step: int, error: BaseException | None) -> TrainingError:
        """The partial directory of a failed background write removed; the line that says why."""
        failure = checkpoint.discard(self.run_dir, step, error)
        if isinstance(error, _NonFinite):  # never a checkpoint that resuming would train on from NaN
            return self._nonfinite(step)
        return failure

    def close(self, failed: bool = False) -> None:
        """End of the run: the write in flight finished (collective). After a failure, without collectives (a rank
        may be gone): this rank's part of it waited for (rank 0 published it if every rank wrote theirs), a failure
        only logged, as the run's own error is the one reported. The host copy is released."""
        try:
            if not failed:
                self.wait()
            elif self._writing is not None:
                self._done.drop(drain=False)
                w, self._writing = self._writing, None
                try:
                    w.future.result()
                except BaseException as e:  # noqa: BLE001
                    log.error("%s", self._failed(w.step, e))
        finally:
            if self._stager is not None:
                self._writer.shutdown()
                self._stager.close()
                self._stager = None
            if self._group is not None:
                # Now, in this process: a process group left to the garbage collector can be collected in a
                # forked child, whose destructor then waits for the parent's gloo threads forever.
                dist.destroy_process_group(self._group)
                self._group = None

    def summary(self) -> dict:
        """For result.json: each save's stall and write time, in seconds."""
        return {"async": self.asynchronous, "stall_s": [round(s, 3) for s in self.stall_s],
                "write_s": [round(s, 3) for s in self.write_s], **({"cadence": self.cadence.summary()}
                                                                    if self.cadence.auto else {})}

    def restore(self, start: str | None) -> str | None:
        """Load `start` ("auto": the run dir's newest loadable checkpoint; None: nothing); return what was loaded."""
        if start == "auto":
            path, saved = checkpoint.load_newest(self.run_dir, self.model, self.optimizer, self.expected,
                                                 check_trainer_state) or (None, None)
        elif start:
            path, saved = start, checkpoint.load(start, self.model, self.optimizer, self.expected, check_trainer_state)
        else:
            return None
        if saved:
            self._load_parts(path, saved)
            changed = reapply(self.optimizer, self._settings)
            if changed:
                log.info("optimizer settings of this run over the checkpoint's: %s", "; ".join(changed))
        return path if saved else None

    def _load_parts(self, path: str, saved: dict) -> None:
        """A checkpoint's trainer state (checked by `check_trainer_state` as it was opened) into the parts."""
        for name, part in self.parts.items():
            part.load_state_dict(saved[name])
        for name, part in self.optional.items():
            if part is not None and saved.get(name):
                part.load_state_dict(saved[name])


# What a trainer_state.json holds: each part's check of its saved document (TypeError), the required ones first.
PART_CHECKS = {"run": RunState.check, "scheduler": Schedule.check}
OPTIONAL_CHECKS = {"scaler": AgreedGradScaler.check, "loss_spike": LossSpikeGuard.check}


def check_trainer_state(path: str, saved: dict) -> None:
    """Every value of a checkpoint's trainer state checked like a config value, and its step the same three times
    over (its directory's name, the run state's, the schedule's): one CheckpointError line otherwise, before
    anything is loaded (a crafted step=-1000 or base_lrs=-0.5 never trains)."""
    try:
        for name, check in PART_CHECKS.items():
            check(saved[name])
        for name, check in OPTIONAL_CHECKS.items():
            if saved.get(name):
                check(saved[name])
        step = saved["run"].get("step")
        dirname = os.path.basename(os.path.normpath(path))
        if checkpoint.is_step_dir(dirname) and checkpoint.step_of(path) != step:
            raise TypeError(f"run.step={step!r} in a checkpoint named {dirname}")
        if saved["scheduler"]["last_epoch"] != step:
            raise TypeError(f"scheduler.last_epoch={saved['scheduler']['last_epoch']!r}, run.step={step!r}")
    except (KeyError, TypeError) as e:
        raise checkpoint.cannot_load(path, f"{checkpoint.STATE_FILE} is not an hpctrain trainer state: "
                                           f"{type(e).__name__}: {e}") from None
