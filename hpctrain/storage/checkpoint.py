"""Atomic, resharding-friendly checkpoints with torch.distributed.checkpoint (DCP).

Layout: <run_dir>/checkpoints/step-0000100/ holds the DCP shards (model, optimizer, RNG) and
trainer_state.json (step, data position, schedule, loss scale: plain JSON). A checkpoint is written
into a hidden temporary directory and renamed once complete; `latest` is a symlink updated after the
rename, so a crash at any point leaves the previous checkpoint as the one resumed from.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import io
import logging
import os
import pickle
import re
import shutil
import types

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from hpctrain.core.errors import CheckpointError, TrainingError
from hpctrain.core.files import (
    FileCheckError,
    MiB,
    causes,
    check_file,
    free_name,
    no_space,
    open_checked,
    read_json,
    write_json,
)
from hpctrain.parallel.compression import grad_exchange
from hpctrain.parallel.parallelize import tied_aliases

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
REMOVING = ".removing-"  # a rotated checkpoint, renamed before its removal
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
log = logging.getLogger("hpctrain")
_FIX = "resume from another checkpoint (train.resume=PATH) or train.resume=never"


_TOOL_FIX = "pass checkpoint=RUN_DIR/checkpoints/step-N (a complete one), or leave checkpoint= out for the latest"


def cannot_load(path: str, reason: str) -> CheckpointError:
    return CheckpointError(f"cannot load checkpoint {path} ({reason}): {_FIX}", reason)


_OTHER_MODEL_FIX = "set model.* as the run that wrote it had them (its .hydra/config.yaml), or use another checkpoint"
_TOOL_OTHER_MODEL_FIX = "pass the directory of the run that wrote it, or a checkpoint of this run"


@contextlib.contextmanager
def as_tool_says():
    """A CheckpointError raised inside, as a tool that reads a checkpoint (generate, export-hf, eval) words it: its
    fix is another checkpoint=DIR or run directory, not a resume or model.* keys (a tool takes the run's)."""
    try:
        yield
    except CheckpointError as e:
        msg = str(e)
        for fix, tools in ((_FIX, _TOOL_FIX), (_OTHER_MODEL_FIX, _TOOL_OTHER_MODEL_FIX)):
            if msg.endswith(fix):
                raise CheckpointError(msg[:-len(fix)] + tools, e.reason, tools if e.fix else None) from None
        raise


def trained_tokenizer(path: str) -> str | None:
    """The sha256 of the tokenizer whose token ids checkpoint `path`'s weights were trained on (None where it records
    none)."""
    run = check_loadable(path).get("run")
    sha = run.get("tokenizer_sha256") if isinstance(run, dict) else None
    return sha if isinstance(sha, str) else None


def check_tokenizer(path: str, data_dir: str, sha256: str | None) -> None:
    """The shards in `data_dir` (their tokenizer's `sha256`) number tokens as checkpoint `path`'s weights were trained
    on, where both say: a tool reading a run whose data.path has since been rebuilt with another tokenizer would
    decode (or export) the wrong text, silently."""
    theirs = trained_tokenizer(path)
    if theirs and sha256 and theirs != sha256:
        raise CheckpointError(f"checkpoint {path} was trained on the token ids of another tokenizer (sha256 "
                              f"{theirs[:12]}) than the shards in {data_dir} hold now ({sha256[:12]}): put the "
                              "run's shards (or their tokenizer) back at that path")


def _describe(e: BaseException) -> str:
    """An exception as a short line: DCP and torch.load messages run to paragraphs, a truncated file's to none."""
    if isinstance(e, EOFError):
        return "EOFError: a file ends early (truncated)" + (f": {e}" if str(e) else "")
    if isinstance(e, OSError) and e.filename:
        return f"{e.strerror or type(e).__name__}: {e.filename}"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    text = lines[0].split(". ")[0][:200]
    if text.startswith("Weights only load failed") and len(lines) > 1:  # the refused global is on the next line
        text += ": " + lines[1].split(". ")[0][:200]
    return f"{type(e).__name__}: {text}"


# Exactly the globals DCP's .metadata pickle is made of, found by listing the GLOBAL/STACK_GLOBAL opcodes of the
# checkpoints every layout of this suite writes (single, ddp, zero2, fsdp, tp2_sp, dp2_tp2, pp, dp2_tp2_pp2;
# fp32/bf16/fp16; adamw/adafactor/sgd) with torch 2.13; torch 2.11's DCP pickles the same classes. Exact pairs
# only: pickle resolves a dotted name by walking attributes, so a module prefix or a dotted name would reach
# anything those modules import (os.system) or define (functions that load or write files). A pair missing from
# some torch or Python version fails that load (one line), never the import.
_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta",
        "_MEM_FORMAT_ENCODING",  # TensorProperties' memory format: an Enum, called only to look up a member
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # storage_data: file name, offset, length
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch.layout pickles: a lookup of a layout by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib._local", "PosixPath"),  # the same, as Python 3.13 pickles it
})
# torch.dtype pickles as ("torch", "<name>"): the dtypes a checkpoint can hold, by name, if this torch has them.
_DTYPES = frozenset(name for name in (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8", "bool",
) if isinstance(getattr(torch, name, None), torch.dtype))


_SHARED_KINDS = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, enum.Enum, torch.dtype,
                 torch.layout)


def _refuse_shared_build(unpickler) -> None:
    """BUILD sets attributes on the object below it: allowed on an instance this load made, never on a class,
    function, module or process-wide singleton (an Enum member, a dtype): that would patch it for every later load
    in the process (`__qualname__`, `__eq__`, a function's cache), whatever `vars()` shows."""
    target = unpickler.stack[-2] if len(unpickler.stack) >= 2 else None
    if isinstance(target, _SHARED_KINDS):
        raise pickle.UnpicklingError(f"it modifies {getattr(target, '__qualname__', type(target).__name__)}")
    pickle._Unpickler.load_build(unpickler)


class _MetadataUnpickler(pickle._Unpickler):
    """DCP's .metadata file is a pickle: it may name only the classes DCP metadata is made of, and change none of
    them. The Python unpickler, not the C one: its opcode table is the one place BUILD can be checked."""

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _refuse_shared_build}

    def find_class(self, module, name):
        if (module, name) not in _METADATA_GLOBALS and not (module == "torch" and name in _DTYPES):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return getattr(importlib.import_module(module), name)


MAX_METADATA_BYTES = 1024 * MiB


def _read_metadata(path: str, file: str) -> Metadata:
    """Unpickle DCP's .metadata through the allow-list; whatever is wrong with it is one CheckpointError."""
    try:
        with open_checked(file, MAX_METADATA_BYTES) as f:
            metadata = _MetadataUnpickler(f).load()
    except OSError as e:
        raise cannot_load(path, _describe(e)) from None
    except FileCheckError as e:
        raise cannot_load(path, f"bad .metadata: {e}") from None
    except Exception as e:  # noqa: BLE001 - a damaged or hostile pickle raises anything at all
        raise cannot_load(path, f"bad .metadata: {_describe(e)}") from None
    return _checked(metadata, path)


def _checked(metadata, path: str) -> Metadata:
    """What this module and the reader use outside DCP (whose own failures become one line anyway)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # private: imported only when used

    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)
            and isinstance(metadata.storage_meta, StorageMeta | None)
            and all(isinstance(info, _StorageInfo) for info in metadata.storage_data.values())):
        raise cannot_load(path, "bad .metadata: not DCP checkpoint metadata")
    checked = set()
    for info in metadata.storage_data.values():  # data files are read from path/relative_path
        rel = info.relative_path
        if not isinstance(rel, str) or os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] == "..":
            raise cannot_load(path, f"bad .metadata: data file {rel!r} is outside the checkpoint")
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0):
            raise cannot_load(path, f"bad .metadata: an entry of {rel} at bytes {info.offset!r}+{info.length!r}")
        if rel not in checked and os.path.lexists(os.path.join(path, rel)):  # (a missing one: DCP's own line)
            try:
                check_file(os.path.join(path, rel), 2**62)  # a regular file: never a device read without end
            except FileCheckError as e:
                raise cannot_load(path, f"data file {e}") from None
            checked.add(rel)
    return metadata


class _SafeReader(FileSystemReader):
    """Reads .metadata once, through the allow-list, when made: DCP gets that copy, so a bad file is one
    CheckpointError here and never reaches DCP's own fallback (per-rank metadata files, logged tracebacks)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.metadata = _read_metadata(path, str(self._get_metadata_path()))

    def read_data(self, plan, planner):
        """The entries of `plan` read once each lies inside its file (a truncated file is one line, checked before
        a read that would return short)."""
        sizes: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            rel = info.relative_path
            if rel not in sizes:
                sizes[rel] = os.path.getsize(os.path.join(self.path, rel))
            if info.offset + info.length > sizes[rel]:
                raise EOFError(f"{rel} is {sizes[rel]} bytes, its entry {item.storage_index.fqn} ends at byte "
                               f"{info.offset + info.length}")
        return super().read_data(plan, planner)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer hyper-parameters) are loaded with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

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


def strays(run_dir: str) -> list[str]:
    """Entries of <run_dir>/checkpoints named like a checkpoint (`step-N`) that are not complete ones: never
    written by hpctrain (its checkpoints appear complete, by a rename), so never to be replaced or removed."""
    r = root(run_dir)
    if not os.path.isdir(r):
        return []
    return [os.path.join(r, name) for name in sorted(os.listdir(r))
            if _STEP_DIR.match(name) and not os.path.isfile(os.path.join(r, name, STATE_FILE))]


def check_no_strays(run_dir: str) -> None:
    """A run continuing in `run_dir` would reach the steps of its strays beyond its newest complete checkpoint
    (a copy or backup the user may expect it to continue from): refuse it (one CheckpointError line). Older ones
    (a removal of the run's own cut short) are never written again, never touched either."""
    done = complete_checkpoints(run_dir)
    newest = step_of(done[-1]) if done else -1
    found = [path for path in strays(run_dir) if step_of(path) > newest]
    if found:
        raise CheckpointError(f"{found[0]} is not a complete checkpoint (no {STATE_FILE}: an interrupted copy, or "
                              "one made by hand?), and this run would write its step there: move it out of "
                              f"{root(run_dir)}, or start over with train.resume=never (the old run, this "
                              "directory included, is moved aside)")


def is_step_dir(name: str) -> bool:
    return bool(_STEP_DIR.match(name))


def step_of(path: str) -> int:
    """The step a checkpoint directory holds (from its name)."""
    return int(_STEP_DIR.match(os.path.basename(os.path.normpath(path))).group(1))


def latest(run_dir: str) -> str | None:
    link = os.path.join(root(run_dir), "latest")
    target = os.path.realpath(link)
    if os.path.islink(link) and _STEP_DIR.match(os.path.basename(target)) and os.path.isfile(
            os.path.join(target, STATE_FILE)):
        # A complete checkpoint newer than the link's, written after the link last moved: the run was stopped between
        # its rename and the link's (one a fallback past it had re-pointed the link after it stays passed over)
        moved = os.lstat(link).st_mtime
        newer = [p for p in complete_checkpoints(run_dir) if step_of(p) > step_of(target)
                 and os.path.getmtime(os.path.join(p, STATE_FILE)) > moved]
        return newer[-1] if newer else target
    # A stale or missing link, or a copy of the run made without symlinks (`cp -r`: `latest` is a directory
    # then, named for no step): the newest complete checkpoint.
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def _renamed(optim_sd: dict, aliases: dict[str, str], back: bool = False) -> dict:
    """Flattened optimizer state with the keys of tied copies (`state.output.weight.exp_avg`) under the name of
    the Parameter they copy, as one process saves it (`back`: the other way), so checkpoints reshard between a
    pipeline and one process."""
    for copy, source in aliases.items():
        old, new = (source, copy) if back else (copy, source)
        for part in ("state", "param_groups"):
            prefix = f"{part}.{old}."
            for key in [k for k in optim_sd if k.startswith(prefix)]:
                optim_sd[f"{part}.{new}.{key[len(prefix):]}"] = optim_sd.pop(key)
    return optim_sd


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def state_of(model, optimizer) -> dict:
    """What a checkpoint's shards hold: model, optimizer (flattened), this rank's RNG state and, with
    parallel.grad_compression, this rank's compressor state (its error-feedback residuals)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    optim_sd = _renamed(optim_sd, tied_aliases(model))
    rank = _rank()
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"cpu_rank{rank}": torch.get_rng_state()}}
    if torch.cuda.is_available():
        state["rng"][f"cuda_rank{rank}"] = torch.cuda.get_rng_state()
    exchange = grad_exchange(model)
    if exchange is not None:
        state["comm"] = exchange.state_dict(rank)
    return state


def _saved_comm_state(model, present: dict) -> dict | None:
    """Tensors to load the compressor state into, shaped as saved (its residuals are made at the first compressed
    step, so the live state may have none yet): the shared part and this rank's; None without compression."""
    if grad_exchange(model) is None:
        return None
    prefixes = ("comm.shared.", f"comm.rank{_rank()}.")
    return {key[len("comm."):]: torch.empty(md.size, dtype=md.properties.dtype) for key, md in present.items()
            if key.startswith(prefixes)}


def tmp_dir(run_dir: str, step: int) -> str:
    return os.path.join(root(run_dir), f".tmp-step-{step:07d}")


def begin(run_dir: str, step: int) -> str:
    """The hidden directory checkpoint `step` is written into, empty (collective); `publish` makes it complete."""
    tmp = tmp_dir(run_dir, step)

    def fresh():
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)  # ours, left over from a crash mid-save
            os.makedirs(tmp)
    _all_or_none(run_dir, step, fresh)
    return tmp


def write(state: dict, tmp: str, threads: int = 1, group=None) -> None:
    """DCP's write of `state` into `tmp` (collective over `group`), `threads` files at once per rank."""
    dcp.save(state, storage_writer=FileSystemWriter(tmp, thread_count=threads), process_group=group)


def save(run_dir: str, step: int, model, optimizer, trainer_state: dict, keep: int, threads: int = 1) -> str:
    """Write checkpoint `step` atomically (collective: every rank calls it); return its path. A failure on any
    rank (a full disk) removes the partial checkpoint and raises the same TrainingError line on every rank."""
    tmp = begin(run_dir, step)

    def write_and_publish():
        write(state_of(model, optimizer), tmp, threads)
        if _is_main():
            publish(run_dir, step, trainer_state, keep)
    _all_or_none(run_dir, step, write_and_publish)
    return os.path.join(root(run_dir), f"step-{step:07d}")


def _all_or_none(run_dir: str, step: int, work) -> None:
    """work() on every rank, then a vote: a failure anywhere discards checkpoint `step`'s partial directory (rank 0)
    and raises `discard`'s line on every rank (KeyboardInterrupt where Ctrl-C stopped it), so none waits in a
    collective for the others."""
    from hpctrain.parallel.vote import any_rank

    error = None
    try:
        work()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - an OSError, DCP's CheckpointException (a BaseException): alike
        error = e
    if any_rank(error is not None):
        failure = discard(run_dir, step, error)
        if any(isinstance(e, KeyboardInterrupt) for e in causes(error)):  # (DCP wraps it in its own exception)
            raise KeyboardInterrupt from None
        raise failure


def discard(run_dir: str, step: int, error: BaseException | None) -> TrainingError:
    """Rank 0 removes the partial directory of checkpoint `step` (hidden, its own: never a complete checkpoint,
    never `latest`); the one-line error saying why it failed, for every rank to raise."""
    tmp = tmp_dir(run_dir, step)
    why = no_space(error, root(run_dir)) or (dcp_failure(error) if error is not None else "it failed on another rank")
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    return TrainingError(f"checkpoint step {step} could not be written ({why}); its partial directory was removed, "
                         f"the last complete checkpoint is {latest(run_dir) or 'none'}: free space in or fix "
                         f"{root(run_dir)}, then resume (train.resume=auto)")


def dcp_failure(e: BaseException) -> str:
    """A failed DCP save or load as one line (DCP gathers every rank's failures into one exception, raised on all)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        e = next((exc for exc, _trace in e.failures.values()), e)
    return _describe(e)


def publish(run_dir: str, step: int, trainer_state: dict, keep: int) -> str:
    """Rank 0, once the shards of checkpoint `step` are written: its trainer state, the rename that makes it
    complete, `latest`, and the removal of the complete checkpoints beyond the newest `keep`."""
    final = os.path.join(root(run_dir), f"step-{step:07d}")
    tmp = os.path.join(root(run_dir), f".tmp-step-{step:07d}")
    write_json(os.path.join(tmp, STATE_FILE), trainer_state)
    if os.path.lexists(final):  # reached again after falling back from it: kept, renamed out of the rotation
        aside = free_name(final + ".replaced")
        os.rename(final, aside)
        log.warning("%s existed already: moved to %s", final, aside)
    os.rename(tmp, final)
    link_tmp = os.path.join(root(run_dir), ".latest.tmp")
    if os.path.lexists(link_tmp):
        os.remove(link_tmp)
    os.symlink(os.path.basename(final), link_tmp)
    link = os.path.join(root(run_dir), "latest")
    if os.path.isdir(link) and not os.path.islink(link):  # a run copied without symlinks (cp -r): kept
        os.rename(link, free_name(link + ".copy"))
    os.replace(link_tmp, link)
    # The newest `keep` up to this step stay (newer ones, met after falling back past them, are not counted: they
    # would crowd out the checkpoint just written). Renamed before the removal, so that a removal cut short
    # leaves no `step-N` without its trainer state; leftovers of earlier ones go too (their names are ours).
    held = pinned(run_dir)
    older = [path for path in complete_checkpoints(run_dir) if step_of(path) <= step][:-keep]
    for old in (path for path in older if step_of(path) not in held):
        os.rename(old, os.path.join(root(run_dir), REMOVING + os.path.basename(old)))
    for name in os.listdir(root(run_dir)):
        if name.startswith(REMOVING):
            shutil.rmtree(os.path.join(root(run_dir), name), ignore_errors=True)
    return final


PINS_DIR = "pins"  # <run_dir>/pins/step-N.<who>: a reader (an eval job) of checkpoint N, which rotation keeps


def _pin_path(run_dir: str, step: int, who: str) -> str:
    """<run_dir>/pins/step-N.<who>; `who` a plain name (it reaches a path: no separator, no leading dot)."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", who):
        raise CheckpointError(f"pin name {who!r}: use letters, digits, '_', '.' and '-' only")
    return os.path.join(run_dir, PINS_DIR, f"step-{step:07d}.{who}")


def pin(run_dir: str, step: int, who: str, **about) -> str:
    """Keep checkpoint `step` out of the rotation until `unpin` (an eval job reading it); `about`: what the pin
    records besides (written again to add to it); returns the pin's path."""
    path = _pin_path(run_dir, step, who)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, {"step": step, "who": who, **about})
    return path


def pins(run_dir: str) -> list[dict]:
    """What each pin of the run records ({"step", "who", ...})."""
    from hpctrain.core.files import read_object

    try:
        names = sorted(os.listdir(os.path.join(run_dir, PINS_DIR)))
    except FileNotFoundError:
        return []
    found = (read_object(os.path.join(run_dir, PINS_DIR, name)) for name in names if name.startswith("step-"))
    return [doc for doc in found if isinstance(doc, dict) and isinstance(doc.get("step"), int)]


def unpin(run_dir: str, step: int, who: str) -> None:
    """The pin `pin` made removed (only such a file: its own name in the pins directory)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(_pin_path(run_dir, step, who))


def pinned(run_dir: str) -> set[int]:
    """The steps whose checkpoints are pinned (by the pins' names: a pin whose content cannot be read still holds)."""
    try:
        names = os.listdir(os.path.join(run_dir, PINS_DIR))
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for m in map(re.compile(r"step-(\d+)\.").match, names) if m}


def _agreed(check):
    """check() on every rank; a CheckpointError on any rank is raised on all (they read shared files, which a
    network filesystem can still show differently), so no rank goes on into a collective load alone."""
    result, failure = None, None
    try:
        result = check()
    except CheckpointError as e:
        failure = (str(e), e.reason, e.fix)
    if dist.is_initialized():
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise CheckpointError(*failure)
    return result


def _same_on_every_rank(value):
    """Rank 0's value (directory listings, like file contents, can differ between nodes)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _read_trainer_state(path: str) -> dict:
    try:
        state = read_json(os.path.join(path, STATE_FILE))
    except FileNotFoundError:
        raise cannot_load(path, f"not a complete checkpoint: no {STATE_FILE}") from None
    except FileCheckError as e:
        raise cannot_load(path, f"bad {STATE_FILE}: {e}") from None
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise cannot_load(path, f"bad {STATE_FILE}: {_describe(e)}") from None
    if not isinstance(state, dict):
        raise cannot_load(path, f"bad {STATE_FILE}: not a JSON object")
    return state


def _dcp_load(state: dict, path: str, reader: _SafeReader | None = None, **kwargs) -> None:
    """dcp.load through the safe reader/planner; a failure becomes one CheckpointError line."""
    from torch.distributed.checkpoint.api import CheckpointException

    reader = reader or _SafeReader(path)
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=reader, planner=_SafeLoadPlanner(), **kwargs)
    except CheckpointException as e:  # a BaseException in DCP: it would escape `except Exception`
        # DCP gathers every rank's failures and raises them on all ranks: each rank takes the same decision.
        raise cannot_load(path, dcp_failure(e)) from None


Shapes = dict  # state_dict key -> (shape as a tuple, dtype): every weight of the whole model (ModelSpec.weights)


def check_weights(path: str, present: dict, expected: Shapes) -> None:
    """Strict: the checkpoint's model entries are exactly `expected` (every weight there, nothing more, shapes
    and dtypes equal); one CheckpointError naming the first difference. A smaller model would otherwise load part
    of a bigger one's weights without a word."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {key[len("model."):]: md for key, md in present.items() if key.startswith("model.")}
    reason = None
    for key, (shape, dtype) in expected.items():
        md = saved.get(key)
        if not isinstance(md, TensorStorageMetadata):
            reason = f"it has no weight {key}"
        elif tuple(md.size) != tuple(shape):
            reason = f"its {key} is {list(md.size)}, this model's {list(shape)}"
        elif md.properties.dtype != dtype:
            reason = f"its {key} is {md.properties.dtype}, this model's {dtype}"
        if reason:
            break
    extra = sorted(set(saved) - set(expected))
    if reason is None and extra:
        reason = f"it holds {extra[0]}{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}, which this model has not"
    if reason:
        reason = f"written for another model: {reason}"
        raise CheckpointError(f"cannot load checkpoint {path} ({reason}): {_OTHER_MODEL_FIX}", reason,
                              _OTHER_MODEL_FIX)


def check_model(path: str, expected: Shapes) -> None:
    """`check_weights` of a checkpoint directory, in this process alone (no process group)."""
    check_weights(path, _SafeReader(path).metadata.state_dict_metadata, expected)


def _opened(path: str, expected: Shapes | None, check_state=None) -> tuple[dict, _SafeReader]:
    """(trainer state, reader) once the checkpoint is complete, its metadata safe, with `expected` its model
    entries exactly those, with `check_state(path, saved)` its trainer state valid: agreed by every rank."""
    def check():
        saved, reader = _read_trainer_state(path), _SafeReader(path)
        if check_state is not None:
            check_state(path, saved)
        if expected is not None:
            check_weights(path, reader.metadata.state_dict_metadata, expected)
        return saved, reader
    return _agreed(check)


def load(path: str, model, optimizer, expected: Shapes | None = None, check_state=None) -> dict:
    """Load model and optimizer state in place (resharded to the current layout); return trainer_state.
    `expected`: the whole model's weights, checked strictly first; `check_state(path, trainer_state)` raises a
    CheckpointError for a trainer state the caller cannot use. Collective when distributed: a damaged
    checkpoint raises the same CheckpointError on every rank."""
    saved, reader = _opened(path, expected, check_state)
    present = reader.metadata.state_dict_metadata
    state = state_of(model, optimizer)
    # RNG streams are per rank: a resume on more ranks than were saved starts the new ones fresh.
    state["rng"] = {k: v for k, v in state["rng"].items() if f"rng.{k}" in present}
    comm = _saved_comm_state(model, present)
    state.pop("comm", None)
    if comm:
        state["comm"] = comm
    _dcp_load(state, path, reader)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=_renamed(state["optim"], tied_aliases(model), back=True), options=_OPTIONS)
    for key, value in state["rng"].items():
        if key.startswith("cpu"):
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value)
    if comm is not None:
        grad_exchange(model).load_state_dict(comm, _rank())
    return saved


def load_weights(path: str, model, expected: Shapes | None = None) -> None:
    """Load only the model weights of a checkpoint, in place and resharded to the current layout (fine-tuning
    from it: the optimizer, schedule and data position start fresh). Collective like `load`."""
    _, reader = _opened(path, expected)
    state = {"model": get_model_state_dict(model, options=_OPTIONS)}
    _dcp_load(state, path, reader, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"], options=_OPTIONS)


def check_loadable(path: str) -> dict:
    """The checks that need no model, in this process alone: the trainer state is JSON and the metadata passes
    the allow-list (before a run spawns or writes anything); returns the trainer state."""
    saved = _read_trainer_state(path)
    _SafeReader(path)
    return saved


def _newest_first(run_dir: str) -> list[str]:
    """The checkpoint `latest` names, then the complete ones older than it, newest first."""
    newest = latest(run_dir)
    if newest is None:
        return []
    return [newest, *(p for p in reversed(complete_checkpoints(run_dir)) if step_of(p) < step_of(newest))]


def load_newest(run_dir: str, model, optimizer, expected: Shapes | None = None,
                check_state=None) -> tuple[str, dict] | None:
    """Resume from the newest complete checkpoint of run_dir that loads, falling back to older ones (one warning
    each); return (its path, its trainer_state), or None when run_dir has none. Collective like `load`."""
    candidates = _same_on_every_rank(_newest_first(run_dir))
    first = None
    for path, older in zip(candidates, [*candidates[1:], None]):
        try:
            return path, load(path, model, optimizer, expected, check_state)
        except CheckpointError as e:
            if e.fix:  # not damage but another model's checkpoint: the older ones are that model's too
                raise
            first = first or e
            if older and _is_main():
                log.warning("checkpoint %s cannot be loaded (%s): falling back to %s", path, e.reason, older)
    if first is None:
        return None
    raise CheckpointError(f"no checkpoint in {root(run_dir)} can be loaded (the newest, {candidates[0]}: "
                          f"{first.reason}): pass train.resume=PATH or use a new run_dir", first.reason)


def read_weights(path: str, tensors: dict) -> None:
    """Fill `tensors` ({model state_dict key: a tensor of its shape}) from a checkpoint, in this process alone,
    reading only those entries (whatever layout wrote them)."""
    import warnings

    with warnings.catch_warnings():  # "no process group, assuming one process": exactly the intent
        warnings.simplefilter("ignore", UserWarning)
        _dcp_load({"model": tensors}, path, no_dist=True)


def load_model(path: str, model) -> None:
    """Load only the model weights of a checkpoint into a whole, unsharded model, without a process group: every
    weight of the checkpoint, strictly (`check_weights`)."""
    state = model.state_dict()
    check_model(path, {key: (tuple(t.shape), t.dtype) for key, t in state.items()})
    read_weights(path, state)
    model.load_state_dict(state)
