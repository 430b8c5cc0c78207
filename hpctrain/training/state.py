"""The run's own state besides tensors: where it is (step, samples), what it has seen, what it is bound to.

Checkpoints hold it as JSON, which anyone can edit: every value is checked like a config value when loaded
(`count`, `number`: TypeError naming the key), so a damaged or crafted trainer_state.json is refused in one line
instead of training from step -1000 or reporting a run complete that never trained.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field, fields

MAX_COUNT = 2**62  # steps, samples, tokens: anything larger is not a real run's


def count(doc: dict, key: str, low: int = 0, high: int = MAX_COUNT) -> int:
    """doc[key], an integer within [low, high] (TypeError otherwise)."""
    value = doc.get(key)
    if type(value) is not int or not low <= value <= high:
        raise TypeError(f"{key}={value!r} is not an integer within [{low}, {high}]")
    return value


def number(doc: dict, key: str, low: float = 0.0, high: float = math.inf, optional: bool = False) -> float | None:
    """doc[key], a finite number within [low, high] (None allowed when `optional`; TypeError otherwise)."""
    value = doc.get(key)
    if value is None and optional:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
        raise TypeError(f"{key}={value!r} is not a finite number within [{low}, {high}]")
    return value


_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_WINDOW_KEYS = ("spike_step", "back_to_step", "from_sample", "to_sample")

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
    data_seed: int | None = None  # train.seed and data.shuffle: the sample order too
    data_shuffle: bool | None = None
    tokenizer_sha256: str | None = None  # the token ids the weights were trained on
    data_mixture: list | None = None  # [[source name, weight], ...] of data.sources: the sample order too
    # [[step, [weight per source], global sample where it begins], ...] of data.schedule: its past phases too
    data_schedule: list | None = None
    started_at: float = field(default_factory=time.time, repr=False)  # not saved

    def elapsed_s(self) -> float:
        return self.wall_time_s + time.time() - self.started_at

    def state_dict(self) -> dict:
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "started_at"}
        doc["wall_time_s"] = self.elapsed_s()
        return doc

    @classmethod
    def check(cls, doc: dict) -> None:
        """TypeError for a document that is not an hpctrain run state (each value checked)."""
        if not isinstance(doc, dict):
            raise TypeError("run is not an object")
        unknown = set(doc) - ({f.name for f in fields(cls)} - {"started_at"})
        if unknown:
            raise TypeError(f"unexpected keys {sorted(unknown)}")
        _check_run(doc)

    def load_state_dict(self, doc: dict) -> None:
        """TypeError for a document that is not an hpctrain run state (each value checked)."""
        self.check(doc)
        for key, value in doc.items():
            setattr(self, key, list(value) if key == "skipped_data" else value)
        self.started_at = time.time()

    def advance(self, samples: int, tokens: int) -> None:
        self.step += 1
        self.samples += samples
        self.tokens += tokens


def _check_run(doc: dict) -> None:
    for key in ("step", "samples", "tokens", "skipped_nonfinite", "skipped_overflow", "consecutive_nonfinite",
                "skipped_spike"):
        if key in doc:
            count(doc, key)
    for key in ("last_loss", "last_val_loss"):
        number(doc, key, -math.inf, math.inf, optional=True)
    if "wall_time_s" in doc:
        number(doc, "wall_time_s")
    if doc.get("data_lanes") is not None:
        count(doc, "data_lanes", 1, 2**31)
    if doc.get("data_seed") is not None:
        count(doc, "data_seed", 0, 2**63 - 1)
    if doc.get("data_shuffle") not in (None, True, False):
        raise TypeError(f"data_shuffle={doc['data_shuffle']!r} is not a boolean")
    mixture = doc.get("data_mixture")
    if mixture is not None and not (isinstance(mixture, list) and all(
            isinstance(m, list) and len(m) == 2 and isinstance(m[0], str) and type(m[1]) in (int, float)
            and math.isfinite(m[1]) for m in mixture)):
        raise TypeError(f"data_mixture={mixture!r} is not a list of [name, weight]")
    phases = doc.get("data_schedule")
    if phases is not None and not (isinstance(phases, list) and all(
            isinstance(p, list) and len(p) in (2, 3) and type(p[0]) is int and isinstance(p[1], list)
            and all(type(w) in (int, float) and math.isfinite(w) for w in p[1])
            and (len(p) == 2 or (type(p[2]) is int and p[2] >= 0)) for p in phases)):  # (2: before the start sample)
        raise TypeError(f"data_schedule={phases!r} is not a list of [step, [weights], start sample]")
    sha = doc.get("tokenizer_sha256")
    if sha is not None and not (isinstance(sha, str) and _SHA256.match(sha)):
        raise TypeError(f"tokenizer_sha256={sha!r} is not a sha256")
    windows = doc.get("skipped_data", [])
    if not isinstance(windows, list) or not all(isinstance(w, dict) for w in windows):
        raise TypeError("skipped_data is not a list of objects")
    for w in windows:
        for key in _WINDOW_KEYS:
            count(w, key)
        if w["from_sample"] > w["to_sample"]:
            raise TypeError(f"skipped_data window {w['from_sample']}..{w['to_sample']} runs backwards")
