"""The bad-node list: nodes that lost a rank, hung a collective, failed preflight or straggled in several runs,
kept in one JSON file that a project's runs share (cluster.bad_nodes), each record with its reason, its run and its
time. Submissions (`--exclude`) leave out the nodes whose records have not expired (cluster.bad_node_expiry_h);
`hpctrain nodes` lists and clears them.

The file is written under a lock (several ranks, jobs and login-node commands may record at once) and replaced
whole; a file at that path that this module did not write is never overwritten.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from hpctrain.core.errors import ConfigError
from hpctrain.core.files import read_json, write_json

log = logging.getLogger("hpctrain")

FORMAT = "hpctrain-bad-nodes/1"
ENV, DEFAULT = "HPCTRAIN_BAD_NODES", "~/.hpctrain/bad_nodes.json"  # cluster.bad_nodes's default, for commands without
# a run config (preflight)
# Why a node is listed. It is excluded once it has this many live records of the reason (a straggler can be a busy
# neighbour once; a dead rank or a hang is reason enough).
REPEATS = {"died": 1, "hung": 1, "preflight": 1, "straggler": 2}
SAME_EVENT_S = 600.0  # records of one node, reason, run and job this close together are one event
MAX_RECORDS = 1000  # the oldest go first: the file stays small whatever runs for months


@dataclass(frozen=True)
class Record:
    node: str
    reason: str  # a key of REPEATS
    detail: str  # one line: what was seen
    at: float  # wall time
    run: str = ""  # the run directory (or the command) that saw it
    job: str = ""  # the Slurm job id, where there is one


def default_path() -> str:
    return os.environ.get(ENV) or DEFAULT


def _path(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


# A node's name as Slurm and hosts spell it: the names go into `#SBATCH --exclude=` lines and scontrol arguments.
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _valid(doc) -> bool:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("records"), list):
        return False
    return all(isinstance(r, dict) and isinstance(r.get("node"), str) and _NODE.fullmatch(r["node"])
               and r.get("reason") in REPEATS
               and isinstance(r.get("detail"), str) and type(r.get("at")) in (int, float) for r in doc["records"])


def read(path: str) -> list[Record]:
    """Every record of the list at `path` ([] when there is none); ConfigError for a file this module did not
    write."""
    path = _path(path)
    if not os.path.lexists(path):
        return []
    try:
        doc = read_json(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cluster.bad_nodes={path} cannot be read as a bad-node list ({e}): point cluster.bad_nodes "
                          "at another file, or remove this one") from None
    if not _valid(doc):
        raise ConfigError(f"cluster.bad_nodes={path} is not a bad-node list written by hpctrain: point "
                          "cluster.bad_nodes at another file (hpctrain never overwrites a file it did not write)")
    return [Record(r["node"], r["reason"], r["detail"], float(r["at"]), str(r.get("run", "")), str(r.get("job", "")))
            for r in doc["records"]]


@contextmanager
def _locked(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: str, records: list[Record]) -> None:
    write_json(path, {"format": FORMAT, "records": [asdict(r) for r in records[-MAX_RECORDS:]]})


def record(path: str | None, nodes: list[str], reason: str, detail: str, run: str = "") -> None:
    """Add `nodes` with `reason` to the list (none when `path` is None). Never raises: a list that cannot be
    written is said in the log, and the failure being recorded stays the run's error."""
    nodes = [n for n in nodes if _NODE.fullmatch(n)]  # (a heartbeat's text is not trusted into a job script)
    if not path or not nodes:
        return
    path = _path(path)
    job = os.environ.get("SLURM_JOB_ID", "")
    try:
        with _locked(path):
            records = read(path)
            now = time.time()  # several ranks report the same loss: one record
            seen = {(r.node, r.reason, r.run, r.job) for r in records if now - r.at < SAME_EVENT_S}
            new = [Record(n, reason, detail, now, run, job) for n in dict.fromkeys(nodes)
                   if (n, reason, run, job) not in seen]
            if new:
                _write(path, records + new)
                log.warning("bad-node list %s: %s (%s)", path, ", ".join(r.node for r in new), reason)
    except (OSError, ConfigError) as e:
        log.error("the bad-node list could not record %s (%s): %s", ", ".join(nodes), reason, e)


def excluded(path: str | None, expiry_h: float, now: float | None = None) -> dict[str, str]:
    """{node: why} for every node to leave out: enough records of one reason within the last `expiry_h` hours."""
    if not path:
        return {}
    now = time.time() if now is None else now
    same: dict[tuple[str, str], list[Record]] = {}  # (node, reason) -> its live records, oldest first
    for r in read(path):
        if now - r.at <= expiry_h * 3600:
            same.setdefault((r.node, r.reason), []).append(r)
    out = {}
    for (node, reason), rs in same.items():
        if len(rs) >= REPEATS[reason] and node not in out:
            out[node] = f"{reason}: {rs[-1].detail}" + (f" ({len(rs)} times)" if len(rs) > 1 else "")
    return out


def leave_out(path: str | None, expiry_h: float) -> list[str]:
    """The nodes to leave out, for a run that is stopping: never raises (a list it cannot read is said in the log)."""
    try:
        return sorted(excluded(path, expiry_h))
    except ConfigError as e:
        log.error("%s", e)
        return []


def clear(path: str, nodes: list[str] | None = None) -> int:
    """Forget `nodes` (every node when None); how many records went."""
    path = _path(path)
    with _locked(path):
        records = read(path)
        if not records:
            return 0
        kept = [r for r in records if nodes is not None and r.node not in nodes]
        _write(path, kept)
        return len(records) - len(kept)
