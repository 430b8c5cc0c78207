"""The run's own state besides tensors: where it is (step, samples), what it has seen, what it is bound to."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields


@dataclass
class RunState:
    """Stored as JSON in each checkpoint (`state_dict` / `load_state_dict`, as the other stateful parts)."""

    step: int = 0
    samples: int = 0  # global samples consumed: the data position
    tokens: int = 0
    skipped_nonfinite: int = 0
    skipped_overflow: int = 0
    consecutive_nonfinite: int = 0
    skipped_spike: int = 0  # steps not applied as loss spikes (monitor.loss_spike)
    # Data windows skipped by rollbacks: {spike_step, loss, back_to_step, from_sample, to_sample} (to excluded)
    skipped_data: list = field(default_factory=list)
    last_loss: float | None = None
    last_val_loss: float | None = None
    wall_time_s: float = 0.0  # up to the last (re)start; `elapsed_s()` adds this start's time
    data_lanes: int | None = None  # fixed for the run's life: it defines the sample order
    tokenizer_sha256: str | None = None  # the token ids the weights were trained on
    started_at: float = field(default_factory=time.time, repr=False)  # not saved

    def elapsed_s(self) -> float:
        return self.wall_time_s + time.time() - self.started_at

    def state_dict(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "started_at"}
        doc["wall_time_s"] = self.elapsed_s()
        return doc

    def load_state_dict(self, doc: dict) -> None:
        """KeyError / TypeError for a document that is not an hpctrain run state."""
        if not isinstance(doc, dict):
            raise TypeError("run is not an object")
        unknown = set(doc) - ({f.name for f in fields(self)} - {"started_at"})
        if unknown:
            raise TypeError(f"unexpected keys {sorted(unknown)}")
        for key, value in doc.items():
            setattr(self, key, value)
        self.started_at = time.time()

    def advance(self, samples: int, tokens: int) -> None:
        self.step += 1
        self.samples += samples
        self.tokens += tokens
