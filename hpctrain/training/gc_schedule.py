"""When Python's garbage collector runs: on a schedule of steps while training (train.gc_every), instead of whenever
allocations add up, and never while a new process imports its libraries (`importing`).

Left automatic, the collector runs in the middle of a step on whichever rank crossed its allocation threshold, and
every other rank waits for that one at the next collective; a full collection walks every object the process holds
(the model's modules, DTensor's caches). During training it is off and collects the two young generations every N
steps, on every rank at the same step, as torchtitan (training.gc_freq) and OLMo-core do. Objects old enough to be
in the oldest generation are left to Python's automatic collection after the run: nothing piles up there (the
tests' model, 300 steps with evaluations and checkpoints every 100, train.gc_every=50: a full collection afterwards
found 56 unreachable objects, as after 10 steps; 133 with automatic collection). Measured on the context- and
pipeline-parallel tests (46 runs of 2-8 forked ranks, 3 test workers on 2 cores), three alternated pairs: 140.4-157.0
core-s with automatic collection, 135.2-145.0 with train.gc_every=50, 4-8 % less in each pair.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Iterator


class GcSchedule:
    """A context for the training loop: automatic collection off inside it (every > 0), restored on leaving; a
    generation-1 collection after every `every`-th step, its seconds for the step's record (`gc_s`)."""

    def __init__(self, every: int):
        self.every = every
        self._was_enabled = False

    def __enter__(self) -> GcSchedule:
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        if self.every and self._was_enabled:
            gc.enable()

    def after_step(self, step: int) -> dict:
        if not self.every or step % self.every:
            return {}
        t0 = time.perf_counter()
        gc.collect(1)
        return {"gc_s": round(time.perf_counter() - t0, 4)}


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """The collector paused while a new process imports torch and the libraries around it, then what they made
    frozen: ~300,000 objects that live as long as the process. Its full passes over them were a quarter of a small
    run's CPU (`python -m hpctrain`, the tests' model, 6 steps: 3.6-3.8 -> 2.5-2.8 core-s of user time); frozen, no
    later pass walks them again, and a forked rank or data-loader worker never writes to their pages. The
    unreachable ones among them stay (+1.4 MiB of RSS). A process that imported torch before (a test's) collects as
    it did."""
    if "torch" in sys.modules or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
