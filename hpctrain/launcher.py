"""`hydra/launcher=slurm|local`: where runs go. hydra-submitit-launcher does the submitting; this adds

- job resources derived from the parallel layout (tasks = dp·tp·pp, one per GPU or cluster.tasks_per_node);
- every sweep point validated (config, layout, data) before anything is submitted;
- one run submitted without `-m` (`python -m hpctrain hydra/launcher=slurm ...`), into its own run dir;
- no blocking on the login node unless cluster.wait=true, and then jobs that end without a result
  (cancelled, node failure, timeout) are reported with their Slurm state instead of raised.
"""

from __future__ import annotations

import logging.config
import os
import sys
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin
from omegaconf import DictConfig, OmegaConf

from hpctrain.config import ConfigError

log = logging.getLogger("hpctrain")
_INIT_KEYS = {"submitit_folder", "max_num_timeout"}


def resources(cfg) -> dict[str, int | None]:
    """Slurm shape of a run: nodes, tasks per node (= ranks), GPUs per node; ConfigError if it cannot fit."""
    p, c = cfg.parallel, cfg.cluster
    per_node = c.gpus_per_node or c.tasks_per_node
    what = "cluster.gpus_per_node" if c.gpus_per_node else "cluster.tasks_per_node"
    if per_node < 1:
        raise ConfigError(f"{what}={per_node} must be >= 1")
    if p.dp == "auto":  # fill the nodes asked for
        if not c.nodes:
            raise ConfigError("parallel.dp=auto on Slurm needs cluster.nodes (or set parallel.dp)")
        if per_node % (p.tp * p.pp):
            raise ConfigError(f"parallel.dp=auto: {what}={per_node} is not a multiple of tp×pp={p.tp * p.pp}")
        world = c.nodes * per_node
    else:
        world = int(p.dp) * p.tp * p.pp
    nodes, tasks = (1, world) if world <= per_node else (world // per_node, per_node)
    if nodes * tasks != world:
        raise ConfigError(f"dp×tp×pp={world} ranks do not fill whole nodes of {per_node} ({what}): make the "
                          f"layout a multiple of {per_node} ranks")
    if c.nodes and c.nodes != nodes:
        raise ConfigError(f"cluster.nodes={c.nodes} but the layout dp×tp×pp={world} needs {nodes} node(s) of "
                          f"{per_node} ranks: drop cluster.nodes or change parallel.dp")
    return {"nodes": nodes, "tasks_per_node": tasks, "gpus_per_node": tasks if c.gpus_per_node else None}


def resolver(key: str, *, _root_: DictConfig):
    """`${hpctrain_slurm:nodes}` etc. in the launcher configs (bad layouts are reported by `check`)."""
    if key == "sbatch_extra":
        return {"requeue": True, **OmegaConf.to_container(_root_.cluster.sbatch_extra)}
    try:
        return resources(_root_)[key]
    except ConfigError:
        return 1


def check(cfg) -> None:
    """Everything a job would check at its start, run on the login node before submitting (its memory is
    not the compute nodes': the memory check is left to the job)."""
    from hpctrain.train import prepare

    shape = resources(cfg)
    prepare(cfg, shape["nodes"] * shape["tasks_per_node"], local=False)


def _bad_input() -> tuple[type[Exception], ...]:
    from hpctrain.errors import bad_input

    return (*bad_input(), OSError)  # OSError: a sweep or submitit folder that cannot be made


class RunJob:
    """The callable a single submitted run executes on every task (pickled by submitit)."""

    def __init__(self, cfg: dict, run_dir: str, job_logging: dict | None):
        self.cfg, self.run_dir, self.job_logging = cfg, run_dir, job_logging

    def __call__(self) -> dict:
        from hpctrain.config import Config
        from hpctrain.job import Stopped, quiet_other_ranks
        from hpctrain.train import train

        if self.job_logging:
            logging.config.dictConfig(self.job_logging)  # train.log in the run dir, as in a local run
        quiet_other_ranks()
        cfg = OmegaConf.merge(OmegaConf.structured(Config), self.cfg)
        try:
            return train(cfg, self.run_dir)
        except Stopped as e:  # not a failure: no result for submitit to collect, the job is requeued or over
            log.warning("%s", e)
            sys.exit(e.exit_code)

    def checkpoint(self):  # called by submitit on preemption: rerun as is; train() resumes from the run dir
        import submitit

        return submitit.helpers.DelayedSubmission(self)


class Submitting:
    """What the Slurm and local launchers share; `_EXECUTOR` comes from the plugin class."""

    _EXECUTOR: str
    params: dict

    def executor(self, folder: str, cluster_cfg):
        import shutil

        import submitit

        if self._EXECUTOR == "slurm" and not shutil.which("sbatch"):
            raise ConfigError("hydra/launcher=slurm needs Slurm, and sbatch is not on PATH here: run on a Slurm "
                              "login node, or use hydra/launcher=local (or no launcher) to run on this machine")
        from submitit.core import job_environment
        from submitit.slurm import slurm

        from hpctrain.config import signal_number

        # submitit reads the signal name from the environment, here and (inherited) in the job.
        sig = signal_number(cluster_cfg.signal).name.removeprefix("SIG")
        os.environ["SUBMITIT_PREEMPT_SIGNAL"] = sig
        job_environment.JobEnvironment.USR_SIG = slurm.SlurmJobEnvironment.USR_SIG = sig
        init = {"folder": folder}
        if "max_num_timeout" in self.params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(plugin.BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v
                                      for k, v in self.params.items() if k not in _INIT_KEYS})
        return executor

    def _shape(self) -> str:
        return f"{self.params['nodes']} node(s) × {self.params['tasks_per_node']} task(s)"

    def launch(self, job_overrides, initial_job_idx: int):
        configs = [self.hydra_context.config_loader.load_sweep_config(self.config, list(o)) for o in job_overrides]
        for i, cfg in enumerate(configs):
            try:
                check(cfg)
                if resources(cfg) != resources(self.config):
                    raise ConfigError("sweep points must share one layout (one job shape per array): "
                                      "sweep parallel.*/cluster.* in separate commands")
            except _bad_input() as e:
                common = set.intersection(*map(set, job_overrides)) if len(job_overrides) > 1 else set()
                point = " ".join(o for o in filter_overrides(job_overrides[i]) if o not in common)
                _fail(f"sweep point #{initial_job_idx + i} ({point}): {e}")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        args = [(list(o), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}",
                 plugin.Singleton.get_state()) for i, o in enumerate(job_overrides)]
        try:
            executor = self.executor(self.params["submitit_folder"], self.config.cluster)
            sweep_dir.mkdir(parents=True, exist_ok=True)
            jobs = _or_fail(lambda: executor.map_array(self, *zip(*args)))
        except _bad_input() as e:
            _fail(str(e))
        print(f"hpctrain: submitted {len(jobs)} job(s) {_ids(jobs)} ({self._shape()} each) -> {sweep_dir}\n"
              f"hpctrain: progress: python -m hpctrain.sweep report {sweep_dir}", flush=True)
        if self.config.cluster.wait:
            _wait(jobs, str(sweep_dir))
        return [JobReturn(overrides=list(o), cfg=c, _return_value=j.job_id, working_dir=str(sweep_dir),
                          task_name="hpctrain", status=JobStatus.COMPLETED)
                for o, c, j in zip(job_overrides, configs, jobs)]

    def submit_run(self, cfg: DictConfig, run_dir: str, job_logging: dict | None,
                   started: float = float("inf")) -> None:
        """One run (no -m): validate, submit one job running in `run_dir`, print where to look. On bad input
        the run dir Hydra made for it (after `started`) is removed again."""
        from hpctrain import rundir

        folder = os.path.join(run_dir, ".submitit", "%j")
        try:
            check(cfg)
            executor = self.executor(folder, cfg.cluster)
            rundir.start_over(run_dir, cfg)  # before the job (or this) writes anything of the new run there
            job = _or_fail(lambda: executor.submit(RunJob(OmegaConf.to_container(cfg, resolve=True), run_dir,
                                                          job_logging)))
        except _bad_input() as e:
            rundir.remove_if_fresh(run_dir, started)
            _fail(str(e))
        rundir.save_config(run_dir, cfg)
        print(f"hpctrain: submitted job {job.job_id} ({self._shape()}) -> {run_dir}\n"
              f"hpctrain: logs: {folder.replace('%j', job.job_id)}/; progress: "
              f"python -m hpctrain.sweep report {run_dir}", flush=True)
        if cfg.cluster.wait:
            _wait([job], run_dir)


def _ids(jobs) -> str:
    first = jobs[0].job_id.split("_")[0]
    return f"array {first}" if "_" in jobs[0].job_id else ", ".join(j.job_id for j in jobs)


def _wait(jobs, where: str) -> None:
    """Block until every job ends; report the ones that ended without a result by their Slurm state."""
    import submitit

    from hpctrain.sweep import sacct_state

    bad = []
    for job in jobs:
        job.wait()  # a result file, or Slurm says the job ended
        state = sacct_state(job.job_id) if isinstance(job, submitit.SlurmJob) else None  # local: a PID
        if state not in (None, "completed") and not job.paths.result_pickle.exists():
            # Cancelled, timed out, node failure: no result will come; submitit would wait 15 s for one.
            bad.append(f"job {job.job_id} {state}")
            continue
        try:
            job.results()
        except (submitit.core.utils.UncompletedJobError, submitit.core.utils.FailedJobError) as e:
            state = state or (job.state.split() or ["unknown"])[0].lower()
            bad.append(f"job {job.job_id} {state}")
            log.debug("job %s: %s", job.job_id, e)
    if bad:
        _fail(f"{len(bad)} of {len(jobs)} job(s) did not complete ({'; '.join(bad)}): see "
              f"python -m hpctrain.sweep report {where}", code=1)
    print(f"hpctrain: {len(jobs)} job(s) completed", flush=True)


def _or_fail(submit):
    """submit(); sbatch refusing the job (a bad partition, account, time limit...) becomes one line."""
    import contextlib
    import io

    import submitit

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit also prints sbatch's whole refusal
            return submit()
    except submitit.core.utils.FailedJobError as e:
        refusal = [line for line in str(e).splitlines() if "error" in line.lower()] or str(e).splitlines() or ["?"]
        raise ConfigError(f"sbatch refused the job ({refusal[0].strip()}): check cluster.partition, "
                          "cluster.account, cluster.qos, cluster.time_min and cluster.sbatch_extra") from None


def _fail(message: str, code: int = 2):
    from hpctrain.cli import fail  # here: the CLI module loads this one (through Hydra's launcher plugin)

    fail(message, code)
