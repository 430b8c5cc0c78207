"""Local launcher: a layout that needs N processes, started outside torchrun/srun, forks its N ranks.

The parent has already validated the config and the data and imported torch; forking (not spawning)
shares that work, so ranks start in well under a second. Each child gets the variables torchrun would
set and runs the same training code path as under torchrun or srun. The parent waits; when a rank
fails, it stops the others and raises naming that rank.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

from hpctrain.core.host import usable_cpus


class LaunchError(RuntimeError):
    """A rank failed; the message names it."""


# A local world's rendezvous port: below Linux's ephemeral range (32768-60999), apart from a Slurm job's
# (core.slurm.job_port, 20000-31999) and from the local test cluster's slurmd ports (17001-). A port from bind(0)
# is free only until rank 0 binds it, and any process's outgoing connection or bind(0) may take it in between
# (EADDRINUSE, as measured for job ports).
LOCAL_PORTS = range(10000, 17000)


def free_port() -> int:
    """A port nothing holds now, outside the ephemeral range where nothing takes it unasked."""
    pick = random.SystemRandom()  # not the seeded global generator: concurrent launches must not agree
    for _ in range(100):
        port = pick.choice(LOCAL_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))  # the wildcard, as rank 0's store binds it: any holder on any address counts
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all taken: the kernel's pick, as before
        s.bind(("", 0))
        return s.getsockname()[1]


def _child(rank: int, env: dict[str, str], threads: int, fn: Callable, args: tuple, quiet: tuple,
           errors) -> None:
    # The parent's objects are never collected here: a process group among them would wait forever in its
    # destructor for the parent's gloo threads, which a forked child does not have.
    gc.freeze()
    os.environ.update(env)
    code = 0
    try:
        import torch

        torch.set_num_threads(threads)
        if rank != 0:  # rank 0 writes the human log; the others only report problems
            logging.getLogger("hpctrain").setLevel(logging.WARNING)
        fn(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 - any failure must end this rank with a non-zero status
        code = getattr(e, "exit_code", None)  # a deliberate stop (e.g. preemption): the parent reports it
        if code is None:
            # A bad input (`quiet`) is the parent's one line; anything else also gets its traceback here.
            said = " ".join(str(e).split()) if isinstance(e, quiet) else f"{type(e).__name__}: {e}"
            errors.put((rank, said[:2000]))  # bounded: a pipe's buffer holds it, so exiting never blocks
            if not isinstance(e, quiet):
                print(f"hpctrain: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
                traceback.print_exc()
            code = 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # never run the parent's atexit handlers (pytest, Hydra) in a forked child


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def spawn(world: int, fn: Callable, args: tuple = (), threads: int | None = None, grace_s: float = 5.0,
          quiet: tuple[type[BaseException], ...] = (KeyboardInterrupt,), ok_codes: tuple[int, ...] = (0,),
          forward: tuple[signal.Signals, ...] = ()) -> None:
    """Run fn(*args) in `world` forked ranks; return when all exited with an `ok_codes` status, else raise
    LaunchError. Signals in `forward` that reach the parent are passed on to every rank.

    A rank's `quiet` error (bad input) becomes part of the LaunchError's one line; any other error is also
    printed by the rank with its traceback.
    """
    threads = threads or max(1, usable_cpus() // world)
    base = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    ctx = mp.get_context("fork")
    gc.collect()  # the parent's garbage (an earlier run's process groups) freed here, where its threads are
    # What survives is frozen (Python's advice before fork): no later collect walks it again, here or in a rank,
    # and a rank's first collect does not dirty every inherited page.
    gc.freeze()
    errors = ctx.SimpleQueue()
    procs = []
    for rank in range(world):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        p = ctx.Process(target=_child, args=(rank, env, threads, fn, args, quiet, errors),
                        name=f"hpctrain-rank{rank}")
        p.start()
        procs.append(p)
    running = {p.sentinel: (rank, p) for rank, p in enumerate(procs)}
    failed = None

    def pass_on(signum, frame):
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in forward}
    try:
        while running and failed is None:
            for sentinel in wait(list(running)):
                rank, p = running.pop(sentinel)
                p.join()
                if p.exitcode not in ok_codes and failed is None:
                    failed = (rank, p.exitcode)
    finally:  # a failed rank, or the parent interrupted: stop the rest
        for sig, prev in previous.items():
            signal.signal(sig, prev)
        if failed is not None:
            _let_end(running, grace_s)
        _stop([p for _, p in running.values()], grace_s)
    if failed is not None:
        rank, code = failed
        said = {}
        while not errors.empty():
            r, message = errors.get()
            said.setdefault(r, message)
        why = said.get(rank) or next(iter(said.values()), None)
        raise LaunchError(f"rank {rank} of {world} failed ({_describe(code)})" + (f": {why}" if why else "")
                          + "; the other ranks were stopped")


def _let_end(running: dict, grace_s: float) -> None:
    """After one rank failed: the others often end the same way a moment later (a stop the ranks agreed on), so
    they get up to grace_s to do it themselves, the main rank writing the run's result — terminated at once, it
    wrote none under load."""
    deadline = time.monotonic() + grace_s
    while running and (left := deadline - time.monotonic()) > 0:
        for sentinel in wait(list(running), timeout=left):
            running.pop(sentinel)[1].join()


def _stop(procs: list, grace_s: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()  # also ends a stopped or hung rank
            p.join()
