"""train.gc_every: Python's garbage collector on a schedule of steps instead of whenever allocations add up.

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

import gc
import time


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
