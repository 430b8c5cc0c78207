"""The memory model's vocabulary: what one feature holds on a device, in bytes, at each moment of a training step.

Each feature states its own term beside its code (the optimizer its state, data parallelism its shards and gathered
copies, the loss its buffers, activation checkpointing what blocks keep, ...); the planner (training/planner.py) adds
the terms up moment by moment and takes the worst moment. The moments:

  backward    the start of backward: every saved activation and the loss's buffers alive
  recompute   later in backward: a checkpointed block recomputed, the loss's buffers freed by then
  reduced     the end of backward under data parallelism: the last unit's gradients being reduced
  step        the optimizer step
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MOMENTS = ("backward", "recompute", "reduced", "step")


@dataclass(frozen=True)
class Term:
    backward: float = 0.0
    recompute: float = 0.0
    reduced: float = 0.0
    step: float = 0.0

    @classmethod
    def held(cls, nbytes: float) -> Term:
        """Held through the whole step: weights, optimizer state, buffers."""
        return cls(nbytes, nbytes, nbytes, nbytes)

    @classmethod
    def in_backward(cls, nbytes: float) -> Term:
        """Made in forward, freed once backward has used it (saved activations, compute copies of weights)."""
        return cls(backward=nbytes, recompute=nbytes)

    @classmethod
    def gradients(cls, nbytes: float, accumulating: bool) -> Term:
        """Gradient-sized buffers: made by backward, held through the step; at backward's start only when earlier
        micro-batches of the step have filled them already."""
        early = nbytes if accumulating else 0.0
        return cls(early, early, nbytes, nbytes)

    def __add__(self, other: Term) -> Term:
        return Term(*(getattr(self, m) + getattr(other, m) for m in MOMENTS))

    @property
    def size(self) -> float:
        """The most it holds at any moment: what a plan's line shows."""
        return max(getattr(self, m) for m in MOMENTS)


def peak(terms: Iterable[Term]) -> float:
    """The worst moment of the terms added up (not the sum of their sizes: they peak at different moments)."""
    return sum(terms, Term()).size


def merge(*parts: dict[str, Term]) -> dict[str, Term]:
    """Named terms from several features; terms of the same name (one line of the plan) add up."""
    out: dict[str, Term] = {}
    for part in parts:
        for name, term in part.items():
            out[name] = out[name] + term if name in out else term
    return out
