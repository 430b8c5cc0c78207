"""The run directory's life outside training: who owns it, its config record, starting over, a clean failure.

A directory is a run's once `LOCK_FILE` is in it: hpctrain writes that file before anything else of a run, and
never writes into a directory holding a run's files without it (someone else's metrics.jsonl stays theirs). The
main rank holds an advisory lock on that file while the run lives, so a second run in the same directory stops
at once instead of deleting the first one's checkpoints; the kernel drops the lock with the process, so a crashed
or killed run leaves nothing stale. A previous run is moved aside, never deleted. The only thing ever removed is
the run directory of a run that failed its checks, when all of it was made by this command (and the parents
Hydra made for it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import logging
import os
import shutil
import socket
import sys
import time

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from hpctrain.core.config import check_values
from hpctrain.core.errors import TrainingError
from hpctrain.core.files import MiB, absolute_path, free_name, read_object, read_yaml
from hpctrain.core.host import memory_headroom

log = logging.getLogger("hpctrain")

# What a run writes: the first four make a directory hold a previous run; all of them move aside with it.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tb", "result.json")
RUN_RECORDS = (".hydra", "train.log", "slurm.json", ".submitit", "hf", "alerts.jsonl", "profile", "memory", "hang",
               "trackers.json", "mlflow", "wandb",  # the trackers: a run started over gets new tracker runs
               "evals.jsonl", "eval_samples", "eval_jobs", "pins")  # its checkpoints' scores go with them
PREVIOUS = "previous"
LOCK_FILE = ".hpctrain-run.lock"  # the mark of a run directory, and the lock of the run living in it

_first_new: str | None = None  # the highest ancestor of this run's directory that did not exist before it


class NoteNewDirs(Callback):
    """Hydra callback (conf/config.yaml): before Hydra makes the run directory, note which of its ancestors
    do not exist yet, so that a run failing its checks can take back exactly what was made for it."""

    def on_run_start(self, config, **kwargs) -> None:
        global _first_new
        path, _first_new = os.path.abspath(str(config.hydra.run.dir)), None
        while not os.path.exists(path) and path != os.path.dirname(path):
            path, _first_new = os.path.dirname(path), path


def _made_since(path: str, since: float) -> bool:
    """Whether `path` and everything under it changed status after `since` (a directory's own time moves when
    entries come and go, so this says nothing of who made a directory that is still there: the leaf only)."""
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
    """Take back the run directory of a run that failed its checks: only when all of it is newer than `since`
    (made by Hydra, or by a submission sbatch refused), and only on the main rank; then the parents Hydra made
    for it (noted by NoteNewDirs), while empty. Anything that existed before stays."""
    from hpctrain.parallel.process_group import launched_rank

    path = os.path.abspath(path)
    if launched_rank() != 0 or not os.path.isdir(path) or not _made_since(path, since):
        return
    shutil.rmtree(path, ignore_errors=True)
    if _first_new is None or not (path + os.sep).startswith(_first_new + os.sep):
        return
    while path != _first_new:
        path = os.path.dirname(path)
        try:
            os.rmdir(path)  # only when empty
        except OSError:
            return


def _legacy_run(run_dir: str) -> bool:
    """A run of an hpctrain older than LOCK_FILE: its config record and a complete checkpoint of its own."""
    from hpctrain.storage.checkpoint import complete_checkpoints

    return os.path.isfile(os.path.join(run_dir, ".hydra", "config.yaml")) and bool(complete_checkpoints(run_dir))


def _logging_here(path: str) -> bool:
    """Whether this process's logging writes `path`: Hydra's train.log, opened at the first log line (a warning of
    the run's own checks, before the directory is claimed) — this run's file, not another's."""
    import logging

    return any(isinstance(h, logging.FileHandler) and h.stream is not None
               and os.path.realpath(h.baseFilename) == os.path.realpath(path) for h in logging.getLogger().handlers)


def check_owned(run_dir: str) -> None:
    """Refuse (one TrainingError line) a directory holding files of the names a run writes that no hpctrain run
    wrote (no LOCK_FILE): they would be appended to, truncated or moved. Reads only."""
    if not os.path.isdir(run_dir) or os.path.lexists(os.path.join(run_dir, LOCK_FILE)):
        return
    found = [name for name in RUN_OUTPUTS + RUN_RECORDS if os.path.lexists(os.path.join(run_dir, name))
             and not _logging_here(os.path.join(run_dir, name))]
    if found and not _legacy_run(run_dir):
        raise TrainingError(f"run_dir={run_dir} holds {', '.join(found[:3])} that no hpctrain run wrote (no "
                            f"{LOCK_FILE}): choose a new or empty run_dir (if it is a run of an hpctrain older than "
                            f"that file, adopt it: touch {os.path.join(run_dir, LOCK_FILE)})")


def _holder(path: str) -> str:
    doc = read_object(path, MiB) or {}
    who = f"pid {doc.get('pid', '?')} on {doc.get('host', '?')}"
    since = doc.get("since")
    return who + (f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
                  if isinstance(since, (int, float)) else "")


_held: dict[str, list] = {}  # real path of a run dir -> [lock file descriptor, nesting depth], in this process


@contextlib.contextmanager
def claimed(run_dir: str, probe: bool = False):
    """The run directory for one run at a time: checked (`check_owned`), marked with LOCK_FILE and locked (an
    advisory flock held until the block ends or the process dies) on the main rank; other ranks pass through.
    Re-entrant in a process. `probe`: mark and release at once (a login node submitting the job that takes the
    lock: the directory is a run's from the submission on). A directory another run holds is one TrainingError
    line naming that run."""
    from hpctrain.parallel.process_group import launched_rank

    key = os.path.realpath(run_dir)
    if launched_rank() != 0 or key in _held:
        if key in _held:
            _held[key][1] += 1
        try:
            yield
        finally:
            if key in _held:
                _held[key][1] -= 1
        return
    check_owned(run_dir)
    path = os.path.join(run_dir, LOCK_FILE)
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TrainingError(f"run_dir={run_dir} is in use by another run ({_holder(path)}): wait for it to end or "
                            "stop it, or choose another run_dir") from None
    except OSError as e:  # a filesystem without locks (Lustre mounted noflock): the mark still goes in
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise
        log.warning("run_dir %s cannot be locked (%s): a second run started in it would not be stopped",
                    run_dir, e.strerror)
    if not probe:
        doc = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                          "argv": sys.argv[1:]}).encode()
        os.ftruncate(fd, 0)  # in place: replacing the file would leave the lock on the old one
        os.pwrite(fd, doc, 0)
    _held[key] = [fd, 1]
    try:
        yield
    finally:
        del _held[key]
        os.close(fd)  # the lock goes with its last descriptor (forked ranks hold copies until they exit)


def save_config(run_dir: str, cfg) -> None:
    """`.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`, as Hydra writes them, once the run is valid
    (Hydra's own writing is off: `hydra.output_subdir: null`)."""
    from hydra.core.hydra_config import HydraConfig

    from hpctrain.parallel.process_group import launched_rank

    if launched_rank() != 0:
        return
    out = os.path.join(run_dir, ".hydra")
    os.makedirs(out, exist_ok=True)
    hc = HydraConfig.instance().cfg
    OmegaConf.save(with_absolute_paths(cfg), os.path.join(out, "config.yaml"))
    OmegaConf.save(hc, os.path.join(out, "hydra.yaml"))
    OmegaConf.save(hc.hydra.overrides.task, os.path.join(out, "overrides.yaml"))


# The keys that name files: recorded as absolute paths, so that the tools that read a run (generate, export-hf, eval)
# find them from any directory (a run reads a relative one from where it was started).
PATH_KEYS = ("data.path", "model.init_from", "train.resume", "eval.include_path")


def with_absolute_paths(cfg: DictConfig) -> DictConfig:
    """A copy of `cfg` whose PATH_KEYS (and data.sources' paths) are absolute; an interpolation (`${oc.env:...}`)
    is kept as written (it is resolved where the run reads it)."""
    import copy

    from hpctrain.models import HF_PREFIX

    def absolute(node, name: str, prefix: str = "") -> None:
        raw = OmegaConf.to_container(node, resolve=False).get(name)
        if isinstance(raw, str) and "${" not in raw and raw not in ("auto", "never"):  # (train.resume's words)
            node[name] = absolute_path(raw, prefix)

    cfg = copy.deepcopy(cfg)
    for key in PATH_KEYS:
        group, name = key.split(".")
        absolute(cfg[group], name, HF_PREFIX)
    for source in cfg.data.get("sources") or ():
        absolute(source, "path")
    return cfg


def has_previous_run(run_dir: str) -> bool:
    """Whether `run_dir` holds a run's outputs; an empty checkpoints/ is none (made ready for the run: a symlink to,
    or a mount of, another filesystem, which stays where it is)."""
    def held(name: str) -> bool:
        path = os.path.join(run_dir, name)
        return os.path.exists(path) and not (name == "checkpoints" and os.path.isdir(path) and not os.listdir(path))

    return any(held(name) for name in RUN_OUTPUTS)


RESTART_ENV = "HPCTRAIN_RESTART"  # a supervised run's restart inside its allocation (launch/supervise.py): 1, 2, ...


def requeued() -> bool:
    """A Slurm job running again after a requeue (preemption, time limit, node failure), or a supervised run's step
    restarted inside its allocation (cluster.spare_nodes): either continues its own run, never starts over."""
    return any(int(os.environ.get(name, "0") or 0) > 0 for name in ("SLURM_RESTART_COUNT", RESTART_ENV))


def set_aside(run_dir: str) -> str:
    """Move a previous run's outputs and records into `<run_dir>/previous/<time>/` so that a new run starts clean
    (its checkpoint rotation, `latest`, metrics and config never mix with the old run's); return that directory."""
    dest = free_name(os.path.join(run_dir, PREVIOUS, time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(dest)
    for name in RUN_OUTPUTS + RUN_RECORDS:
        if os.path.lexists(os.path.join(run_dir, name)):
            os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    log.warning("%s held a previous run: it was moved to %s", run_dir, dest)
    return dest


def start_over(run_dir: str, cfg) -> None:
    """`train.resume=never` or a checkpoint path in a directory that holds a run, or `auto` where that run left no
    complete checkpoint to continue (it never wrote one, or trained with train.checkpointing=false): move that run
    aside first (before anything of the new run is written; its metrics would be cut, its result replaced) and point
    `cfg.train.resume` at where a checkpoint of it went. Once done it is a no-op, so every stage of a launch may call
    it; a requeued job never starts over."""
    resume = cfg.train.resume
    if requeued() or not has_previous_run(run_dir) or (resume == "auto" and _has_checkpoint(run_dir)):
        return
    own = os.path.realpath(os.path.join(run_dir, "checkpoints"))
    dest = set_aside(run_dir)
    path = os.path.realpath(os.path.expanduser(resume)) if resume != "never" else None
    if path and (path + os.sep).startswith(own + os.sep):
        cfg.train.resume = os.path.join(dest, "checkpoints", os.path.relpath(path, own))


def resumes(run_dir: str | None, resume: str) -> bool:
    """Whether a run about to start in `run_dir` continues from a checkpoint (its own newest, or train.resume=PATH)
    rather than from model.init_from's weights."""
    own = run_dir is not None and _has_checkpoint(run_dir)
    if requeued() and own:  # (whatever train.resume says: `start_point`)
        return True
    return resume != "never" and (resume != "auto" or own)


def start_point(run_dir: str, resume: str) -> str | None:
    """Where the run starts (after `start_over`): "auto" (the run dir's newest loadable checkpoint, if any), a
    checkpoint path, or None (from scratch). A requeued job continues its own run; before its first checkpoint
    it starts where its first attempt did (a checkpoint of an old run is found where `start_over` moved it)."""
    if resume == "auto" or (requeued() and _has_checkpoint(run_dir)):
        return "auto"
    if resume == "never":
        return None
    return moved(os.path.realpath(os.path.expanduser(resume)), run_dir)


def moved(path: str, run_dir: str) -> str:
    """`path`, or, when it was in the outputs of the run in `run_dir` (a checkpoint, an export in hf/) that have
    since been set aside, where it is now (the newest set aside that holds it)."""
    path = os.path.realpath(path)
    rel = os.path.relpath(path, os.path.realpath(run_dir))
    if os.path.exists(path) or rel.split(os.sep)[0] not in RUN_OUTPUTS + RUN_RECORDS:
        return path
    for old in sorted(glob.glob(os.path.join(glob.escape(run_dir), PREVIOUS, "*")), reverse=True):
        if os.path.exists(os.path.join(old, rel)):
            return os.path.join(old, rel)
    return path


def _has_checkpoint(run_dir: str) -> bool:
    from hpctrain.storage.checkpoint import complete_checkpoints

    return bool(complete_checkpoints(run_dir))


class RunDirError(ValueError):
    """A directory that is not a finished training run's, or one without a checkpoint: one line naming the fix."""


def run_config(run_dir: str, ckpt: str | None = None):
    """(the config a run was trained with, its latest checkpoint or `ckpt`), for the tools that read a run."""
    from hpctrain.runs.compose import register
    from hpctrain.storage.checkpoint import latest

    register()  # the saved config may use hpctrain's resolvers (e.g. the demo data path)
    config = os.path.join(run_dir, ".hydra", "config.yaml")
    if not os.path.lexists(config):  # (one that is there but no file is read below, and refused in one line)
        what = "does not exist" if not os.path.exists(run_dir) else f"is not a run directory (no {config})"
        raise RunDirError(f"run_dir={run_dir} {what}: pass the directory a training run wrote")
    ckpt = ckpt or latest(run_dir)
    if ckpt is None:
        raise RunDirError(f"no complete checkpoint in {run_dir}/checkpoints: train longer (a checkpoint is "
                          "written every train.ckpt_every steps and at the end) or pass checkpoint=DIR")
    try:
        loaded = read_yaml(config)
    except Exception as e:  # noqa: BLE001 - not a file, too big, not UTF-8, not YAML: one line whatever it is
        raise RunDirError(f"{config} is not a readable run config ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}): "
                          "restore it from a copy of the run") from None
    if not isinstance(loaded, DictConfig):
        raise RunDirError(f"{config} is not a run config (not a mapping): restore it from a copy of the run")
    _check_run_config(loaded, config)
    return loaded, ckpt


def _check_run_config(cfg: DictConfig, config: str) -> None:
    """A saved config's model is checked as the command line's is, and must fit this machine, before a tool builds
    it: an edited max_seq_len would otherwise allocate its RoPE tables at once. (Only `model.*`: a run saved by an
    older hpctrain may hold other values this one no longer allows, and the tools use none of them.)"""
    from hpctrain.models import resident_bytes

    try:
        check_values(cfg, prefix="model.")
        params, buffers = resident_bytes(cfg.model)
    except Exception as e:  # noqa: BLE001 - a range, a missing key, a wrong type: one line whatever it is
        raise RunDirError(f"{config}: {' '.join(str(e).split())}: restore it from a copy of the run") from None
    cap, where = memory_headroom()
    if cap is not None and params + buffers > cap:
        raise RunDirError(
            f"the model of {config} needs {(params + buffers) / 2**30:.1f} GiB before any activation, more than "
            f"{where} ({cap / 2**30:.1f} GiB): parameters {params / 2**30:.1f} GiB, buffers (the "
            f"RoPE tables, model.max_seq_len={cfg.model.max_seq_len} × head_dim) {buffers / 2**30:.1f} GiB; "
            "restore the config from a copy of the run, or use a larger machine")
