"""When to checkpoint: every N steps as configured, or (train.ckpt_every=auto) at the interval that loses the least
time to saving and to failures, from the measured save stall and step time and the job's expected failure rate.

Young (1974) and Daly (2006): with a save costing δ seconds of training and failures arriving every M seconds on
average (the job's MTBF: a node's MTBF over the job's node count), the compute time between checkpoints that
minimises the expected waste is τ ≈ √(2δM)·(1 + ⅓√(δ/2M) + ⅑·δ/2M) − δ (τ = M once δ ≥ 2M). Saving more often
wastes δ per save; less often, half an interval of lost work per failure.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass

from hpctrain.parallel.vote import all_reduced

log = logging.getLogger("hpctrain")

AUTO = "auto"
# Until a save has been measured: the first checkpoint at this step (steps 2 and 3 timed; step 1 builds and
# compiles), then the interval from the measurements, re-evaluated at every save.
FIRST_AUTO_STEP = 3


def daly_interval(stall_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that minimise the expected waste (Daly's higher-order estimate;
    Young's √(2δM) when δ ≪ M)."""
    if stall_s <= 0:
        return 0.0
    if stall_s >= 2 * mtbf_s:
        return mtbf_s
    r = stall_s / (2 * mtbf_s)
    return math.sqrt(2 * stall_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - stall_s


@dataclass(frozen=True)
class Decision:
    """One choice of the interval, with the measurements it was made from (result.json's checkpoints.cadence)."""

    step: int  # the save after which it was made
    stall_s: float  # what that save held training back (the slowest rank)
    step_s: float  # seconds per step since the save before (the slowest rank)
    mtbf_s: float  # the job's
    interval_s: float  # Young/Daly's τ
    every: int  # τ in steps: the next save is `every` steps on
    lost_s: float  # expected work redone per failure: half of an interval and its save

    @property
    def overhead(self) -> float:
        """Expected fraction of the time spent saving or redoing lost work."""
        period = self.every * self.step_s
        return self.stall_s / (period + self.stall_s) + (period + self.stall_s) / (2 * self.mtbf_s)


class Cadence:
    """Which steps end with a checkpoint. `every`: an int (0: only the ones the run forces: the last step, a stop),
    or "auto" with `mtbf_s`, the job's mean time between failures. Auto decides after each save from that save's
    stall and the time per step since the previous one, agreed over every rank (the slowest), so all save at the
    same steps."""

    def __init__(self, every: int | str, mtbf_s: float | None = None):
        self.auto = every == AUTO
        self.every = 0 if self.auto else int(every)
        self.mtbf_s = mtbf_s
        self.decisions: list[Decision] = []
        self._next = FIRST_AUTO_STEP
        self._mark: tuple[int, float] | None = None  # (step, time) the current stretch of steps is timed from

    def due(self, step: int) -> bool:
        if not self.auto:
            return bool(self.every and step % self.every == 0)
        if self._mark is None:  # the first step is done: time the next ones
            self._mark = (step, time.perf_counter())
        return step >= self._next and step > self._mark[0]

    def saved(self, step: int, stall_s: float) -> None:
        """After a save at `step` that held training `stall_s` (collective under auto): the next one decided."""
        if not self.auto:
            return
        now = time.perf_counter()
        if self._mark is None or step <= self._mark[0]:  # a save forced before any step was timed
            self._mark = (step, now)
            return
        mark_step, mark_t = self._mark
        step_s = (now - stall_s - mark_t) / (step - mark_step)
        # (every rank the slowest's figures, and the lowest MTBF: a list read while another job wrote it)
        stall_s, step_s, neg_mtbf = all_reduced([stall_s, step_s, -self.mtbf_s], "max")
        self.mtbf_s = -neg_mtbf
        interval = daly_interval(stall_s, self.mtbf_s)
        every = max(1, round(interval / step_s)) if step_s > 0 else 1
        d = Decision(step, stall_s, step_s, self.mtbf_s, interval, every, (every * step_s + stall_s) / 2)
        self.decisions.append(d)
        self._next = step + every
        self._mark = (step, time.perf_counter())
        if not self.decisions[:-1] or self.decisions[-2].every != every:
            log.info("checkpoint cadence: every %d steps (%.0f s; Young/Daly from a save stall of %.2f s, %.3g s per "
                     "step and a job MTBF of %.3g h): expected work lost per failure %.0f s, overhead %.1f %%",
                     every, every * step_s, stall_s, step_s, self.mtbf_s / 3600, d.lost_s, 100 * d.overhead)

    def summary(self) -> list[dict]:
        return [{k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(d).items()} for d in self.decisions]
