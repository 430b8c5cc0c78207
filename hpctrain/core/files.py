"""The small files runs and shard builds keep (JSON records, metrics lines): written atomically, read in one place.

A leaf module (standard library only): `data_prep` and every part of `hpctrain` share it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator
from typing import Any

METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
RUNNING = "running"  # result.json's status while an attempt of a run that had one before goes on
EVALS_FILE = "evals.jsonl"  # hpctrain eval: one record per scored checkpoint (step, checkpoint, eval/<task>/<metric>)

# The most a file of each kind may hold before hpctrain refuses to read it: a symlink to /dev/zero, a FIFO or a
# runaway file must end in one line, never in a read that exhausts memory or never returns.
MiB = 2**20
MAX_JSON_BYTES = 64 * MiB  # trainer states, results, plans, HF configs, tokenizer configs
MAX_MANIFEST_BYTES = 1024 * MiB  # a shard set's manifest: ~300 bytes a shard
MAX_LINE_BYTES = 4 * MiB  # one metrics.jsonl / alerts.jsonl record


class FileCheckError(ValueError):
    """A file that is not what it must be (not a regular file, too large, not text): one line naming it."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _checked_fd(path: str, limit: int) -> tuple[int, int]:
    """An open descriptor of `path` and its size, once `path` (symlinks followed) is a regular file of at most
    `limit` bytes. Opened without blocking (a FIFO would wait for a writer) and checked on the open file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileCheckError(f"{path} is {_kind(st.st_mode)}, not a regular file: replace it with the file "
                                 "it should be")
        if st.st_size > limit:
            raise FileCheckError(f"{path} is {st.st_size:,} bytes, more than the {limit:,} such a file can be: it is "
                                 "not the file hpctrain wrote; restore or remove it")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_tail(path: str, start: int, limit: int) -> bytes:
    """A regular file's bytes from offset `start` on, at most its last `limit` (a log of any size; never a FIFO or a
    device, which could block or never end)."""
    fd, size = _checked_fd(path, 1 << 62)
    with open(fd, "rb") as f:
        f.seek(max(start, size - limit, 0))
        return f.read(limit)


def check_file(path: str, limit: int) -> int:
    """`path` is a regular file (symlinks followed) of at most `limit` bytes: its size; FileCheckError or
    OSError otherwise."""
    fd, size = _checked_fd(path, limit)
    os.close(fd)
    return size


def open_checked(path: str, limit: int, mode: str = "rb"):
    """`open(path, mode)` for reading, once `check_file` holds (on the opened file itself)."""
    fd, _ = _checked_fd(path, limit)
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def read_bytes(path: str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (also when it grows while read)."""
    with open_checked(path, limit) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileCheckError(f"{path} grew past the {limit:,} bytes such a file can be while it was read")
    return data


def fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (where the platform has directory descriptors)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def absolute_path(value, prefix: str = ""):
    """A path (a config value) made absolute from this process's directory, `~` expanded and a leading `prefix` (such
    as `hf:`) kept; anything else (None, an interpolation `${...}`) as it is."""
    if not isinstance(value, str) or not value or "${" in value:
        return value
    kept = prefix if prefix and value.startswith(prefix) else ""
    return kept + os.path.abspath(os.path.expanduser(value[len(kept):]))


def free_name(path: str) -> str:
    """`path`, or `path-2`, `path-3`, ... : the first name nothing exists at."""
    n, name = 1, path
    while os.path.lexists(name):
        n += 1
        name = f"{path}-{n}"
    return name


def atomic_write(path: str, data: str | bytes, sync_dir: bool = False) -> None:
    """Replace `path` with `data` all at once: a crash leaves the old file or the new one, never half of one.

    The temporary name carries the pid, so processes writing the same file never share one temporary file.
    """
    tmp, opened = f"{path}.{os.getpid()}.tmp", False
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w", **({} if isinstance(data, bytes) else
                                                                      {"encoding": "utf-8"})) as f:
            opened = True
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or Ctrl-C mid-write leaves no temporary behind (only one it opened)
        if opened:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json(path: str, doc: Any, sort_keys: bool = False) -> None:
    atomic_write(path, json.dumps(doc, indent=1, sort_keys=sort_keys))


def read_json(path: str, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON file of at most `limit` bytes: OSError, FileCheckError or ValueError (not JSON, not UTF-8)."""
    return json.loads(read_bytes(path, limit).decode("utf-8"))


def read_yaml(path: str, limit: int = MAX_JSON_BYTES) -> Any:
    """A YAML file (a saved run config, Hydra's overrides and multirun.yaml) of at most `limit` bytes, as OmegaConf
    reads it: OSError, FileCheckError, ValueError (not UTF-8) or OmegaConf's errors (not YAML)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(read_bytes(path, limit).decode("utf-8"))


def read_object(path: str, limit: int = MAX_JSON_BYTES) -> dict | None:
    """A JSON object file, or None when it is missing, is not an object, or was caught mid-write."""
    try:
        doc = read_json(path, limit)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_result(run_dir: str) -> dict | None:
    """A run's result.json, or None while it is running (or when it never finished)."""
    return read_object(os.path.join(run_dir, RESULT_FILE))


def step_of(line: str | bytes) -> int | None:
    """The step of one metrics line; None for a line cut short by a crash (or anything else but a record)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if type(step) is int else None


def lines(path: str, limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The lines of a regular file, each of at most `limit` bytes (FileCheckError at a longer one), streamed:
    memory stays one line whatever the file's size."""
    with open_checked(path, 2**62) as f:
        n = 0
        while line := f.readline(limit + 1):
            n += 1
            if len(line) > limit and not line.endswith(b"\n"):
                raise FileCheckError(f"{path}: line {n} is longer than the {limit:,} bytes a record can be: it is "
                                     "not a file hpctrain wrote; restore or remove it")
            yield line


def read_metrics(run_dir: str, lenient: bool = False) -> list[dict]:
    """The records of <run_dir>/metrics.jsonl. `lenient`: skip lines that are not JSON objects (a crash can cut
    the last one short) instead of raising ValueError."""
    return read_records(os.path.join(run_dir, METRICS_FILE), lenient)


def read_evals(run_dir: str) -> list[dict]:
    """<run_dir>/evals.jsonl's records with an integer step (none yet: []; lines that are no record passed over)."""
    path = os.path.join(run_dir, EVALS_FILE)
    found = read_records(path, lenient=True) if os.path.exists(path) else []
    return [r for r in found if isinstance(r.get("step"), int)]


def read_records(path: str, lenient: bool = False) -> list[dict]:
    """The JSON-object lines of a JSON-lines file (`lenient`: lines that are not one passed over)."""
    records = []
    for line in lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError:  # UnicodeDecodeError included
            if not lenient:
                raise
            continue
        records.append(record)
    return records


def causes(error: BaseException | None) -> Iterator[BaseException]:
    """`error` and what it wraps: its cause and context, and the failures DCP gathers from every rank."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, *(exc for exc, _ in getattr(e, "failures", {}).values())]


def no_space(error: BaseException | None, path: str) -> str | None:
    """"no space left on device in PATH" (or the quota's words) when that is what stopped a write: an OSError of
    ENOSPC/EDQUOT anywhere in the exception's chain or DCP's gathered failures, or, for errors that lost the
    errno on their way (torch's zip writer: "unexpected pos"), a filesystem with under 1 MiB free."""
    for e in causes(error):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{e.strerror.lower()} in {path}"
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return f"no space left on device in {path}" if error is not None and st.f_bavail * st.f_frsize < MiB else None


def free_bytes(path: str) -> float | None:
    """Bytes the filesystem that holds (or would hold) `path` has free for this user (statvfs's f_bavail, from the
    nearest directory that exists); None where it cannot say. A user or project quota (Lustre's `lfs quota`) is not
    seen."""
    try:
        st = os.statvfs(nearest_dir(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def nearest_dir(path: str) -> str:
    """`path` (absolute) if it is a directory, else its nearest ancestor that is."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
