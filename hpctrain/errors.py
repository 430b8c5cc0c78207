"""The exceptions that mean bad input: each is reported as one line naming the fix, never as a traceback."""

from __future__ import annotations


def bad_input() -> tuple[type[Exception], ...]:
    # Imported here: the modules that define them import much of the package.
    from omegaconf.errors import OmegaConfBaseException

    from data_prep.shard_format import DataError
    from hpctrain.checkpoint import CheckpointError
    from hpctrain.config import ConfigError
    from hpctrain.train import TrainingError

    return ConfigError, DataError, TrainingError, CheckpointError, OmegaConfBaseException
