"""Hang forensics: when a step stops making progress, every rank that still runs writes its Python stacks to
`<run_dir>/hang/rank-N.txt` and the failure names the ranks that stopped responding, with their nodes.

Each rank runs a watchdog thread that, every `monitor.heartbeat_s`, records a heartbeat (wall time) and the node
it runs on in the job's store through a connection of its own, and checks how long the current iteration (step,
checkpoint, evaluation) has run. Past `monitor.hang_s` (default: 90 % of cluster.pg_timeout_s, so before the
collectives' own timeout) it writes the stacks of every thread of its process and works out who is stuck:
ranks whose heartbeat is older than three beats stopped responding (a stopped or dead process, a lost node); if
every rank still beats, they are all alive but waiting (a collective one of them never joined, a stuck data
read). A collective that times out ends the run with that line instead of the backend's bare timeout. A collective
that fails because a peer went away (gloo's "Connection closed by peer", NCCL's remote error: a killed rank, a lost
node) ends it with the rank whose heartbeat stopped, once it is LOST_BEATS beats old, instead of the survivor's
transport error, which names only an address.

On NCCL the flight recorder is on (`flight_recorder_env`): a timed-out collective dumps every rank's recent
collectives to `hang/nccl-trace-rank-N` (PyTorch's `fr_trace` tool reads them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

from hpctrain.parallel.process_group import node_name
from hpctrain.runtime import bad_nodes

log = logging.getLogger("hpctrain")
HANG_DIR = "hang"
STALE_BEATS = 3  # a heartbeat older than this many intervals: the rank stopped responding
LOST_BEATS = 2  # after a peer's connection closed: older than this names the rank that went away
# How the backends word a peer that went away (lower case): gloo's TCP transport, a reset socket, NCCL's remote error.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "ncclremoteerror", "remote end closed")
_KEY = "hpctrain/heartbeat/{}"


# The flight recorder's buffer, as PyTorch spelled it before 2.8 and since (the old name warns on 2.11).
BUFFER_NAMES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")


def flight_recorder_env(run_dir: str) -> dict[str, str]:
    """NCCL's flight recorder, dumped into <run_dir>/hang/ when a collective times out (both spellings of the
    dump path: PyTorch renamed it; the buffer's under the name this PyTorch reads)."""
    import torch

    prefix = os.path.join(os.path.abspath(run_dir), HANG_DIR, "nccl-trace-rank-")
    renamed = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)
    return {BUFFER_NAMES[renamed]: "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix}


_ours: dict[str, str] = {}  # what this process set: a later run in it (a benchmark, a test) sets its own


def apply_flight_recorder(run_dir: str) -> dict[str, str]:
    """Export flight_recorder_env before the process group starts; a variable the job's environment set is kept.
    Returns {key: "value (source)"} as process_group.apply_env does."""
    effective = {}
    for key, value in flight_recorder_env(run_dir).items():
        names = BUFFER_NAMES if key in BUFFER_NAMES else (key,)  # (the buffer under either name is the job's)
        theirs = next((k for k in names if k in os.environ and os.environ[k] != _ours.get(k)), None)
        if theirs:
            effective[theirs] = f"{os.environ[theirs]} (environment)"
        else:
            os.environ[key] = _ours[key] = value
            effective[key] = f"{value} (flight recorder)"
    return effective


def _backend_error(error: BaseException, words: tuple[str, ...]) -> bool:
    """A RuntimeError (what gloo, NCCL and the store raise), not one of hpctrain's own one-line errors, whose text
    holds one of `words` (lower case)."""
    from hpctrain.core.errors import BAD_INPUT

    text = str(error).lower()
    return isinstance(error, RuntimeError) and not isinstance(error, BAD_INPUT) and any(w in text for w in words)


def is_timeout(error: BaseException) -> bool:
    """A collective or store operation that ran out of time (gloo, NCCL and the store word it differently)."""
    return _backend_error(error, ("timed out", "timeout"))


def is_peer_lost(error: BaseException) -> bool:
    """A collective that failed because a peer's process or node went away."""
    return _backend_error(error, _PEER_LOST)


def _store(timeout_s: float):
    """A store client of our own (never the process group's, which a blocked collective may hold), or None for a
    job without one (a single process)."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class HangWatch:
    """The watchdog of one rank: `begin(step)` / `end()` around each loop iteration, `close()` at the end."""

    def __init__(self, run_dir: str, rank: int, world: int, hang_s: float, beat_s: float,
                 bad_nodes: str | None = None):
        """`bad_nodes`: the bad-node list the nodes of ranks that stopped are added to (cluster.bad_nodes)."""
        self.run_dir, self.rank, self.world, self.hang_s, self.beat_s = run_dir, rank, world, hang_s, beat_s
        self.bad_nodes = bad_nodes
        self.node = node_name()
        self.line: str | None = None  # the diagnosis, once made
        self.lost_rank0 = False  # a peer was lost and rank 0's store no longer answers: rank 0 is gone
        self.lost: list[dict] = []  # the ranks the diagnosis found gone or stopped: rank, node, reason
        self._step, self._since = 0, None
        self._lock, self._diagnosing, self._stop = threading.Lock(), threading.Lock(), threading.Event()
        try:
            self._store = _store(max(5.0, 2 * beat_s))
        except Exception as e:  # noqa: BLE001 - forensics must never stop a run
            log.warning("hang forensics without heartbeats: the store at MASTER_ADDR does not answer (%s)", e)
            self._store = None
        self._beat()
        self._thread = threading.Thread(target=self._watch, name="hpctrain-hangwatch", daemon=True)
        self._thread.start()

    def begin(self, step: int) -> None:
        with self._lock:
            self._step, self._since = step, time.monotonic()
            self.line = None  # a slow iteration that finished after all was no hang

    def end(self) -> None:
        with self._lock:
            self._since = None

    def _beat(self) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):  # the store's host may be the rank that is gone
                self._store.set(_KEY.format(self.rank), f"{time.time():.3f} {self.node}")

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            self._beat()
            with self._lock:  # the whole test under it: begin() between reading and testing would reset `line`
                since, step = self._since, self._step
                hung = since is not None and self.line is None and time.monotonic() - since > self.hang_s
            if hung:
                self.diagnose(f"step {step} has run for {_seconds(time.monotonic() - since)} s (monitor.hang_s="
                              f"{self.hang_s:g})", since=since)

    def _others(self, stale_beats: float = STALE_BEATS) -> tuple[list[tuple[str, int, str | None]], str | None]:
        """(the ranks whose heartbeat is older than `stale_beats` beats, each (description, rank, node or None), why
        they could not be read or None)."""
        if self._store is None:
            return [], "no heartbeats in a single process" if self.world == 1 else "no store to read heartbeats"
        now, stale = time.time(), []
        try:
            for r in range(self.world):
                key = _KEY.format(r)
                if not self._store.check([key]):
                    stale.append((f"rank {r} (never sent a heartbeat)", r, None))
                    continue
                beat, node = self._store.get(key).decode().split(" ", 1)
                if now - float(beat) > stale_beats * self.beat_s:
                    stale.append((f"rank {r} (node {node}, last heartbeat {_seconds(now - float(beat))} s ago)", r,
                                  node))
        except Exception as e:  # noqa: BLE001 - the store lives in rank 0's process
            return stale, (f"the store on rank 0 ({os.environ.get('MASTER_ADDR')}) does not answer ({type(e).__name__}):"
                           " rank 0 is likely the one that stopped")
        return stale, None

    def diagnose(self, what: str, stale_beats: float = STALE_BEATS, reason: str = "hung",
                 since: float | None = None) -> str:
        """Write this rank's stacks and work out who is stuck (ranks whose heartbeat is older than `stale_beats`
        beats: their nodes go on the bad-node list with `reason`); return (and keep) the one-line diagnosis.
        `since`: the start of the step the watchdog found running too long; if that step ended meanwhile, the line
        is not kept (it would stand for the next step, and hide that step's own hang)."""
        with self._diagnosing:  # the watchdog and a failing main thread: one diagnosis
            if self.line is not None:
                return self.line
            line = self._diagnose(what, stale_beats, reason)
            with self._lock:
                if since is None or self._since == since:
                    self.line = line
            return line

    def _diagnose(self, what: str, stale_beats: float, reason: str) -> str:
        stale, unreadable = self._others(stale_beats)
        if stale:
            who = f"{', '.join(d for d, _, _ in stale)} stopped responding"
            self.lost = [{"rank": r, "node": n, "reason": reason} for _, r, n in stale]
            bad_nodes.record(self.bad_nodes, [n for _, _, n in stale if n], reason,
                             f"{what}: {who} (seen by rank {self.rank})", self.run_dir)
        elif unreadable:
            who = unreadable
            if reason == "died" and self._store is not None:
                self.lost_rank0 = True
                addr = os.environ.get("MASTER_ADDR", "")
                node = addr if addr and not addr.replace(".", "").isdigit() and addr != "localhost" else None
                self.lost = [{"rank": 0, "node": node, "reason": reason}]  # (the store's host: rank 0's node)
                bad_nodes.record(self.bad_nodes, [node] if node else [], reason,
                                 f"{what}: {who} (seen by rank {self.rank})", self.run_dir)
        elif stale_beats < STALE_BEATS:  # a lost peer that still beats: its connection went, not (yet) its process
            who = f"every one of the {self.world} ranks still sends heartbeats (a connection between them broke)"
        else:
            who = f"every one of the {self.world} ranks still responds (waiting on each other or on data)"
        folder = os.path.join(self.run_dir, HANG_DIR)
        line = (f"{what} on rank {self.rank} (node {self.node}): {who}; the Python stacks of every rank still "
                f"running are in {folder}/")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"rank-{self.rank}.txt"), "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n\n{stacks()}\n")
        except OSError as e:
            log.error("could not write the stacks of rank %d: %s", self.rank, e)
        log.error("hang: %s", line)
        return line

    def explain(self, error: BaseException) -> str | None:
        """The diagnosis for a run that failed with a timed-out collective (the watchdog's, when it made one in this
        iteration, else made now); None for any other failure. (NCCL's own watchdog ends a process whose
        collective timed out without a Python exception: there the watchdog's line in the log and the stack files
        are what remains.)"""
        with self._lock:
            step = self._step
        if self.world > 1 and is_peer_lost(error):  # (one process has no peer: such an error is its own)
            return self._lost_peer(step)
        if not is_timeout(error):
            return None
        return self.diagnose(f"a collective timed out in step {step}")

    def _lost_peer(self, step: int) -> str:
        """A peer went away: wait (up to LOST_BEATS + 1 beats) until its heartbeat is old enough to name it."""
        deadline = time.monotonic() + (LOST_BEATS + 1) * self.beat_s
        while time.monotonic() < deadline and self._store is not None:
            stale, unreadable = self._others(LOST_BEATS)
            if stale or unreadable:
                break
            time.sleep(min(0.2, self.beat_s / 4))
        return self.diagnose(f"a collective in step {step} lost its peer", LOST_BEATS, "died")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.beat_s)


def _seconds(s: float) -> str:
    return f"{s:.0f}" if s >= 10 else f"{s:.1f}"


def stacks() -> str:
    """Every thread's Python stack, innermost call last, as `py-spy dump` would list them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: item[0] != main):  # main first
        out.append(f"Thread {names.get(ident, '?')} ({ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)
