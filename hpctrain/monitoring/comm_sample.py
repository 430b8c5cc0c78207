"""Communication, synchronisation and stragglers, sampled (`monitor.sample_every`).

One step in `sample_every` runs under the torch profiler on every rank. The time its collectives took (NCCL's
kernels on a GPU, gloo's operations on CPU; overlapping ones counted once) is this rank's communication time;
the step's time minus it is the rank's compute time. Every rank's pair is gathered:
- `communication_overhead`: the smallest share of the step in collectives over the ranks, in percent (the
  slowest rank waits least for the others, so its share is the collectives' own cost, not synchronisation);
- `synchronization_time`: the slowest rank's compute time minus the fastest's, in seconds;
- `stragglers`: ranks whose compute time is above (1 + `straggler_frac`) × the median, named with their node;
- `comm_bytes`: the bytes the step handed to collectives on the busiest rank (each collective's input: what an
  all-reduce sums, a rank's piece of an all-gather), read from the profiler's recorded shapes and dtypes;
  `comm_bytes_by_op`: rank 0's, by kind of collective.
The rest of the time nothing is profiled; a sampled step costs one small all-gather besides the profiler.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpctrain.parallel.process_group import node_name
from hpctrain.runtime import bad_nodes

log = logging.getLogger("hpctrain")


def comm_seconds(events, on_gpu: bool) -> float:
    """Seconds covered by the collectives among profiler `events` (overlapping intervals counted once)."""
    spans = []
    for e in events:
        if on_gpu:
            is_comm = e.device_type == torch.autograd.DeviceType.CUDA and e.name.lower().startswith("nccl")
        else:
            is_comm = e.name.startswith("gloo:")
        if is_comm:
            spans.append((e.time_range.start, e.time_range.end))
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):  # the union of the intervals, in microseconds
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e6


# The profiler's names of tensor dtypes (c10's), in bytes per element.
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "int": 4, "long int": 8,
                "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}


def comm_bytes(prof) -> dict[str, int]:
    """Bytes handed to each kind of collective (gloo's or NCCL's operations: their input tensors) that a profiler
    recorded with record_shapes, e.g. {"gloo:all_reduce": 15803392}."""
    by_op: dict[str, int] = {}
    for e in prof.profiler.kineto_results.events():
        if e.name().startswith(("gloo:", "nccl:")):
            n = sum(_DTYPE_BYTES[dtype] * int(torch.Size(shape).numel())
                    for shape, dtype in zip(e.shapes(), e.dtypes()) if shape and dtype in _DTYPE_BYTES)
            by_op[e.name()] = by_op.get(e.name(), 0) + n
    return by_op


def _all_threads_config():
    """Profile every thread: a communication hook's later collectives run in the callbacks of its futures, on
    the process group's threads. None where this torch has no such option."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


@dataclass(frozen=True)
class Sample:
    """A sampled step, as gathered from every rank."""

    step: int
    compute_s: list[float]  # by rank
    comm_s: list[float]
    step_s: list[float]
    nodes: list[str]
    straggler_frac: float
    bytes: list[int]
    bytes_by_op: dict[str, int]  # rank 0's

    def straggler_ranks(self) -> list[int]:
        median = statistics.median(self.compute_s)
        return [r for r, c in enumerate(self.compute_s) if c > (1 + self.straggler_frac) * median]

    def stragglers(self) -> list[str]:
        return [f"rank {r} ({self.nodes[r]})" for r in self.straggler_ranks()]

    def metrics(self) -> dict:
        overhead = min(100.0 * c / s for c, s in zip(self.comm_s, self.step_s) if s > 0)
        return {"communication_overhead": overhead, "synchronization_time": max(self.compute_s) - min(self.compute_s),
                "compute_s_by_rank": [round(c, 6) for c in self.compute_s], "stragglers": self.stragglers(),
                "comm_bytes": max(self.bytes), "comm_bytes_by_op": self.bytes_by_op}


# A node that straggled in this many sampled steps of a run is recorded on the bad-node list (which leaves it out
# once two runs recorded it).
STRAGGLED_SAMPLES = 3


class CommSampler:
    """Profiles one step in `every` on every rank and gathers the figures (collective: every rank samples the same
    steps). `every=0`, or a single rank: nothing is measured. A step inside train.profile_steps is not sampled
    (one profiler at a time)."""

    def __init__(self, every: int, straggler_frac: float, world: int, device: torch.device,
                 profile_window: tuple[int, int] | None, bad_nodes: str | None = None, run_dir: str = ""):
        """`bad_nodes`: the bad-node list that a node straggling in STRAGGLED_SAMPLES sampled steps of the run is
        added to, at the end (given on one rank)."""
        self.every, self.straggler_frac, self.device = every if world > 1 else 0, straggler_frac, device
        self.bad_nodes, self.run_dir = bad_nodes, run_dir
        self.window = profile_window
        self.nodes = [node_name()]
        if self.every:
            self.nodes = [None] * world
            dist.all_gather_object(self.nodes, node_name())
        self._prof = None
        self.straggled: dict[str, int] = {}  # "rank R (node)" -> the sampled steps it straggled in
        self._straggled_nodes: dict[str, int] = {}  # the same by node
        # What sampling cost this rank: the profiler's start, stop and reading, the gather, and how much longer the
        # sampled steps took than the step before each (seconds; result.json's monitor_overhead_s).
        self.spent_s = 0.0
        self._last_step_s = None

    def _due(self, step: int) -> bool:
        in_window = self.window is not None and self.window[0] <= step <= self.window[1]
        return bool(self.every) and step % self.every == 0 and not in_window

    def before_step(self, step: int) -> None:
        """`step`: the step about to run (1-based)."""
        if not self._due(step):
            return
        t0 = time.perf_counter()
        from torch.profiler import ProfilerActivity, profile

        # Kineto prints two lines at every profiler start and stop: read at its first use in the process.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        on_gpu = self.device.type == "cuda"
        self._prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else []),
                             record_shapes=True, experimental_config=_all_threads_config())
        self._prof.start()
        self.spent_s += time.perf_counter() - t0

    def after_step(self, step: int, step_s: float) -> Sample | None:
        """The sample of `step` when it was sampled (collective then), else None."""
        if self._prof is None:
            self._last_step_s = step_s
            return None
        t0 = time.perf_counter()
        if self._last_step_s is not None:
            self.spent_s += max(step_s - self._last_step_s, 0.0)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize(self.device)
        self._prof.stop()
        comm = comm_seconds(self._prof.events(), on_gpu)
        by_op = comm_bytes(self._prof)
        self._prof = None
        mine = torch.tensor([max(step_s - comm, 0.0), comm, step_s, sum(by_op.values())], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in self.nodes]
        dist.all_gather(every, mine)  # a CPU tensor: gloo (the default group has it beside NCCL)
        rows = torch.stack(every).tolist()
        sample = Sample(step, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], self.nodes,
                        self.straggler_frac, [int(r[3]) for r in rows], by_op)
        for name in sample.stragglers():
            self.straggled[name] = self.straggled.get(name, 0) + 1
        for node in {sample.nodes[r] for r in sample.straggler_ranks()}:
            self._straggled_nodes[node] = self._straggled_nodes.get(node, 0) + 1
        self.spent_s += time.perf_counter() - t0
        return sample

    def close(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
        slow = sorted(n for n, count in self._straggled_nodes.items() if count >= STRAGGLED_SAMPLES)
        bad_nodes.record(self.bad_nodes, slow, "straggler", f"straggled in {STRAGGLED_SAMPLES}+ sampled steps "
                         f"(compute > {1 + self.straggler_frac:g} × the median)", self.run_dir)
        self._straggled_nodes = {}
