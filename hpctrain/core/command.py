"""How a command ends: one line on stderr and an exit status, never a traceback. The tools (`hpctrain generate`,
`export-hf`, the `hpctrain prep` steps) share it, so each failure class ends the same way everywhere."""

from __future__ import annotations

from collections.abc import Callable

from hpctrain.core.errors import BAD_INPUT, EXIT_BAD_INPUT, EXIT_INTERRUPTED, say

EXIT_SYSTEM = 1  # the system's failure (a full disk, a lost directory), not the input's


def run_command(work: Callable[[], object], prog: str = "", bad: tuple[type[BaseException], ...] = BAD_INPUT,
                os_error: str | Callable[[OSError], str] | None = None, interrupted: str = "interrupted") -> int:
    """work() as a command: 0; or one line `PROG: error: ...` and 2 (one of the `bad` exceptions), 1 (an OSError,
    when `os_error` words it: the fix as text, or the whole message from the error; without it the OSError is a
    bug and keeps its traceback), 130 (Ctrl-C: `PROG: ` and the `interrupted` line, which says what was left)."""
    head = f"{prog}: " if prog else ""
    try:
        work()
    except bad as e:
        say(f"{head}error: {e}")
        return EXIT_BAD_INPUT
    except OSError as e:
        if os_error is None:
            raise
        say(f"{head}error: " + (os_error(e) if callable(os_error) else f"{e.strerror or e} ({e.filename}): {os_error}"))
        return EXIT_SYSTEM
    except KeyboardInterrupt:
        say(head + interrupted)
        return EXIT_INTERRUPTED
    return 0
