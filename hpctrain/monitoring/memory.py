"""Peak memory of one rank, over what the process held before its model was built.

A GPU rank reads the caching allocator's counters (`max_memory_allocated`: tensor bytes, what the planner
estimates). A CPU rank reads the kernel's resident high-water mark (VmHWM), which it can restart from the
current size (/proc/self/clear_refs), minus the resident size when the probe started (after giving malloc's
free pages back): libraries and the process group are not the model's. A resident peak also counts what the
runtime and malloc keep beside the tensors, so it sits above the planner's tensor bytes. Where /proc cannot
say (not Linux), peaks are None.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("hpctrain")


def _proc_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(key + ":")), None)
    except (OSError, ValueError, IndexError):
        return None


def _trim_heap() -> None:
    """Give malloc's free pages back to the kernel (glibc), so that what the rank allocates next shows in its
    resident size: a forked rank inherits its parent's freed-but-resident heap, which would hide it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class MemoryProbe:
    """`reset()` starts a window; `peak()` is the most bytes held in it over the probe's baseline."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        if not self.cuda:
            _trim_heap()
        self.baseline = self._current()
        self.reset()

    def _current(self) -> int | None:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        kib = _proc_kib("VmRSS")
        return None if kib is None else kib * 1024

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the high-water mark restarts from the current resident size
        except OSError:
            self.baseline = None  # a peak that cannot restart would mix windows: report none

    def peak(self) -> int | None:
        if self.baseline is None:
            return None
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        kib = _proc_kib("VmHWM")
        return None if kib is None else kib * 1024 - self.baseline


SHOWN_RANKS = 16  # ranks the memory line names; result.json keeps every rank's


@dataclass
class Peaks:
    """This rank's start-up peak (model, optimizer and restored state) and the planner's estimate for its device.

    After the first steps (`at_step`: two, when the optimizer state exists and a whole step has run with it),
    every rank's step peak is gathered, and the main rank logs them all against the planner; `gathered` keeps
    them in GiB for result.json."""

    startup: int | None
    planned: float
    at_step: int
    gathered: dict | None = None

    def report(self, step_peak: int | None, world: int) -> None:
        mine = (self.startup, step_peak, self.planned)
        ranks = [mine] * world
        if world > 1:
            dist.all_gather_object(ranks, mine)
        keys = ("startup_gib", "step_gib", "planned_gib")
        self.gathered = {key: [_gib(r[i]) for r in ranks] for i, key in enumerate(keys)}
        shown = [(i, "/".join("n/a" if v is None else f"{v:.2f}" for v in values))
                 for i, values in enumerate(zip(*self.gathered.values()))]
        if len(shown) > SHOWN_RANKS:  # (an 8,192-rank line would be 200 KB): the largest step peaks, and how many
            by_peak = sorted(range(len(shown)), key=lambda i: -(self.gathered["step_gib"][i] or 0))
            shown = [shown[i] for i in sorted(by_peak[:SHOWN_RANKS])]
        log.info("memory per rank over its size before the model, GiB (start-up peak / peak up to step %d / "
                 "planner): %s%s", self.at_step, ", ".join(f"r{i} {v}" for i, v in shown),
                 f" (the {SHOWN_RANKS} largest step peaks of {len(ranks)} ranks; all in result.json)"
                 if len(ranks) > SHOWN_RANKS else "")


def _gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**30, 4)

