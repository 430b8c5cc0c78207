"""The run directory's life outside training: its config record, starting over, and a clean failure.

A previous run is moved aside, never deleted; the only thing removed is a run directory this process made
(everything in it newer than the process) for a run that then failed its checks.
"""

from __future__ import annotations

import logging
import os
import time

from omegaconf import OmegaConf

log = logging.getLogger("hpctrain")

# What a run writes besides the config and the log: these make a directory a previous run.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tb", "result.json")
PREVIOUS = "previous"


def free_name(path: str) -> str:
    """`path`, or `path-2`, `path-3`, ... : the first name nothing exists at."""
    n, name = 1, path
    while os.path.lexists(name):
        n += 1
        name = f"{path}-{n}"
    return name


def _made_since(path: str, since: float) -> bool:
    """Whether `path` and everything under it were made after `since` (status change times)."""
    try:
        if os.lstat(path).st_ctime < since:
            return False
        for root, dirs, files in os.walk(path):
            if any(os.lstat(os.path.join(root, name)).st_ctime < since for name in dirs + files):
                return False
    except OSError:
        return False
    return True


def remove_if_fresh(path: str, since: float) -> None:
    """Remove the run directory of a run that failed its checks, when all of it was made after `since` (by Hydra,
    or by a submission sbatch refused), then its parents while empty and as new. Anything older stays."""
    import shutil

    path = os.path.abspath(path)
    if not os.path.isdir(path) or not _made_since(path, since):
        return
    shutil.rmtree(path, ignore_errors=True)
    stop = os.path.abspath(os.getcwd())
    path = os.path.dirname(path)
    while path not in (stop, os.path.dirname(path)) and _made_since(path, since):
        try:
            os.rmdir(path)  # only when empty
        except OSError:
            return
        path = os.path.dirname(path)


def save_config(run_dir: str, cfg) -> None:
    """`.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`, as Hydra writes them, once the run is valid
    (Hydra's own writing is off: `hydra.output_subdir: null`)."""
    from hydra.core.hydra_config import HydraConfig

    from hpctrain.distributed import launched_rank

    if launched_rank() != 0:
        return
    out = os.path.join(run_dir, ".hydra")
    os.makedirs(out, exist_ok=True)
    hc = HydraConfig.instance().cfg
    OmegaConf.save(cfg, os.path.join(out, "config.yaml"))
    OmegaConf.save(hc, os.path.join(out, "hydra.yaml"))
    OmegaConf.save(hc.hydra.overrides.task, os.path.join(out, "overrides.yaml"))


def has_previous_run(run_dir: str) -> bool:
    return any(os.path.exists(os.path.join(run_dir, name)) for name in RUN_OUTPUTS)


def set_aside(run_dir: str) -> str:
    """Move a previous run's outputs into `<run_dir>/previous/<time>/` so that a new run starts clean
    (its checkpoint rotation, `latest` and metrics never mix with the old run's); return that directory."""
    dest = free_name(os.path.join(run_dir, PREVIOUS, time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(dest)
    for name in RUN_OUTPUTS:
        if os.path.exists(os.path.join(run_dir, name)):
            os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    log.warning("%s held a previous run: its outputs were moved to %s", run_dir, dest)
    return dest


def start_point(run_dir: str, resume: str) -> str | None:
    """Where this run starts: "auto" (resume from the run dir's newest loadable checkpoint, if any) or the path
    of a checkpoint (`train.resume=PATH`), or None (from scratch). Rank 0 only: `never` and an explicit path
    move a previous run in `run_dir` aside first. A requeued Slurm job continues its own run whatever
    `resume` says (else every requeue would start over)."""
    if resume == "auto" or int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        return "auto"
    path = None if resume == "never" else os.path.realpath(os.path.expanduser(resume))
    if has_previous_run(run_dir):
        own = os.path.realpath(os.path.join(run_dir, "checkpoints"))
        dest = set_aside(run_dir)
        if path is not None and (path + os.sep).startswith(own + os.sep):  # a checkpoint of the old run
            path = os.path.join(dest, "checkpoints", os.path.relpath(path, own))
    return path
