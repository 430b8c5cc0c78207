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
    hours = doc.get("node_hours", 0.0)
    if type(hours) not in (int, float) or not 0 <= hours < float("inf"):
        return False
    return all(isinstance(r, dict) and isinstance(r.get("node"), str) and _NODE.fullmatch(r["node"])
               and r.get("reason") in REPEATS
               and isinstance(r.get("detail"), str) and type(r.get("at")) in (int, float) for r in doc["records"])


def read(path: str) -> list[Record]:
    """Every record of the list at `path` ([] when there is none); ConfigError for a file this module did not
    write."""
    return _read(path)[0]


def _read(path: str) -> tuple[list[Record], float]:
    """(the records, the node-hours the list's runs trained: its exposure)."""
    path = _path(path)
    if not os.path.lexists(path):
        return [], 0.0
    try:
        doc = read_json(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cluster.bad_nodes={path} cannot be read as a bad-node list ({e}): point cluster.bad_nodes "
                          "at another file, or remove this one") from None
    if not _valid(doc):
        raise ConfigError(f"cluster.bad_nodes={path} is not a bad-node list written by hpctrain: point "
                          "cluster.bad_nodes at another file (hpctrain never overwrites a file it did not write)")
    return [Record(r["node"], r["reason"], r["detail"], float(r["at"]), str(r.get("run", "")), str(r.get("job", "")))
            for r in doc["records"]], float(doc.get("node_hours", 0.0))


@contextmanager
def _locked(path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: str, records: list[Record], node_hours: float) -> None:
    write_json(path, {"format": FORMAT, "records": [asdict(r) for r in records[-MAX_RECORDS:]],
                      "node_hours": round(node_hours, 4)})


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
            records, hours = _read(path)
            now = time.time()  # several ranks report the same loss: one record
            seen = {(r.node, r.reason, r.run, r.job) for r in records if now - r.at < SAME_EVENT_S}
            new = [Record(n, reason, detail, now, run, job) for n in dict.fromkeys(nodes)
                   if (n, reason, run, job) not in seen]
            if new:
                _write(path, records + new, hours)
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
        records, hours = _read(path)
        if not records:
            return 0
        kept = [r for r in records if nodes is not None and r.node not in nodes]
        _write(path, kept, hours)
        return len(records) - len(kept)


FAILURES = ("died", "hung")  # what a node's mean time between failures counts (not preflight, not stragglers)


def add_node_hours(path: str | None, node_hours: float) -> None:
    """A finished (or failed) Slurm run's nodes × hours, the exposure its failures are counted against. Never
    raises (said in the log)."""
    if not path or not node_hours > 0:
        return
    path = _path(path)
    try:
        with _locked(path):
            records, hours = _read(path)
            _write(path, records, hours + node_hours)
    except (OSError, ConfigError) as e:
        log.error("the bad-node list could not add this run's %.3g node-hours: %s", node_hours, e)


def node_mtbf_h(path: str | None, prior_h: float) -> tuple[float, str]:
    """A node's mean time between failures, learned from the list: its runs' node-hours over the nodes that died or
    hung in them, with cluster.node_mtbf_h as one failure's worth of prior evidence ((hours + prior) / (failures +
    1): the prior alone until the list has seen something, the list's own rate once it has seen many); and how it
    was reached, for the log. A list that cannot be read: the prior."""
    try:
        records, hours = _read(path) if path else ([], 0.0)
    except ConfigError as e:
        log.error("%s", e)
        records, hours = [], 0.0
    failures = len({(r.node, r.job or r.run, r.reason) for r in records if r.reason in FAILURES})
    if not hours and not failures:
        return prior_h, f"cluster.node_mtbf_h={prior_h:g} (the bad-node list has seen no runs yet)"
    learned = (hours + prior_h) / (failures + 1)
    return learned, (f"{learned:.4g} h learned: {failures} node failure(s) in {hours:.4g} node-hours of runs recorded "
                     f"in {path}, with cluster.node_mtbf_h={prior_h:g} as one prior failure")
