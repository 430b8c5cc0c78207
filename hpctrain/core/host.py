"""What this machine can still give: the bound every check of "does it fit here" compares against."""

from __future__ import annotations

import math
import os


def available_memory() -> float | None:
    """Bytes this machine can still give (MemAvailable), or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_cpus() -> int:
    """CPUs this process may use: those it may run on (a Slurm allocation's cpuset, taskset), fewer where its cgroup
    has a CPU quota (a container's --cpus). os.cpu_count() is the machine's: 4 local ranks in an 8-CPU allocation
    of a 128-core node would each start 32 threads."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def _cpu_quota() -> float | None:
    """CPUs' worth of time this process's cgroup may use (cgroup v2 cpu.max, v1 cfs quota), or None: no quota."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        try:
            if controllers == "":  # v2 (in a hybrid layout its files may not be there: then v1's count)
                quota, period = _read(f"/sys/fs/cgroup{path}/cpu.max").split()
            elif "cpu" in controllers.split(","):
                quota = _read(f"/sys/fs/cgroup/cpu{path}/cpu.cfs_quota_us")
                period = _read(f"/sys/fs/cgroup/cpu{path}/cpu.cfs_period_us")
            else:
                continue
            if quota not in ("max", "-1"):
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue
    return min(quotas, default=None)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()
