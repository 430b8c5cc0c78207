"""The one protocol of everything a run reports to: metrics.jsonl, TensorBoard, the console, MLflow, W&B, a
Prometheus endpoint and the alert rules are all sinks. A new destination subclasses Sink and overrides what it
uses; `metrics.run_sinks` builds a run's set."""

from __future__ import annotations


class Sink:
    """Every method is optional (a no-op here), so callers never ask a sink what it can do."""

    def write(self, record: dict) -> None:
        """A logged step's record (main rank), or a validation record."""

    def alert(self, event: dict) -> None:
        """An alert event: a rule fired or cleared, a loss spike, a rollback (see monitor.AlertSink)."""

    def rewind(self, step: int) -> None:
        """The run went back to `step` (a loss-spike rollback): drop what was written after it, where possible."""

    def close(self) -> None:
        """The run ended (or failed): flush and release."""


def display_name(key: str) -> str:
    """A record's key as TensorBoard and the trackers show it: val_x as val/x, downstream scores (eval/...) as they
    are, everything else under train/."""
    if key.startswith("val_"):
        return key.replace("val_", "val/", 1)
    return key if key.startswith("eval/") else f"train/{key}"
