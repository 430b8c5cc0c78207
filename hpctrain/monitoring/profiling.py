"""Looking inside steps: `train.profile_steps=[a,b]` (the torch profiler over steps a..b on every rank) and, on CUDA,
`train.memory_snapshot=true` (the allocator's history, dumped on an out-of-memory error and at the end).

Files, per rank N, under the run directory:
  profile/rank-N.json           Chrome trace of steps a..b (open in https://ui.perfetto.dev or chrome://tracing)
  profile/rank-N.txt            the ops by total device time (CPU time without a GPU), then by CPU time, then split by
                                input shapes (which of an op's calls, e.g. which copies, take the time)
  memory/rank-N-oom.pickle      the allocator's history up to an out-of-memory error (PyTorch's memory viz)
  memory/rank-N-end.pickle      the same at the end of the run
Files of an earlier attempt are kept: a new one gets a free name (rank-N-2.json, ...).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("hpctrain")
PROFILE_DIR, MEMORY_DIR = "profile", "memory"
HISTORY_ENTRIES = 100_000  # allocator events kept (PyTorch's recommended order of magnitude)


def _out(run_dir: str, folder: str, name: str, also: str = "") -> str:
    """run_dir/folder/name, or name-2, name-3, ... (before the extension): never a file that exists, nor its twin
    with the extension `also`."""
    os.makedirs(os.path.join(run_dir, folder), exist_ok=True)
    stem, ext = os.path.splitext(os.path.join(run_dir, folder, name))
    path, n = stem + ext, 1
    while os.path.lexists(path) or (also and os.path.lexists(path[:-len(ext)] + also)):
        n += 1
        path = f"{stem}-{n}{ext}"
    return path


class StepProfiler:
    """The torch profiler over steps [first, last] of this rank (nothing outside them)."""

    def __init__(self, run_dir: str, window: tuple[int, int] | None, rank: int, device: torch.device):
        self.run_dir, self.window, self.rank, self.device = run_dir, window, rank, device
        self._prof = None

    def before_step(self, step: int) -> None:
        """`step`: the step about to run (1-based)."""
        if self.window is None or step != self.window[0]:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        # shapes: the one-step profile of llama_1b on an H200 had 0.11 s of aten::copy_ in 538 calls that the op
        # table alone could not attribute
        self._prof = profile(activities=activities, record_shapes=True)
        self._prof.start()

    def after_step(self, step: int) -> None:
        if self._prof is None or step != self.window[1]:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.stop()
        trace = _out(self.run_dir, PROFILE_DIR, f"rank-{self.rank}.json", also=".txt")
        self._prof.export_chrome_trace(trace)
        table = trace[:-len(".json")] + ".txt"  # the same attempt's suffix for both
        events = self._prof.key_averages()
        by_device = "cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        with open(table, "w") as f:
            f.write(f"steps {self.window[0]}-{self.window[1]}, rank {self.rank}, sorted by {by_device}\n")
            f.write(events.table(sort_by=by_device, row_limit=40, max_name_column_width=80) + "\n")
            f.write("sorted by cpu_time_total\n")
            f.write(events.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=80) + "\n")
            self_time = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            f.write(f"by input shape, sorted by {self_time}\n")  # (self: wrapper ops would crowd the kernels out)
            f.write(self._prof.key_averages(group_by_input_shape=True).table(
                sort_by=self_time, row_limit=40, max_name_column_width=60, max_shapes_column_width=100) + "\n")
        self._prof = None
        if self.rank == 0:
            log.info("profile of steps %d-%d written: %s (and %s)", *self.window, trace, table)

    def close(self) -> None:
        """A run that ended inside the window (a stop, an error): the profile is dropped, not written half."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None


class MemorySnapshot:
    """train.memory_snapshot: the CUDA allocator's history, recorded once the model and optimizer are built (every
    step's allocations), dumped on an out-of-memory error (-oom) or when the run ends otherwise (-end). A rank
    without CUDA says so once and records nothing."""

    def __init__(self, run_dir: str, enabled: bool, rank: int, device: torch.device):
        self.run_dir, self.rank, self.device = run_dir, rank, device
        self.on = enabled and device.type == "cuda"
        if enabled and not self.on and rank == 0:
            log.warning("train.memory_snapshot=true: no CUDA device on this rank, no allocator history is recorded")
        if self.on:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)

    def dump(self, why: str) -> str | None:
        if not self.on:
            return None
        path = _out(self.run_dir, MEMORY_DIR, f"rank-{self.rank}-{why}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        (log.warning if why == "oom" else log.info)("memory snapshot (%s) of rank %d written: %s (drag it into "
                                                    "https://pytorch.org/memory_viz)", why, self.rank, path)
        return path

    def close(self, error: BaseException | None) -> None:
        if not self.on:
            return
        self.dump("oom" if isinstance(error, torch.OutOfMemoryError) else "end")
        torch.cuda.memory._record_memory_history(enabled=None)
        self.on = False
