"""`hydra/launcher=slurm|local`: where runs go. hydra-submitit-launcher does the submitting; this adds

- job resources derived from the parallel layout (tasks = dp·tp·pp, one per GPU or cluster.tasks_per_node);
- every sweep point validated (config, layout, data) before anything is submitted;
- one run submitted without `-m` (`python -m hpctrain hydra/launcher=slurm ...`), into its own run dir;
- no blocking on the login node unless cluster.wait=true, and then jobs that end without a result
  (cancelled, node failure, timeout) are reported with their Slurm state instead of raised.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpctrain.core.config import ConfigError
from hpctrain.core.errors import BAD_INPUT, fail
from hpctrain.core.slurm import check_partition, missing_commands
from hpctrain.parallel.layout import job_shape, min_nodes, restarts_in_allocation
from hpctrain.runtime.task_exits import SRUN_ARGS, exit_trap

log = logging.getLogger("hpctrain")
_INIT_KEYS = {"submitit_folder", "max_num_timeout"}
_ARRAY_TABLE_BYTES = 1 << 20  # an array's run-directory table in its script (sbatch refuses scripts over 4 MiB)


def check(cfg, run_dir: str | None = None):
    """Everything a job would check at its start, run on the login node before submitting: the memory check against
    what the job asks of its nodes (cluster.gpu_mem_gb, cluster.mem_gb), not the login node's; with `run_dir` also
    that a checkpoint fits in what its filesystem has free (a sweep checks its points' sum itself). Returns the
    prepared run."""
    from hpctrain.training.run import check_checkpoint_space, prepare

    shape = job_shape(cfg.parallel, cfg.cluster)
    min_nodes(cfg.parallel, cfg.cluster)
    prepared = prepare(cfg, shape["nodes"] * shape["tasks_per_node"], local=False, per_node=shape["tasks_per_node"],
                       run_dir=run_dir)
    if run_dir is not None:
        check_checkpoint_space([prepared.checkpoint], run_dir, cfg.train.ckpt_keep, cfg.train.resume)
    return prepared


def _check_lead(c) -> None:
    """The time limit's warning comes cluster.signal_lead_s before the end, and Slurm may send it up to 60 s early
    (`man sbatch`): a job left less than that before it gets it at its start, before the run has a handler for it
    (the signal's default action ends the job), every time it is requeued."""
    left = c.time_min * 60 - c.signal_lead_s
    if left < 60:
        raise ConfigError(f"cluster.time_min={c.time_min} ({c.time_min * 60} s) leaves {max(0, left)} s before the time "
                          f"limit's warning (cluster.signal_lead_s={c.signal_lead_s}), which Slurm may send up to 60 s "
                          "early: the job would get it as it starts; raise cluster.time_min or lower "
                          "cluster.signal_lead_s")


def timeouts_warning(cfg, prepared, run_dir: str | None = None) -> str | None:
    """Where submitit's max_num_timeout limits a Slurm run's requeues (a supervised run, cluster.spare_nodes or
    min_nodes, and packed sweep points requeue themselves, without limit, as do the sbatch templates): the plan's
    warning, with cluster.gpu_type, when the run at the predicted step time needs every requeue or more; `run_dir`'s
    latest checkpoint (train.resume=auto) counts as done."""
    from hpctrain.storage import checkpoint
    from hpctrain.training.planner import jobs_warning

    if restarts_in_allocation(cfg.parallel, cfg.cluster) or cfg.cluster.pack > 1:
        return None
    latest = checkpoint.latest(run_dir) if run_dir and cfg.train.resume == "auto" else None
    return jobs_warning(cfg, prepared.shape, prepared.seq_len, checkpoint.step_of(latest) if latest else 0)


_BAD_INPUT = (*BAD_INPUT, OSError)  # OSError: a sweep or submitit folder that cannot be made


class RunJob:
    """The callable a single submitted run executes on every task (pickled by submitit)."""

    def __init__(self, cfg: dict, run_dir: str, job_logging: dict | None):
        self.cfg, self.run_dir, self.job_logging = cfg, run_dir, job_logging

    def __call__(self) -> dict:
        from hpctrain.launch.supervise import run_job

        return run_job(self.cfg, self.run_dir, self.job_logging)

    def checkpoint(self):  # called by submitit on preemption: rerun as is; train() resumes from the run dir
        import submitit

        return submitit.helpers.DelayedSubmission(self)


class Submitting:
    """What the Slurm and local launchers share; `_EXECUTOR` comes from the plugin class."""

    _EXECUTOR: str
    params: dict

    def executor(self, folder: str, cluster_cfg, checked: bool = False):
        import submitit

        # (`checked`: a packed sweep ran these once, for its jobs' node counts; without Slurm, check_partition reads
        # only the SBATCH_* environment)
        if self._EXECUTOR == "slurm" and not checked:
            _check_lead(cluster_cfg)
            check_partition(self.params.get("partition"), self.params.get("timeout_min"), self.params.get("nodes"),
                            cluster_cfg.qos)
            _check_slurm_here()
        from submitit.core import job_environment
        from submitit.slurm import slurm

        from hpctrain.core.config import signal_number

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
        if self._EXECUTOR == "slurm":  # one task that dies ends the step (KILL_ON_BAD_EXIT)
            executor.update_parameters(slurm_srun_args=list(SRUN_ARGS))
        return executor

    def _array_exit_trap(self, executor, sweep_dir: Path, first: int, configs: list) -> None:
        """The array's tasks are its points in order: the exit trap finds each task's run directory in a table by
        its index. Left out (said in the log) where the directories are not known before the jobs run (a
        hydra.sweep.subdir of ${hydra.job.id} or the time), or the table would crowd sbatch's script limit."""
        if self._EXECUTOR != "slurm":
            return
        try:
            dirs = [shlex.quote(self._point_dir(sweep_dir, first + i, cfg)) for i, cfg in enumerate(configs)]
        except OmegaConfBaseException as e:  # an interpolation known only in the job: the sweep runs without the trap
            log.info("srun's task exits will not be added to the points' results: %s", e)
            return
        if sum(len(d) + 1 for d in dirs) > _ARRAY_TABLE_BYTES:
            log.info("srun's task exits will not be added to the points' results: %d points", len(dirs))
            return
        self._exit_trap(executor, '"${hpctrain_run_dirs[$SLURM_ARRAY_TASK_ID]}"', f"hpctrain_run_dirs=({' '.join(dirs)})")

    def _supervised(self, cfg) -> bool:
        """Restarts inside the allocation (spare nodes, or shrinking to cluster.min_nodes): a supervisor runs the
        training as srun steps."""
        return self._EXECUTOR == "slurm" and restarts_in_allocation(cfg.parallel, cfg.cluster)

    def _exit_trap(self, executor, run_dir_word: str, *before: str) -> None:
        """After the job's srun, how its tasks ended goes into the run's failed result (runtime.task_exits):
        `run_dir_word` is the run directory as the batch shell reads it, after the setup lines `before`."""
        if self._EXECUTOR == "slurm":
            executor.update_parameters(slurm_setup=[*(self.params.get("setup") or []), *before,
                                                    exit_trap(sys.executable, run_dir_word)])

    def _shape(self) -> str:
        left_out = self.params.get("exclude")  # the bad-node list's (cluster.bad_nodes)
        return (f"{self.params['nodes']} node(s) × {self.params['tasks_per_node']} task(s)"
                + (f", leaving out {left_out}: see python -m hpctrain nodes" if left_out else ""))

    def launch(self, job_overrides, initial_job_idx: int):
        if self._EXECUTOR == "slurm":
            check_array_size(initial_job_idx + len(job_overrides))
            try:
                shrinks = min_nodes(self.config.parallel, self.config.cluster)
            except ConfigError as e:
                fail(str(e))
            for key, on in (("spare_nodes", self.config.cluster.spare_nodes), ("min_nodes", shrinks)):
                if on:
                    fail(f"cluster.{key} restarts one run inside its allocation: submit runs one at a time (no -m), "
                         "or drop it for a sweep")
        from hpctrain.training.run import check_checkpoint_space

        configs, checkpoints = [], []
        progress = Progress(len(job_overrides))
        warnings: dict[str, None] = {}  # (a sweep's points mostly say the same: once each)
        for i, o in enumerate(job_overrides):
            try:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(o))
                configs.append(cfg)
                prepared = check(cfg)
                checkpoints.append(prepared.checkpoint)
                if self._EXECUTOR == "slurm":
                    warnings[timeouts_warning(cfg, prepared)] = None
                if job_shape(cfg.parallel, cfg.cluster) != job_shape(self.config.parallel, self.config.cluster):
                    raise ConfigError("sweep points must share one layout (one job shape per array): "
                                      "sweep parallel.*/cluster.* in separate commands")
            except _BAD_INPUT as e:
                common = set.intersection(*map(set, job_overrides)) if len(job_overrides) > 1 else set()
                point = " ".join(o for o in filter_overrides(job_overrides[i]) if o not in common)
                fail(f"sweep point #{initial_job_idx + i} ({point}): {e}")
            progress.tick(i + 1)
        for warning in filter(None, warnings):
            log.warning("%s", warning)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        try:  # every point writes a first checkpoint there (a warning: not the train.ckpt_keep of each)
            check_checkpoint_space(checkpoints, str(sweep_dir), self.config.train.ckpt_keep)
        except _BAD_INPUT as e:
            fail(str(e))
        if self._EXECUTOR == "slurm" and self.config.cluster.pack > 1:
            return self._launch_packed(job_overrides, initial_job_idx, configs, sweep_dir)
        args = [(list(o), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{initial_job_idx + i}",
                 plugin.Singleton.get_state()) for i, o in enumerate(job_overrides)]
        try:
            executor = self.executor(self.params["submitit_folder"], self.config.cluster)
            self._array_exit_trap(executor, sweep_dir, initial_job_idx, configs)
            sweep_dir.mkdir(parents=True, exist_ok=True)
            jobs = _orfail(lambda: executor.map_array(self, *zip(*args)))
        except _BAD_INPUT as e:
            fail(str(e))
        print(f"hpctrain: submitted {len(jobs)} job(s) {_ids(jobs)} ({self._shape()} each) -> {sweep_dir}\n"
              f"hpctrain: progress: python -m hpctrain report {sweep_dir}", flush=True)
        if self.config.cluster.wait:
            _wait(jobs, str(sweep_dir))
        return [JobReturn(overrides=list(o), cfg=c, _return_value=j.job_id, working_dir=str(sweep_dir),
                          task_name="hpctrain", status=JobStatus.COMPLETED)
                for o, c, j in zip(job_overrides, configs, jobs)]

    def _launch_packed(self, job_overrides, first: int, configs: list, sweep_dir: Path) -> list[JobReturn]:
        """cluster.pack=N: N points per job, each an srun step of its own in its own run directory (PackedRuns)."""
        import math

        from hpctrain.launch.supervise import PackedRuns

        cluster, pack = self.config.cluster, self.config.cluster.pack
        shape = job_shape(self.config.parallel, cluster)  # one point's
        tasks = shape["nodes"] * shape["tasks_per_node"]
        per_node = max(cluster.gpus_per_node or cluster.tasks_per_node, shape["tasks_per_node"])

        def nodes_for(points: int) -> int:  # whole nodes for a point of several nodes; points of one node share nodes
            return points * shape["nodes"] if shape["nodes"] > 1 else math.ceil(points * tasks / per_node)

        try:  # (the widest job and the narrowest, a short last one, and Slurm here, before any directory is made)
            _check_lead(cluster)
            for points in {min(pack, len(configs)), len(configs) % pack or min(pack, len(configs))}:
                check_partition(cluster.partition, cluster.time_min, nodes_for(points), cluster.qos)
            _check_slurm_here()
            sweep_dir.mkdir(parents=True, exist_ok=True)
            points = [(self._packed_point(sweep_dir, first + i, list(o), cfg), shape["nodes"], tasks)
                      for i, (o, cfg) in enumerate(zip(job_overrides, configs))]
            jobs = []
            for start in range(0, len(points), pack):
                chunk = points[start:start + pack]
                executor = self.executor(self.params["submitit_folder"], cluster, checked=True)
                nodes = nodes_for(len(chunk))
                executor.update_parameters(slurm_use_srun=False, nodes=nodes,
                                           tasks_per_node=min(per_node, math.ceil(len(chunk) * tasks / nodes)))
                jobs.append(_orfail(lambda c=chunk, e=executor: e.submit(PackedRuns(c, cluster.cpus_per_task)), jobs))
        except _BAD_INPUT as e:
            fail(str(e))
        print(f"hpctrain: submitted {len(jobs)} job(s) {' '.join(j.job_id for j in jobs)} ({min(pack, len(points))} "
              f"points each, one srun step per point) -> {sweep_dir}\nhpctrain: progress: python -m hpctrain report "
              f"{sweep_dir}",
              flush=True)
        if cluster.wait:
            _wait(jobs, str(sweep_dir), batch_only=True)
        return [JobReturn(overrides=list(o), cfg=c, _return_value=jobs[i // pack].job_id, working_dir=str(sweep_dir),
                          task_name="hpctrain", status=JobStatus.COMPLETED)
                for i, (o, c) in enumerate(zip(job_overrides, configs))]

    @staticmethod
    def _point_dir(sweep_dir: Path, num: int, cfg) -> str:
        """Where Hydra puts sweep point `num` (its job number set on `cfg`)."""
        from omegaconf import open_dict

        with open_dict(cfg):
            cfg.hydra.job.num = num
        return str(sweep_dir / str(cfg.hydra.sweep.subdir))

    @staticmethod
    def _packed_point(sweep_dir: Path, num: int, overrides: list[str], cfg) -> str:
        """A packed point's run directory, made and recorded as the job of an unpacked point would (its config and
        overrides under .hydra/, which the report reads), with what its steps train from."""
        from omegaconf import open_dict

        from hpctrain.launch.supervise import write_step_file
        from hpctrain.runs import rundir

        run_dir = Submitting._point_dir(sweep_dir, num, cfg)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = run_dir
            cfg.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        run_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        with rundir.claimed(run_dir, probe=True):
            rundir.start_over(run_dir, run_cfg)
        os.makedirs(os.path.join(run_dir, ".hydra"), exist_ok=True)
        OmegaConf.save(rundir.with_absolute_paths(run_cfg), os.path.join(run_dir, ".hydra", "config.yaml"))
        OmegaConf.save(OmegaConf.create(overrides), os.path.join(run_dir, ".hydra", "overrides.yaml"))
        write_step_file(run_dir, OmegaConf.to_container(run_cfg, resolve=True),
                        OmegaConf.to_container(cfg.hydra.job_logging, resolve=True))
        return run_dir

    def submit_run(self, cfg: DictConfig, run_dir: str, job_logging: dict | None,
                   started: float = float("inf")) -> None:
        """One run (no -m): validate, submit one job running in `run_dir`, print where to look. On bad input
        the run dir Hydra made for it (after `started`) is removed again."""
        from hpctrain.runs import rundir

        folder = os.path.join(run_dir, ".submitit", "%j")
        try:
            rundir.check_owned(run_dir)
            prepared = check(cfg, run_dir)
            warning = timeouts_warning(cfg, prepared, run_dir) if self._EXECUTOR == "slurm" else None
            if warning:
                log.warning("%s", warning)
            with rundir.claimed(run_dir, probe=True):  # marked a run's; not while another run lives there
                executor = self.executor(folder, cfg.cluster)
                rundir.start_over(run_dir, cfg)  # before the job (or this) writes anything of the new run there
            resolved = OmegaConf.to_container(cfg, resolve=True)
            supervised = self._supervised(cfg)
            if supervised:  # a supervisor runs the training as srun steps
                from hpctrain.launch.supervise import SupervisedRun

                executor.update_parameters(slurm_use_srun=False)
                shape = job_shape(cfg.parallel, cfg.cluster)
                fn = SupervisedRun(resolved, run_dir, job_logging, shape["nodes"], shape["tasks_per_node"],
                                   cfg.cluster.max_restarts, min_nodes(cfg.parallel, cfg.cluster))
            else:
                fn = RunJob(resolved, run_dir, job_logging)
                self._exit_trap(executor, shlex.quote(run_dir))
            job = _orfail(lambda: executor.submit(fn))
        except _BAD_INPUT as e:
            rundir.remove_if_fresh(run_dir, started)
            fail(str(e))
        rundir.save_config(run_dir, cfg)
        print(f"hpctrain: submitted job {job.job_id} ({self._shape()}) -> {run_dir}\n"
              f"hpctrain: logs: {folder.replace('%j', job.job_id)}/; progress: "
              f"python -m hpctrain report {run_dir}", flush=True)
        if cfg.cluster.wait:
            _wait([job], run_dir, batch_only=supervised)


class Progress:
    """A line on stdout every `every_s` while many sweep points are checked (a 3000-point sweep takes minutes)."""

    def __init__(self, total: int, every_s: float = 10.0):
        import time

        self.total, self.every_s, self.clock = total, every_s, time.monotonic
        self.next = self.clock() + every_s

    def tick(self, done: int) -> None:
        if self.clock() >= self.next and done < self.total:
            print(f"hpctrain: checked {done} of {self.total} sweep points", flush=True)
            self.next = self.clock() + self.every_s


def max_array_size() -> int | None:
    """The cluster's MaxArraySize (array indices stay below it), or None where scontrol does not say."""
    import re
    import subprocess

    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^MaxArraySize\s*=\s*(\d+)", out, re.M)
    return int(m.group(1)) if m else None


def check_array_size(points: int) -> None:
    """A sweep of `points` array tasks (indices 0..points-1) that the cluster accepts: one ConfigError line."""
    limit = max_array_size()
    if limit is not None and points > limit:
        raise ConfigError(f"the sweep has {points} points, and this cluster's job arrays hold at most {limit} "
                          f"(MaxArraySize): split it into sweeps of at most {limit} points")


def grid(argv: list[str]) -> list[list[str]]:
    """The points of `key=v1,v2 ... [-- overrides]`, as sbatch/sweep.sbatch numbers them: before `--`, an
    override with commas is an axis; the cartesian product, the last axis fastest; the rest on every point."""
    import itertools

    cut = argv.index("--") if "--" in argv else len(argv)
    swept = [a for a in argv[:cut] if "," in a.partition("=")[2]]  # as the template's pattern *=*,*
    axes = [[f"{a.partition('=')[0]}={v}" for v in a.partition("=")[2].split(",")] for a in swept]
    common = [a for a in argv[:cut] if a not in swept] + argv[cut + 1:]
    return [[*point, *common] for point in itertools.product(*axes)]


def _ids(jobs) -> str:
    first = jobs[0].job_id.split("_")[0]
    return f"array {first}" if "_" in jobs[0].job_id else ", ".join(j.job_id for j in jobs)


RESULT_WAIT_S = 15.0  # how long submitit waits for a finished job's result file (a shared filesystem shows it late)


def _outcome(task, wait_s: float = RESULT_WAIT_S) -> str:
    """The outcome submitit wrote for a finished task ("success", "error"), waiting `wait_s` for the file as submitit
    does (a shared filesystem shows it late); "missing" or "unreadable" otherwise. Its file is a pickle of (outcome,
    the job's return value): only its first opcodes are parsed (pickletools), nothing is unpickled (submitit's own
    reader would build, and so run, whatever classes the file names)."""
    import pickletools

    path, deadline = task.paths.result_pickle, time.monotonic() + wait_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    try:
        with open(path, "rb") as f:
            for op, arg, _ in pickletools.genops(f):
                if op.name not in ("PROTO", "FRAME"):  # the tuple's first item: the outcome's string
                    return arg if "UNICODE" in op.name and arg in ("success", "error") else "unreadable"
    except FileNotFoundError:
        return "missing"
    except Exception:  # noqa: BLE001 - a damaged or foreign file: not a success either way
        return "unreadable"
    return "unreadable"


def _wait(jobs, where: str, batch_only: bool = False) -> None:
    """Block until every job ends; report the ones that ended without a result by their Slurm state. `batch_only`:
    jobs whose callable ran once, in the batch step (use_srun=False: a supervisor, packed points), the one result."""
    import submitit

    from hpctrain.launch.sweep import sacct_state

    bad = []
    for job in jobs:
        job.wait()  # a result file, or Slurm says the job ended
        state = sacct_state(job.job_id) if isinstance(job, submitit.SlurmJob) else None  # local: a PID
        if state not in (None, "completed") and not job.paths.result_pickle.exists():
            # Cancelled, timed out, node failure: no result will come; submitit would wait 15 s for one.
            bad.append(f"job {job.job_id} {state}")
            continue
        tasks = [job.task(0)] if batch_only else [job.task(i) for i in range(job.num_tasks)]
        deadline = time.monotonic() + RESULT_WAIT_S  # (once per job, not per task: 64 missing files are not 16 min)
        outcomes = {_outcome(task, max(0.0, deadline - time.monotonic())) for task in tasks}
        if outcomes != {"success"}:
            state = state or (job.state.split() or ["unknown"])[0].lower()
            bad.append(f"job {job.job_id} {state}")
            log.debug("job %s: %s", job.job_id, sorted(outcomes))
    if bad:
        fail(f"{len(bad)} of {len(jobs)} job(s) did not complete ({'; '.join(bad)}): see "
              f"python -m hpctrain report {where}", code=1)
    print(f"hpctrain: {len(jobs)} job(s) completed", flush=True)


def _check_slurm_here() -> None:
    missing = missing_commands()
    if missing:
        raise ConfigError(f"hydra/launcher=slurm needs Slurm, and {missing} not on PATH here: run on a Slurm login "
                          "node, or use hydra/launcher=local (or no launcher) to run on this machine")


def _orfail(submit, queued=()):
    """submit(); sbatch refusing the job (a bad partition, account, time limit...) becomes one line. So does an
    answer of sbatch's that submitit cannot read, but as no bad input: the run directory is kept, as a job may be
    queued all the same (`queued`: the jobs this command submitted before, named too)."""
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
    except submitit.core.utils.FailedSubmissionError as e:
        answer = re.search(r'"(.*)"', str(e), re.S)
        before = f"; job(s) {' '.join(j.job_id for j in queued)} were submitted before it" if queued else ""
        fail(f"sbatch answered {(answer.group(1) if answer else str(e)).strip()[:200]!r}, not 'Submitted batch job "
             "N': submitit cannot put the job's files in place, so a job queued all the same fails as it starts "
             f"(squeue --me; scancel it){before}; is an sbatch wrapper on PATH changing sbatch's answer?", code=1)


