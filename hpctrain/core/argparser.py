"""Argument parsing for hpctrain's argparse commands: a usage error is one line, like every other bad input."""

from __future__ import annotations

import argparse
from collections.abc import Callable


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        self.exit(2, f"{self.prog}: error: {message} (usage: {usage})\n")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (the usage error names the option, in one line, before anything runs)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    return parse
