"""Atomic, resharding-friendly checkpoints with torch.distributed.checkpoint (DCP).

Layout: <run_dir>/checkpoints/step-0000100/ holds the DCP shards (model, optimizer, RNG) and
trainer_state.json (step, data position, schedule, loss scale: plain JSON). A checkpoint is written
into a hidden temporary directory and renamed once complete; `latest` is a symlink updated after the
rename, so a crash at any point leaves the previous checkpoint as the one resumed from.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata file is a pickle: allow only the plain classes it is made of."""

    _ALLOWED_PREFIXES = ("torch.distributed.checkpoint.",)
    _ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("pathlib", "PosixPath"),
                ("pathlib", "PurePosixPath"), ("builtins", "set"), ("builtins", "frozenset"),
                ("builtins", "slice"), ("builtins", "bytearray")}

    def find_class(self, module, name):
        if module.startswith(self._ALLOWED_PREFIXES) or (module, name) in self._ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer hyper-parameters) are loaded with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def complete_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoint directories, oldest first (temporary ones are never listed)."""
    r = root(run_dir)
    if not os.path.isdir(r):
        return []
    steps = sorted((int(m.group(1)), name) for name in os.listdir(r) if (m := _STEP_DIR.match(name)))
    return [os.path.join(r, name) for _, name in steps if os.path.isfile(os.path.join(r, name, STATE_FILE))]


def step_of(path: str) -> int:
    """The step a checkpoint directory holds (from its name)."""
    return int(_STEP_DIR.match(os.path.basename(os.path.normpath(path))).group(1))


def latest(run_dir: str) -> str | None:
    link = os.path.join(root(run_dir), "latest")
    if os.path.isfile(os.path.join(link, STATE_FILE)):
        return os.path.realpath(link)
    done = complete_checkpoints(run_dir)  # a stale or missing link: fall back to the newest complete one
    return done[-1] if done else None


def _model_optim_state(model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"cpu_rank{rank}": torch.get_rng_state()}}
    if torch.cuda.is_available():
        state["rng"][f"cuda_rank{rank}"] = torch.cuda.get_rng_state()
    return state


def save(run_dir: str, step: int, model, optimizer, trainer_state: dict, keep: int) -> str:
    """Write checkpoint `step` atomically (collective: every rank calls it); return its path."""
    final = os.path.join(root(run_dir), f"step-{step:07d}")
    tmp = os.path.join(root(run_dir), f".tmp-step-{step:07d}")
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash mid-save
        os.makedirs(tmp)
    _barrier()
    dcp.save(_model_optim_state(model, optimizer), checkpoint_id=tmp)
    if _is_main():
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump(trainer_state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        link_tmp = os.path.join(root(run_dir), ".latest.tmp")
        if os.path.lexists(link_tmp):
            os.remove(link_tmp)
        os.symlink(os.path.basename(final), link_tmp)
        link = os.path.join(root(run_dir), "latest")
        if os.path.isdir(link) and not os.path.islink(link):  # a run copied without symlinks (cp -r)
            shutil.rmtree(link)
        os.replace(link_tmp, link)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _dcp_load(state: dict, path: str, reader: _SafeReader | None = None, **kwargs) -> None:
    """dcp.load through the safe reader/planner; a failure becomes one CheckpointError line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=path, storage_reader=reader or _SafeReader(path),
                 planner=_SafeLoadPlanner(), **kwargs)
    except CheckpointException as e:  # a BaseException in DCP: it would escape `except Exception`
        cause = next(iter(e.failures.values()), e)
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise CheckpointError(f"cannot load checkpoint {path}: {detail}: resume from another checkpoint "
                              "(train.resume=PATH) or train.resume=never") from None


def load(path: str, model, optimizer) -> dict:
    """Load model and optimizer state in place (resharded to the current layout); return trainer_state."""
    state_file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {STATE_FILE}): pass another train.resume")
    reader = _SafeReader(path)
    try:
        present = reader.read_metadata().state_dict_metadata
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"cannot read checkpoint metadata in {path} ({e}): resume from another "
                              "checkpoint (train.resume=PATH) or train.resume=never") from None
    state = _model_optim_state(model, optimizer)
    # RNG streams are per rank: a resume on more ranks than were saved starts the new ones fresh.
    state["rng"] = {k: v for k, v in state["rng"].items() if f"rng.{k}" in present}
    _dcp_load(state, path, reader)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_OPTIONS)
    for key, value in state["rng"].items():
        if key.startswith("cpu"):
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value)
    with open(state_file) as f:
        return json.load(f)


def load_model(path: str, model) -> None:
    """Load only the model weights of a checkpoint into an unsharded model, without a process group."""
    import warnings

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "no process group, assuming one process": exactly the intent
        warnings.simplefilter("ignore", UserWarning)
        _dcp_load(state, path, no_dist=True)
    model.load_state_dict(state["model"])
