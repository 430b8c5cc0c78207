"""When the run saves, what a checkpoint holds, and where a run resumes from."""

from __future__ import annotations

import logging

from hpctrain import checkpoint
from hpctrain.errors import TrainingError
from hpctrain.training.step import params_finite

log = logging.getLogger("hpctrain")


class Checkpointer:
    """Saves the model and optimizer (sharded, DCP) with the JSON state of the run's other stateful parts.

    `parts`: name -> object with `state_dict()` / `load_state_dict()` that every checkpoint must hold;
    `optional`: the same, None where this run has none (an fp16 loss scaler). `enabled=False`
    (train.checkpointing=false, for benchmarks): nothing is written, but the weights are still checked finite
    whenever a save was due, so a diverged run still fails.
    """

    def __init__(self, run_dir: str, every: int, keep: int, last_step: int, model, optimizer,
                 parts: dict, optional: dict | None = None, enabled: bool = True):
        self.run_dir, self.every, self.keep, self.last_step = run_dir, every, keep, last_step
        self.enabled = enabled
        self.model, self.optimizer = model, optimizer
        self.parts, self.optional = parts, optional or {}

    def due(self, step: int, stopping: bool = False) -> bool:
        return bool(stopping or (self.every and step % self.every == 0) or step == self.last_step)

    def save(self, step: int) -> None:
        if not params_finite(self.model):  # never a checkpoint that resuming would train on from NaN
            raise TrainingError(
                f"the parameters are not finite after step {step}; no checkpoint written (the last good one: "
                f"{checkpoint.latest(self.run_dir) or 'none'}): lower optim.lr or raise optim.warmup_steps, then "
                "resume from it with train.resume=PATH")
        if not self.enabled:
            return
        doc = {name: part.state_dict() for name, part in self.parts.items()}
        doc.update({name: part.state_dict() if part is not None else None for name, part in self.optional.items()})
        checkpoint.save(self.run_dir, step, self.model, self.optimizer, doc, self.keep)

    def restore(self, start: str | None) -> str | None:
        """Load `start` ("auto": the run dir's newest loadable checkpoint; None: nothing); return what was loaded."""
        if start == "auto":
            path, saved = checkpoint.load_newest(self.run_dir, self.model, self.optimizer) or (None, None)
        elif start:
            path, saved = start, checkpoint.load(start, self.model, self.optimizer)
        else:
            return None
        if saved:
            self._load_parts(path, saved)
        return path if saved else None

    def _load_parts(self, path: str, saved: dict) -> None:
        """The JSON of a checkpoint's trainer_state.json (JSON, but maybe not hpctrain's) into the parts."""
        try:
            for name, part in self.parts.items():
                if not isinstance(saved[name], dict):
                    raise TypeError(f"{name} is not an object")
                part.load_state_dict(saved[name])
            for name, part in self.optional.items():
                if part is not None and saved.get(name):
                    part.load_state_dict(saved[name])
        except (KeyError, TypeError) as e:
            raise checkpoint.cannot_load(path, f"{checkpoint.STATE_FILE} is not an hpctrain trainer state: "
                                               f"{type(e).__name__}: {e}") from None
