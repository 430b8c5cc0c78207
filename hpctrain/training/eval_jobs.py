"""eval.mode=job: each checkpoint due for evaluation scored by a Slurm job of its own, never by the training ranks.

At every eval.every-th step (a checkpoint step) and the last, the main rank pins the checkpoint against rotation and
submits `hpctrain eval RUN_DIR checkpoint=… once=true unpin=…` through submitit, on the run's `cluster` resources
changed by eval.cluster. The job loads the checkpoint in its own layout, scores it, appends its record to
<run_dir>/evals.jsonl (once per checkpoint and tasks: a requeued job does not score again) and removes the pin. The
run polls its jobs: it forwards each new record to its sinks at the record's step (metrics.jsonl, TensorBoard,
trackers, alert rules) and reports a job that ended without a record (one warning, an alert event; the pin removed);
a failed eval job never stops training. At its end the run waits up to eval.wait_min for the jobs still going (their
scores reach the trackers too); records that arrive later stay in evals.jsonl (forwarded if the run is resumed).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from omegaconf import OmegaConf

from hpctrain.core.config import ClusterConfig, EvalConfig, EvalMode, ParallelConfig, check_sbatch_text
from hpctrain.core.errors import ConfigError
from hpctrain.core.files import read_evals, read_metrics
from hpctrain.core.slurm import check_partition, missing_commands
from hpctrain.storage import checkpoint
from hpctrain.training.cadence import AUTO

log = logging.getLogger("hpctrain")
POLL_S = 10.0  # at most this often a logged step asks Slurm about the jobs (sacct)
WAIT_POLL_S = 2.0  # how often the run's end asks, waiting for its jobs (eval.wait_min)
ENDED = ("FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def _logged(run_dir: str) -> list[dict]:
    try:
        return read_metrics(run_dir, lenient=True)
    except FileNotFoundError:  # none logged yet
        return []


def job_cluster(cluster: ClusterConfig, ecfg: EvalConfig):
    """The run's cluster group as eval.cluster changes it for the eval jobs (an unknown key: OmegaConf's error)."""
    return OmegaConf.merge(OmegaConf.structured(cluster), ecfg.cluster)


def check(ecfg: EvalConfig, tcfg, checkpointing: bool, cluster: ClusterConfig, parallel: ParallelConfig) -> None:
    """eval.mode=job before the run starts (one-line ConfigError): checkpoints at every eval step, written before the
    job is submitted, eval.cluster's keys and text, Slurm here, and a partition that can start the eval jobs."""
    if not ecfg.tasks or EvalMode(ecfg.mode) != EvalMode.job:
        return

    merged = job_cluster(cluster, ecfg)
    check_sbatch_text(merged, "eval.cluster", options=False)  # (an eval job gets no sbatch_extra)
    if not checkpointing or tcfg.ckpt_async:
        raise ConfigError("eval.mode=job scores the checkpoints, written before each job is submitted: set "
                          "train.checkpointing=true and train.ckpt_async=false, or use eval.mode=loop")
    if ecfg.every and (tcfg.ckpt_every == AUTO or not tcfg.ckpt_every or ecfg.every % tcfg.ckpt_every):
        raise ConfigError(f"eval.every={ecfg.every} with eval.mode=job must be a multiple of train.ckpt_every="
                          f"{tcfg.ckpt_every}: each evaluation scores a checkpoint")
    missing = missing_commands()
    if missing:
        raise ConfigError(f"eval.mode=job submits Slurm jobs, and {missing} not on PATH here: run on a Slurm "
                          "cluster, or use eval.mode=loop")
    from hpctrain.parallel.layout import job_shape
    from hpctrain.parallel.process_group import launched_rank

    # An eval partition's limit under the run's time_min: pending for good (rank 0 asks: not every rank, slurmctld)
    if launched_rank() == 0:
        check_partition(merged.partition, merged.time_min, job_shape(parallel, merged)["nodes"], merged.qos,
                        key="eval.cluster")


class EvalJobs:
    """The main rank's eval jobs: submitted at checkpoint steps, polled, their records forwarded to the metrics."""

    def __init__(self, ecfg: EvalConfig, cluster: ClusterConfig, parallel: ParallelConfig, run_dir: str, metrics,
                 last_step: int, is_main: bool):
        self.ecfg, self.cluster, self.parallel, self.run_dir = ecfg, cluster, parallel, run_dir
        self.metrics, self.last_step = metrics, last_step
        self.enabled = is_main and bool(ecfg.tasks) and EvalMode(ecfg.mode) == EvalMode.job
        self.jobs: dict[str, tuple[int, object, str]] = {}  # job id -> (step, submitit job, its pin's name)
        self.polled = 0.0
        self.seen: set[int] = set()
        if self.enabled:
            # Scores this run's metrics hold already; the others (an earlier attempt's jobs) are forwarded now.
            self.seen = {r["step"] for r in _logged(run_dir) if any(str(k).startswith("eval/") for k in r)}
            self._adopt()

    def _adopt(self) -> None:
        """The jobs an earlier attempt of this run submitted and still pins (a requeued or resumed run)."""
        from submitit.slurm.slurm import SlurmJob

        for doc in checkpoint.pins(self.run_dir):
            job = str(doc.get("job") or "")
            if job.isdigit() and job not in self.jobs:
                self.jobs[job] = (doc["step"], SlurmJob(os.path.join(self.run_dir, "eval_jobs", job), job), doc["who"])

    def due(self, step: int) -> bool:
        every = self.ecfg.every
        return self.enabled and ((every and step % every == 0) or step == self.last_step)

    def submit(self, step: int, ckpt: str) -> str:
        """Pin `ckpt` and submit its eval job; returns the job id."""
        import submitit

        who = f"eval-{os.getpid()}-{step}"
        checkpoint.pin(self.run_dir, step, who)
        command = [sys.executable, "-m", "hpctrain", "eval", self.run_dir, f"checkpoint={ckpt}", "once=true",
                   f"unpin={who}", *self.ecfg.job_args]
        try:
            job = self._executor(step).submit(submitit.helpers.CommandFunction(command, cwd=os.getcwd()))
        except Exception as e:  # noqa: BLE001 - sbatch refusing (a partition, a limit): reported, training goes on
            checkpoint.unpin(self.run_dir, step, who)
            log.warning("eval job for step %d could not be submitted (%s): %s", step, type(e).__name__,
                        " ".join(str(e).split())[:300])
            return ""
        checkpoint.pin(self.run_dir, step, who, job=str(job.job_id), checkpoint=ckpt)  # adopted after a requeue
        self.jobs[str(job.job_id)] = (step, job, who)
        log.info("eval job %s submitted for checkpoint %s", job.job_id, ckpt)
        return str(job.job_id)

    def _executor(self, step: int):
        import submitit

        from hpctrain.parallel.layout import job_shape

        merged = job_cluster(self.cluster, self.ecfg)
        shape = job_shape(self.parallel, merged)
        executor = submitit.AutoExecutor(folder=os.path.join(self.run_dir, "eval_jobs", "%j"), cluster="slurm")
        params = {"timeout_min": merged.time_min, "nodes": shape["nodes"], "tasks_per_node": shape["tasks_per_node"],
                  "cpus_per_task": merged.cpus_per_task, "name": f"eval-step{step}",
                  "slurm_additional_parameters": {"requeue": True}}
        if shape.get("gpus_per_node"):
            params["gpus_per_node"] = shape["gpus_per_node"]
        if merged.mem_gb:
            params["mem_gb"] = merged.mem_gb
        for key in ("partition", "account", "qos", "constraint"):
            if merged.get(key):
                params[f"slurm_{key}"] = merged[key]
        executor.update_parameters(**params)
        return executor

    def poll(self, force: bool = False) -> None:
        """New records forwarded to the metrics; jobs that ended without one reported (rate-limited: POLL_S)."""
        if not self.enabled or (not force and time.time() - self.polled < POLL_S):
            return
        self.polled = time.time()
        for record in read_evals(self.run_dir):
            if record["step"] not in self.seen:
                self.seen.add(record["step"])
                self.metrics.log({k: v for k, v in record.items() if k == "step" or k.startswith("eval/")})
        for job_id, (step, job, who) in list(self.jobs.items()):
            if step in self.seen:
                del self.jobs[job_id]
                continue
            state = (str(job.state).upper().split() or ["UNKNOWN"])[0]  # (sacct: "CANCELLED BY 0")
            if state in ENDED or (state == "COMPLETED" and not self._recorded(step)):
                del self.jobs[job_id]
                checkpoint.unpin(self.run_dir, step, who)
                log.warning("eval job %s for step %d ended %s without a result: training goes on (its output: %s)",
                            job_id, step, state, os.path.join(self.run_dir, "eval_jobs", job_id))
                self.metrics.note({"eval_job_failed": step})

    def finish(self, wait: bool) -> None:
        """At the run's end, after every collective (only the main rank waits): the records there are, and with
        `wait` those of the jobs that end within eval.wait_min."""
        self.poll(force=True)
        if not (wait and self.jobs and self.ecfg.wait_min > 0):
            return
        deadline = time.time() + 60 * self.ecfg.wait_min
        log.info("waiting up to %g min for %d eval job(s): %s", self.ecfg.wait_min, len(self.jobs),
                 " ".join(sorted(self.jobs)))
        while self.jobs and time.time() < deadline:
            time.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.time())))
            self.poll(force=True)
        if self.jobs:
            log.warning("eval job(s) %s still going after eval.wait_min=%g: their records stay in %s/evals.jsonl",
                        " ".join(sorted(self.jobs)), self.ecfg.wait_min, self.run_dir)

    def _recorded(self, step: int) -> bool:
        """Read again: a job that completed since the records were read (its record appended meanwhile)."""
        return any(r["step"] == step for r in read_evals(self.run_dir))
