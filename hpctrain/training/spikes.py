"""Loss spikes (`monitor.loss_spike`): a step whose loss is above `factor` × the median of the last `window`
accepted steps' losses is a spike. Its action: `warn` (the update is applied), `skip_batch` (the update is
dropped, as a non-finite step's is), `rollback` (the update is dropped, the run reloads its last checkpoint and
skips the data from that checkpoint's position to the end of the spiking batch, as PaLM did: Chowdhery et al.
2022, §5.1), or `none`.

The loss is the global batch's mean, the same on every rank, and the window is saved in checkpoints, so every
rank, and a resumed run, takes the same decision at the same step.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

from hpctrain.core.config import SpikeAction
from hpctrain.core.errors import TrainingError
from hpctrain.storage import checkpoint

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class Spike:
    """A spiking step, as alerts.jsonl records it."""

    loss: float
    median: float
    factor: float
    action: str

    def event(self, step: int) -> dict:
        return {"event": "spike", "rule": "loss_spike", "metric": "loss", "value": self.loss,
                "threshold": self.factor * self.median, "median": self.median, "action": self.action,
                "step": step}


class LossSpikeGuard:
    """Decides, before the optimizer applies a step, whether its loss is a spike; a checkpoint part (the window
    of recent losses). Active once the window is full."""

    def __init__(self, factor: float, window: int, action: SpikeAction):
        self.factor, self.window, self.action = factor, window, SpikeAction(action)
        self.losses: deque[float] = deque(maxlen=window)
        self.last: Spike | None = None  # the spike of the step just taken, if it was one

    @property
    def enabled(self) -> bool:
        return self.action != SpikeAction.none

    def drop_update(self, loss: float) -> bool:
        """Whether the optimizer must not apply the step of (finite) loss `loss`; notes a spike in `last`. A
        dropped step's loss stays out of the window; a warned one goes in (a loss that stays high becomes the
        new normal instead of warning at every step)."""
        self.last = None
        if self.enabled and len(self.losses) == self.window:
            median = statistics.median(self.losses)
            if loss > self.factor * median:
                self.last = Spike(loss, median, self.factor, self.action.value)
                if self.action != SpikeAction.warn:
                    return True
        self.losses.append(loss)
        return False

    def state_dict(self) -> dict:
        return {"losses": list(self.losses)}

    @staticmethod
    def check(doc: dict) -> list[float]:
        """The losses of a saved window; TypeError for a document that is not one."""
        losses = doc.get("losses") if isinstance(doc, dict) else None
        if not isinstance(losses, list) or not all(type(x) in (int, float) and math.isfinite(x) for x in losses):
            raise TypeError("loss_spike is not a list of finite losses")
        return losses

    def load_state_dict(self, doc: dict) -> None:
        self.losses = deque(self.check(doc), maxlen=self.window)


def roll_back(checkpointer, state, run_dir: str, spike: Spike, max_rollbacks: int) -> dict | None:
    """Reload the last checkpoint (collective) and move the data position past the spiking batch; return the
    skipped window, also appended to `state.skipped_data`. None when there is no checkpoint yet (the spiking step
    stays skipped, as with skip_batch)."""
    checkpointer.wait()  # a background write finishes first: it may be the one to go back to
    path = checkpoint.latest(run_dir)
    if path is None:
        log.warning("step %d: no checkpoint to roll back to yet; the spiking step was skipped", state.step)
        return None
    if len(state.skipped_data) >= max_rollbacks:
        raise TrainingError(f"loss spike at step {state.step} ({spike.loss:.4g}, median {spike.median:.4g}) after "
                            f"{len(state.skipped_data)} rollbacks (monitor.loss_spike.max_rollbacks={max_rollbacks}): "
                            "lower optim.lr or raise optim.warmup_steps, then resume from the last checkpoint")
    # What the run has lived through stays: its counters, skipped windows and wall time.
    kept = {"skipped_nonfinite": state.skipped_nonfinite, "skipped_overflow": state.skipped_overflow,
            "skipped_spike": state.skipped_spike, "skipped_data": list(state.skipped_data),
            "wall_time_s": state.elapsed_s()}
    spike_step, end = state.step, state.samples
    checkpointer.restore(path)
    window = {"spike_step": spike_step, "loss": spike.loss, "back_to_step": state.step,
              "from_sample": state.samples, "to_sample": end}
    for key, value in kept.items():
        setattr(state, key, value)
    state.started_at, state.samples = time.time(), end
    state.skipped_data.append(window)
    return window


class Rollback:
    """monitor.loss_spike.action=rollback, as one component: back to the last checkpoint (collective), the data
    position past the spiking batch, the metrics sinks rewound, the event logged and recorded (main rank)."""

    def __init__(self, checkpointer, state, feed, metrics, alerts, run_dir: str, max_rollbacks: int):
        self.checkpointer, self.state, self.feed, self.metrics, self.alerts = checkpointer, state, feed, metrics, alerts
        self.run_dir, self.max_rollbacks = run_dir, max_rollbacks

    def __call__(self, spike: Spike) -> bool:
        """Whether the run went back (False: no checkpoint yet, the spiking step stays skipped)."""
        window = roll_back(self.checkpointer, self.state, self.run_dir, spike, self.max_rollbacks)
        if window is None:
            return False
        self.feed.seek(window["to_sample"])
        self.metrics.rewind(self.state.step)
        if self.alerts:
            log.warning("rolled back to step %d; samples %d to %d skipped", self.state.step, window["from_sample"],
                        window["to_sample"] - 1)
            self.alerts.record({"event": "rollback", "rule": "loss_spike", "step": window["spike_step"], **window})
        return True
