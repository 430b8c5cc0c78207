"""Validation: when it runs and what it reports."""

from __future__ import annotations

import math
from collections.abc import Callable


class Evaluator:
    """Every `every` steps and at the last one: the mean token loss over the evaluation's validation samples (the
    same ones each time and in every layout, split over the data-parallel ranks by `batches`), logged as
    val_loss / val_ppl."""

    def __init__(self, every: int, last_step: int, batches: Callable, step, metrics):
        self.every, self.last_step = every, last_step
        self.batches, self.step, self.metrics = batches, step, metrics

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.last_step)

    def run(self, state) -> float:
        state.last_val_loss = self.step.evaluate(self.batches())
        self.metrics.log({"step": state.step, "val_loss": state.last_val_loss,
                          "val_ppl": math.exp(min(state.last_val_loss, 50.0))})
        return state.last_val_loss
