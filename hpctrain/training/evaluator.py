"""Validation: when it runs and what it reports."""

from __future__ import annotations

import math
from collections.abc import Callable


class Evaluator:
    """Every `every` steps and at the last one: the mean token loss over the evaluation's validation samples (the
    same ones each time and in every layout, split over the data-parallel ranks by `batches`), logged as
    val_loss / val_ppl, and as val_bpb, bits per byte of text, which does not depend on the tokenizer (`text_bytes`:
    the evaluation's targets and the bytes they stand for, counted once at the first evaluation; None on ranks that
    log nothing); for a mixture, each source's own validation split as val_loss/<source>."""

    def __init__(self, every: int, last_step: int, batches: Callable, step, metrics,
                 text_bytes: Callable[[], tuple[int, int] | None] | None = None,
                 per_source: dict[str, Callable] | None = None):
        """`per_source`: a mixture's sources' validation batches by name, each logged as val_loss/<name>."""
        self.every, self.last_step = every, last_step
        self.batches, self.step, self.metrics = batches, step, metrics
        self.text_bytes, self._counted = text_bytes, None
        self.per_source = per_source or {}

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.last_step)

    def run(self, state) -> float:
        state.last_val_loss = self.step.evaluate(self.batches())
        record = {"step": state.step, "val_loss": state.last_val_loss,
                  "val_ppl": math.exp(min(state.last_val_loss, 50.0))}
        if self.text_bytes is not None:
            if self._counted is None:
                self._counted = self.text_bytes() or (0, 0)
            targets, nbytes = self._counted
            if nbytes:
                record["val_bpb"] = state.last_val_loss * targets / (math.log(2) * nbytes)
        for name, batches in self.per_source.items():
            record[f"val_loss/{name}"] = self.step.evaluate(batches())
        self.metrics.log(record)
        return state.last_val_loss
