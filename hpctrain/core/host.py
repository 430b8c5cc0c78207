"""What this machine can still give this process (memory, CPUs), its cgroup's limits included: the bound every check
of "does it fit here" compares against."""

from __future__ import annotations

import math
import os


def memory_headroom() -> tuple[float, str] | None:
    """(bytes this process can still get, what bounds them): the machine's MemAvailable, or less under a cgroup
    memory limit (a Slurm job's --mem, a container's --memory), whose kernel kills the job at the limit however much
    the machine has left. None where neither says."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "this machine's available memory"))
    except (OSError, ValueError, IndexError):
        pass
    left = _cgroup_memory_left()
    if left is not None:
        found.append((left, "the memory left under this job's cgroup limit"))
    return min(found, key=lambda f: f[0], default=None)


def _cgroup_memory_left() -> float | None:
    """Bytes left under this process's cgroup memory limits (v2 memory.max, v1 memory.limit_in_bytes), its file
    cache counted as left (the kernel reclaims it before it kills: active and inactive files, not tmpfs); None
    without a limit."""
    lefts = []
    for version, path in _cgroups("memory"):
        try:
            if version == 2:
                limit, usage, stat = (f"/sys/fs/cgroup{path}/memory.{n}" for n in ("max", "current", "stat"))
                cached = ("active_file", "inactive_file")
            else:
                limit, usage, stat = (f"/sys/fs/cgroup/memory{path}/memory.{n}"
                                      for n in ("limit_in_bytes", "usage_in_bytes", "stat"))
                cached = ("total_active_file", "total_inactive_file")
            cap = _read(limit)
            if cap == "max" or int(cap) >= 1 << 60:  # (v1's "no limit" is a page-rounded 2^63)
                continue
            fields = dict(line.split()[:2] for line in _read(stat).splitlines())
            cache = sum(int(fields.get(name, 0)) for name in cached)
            lefts.append(int(cap) - (int(_read(usage)) - cache))
        except (OSError, ValueError, IndexError):
            continue
    return max(0, min(lefts)) if lefts else None


def _cgroups(controller: str) -> list[tuple[int, str]]:
    """(version, path) of this process's cgroups that may hold `controller`'s files, v2's and v1's of it, with every
    ancestor: a limit may be set above the process's own group (Slurm's on the job and step, a task's group below)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if line.count(":") < 2:  # (not a cgroup line)
            continue
        _, controllers, path = line.split(":", 2)
        version = 2 if controllers == "" else 1 if controller in controllers.split(",") else 0
        while version:
            out.append((version, path.rstrip("/")))
            if path in ("/", ""):
                break
            path = os.path.dirname(path.rstrip("/")) or "/"
    return out


def usable_cpus() -> int:
    """CPUs this process may use: those it may run on (a Slurm allocation's cpuset, taskset), fewer where its cgroup
    has a CPU quota (a container's --cpus). os.cpu_count() is the machine's: 4 local ranks in an 8-CPU allocation
    of a 128-core node would each start 32 threads."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def _cpu_quota() -> float | None:
    """CPUs' worth of time this process's cgroup may use (cgroup v2 cpu.max, v1 cfs quota), or None: no quota."""
    quotas = []
    for version, path in _cgroups("cpu"):
        try:  # (in a hybrid layout v2's files may not be there: then v1's count)
            if version == 2:
                quota, period = _read(f"/sys/fs/cgroup{path}/cpu.max").split()
            else:
                quota = _read(f"/sys/fs/cgroup/cpu{path}/cpu.cfs_quota_us")
                period = _read(f"/sys/fs/cgroup/cpu{path}/cpu.cfs_period_us")
            if quota not in ("max", "-1"):
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue
    return min(quotas, default=None)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()
