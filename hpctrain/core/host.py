"""What this machine can still give this process (memory, CPUs), its cgroup's limits included: the bound every check
of "does it fit here" compares against."""

from __future__ import annotations

import math
import os
import re


def memory_headroom() -> tuple[float | None, str]:
    """(bytes this process can still get, what bounds them): the machine's MemAvailable, or less under a cgroup
    memory limit (a Slurm job's --mem, a container's --memory), whose kernel kills the job at the limit however much
    the machine has left. (None, "") where neither says."""
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
    return min(found, key=lambda f: f[0], default=(None, ""))


def _cgroup_memory_left() -> float | None:
    """Bytes left under this process's cgroup memory limits (v2 memory.max, v1 memory.limit_in_bytes), its file
    cache counted as left (the kernel reclaims it before it kills: active and inactive files, not tmpfs); None
    without a limit."""
    lefts = []
    for version, group in _cgroups("memory"):
        try:
            if version == 2:
                limit, usage, stat = (f"{group}/memory.{n}" for n in ("max", "current", "stat"))
                cached = ("active_file", "inactive_file")
            else:
                limit, usage, stat = (f"{group}/memory.{n}" for n in ("limit_in_bytes", "usage_in_bytes", "stat"))
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
    """(version, directory) of this process's cgroups that may hold `controller`'s files, v2's and v1's of it, its own
    group first, then every ancestor visible here: a limit may be set above the process's own group (Slurm's on the
    job and step, a task's group below). Each hierarchy is found where /proc/self/mountinfo says it is mounted, and
    a group's path taken relative to the mount's root: a container's hierarchy is its own group mounted at
    /sys/fs/cgroup[/memory] while /proc/self/cgroup names it by the host's path (Docker on cgroup v1)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    mounts = _cgroup_mounts()
    out = []
    for line in lines:
        if line.count(":") < 2:  # (not a cgroup line)
            continue
        _, controllers, path = line.split(":", 2)
        version = 2 if controllers == "" else 1 if controller in controllers.split(",") else 0
        if not version:
            continue
        default = "/sys/fs/cgroup" if version == 2 else f"/sys/fs/cgroup/{controller}"  # (no mountinfo: the usual)
        root, point = mounts.get((version, controller if version == 1 else ""), ("/", default))
        if root != "/":
            if not (path + "/").startswith(root.rstrip("/") + "/"):
                continue  # (another group mounted here: this process's own is not in sight)
            path = path[len(root.rstrip("/")):] or "/"
        while True:
            out.append((version, point.rstrip("/") + path.rstrip("/")))
            if path in ("/", ""):
                break
            path = os.path.dirname(path.rstrip("/")) or "/"
    return out


def _cgroup_mounts() -> dict[tuple[int, str], tuple[str, str]]:
    """{(1, controller) or (2, ""): (the mounted group's path in its hierarchy, where it is mounted)} from
    /proc/self/mountinfo (`36 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory`); {} where it cannot
    be read."""
    found: dict[tuple[int, str], tuple[str, str]] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype, *rest = line.split(" - ", 1)[1].split()  # (after the separator: type, source, super options)
        root, point = _unescape(fields[3]), _unescape(fields[4])
        keys = [(2, "")] if fstype == "cgroup2" else [(1, o) for o in rest[-1].split(",")] if fstype == "cgroup" else []
        for key in keys:  # a later mount on the same point, or on one above it, hides an earlier one
            if key not in found or found[key][1] == point or not os.path.isfile(f"{found[key][1]}/cgroup.procs"):
                found[key] = (root, point)
    return found


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040)
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


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
    for version, group in _cgroups("cpu"):
        try:  # (in a hybrid layout v2's files may not be there: then v1's count)
            if version == 2:
                quota, period = _read(f"{group}/cpu.max").split()
            else:
                quota, period = _read(f"{group}/cpu.cfs_quota_us"), _read(f"{group}/cpu.cfs_period_us")
            if quota not in ("max", "-1"):
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue
    return min(quotas, default=None)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()
