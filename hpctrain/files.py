"""The small files runs and shard builds keep (JSON records, metrics lines): written atomically, read in one place.

A leaf module (standard library only): `data_prep` and every part of `hpctrain` share it.
"""

from __future__ import annotations

import json
import os
from typing import Any

METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"


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
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb" if isinstance(data, bytes) else "w", **({} if isinstance(data, bytes) else
                                                                  {"encoding": "utf-8"})) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json(path: str, doc: Any, sort_keys: bool = False) -> None:
    atomic_write(path, json.dumps(doc, indent=1, sort_keys=sort_keys))


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_object(path: str) -> dict | None:
    """A JSON object file, or None when it is missing, is not an object, or was caught mid-write."""
    try:
        doc = read_json(path)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_result(run_dir: str) -> dict | None:
    """A run's result.json, or None while it is running (or when it never finished)."""
    return read_object(os.path.join(run_dir, RESULT_FILE))


def step_of(line: str) -> int | None:
    """The step of one metrics line; None for a line cut short by a crash."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def read_metrics(run_dir: str, lenient: bool = False) -> list[dict]:
    """The records of <run_dir>/metrics.jsonl. `lenient`: skip lines that are not JSON (a crash can cut the last
    one short) instead of raising ValueError."""
    records = []
    with open(os.path.join(run_dir, METRICS_FILE), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                if not lenient:
                    raise
    return records
