"""The exceptions that mean bad input: each is reported as one line naming the fix, never as a traceback.

ConfigError (a config that cannot run) lives with the schema, DataError (unusable shards) with the shard
format; the ones raised while a run starts or goes on are here, so that no module has to import the
training code to recognise them.
"""

from __future__ import annotations

import sys

from omegaconf.errors import OmegaConfBaseException

from hpctrain.core.config import ConfigError
from hpctrain.core.shard_format import DataError


class TrainingError(RuntimeError):
    """The run cannot continue; the message is one line naming the cause and the fix."""


class CheckpointError(RuntimeError):
    """One line: what is wrong, where, and the fix. `reason` alone (the what) words load_newest's fallbacks;
    `fix`, where the checkpoint itself is fine but not for this model, the fix whatever the caller."""

    def __init__(self, message: str, reason: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.reason, self.fix = reason or message, fix


BAD_INPUT: tuple[type[Exception], ...] = (ConfigError, DataError, TrainingError, CheckpointError,
                                          OmegaConfBaseException)


EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def say(line: str) -> None:
    """One line on stderr, whatever the text held (whitespace, newlines included, folded)."""
    print(" ".join(str(line).split()), file=sys.stderr, flush=True)


def fail(message: str, code: int = EXIT_BAD_INPUT):
    """End the command with one line on stderr: `hpctrain: error: ...`."""
    say(f"hpctrain: error: {message}")
    sys.exit(code)
