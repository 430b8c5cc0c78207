"""Argument parsing for hpctrain's argparse commands: a usage error is one line, like every other bad input."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        self.exit(2, f"{self.prog}: error: {message} (usage: {usage})\n")
