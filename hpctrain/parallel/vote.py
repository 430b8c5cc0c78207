"""Agreements among ranks: the same answer on every rank. `OverlappedVote` never holds a step back (each rank's
view after one step, all ranks' answer after the next: a stop request, a checkpoint written in the background);
`any_rank` answers at once."""

from __future__ import annotations

import torch
import torch.distributed as dist


class OverlappedVote:
    """An element-wise MAX over ranks of a few ints, started after one step and collected after the next, so the
    all-reduce runs while that step computes. Collective over `group` (default: every rank): they all start and
    collect at the same steps."""

    def __init__(self, group=None):
        self.group = group
        self._work = None  # (work or None, tensor) of the vote in flight

    def start(self, values: list[int]) -> None:
        flag = torch.tensor(values, dtype=torch.int32)  # a CPU tensor: gloo, no device sync
        many = dist.is_initialized() and dist.get_world_size(self.group) > 1
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True) if many else None
        self._work = (work, flag)

    def collect(self) -> list[int] | None:
        """The answer to the vote in flight (None when none is)."""
        if self._work is None:
            return None
        work, flag = self._work
        self._work = None
        if work is not None:
            work.wait()
        return flag.tolist()

    def drop(self, drain: bool) -> None:
        """Forget the vote in flight; `drain`: wait for it first, so that no collective is left pending (not after a
        failure: a rank that died might never join it)."""
        if drain:
            self.collect()
        self._work = None


def any_rank(flag: bool, group=None) -> bool:
    """Whether `flag` is true on any rank of `group` (a vote collected at once; collective when distributed)."""
    vote = OverlappedVote(group)
    vote.start([int(flag)])
    return bool(vote.collect()[0])


def all_reduced(values: list[float], op: str = "max", group=None) -> list[float]:
    """The element-wise MAX (or SUM) over the ranks of `group` of a few floats (collective when distributed): a
    decision every rank takes from the same numbers, or a total."""
    t = torch.tensor(values, dtype=torch.float64)  # a CPU tensor, like the votes
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op], group=group)
    return t.tolist()
