"""How the `python -m data_prep.*` commands end: one line on stderr and an exit status, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from hpctrain.core.shard_format import DataError


def run(work: Callable[[], object], os_fix: str, interrupted: str) -> int:
    """work() as a command: 0; or one line and 2 (bad input), 1 (the system's: a full disk, a lost directory; then
    `os_fix`), 130 (Ctrl-C; then `interrupted`: what was left)."""
    try:
        work()
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.strerror or e} ({e.filename}): {os_fix}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        return 130
    return 0
