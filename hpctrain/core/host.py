"""What this machine can still give: the bound every check of "does it fit here" compares against."""

from __future__ import annotations


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
