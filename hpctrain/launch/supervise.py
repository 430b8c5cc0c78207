"""cluster.spare_nodes=k: restart inside the allocation instead of going back to the queue.

The job asks for k nodes more than the layout needs and runs this supervisor in its batch step (it is no rank). The
supervisor starts the training as one `srun` step on the healthy nodes; when the step fails because a rank died or
stopped responding (the ranks name it, with its node, in result.json's `lost`) or a node went down, it leaves those
nodes out and starts the step again on the others plus a spare, from the latest checkpoint: no requeue, no queue
wait, the same job id. With cluster.min_nodes (and parallel.dp=auto) a run without a spare left goes on on fewer
healthy nodes, dp shrunk. Every restart is a line of <run_dir>/restarts.jsonl. Requeueing stays the fallback for
too few healthy nodes left and for a preemption (the step's exit code 75); a failure no node explains, or one more
than cluster.max_restarts, ends the job as failed.
`python -m hpctrain.launch.supervise RUN_DIR` is the step's command on each task. The same steps run the points of
a packed sweep (cluster.pack, `PackedRuns`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import os
import subprocess
import sys
import threading
import time

from hpctrain.core.files import RESULT_FILE, read_json, read_result, write_json
from hpctrain.core.slurm import hostnames, job_port, requeue_job
from hpctrain.runs.rundir import RESTART_ENV
from hpctrain.runtime.task_exits import EXIT_PREEMPTED, MAX_EXITS, SRUN_ARGS, annotate, parse, said_by_srun

log = logging.getLogger("hpctrain")

RESTARTS_FILE = "restarts.jsonl"
STEP_FILE = "supervised.json"  # the run's resolved config and logging, which every step starts from
_DOWN = ("down", "drain", "fail", "not_responding", "no_respond")


def _down(nodes: list[str]) -> list[str]:
    """The nodes Slurm no longer counts on (down, drained, not responding)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"], capture_output=True, text=True,
                         timeout=60).stdout
    return sorted({n for n, state in (line.split() for line in out.splitlines() if len(line.split()) == 2)
                   if any(d in state.lower() for d in _DOWN)})


class SrunStep:
    """One srun step started by the batch step: its stderr passed on to the job's log as it comes, and srun's lines
    on how its tasks ended kept (`srun: error: n2: task 1: Killed`, an out-of-memory kill: only srun knows)."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.said: list[str] = []
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
        self.reader = threading.Thread(target=self._read, daemon=True)  # (steps run side by side: one reader each)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # drained to the end whatever happens: srun must never block on the pipe
            with contextlib.suppress(Exception):
                sys.stderr.write(line)
                if said_by_srun(line) and len(self.said) < 4 * MAX_EXITS:
                    self.said.append(line.strip()[:300])

    def wait(self) -> int:
        code = self.proc.wait()
        self.reader.join()
        return code


class SupervisedRun:
    """The callable a job with spare nodes runs once, in its batch step (submitit with use_srun=False)."""

    min_nodes: int | None = None  # (a run pickled before cluster.min_nodes existed, requeued: no shrinking)

    def __init__(self, cfg: dict, run_dir: str, job_logging: dict | None, nodes: int, tasks_per_node: int,
                 max_restarts: int, min_nodes: int | None = None):
        self.cfg, self.run_dir, self.job_logging = cfg, run_dir, job_logging
        self.nodes, self.tasks_per_node, self.max_restarts = nodes, tasks_per_node, max_restarts
        self.min_nodes = min_nodes  # cluster.min_nodes: shrink to as few healthy nodes as this

    def __call__(self) -> dict | None:
        logging.basicConfig(level=logging.INFO, format="supervisor: %(message)s", stream=sys.stdout, force=True)
        write_step_file(self.run_dir, self.cfg, self.job_logging)
        allocated = hostnames(os.environ["SLURM_JOB_NODELIST"])
        job = os.environ["SLURM_JOB_ID"]
        left_out: set[str] = set()
        restarts = 0
        while True:
            healthy = [n for n in allocated if n not in left_out]
            picked = healthy[:self.nodes] if len(healthy) >= self.nodes else self._shrink(healthy)
            if not picked:
                _requeue(job, left_out, f"{len(healthy)} healthy node(s) left of {len(allocated)}, {self.nodes} needed"
                         + (f" (at least {self.min_nodes} shrunk)" if self.min_nodes else ""))
            started = time.time()
            log.info("step %d on %s (spare: %s)", restarts, ",".join(picked),
                     ",".join(healthy[self.nodes:]) or "none")
            code, srun_said = self._step(job, picked, restarts)
            ended = time.time()
            if code == 0:
                return read_result(self.run_dir)
            if code == EXIT_PREEMPTED:  # stopped on purpose, checkpoint written: the allocation is being taken back
                _requeue(job, set(), "preempted")
            result = os.path.join(self.run_dir, RESULT_FILE)  # this step's, if it wrote one
            fresh = (annotate(self.run_dir, parse(srun_said), job) or read_result(self.run_dir) or {}) \
                if os.path.exists(result) and os.path.getmtime(result) >= started else {}
            failed = sorted({lost["node"] for lost in fresh.get("lost") or [] if lost.get("node") in picked}
                            | set(_down(picked)))
            record = {"restart": restarts + 1, "job": job, "step_started": started, "step_ended": ended,
                      "exit_code": code, "failed_nodes": failed, "error": (fresh.get("error") or "")[:500],
                      "cause": srun_said, "step": fresh.get("steps"), "nodes": len(picked)}
            if not failed:  # a failure no node explains (a bug, a bad config) would fail again anywhere
                log.info("the step failed (exit code %d) and no node is to blame: not restarting", code)
                sys.exit(code)
            restarts += 1
            if restarts > self.max_restarts:
                log.info("%d restarts (cluster.max_restarts=%d): not restarting", restarts - 1, self.max_restarts)
                sys.exit(code)
            left_out |= set(failed)
            with open(os.path.join(self.run_dir, RESTARTS_FILE), "a") as f:
                f.write(json.dumps(record) + "\n")
            log.info("step failed on %s (exit code %d, %s): restarting without it from the latest checkpoint",
                     ",".join(failed), code, record["error"][:200] or "no result")

    def _shrink(self, healthy: list[str]) -> list[str]:
        """With cluster.min_nodes: the most healthy nodes (at least min_nodes) the run goes on with, dp shrunk and
        the same global and micro batch (accumulation grows; the ranks reshard the checkpoint as any resume on
        another dp); its steps then train from the config on that many nodes. [] when none do."""
        if not self.min_nodes or len(healthy) < self.min_nodes:
            return []
        from omegaconf import OmegaConf

        from hpctrain.core.config import Config, ConfigError
        from hpctrain.runs.resolve import resolve

        def shape(cfg: dict, nodes: int):
            return resolve(OmegaConf.merge(OmegaConf.structured(Config), cfg), nodes * self.tasks_per_node)

        try:
            full = shape(self.cfg, self.nodes)
        except ConfigError as e:  # (checked before submitting: only a config changed under the job)
            log.info("not shrinking: %s", e)
            return []
        # the same global and micro batch on fewer nodes, whichever two the run was given: accumulation derived
        batch = {"global_batch": full.global_batch, "micro_batch": full.micro_batch, "grad_accum": None}
        for k in range(len(healthy), self.min_nodes - 1, -1):
            cfg = {**self.cfg, "cluster": {**self.cfg["cluster"], "nodes": k},
                   "train": {**self.cfg["train"], **batch}}
            try:
                fewer = shape(cfg, k)
            except ConfigError as e:
                log.info("not on %d node(s): %s", k, e)
                continue
            write_step_file(self.run_dir, cfg, self.job_logging)
            log.info("going on on %d of the run's %d nodes (cluster.min_nodes=%d): dp %d -> %d, gradient "
                     "accumulation %d -> %d", k, self.nodes, self.min_nodes, full.dp, fewer.dp, full.grad_accum,
                     fewer.grad_accum)
            return healthy[:k]
        return []

    def _step(self, job: str, nodes: list[str], attempt: int) -> tuple[int, list[str]]:
        """One srun step of the training on `nodes`: its exit code, and srun's lines on how its tasks ended
        (`srun: error: n2: task 1: Killed`, an out-of-memory kill), which only srun knows."""
        env = dict(os.environ, MASTER_PORT=str(job_port(int(job), attempt)),  # a fresh store per step
                   **{RESTART_ENV: str(attempt)})  # (a restart continues the run, as a requeued job does)
        env.pop("MASTER_ADDR", None)  # the step's first node (hpctrain.parallel.process_group)
        cmd = ["srun", *SRUN_ARGS, f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * self.tasks_per_node}",
               f"--ntasks-per-node={self.tasks_per_node}", f"--nodelist={','.join(nodes)}",
               sys.executable, "-m", "hpctrain.launch.supervise", self.run_dir]
        cpus = self.cfg.get("cluster", {}).get("cpus_per_task")
        if cpus:
            cmd.insert(1, f"--cpus-per-task={cpus}")
        step = SrunStep(cmd, env)
        return step.wait(), step.said

    def checkpoint(self):  # submitit on preemption: the steps checkpoint themselves; rerun the supervisor
        import submitit

        return submitit.helpers.DelayedSubmission(self)


def _requeue(job: str, left_out: set[str], why: str) -> None:
    """Back to the queue, leaving out the nodes that failed here; the supervisor's process ends."""
    log.info("requeueing job %s (%s)%s", job, why, f", leaving out {','.join(sorted(left_out))}" if left_out else "")
    requeue_job(job, sorted(left_out))
    sys.exit(EXIT_PREEMPTED)


def run_job(cfg: dict, run_dir: str, job_logging: dict | None) -> dict:
    """One rank of a submitted run (a job's task, a supervised step's): logging as in a local run, the resolved
    config trained in `run_dir`; a deliberate stop (preemption) exits with its code, no result for submitit."""
    from hpctrain.training.gc_schedule import importing

    with importing():
        from omegaconf import OmegaConf

        from hpctrain.core.config import Config
        from hpctrain.runtime.job import Stopped, quiet_other_ranks
        from hpctrain.training.run import train

    if job_logging:
        logging.config.dictConfig(job_logging)  # train.log in the run dir, as in a local run
    quiet_other_ranks()
    try:
        return train(OmegaConf.merge(OmegaConf.structured(Config), cfg), run_dir)
    except Stopped as e:
        log.warning("%s", e)
        sys.exit(e.exit_code)


def write_step_file(run_dir: str, cfg: dict, job_logging: dict | None) -> None:
    """What every step of a run trains from (this module's main): the resolved config and the logging."""
    write_json(os.path.join(run_dir, STEP_FILE), {"cfg": cfg, "job_logging": job_logging})


class PackedRuns:
    """cluster.pack=N: the callable a job of N sweep points runs once, in its batch step: each point an `srun`
    step of its own (`--exact`: its own CPUs/GPUs of the allocation), all at once, each in its own run directory.
    A point that was preempted (exit code 75) requeues the job: on the rerun every point resumes, a finished one
    ends at once."""

    def __init__(self, points: list[tuple[str, int, int]], cpus_per_task: int | None):
        self.points, self.cpus_per_task = points, cpus_per_task  # (run dir, nodes, tasks) of each point

    def __call__(self) -> list[dict | None]:
        logging.basicConfig(level=logging.INFO, format="packed: %(message)s", stream=sys.stdout, force=True)
        job = os.environ["SLURM_JOB_ID"]
        steps, started = [], time.time()
        for i, (run_dir, nodes, tasks) in enumerate(self.points):
            env = dict(os.environ, MASTER_PORT=str(job_port(int(job), 1 + i % 63)))
            env.pop("MASTER_ADDR", None)
            cmd = ["srun", *SRUN_ARGS, "--exact", f"--nodes={nodes}", f"--ntasks={tasks}",
                   *([f"--cpus-per-task={self.cpus_per_task}"] if self.cpus_per_task else []),
                   sys.executable, "-m", "hpctrain.launch.supervise", run_dir]
            log.info("point %d: %s", i, run_dir)
            steps.append(SrunStep(cmd, env))
        codes = [step.wait() for step in steps]
        log.info("exit codes %s", codes)
        for (run_dir, _, _), step in zip(self.points, steps):  # a failed point's result gets srun's word
            annotate(run_dir, parse(step.said), job, since=started)  # (never an earlier attempt's result)
        if EXIT_PREEMPTED in codes:
            _requeue(job, set(), "preempted")
        return [read_result(run_dir) for run_dir, _, _ in self.points]

    def checkpoint(self):  # submitit on preemption: the steps checkpoint themselves; rerun every point
        import submitit

        return submitit.helpers.DelayedSubmission(self)


def main(argv: list[str]) -> int:
    """One task of a supervised step: the run's saved config trained in RUN_DIR."""
    from hpctrain.runs import rundir

    run_dir = argv[0]
    doc = read_json(os.path.join(run_dir, STEP_FILE))
    with rundir.claimed(run_dir):  # one run at a time in the directory (rank 0 holds it)
        run_job(doc["cfg"], run_dir, doc.get("job_logging"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
