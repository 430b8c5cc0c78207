"""Validation: when it runs and what it reports."""

from __future__ import annotations

import math
from collections.abc import Callable


class Evaluator:
    """Every `every` steps and at the last one: the mean token loss over the first `n_batches` validation batches
    (the same batches each time and on every rank), logged as val_loss / val_ppl."""

    def __init__(self, every: int, last_step: int, n_batches: int, batches: Callable, step, metrics):
        self.every, self.last_step, self.n_batches = every, last_step, n_batches
        self.batches, self.step, self.metrics = batches, step, metrics

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.last_step)

    def run(self, state) -> float:
        subset = (b for _, b in zip(range(self.n_batches), self.batches()))
        state.last_val_loss = self.step.evaluate(subset)
        self.metrics.log({"step": state.step, "val_loss": state.last_val_loss,
                          "val_ppl": math.exp(min(state.last_val_loss, 50.0))})
        return state.last_val_loss
