"""Lustre striping of the shard output directory (a no-op where `lfs` is not on PATH).

Shards are large files that one rank reads sequentially while thousands of ranks read other shards, so
the default spreads each file over a few OSTs (count 4) in large stripes (4 MiB): enough bandwidth for
one reader without every file touching every OST. New files and sub-directories inherit the directory's
layout, so it is set once, before any shard is written.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from hpctrain.core.shard_format import DataError

DEFAULT_STRIPE_COUNT = 4
DEFAULT_STRIPE_SIZE = "4M"
_SIZE_RE = re.compile(r"^\d+[KkMmGg]?$")


def check_striping(count: int, size: str) -> None:
    if count < -1:
        raise DataError(f"--stripe-count {count}: use -1 (all OSTs), 0 (leave striping alone) or N >= 1")
    if not _SIZE_RE.match(str(size)):
        raise DataError(f"--stripe-size {size!r} is not a size: use e.g. 4M, 1M or 1G (a multiple of 64K)")


def set_striping(out_dir: str, count: int = DEFAULT_STRIPE_COUNT, size: str = DEFAULT_STRIPE_SIZE) -> bool:
    """`lfs setstripe -c COUNT -S SIZE out_dir` when `lfs` exists and count != 0; True when it was set.

    A failure (e.g. the directory is not on Lustre) is a warning, not an error: the shards are correct
    on any filesystem."""
    check_striping(count, size)
    lfs = shutil.which("lfs")
    if lfs is None or count == 0:
        return False
    cmd = [lfs, "setstripe", "-c", str(count), "-S", str(size), out_dir]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"warning: {' '.join(cmd)} failed ({e}); shards keep the default striping", file=sys.stderr)
        return False
    if r.returncode != 0:
        msg = " ".join((r.stderr or r.stdout).split())
        print(f"warning: {' '.join(cmd)} failed ({msg}); shards keep the default striping", file=sys.stderr)
        return False
    return True
