"""Inside a batch job: stop cleanly on the preemption signal, requeue, and refuse endless restart loops.

Slurm (or the user) signals every rank, but each rank notices at a different moment: the ranks agree at
each step boundary (one tiny all-reduce), so all of them stop after the same step, checkpoint together,
and rank 0 requeues the job. The requeued job starts in the same run directory and resumes from that
checkpoint. None of this knows about the parallel layout.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from enum import Enum, IntEnum

import torch.distributed as dist

from hpctrain.core.config import signal_number
from hpctrain.core.files import RESULT_FILE, read_json, read_object, write_json
from hpctrain.core.slurm import exclude_nodes, outlive_the_requeue, requeue_job
from hpctrain.parallel.vote import OverlappedVote
from hpctrain.runtime.task_exits import EXIT_PREEMPTED, EXIT_TERMINATED

log = logging.getLogger("hpctrain")


class RunStatus(str, Enum):
    """A run's status in result.json (and its summary)."""

    running = "running"
    completed = "completed"
    preempted = "preempted"
    terminated = "terminated"
    stopped = "stopped"  # by an alert rule's `stop` action
    failed = "failed"
    interrupted = "interrupted"  # Ctrl-C


class Stop(IntEnum):
    """Why a run stops at a step boundary. Ranks vote with max(): TERMINATE wins over PREEMPT (a cancelled job
    must not requeue itself), and ALERT (an alert rule's `stop` action) neither."""

    NONE = 0
    PREEMPT = 1
    TERMINATE = 2
    ALERT = 3

    @property
    def status(self) -> RunStatus:
        return _STOP_STATUS[self]


_STOP_STATUS = {Stop.NONE: RunStatus.completed, Stop.PREEMPT: RunStatus.preempted,
                Stop.TERMINATE: RunStatus.terminated, Stop.ALERT: RunStatus.stopped}


class Stopped(RuntimeError):
    """The run stopped at a step boundary on a signal, after writing a checkpoint."""

    def __init__(self, kind: Stop, step: int, signame: str, main: bool = True):
        self.kind, self.step, self.main = kind, step, main
        then = "the job was requeued" if kind == Stop.PREEMPT and in_slurm_job() else "rerun the same command to resume"
        super().__init__(f"stopped by {signame} after step {step}; checkpoint written; {then}")

    @property
    def exit_code(self) -> int:
        """The run's verdict is the main rank's: the others did their part (the checkpoint) and end with 0, so that
        srun's --kill-on-bad-exit does not kill the main rank while it requeues the job."""
        if not self.main:
            return 0
        return EXIT_PREEMPTED if self.kind == Stop.PREEMPT else EXIT_TERMINATED


def in_slurm_job() -> bool:
    return "SLURM_JOB_ID" in os.environ


class StopSignals:
    """Note the preemption signal and SIGTERM in handlers; act on them only at step boundaries."""

    def __init__(self, signame: str):
        self.preempt_sig = signal_number(signame)
        self.noted = Stop.NONE
        self.checkpoint = 0  # an alert asked for a checkpoint (on this rank, then agreed: on every rank)
        self.alert = None  # the alert rule that asked this rank (the main one) to stop
        self.checkpoint_agreed = False
        self._previous = {}
        self._vote = OverlappedVote()  # the agreement started after the last step
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may handle signals (e.g. train() called from a worker thread)
        for sig, kind in ((self.preempt_sig, Stop.PREEMPT), (signal.SIGTERM, Stop.TERMINATE)):
            self._previous[sig] = signal.signal(sig, self._handler(kind))

    def _handler(self, kind: Stop):
        def note(signum, frame):
            self.noted = max(self.noted, kind)
        return note

    def name(self, kind: Stop) -> str:
        if kind == Stop.ALERT:
            return f"alert {self.alert}" if self.alert else "an alert rule (see alerts.jsonl)"
        return (self.preempt_sig if kind == Stop.PREEMPT else signal.SIGTERM).name

    def ask(self, action: str, rule: str) -> None:
        """An alert rule's action on this rank: "checkpoint", or "stop" (after a checkpoint), at a step boundary
        that every rank agrees on."""
        if action == "stop":
            self.noted, self.alert = max(self.noted, Stop.ALERT), self.alert or rule
        self.checkpoint = 1

    def agreed(self) -> Stop:
        """The strongest Stop request any rank had noted by the end of the previous step
        (collective when world > 1: every rank calls it after every step).

        The vote is an all-reduce started after one step and collected after the next, so it runs while that
        step computes and never holds a step back as a global barrier would: a stop takes effect one step later.
        The same vote carries an alert's checkpoint request: `checkpoint_agreed` after the call.
        """
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            self.checkpoint_agreed, self.checkpoint = bool(self.checkpoint), 0
            return Stop(self.noted)
        answer = self._vote.collect()
        self.checkpoint_agreed = bool(answer and answer[1])
        if answer and answer[0]:
            return Stop(answer[0])
        self._vote.start([self.noted, self.checkpoint])
        self.checkpoint = 0
        return Stop.NONE

    def requeue(self, exclude: list[str] = ()) -> None:
        """Rank 0, after the checkpoint: put the job back in the queue (under submitit, its own handler does
        that and counts time-limit requeues against max_num_timeout; it exits the process), leaving out the nodes
        in `exclude` (the bad-node list's) when it runs again (Slurm takes a job's ExcNodeList only while it is
        pending: after the requeue)."""
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            outlive_the_requeue()
        prev = self._previous.get(self.preempt_sig)
        if callable(prev) and getattr(prev, "__module__", "").startswith("submitit"):
            try:
                prev(self.preempt_sig, None)
            finally:  # (it requeues, then exits)
                if exclude and job:
                    exclude_nodes(job, exclude)
            return
        if job:
            requeue_job(job, exclude)

    def restore(self, drain: bool = True, handlers: bool = True) -> None:
        """Put the previous handlers back (with `handlers`). `drain`: first collect the vote in flight, so that no
        collective is left pending (not after a failure: a rank that died might never join it, and this process is
        ending)."""
        self._vote.drop(drain)
        for sig, prev in self._previous.items() if handlers else ():
            signal.signal(sig, prev)


def quiet_other_ranks() -> None:
    """Under srun/torchrun every rank configures logging: only rank 0 writes train.log and INFO lines."""
    from hpctrain.parallel.process_group import launched_rank

    if launched_rank() == 0:
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
    log.setLevel(logging.WARNING)


def _stopped_cleanly(run_dir: str, attempt_started: float) -> bool:
    """Whether the previous attempt (started at `attempt_started`) ended by stopping itself for a requeue
    (preemption, time limit, SIGTERM): its result.json was written after it started and says so. Otherwise it
    was killed under the run (a node failure, `scontrol requeue`): no result of its own."""
    path = os.path.join(run_dir, RESULT_FILE)
    try:
        if os.path.getmtime(path) < attempt_started:
            return False
        return read_json(path).get("status") in ("preempted", "terminated")
    except (OSError, ValueError, AttributeError):
        return False


def job_nodes() -> int:
    """The nodes of this Slurm job (1 outside Slurm: one machine)."""
    return int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)


def step_nodes() -> int:
    """The nodes this rank's job step runs on (a supervised step leaves spares and failed nodes out)."""
    return int(os.environ.get("SLURM_STEP_NUM_NODES") or job_nodes())


def node_failures(run_dir: str) -> tuple[list[float], int] | None:
    """(wall times of this run's node failures, the job's node count), from <run_dir>/slurm.json; None outside
    Slurm."""
    doc = _attempt(os.path.join(run_dir, "slurm.json"))
    if not doc:
        return None
    return doc["node_failures"], doc["nodes"]


def _attempt(path: str) -> dict:
    """The last attempt's record, its values checked; {} when missing, or damaged (said in the log): the counts it
    keeps (stalled restarts, node failures) then start afresh rather than stop a requeued job."""
    doc = read_object(path)
    if doc is None:
        if os.path.lexists(path):
            log.warning("%s is damaged: this attempt starts its restart counts afresh", path)
        return {}
    ints = ("restart_count", "start_step", "stalled_restarts", "nodes")
    ok = all(type(doc.get(k, 0)) is int and doc.get(k, 0) >= -1 for k in ints) and isinstance(
        doc.get("node_failures", []), list) and all(type(t) in (int, float) for t in doc.get("node_failures", [])) \
        and type(doc.get("started_at", 0.0)) in (int, float)
    if not ok:
        log.warning("%s holds values no attempt wrote: this attempt starts its restart counts afresh", path)
        return {}
    return {**doc, "nodes": max(doc.get("nodes", 1), 1), "node_failures": list(doc.get("node_failures", []))}


def record_attempt(run_dir: str, latest_step: int, max_stalled: int,
                   nccl: dict[str, str] | None = None) -> str | None:
    """Write <run_dir>/slurm.json for this job attempt (with the NCCL settings in effect and their source);
    return an error when restarts stopped making progress.

    A job that keeps failing before its next checkpoint (a bad node, a crash on resume) would otherwise be
    requeued forever: after `max_stalled` restarts in a row with no new checkpoint the run gives up.
    """
    e = os.environ
    if "SLURM_JOB_ID" not in e:
        return None
    path = os.path.join(run_dir, "slurm.json")
    prev = _attempt(path)
    restarts = int(e.get("SLURM_RESTART_COUNT", 0))
    stalled, failures = 0, list(prev.get("node_failures", []))
    if restarts and prev.get("job_id") == e["SLURM_JOB_ID"] and restarts > prev.get("restart_count", 0):
        stalled = prev.get("stalled_restarts", 0) + 1 if latest_step <= prev.get("start_step", -1) else 0
        if not _stopped_cleanly(run_dir, prev.get("started_at", 0.0)):
            failures.append(time.time())
    doc = {"job_id": e["SLURM_JOB_ID"], "array_job_id": e.get("SLURM_ARRAY_JOB_ID"),
           "array_task_id": e.get("SLURM_ARRAY_TASK_ID"), "nodelist": e.get("SLURM_JOB_NODELIST"),
           "nodes": job_nodes(), "restart_count": restarts,
           "start_step": latest_step, "stalled_restarts": stalled, "started_at": time.time(),
           "node_failures": failures, "nccl": nccl or {}}
    write_json(path, doc)
    if stalled > max_stalled:
        return (f"Slurm job {doc['job_id']} was restarted {stalled} times in a row without reaching a new "
                f"checkpoint (still at step {latest_step}): see the job's logs for the cause, fix it and "
                f"resubmit (or raise cluster.max_stalled_restarts)")
    return None
