"""Sharded, layout-independent initialisation: every rank draws only the part of each parameter it holds, and
the values are the same whatever the layout, one process included.

Each parameter's values come from its own random stream, keyed by the run seed and its name (the one-process
FQN) and cut into chunks of whole rows (dim 0) of at most CHUNK elements, each chunk with its own generator.
A rank draws the chunks that cover its rows and copies out its box (columns too, for a shard on dim 1). No
rank ever holds more than its shard and one chunk, nothing is broadcast, and the cost per rank falls with the
number of ranks that split dim 0.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

CHUNK = 1 << 22  # elements per chunk at most (16 MiB of fp32): the most one draw allocates
# Wrappers that add a level to parameter names (activation checkpointing, torch.compile's module wrapper).
_WRAPPERS = re.compile(r"(?:^|\.)(?:_checkpoint_wrapped_module|_orig_mod)(?=\.)")


def canonical_name(name: str) -> str:
    """The one-process name of a parameter of a wrapped model."""
    return _WRAPPERS.sub("", name).lstrip(".")


def _seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _box(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's local tensor, its shape, its offset in the whole parameter)."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p.to_local(), tuple(shape), tuple(offset)
    return p, tuple(p.shape), (0,) * p.dim()


@torch.no_grad()
def fill_normal(p: torch.Tensor, name: str, seed: int, std: float) -> None:
    """N(0, std) into this rank's part of `p`, identical to the same part of the whole parameter drawn alone."""
    local, shape, offset = _box(p)
    if local.numel() == 0:
        return
    full = tuple(p.shape) or (1,)
    row = math.prod(full[1:])
    rows_per_chunk = max(1, CHUNK // max(row, 1))
    first, stop = offset[0] if offset else 0, (offset[0] + shape[0]) if offset else 1
    view = local.view(shape or (1,))
    for chunk in range(first // rows_per_chunk, (stop - 1) // rows_per_chunk + 1):
        lo, hi = chunk * rows_per_chunk, min(full[0], (chunk + 1) * rows_per_chunk)
        gen = torch.Generator().manual_seed(_seed(seed, name, chunk))
        values = torch.empty((hi - lo, *full[1:]), dtype=torch.float32).normal_(0.0, std, generator=gen)
        a, b = max(lo, first), min(hi, stop)  # the rows of this chunk that are ours
        part = values[a - lo:b - lo]
        for dim in range(1, len(full)):  # the other dims of our box
            part = part.narrow(dim, offset[dim], shape[dim])
        view[a - first:b - first].copy_(part)


@torch.no_grad()
def init_parameters(model: nn.Module, rule: Callable[[str], tuple[str, float]], seed: int,
                    aliases: dict[str, str] | None = None) -> int:
    """Initialise every parameter of `model` (sharded or not) by `rule(name) -> ("normal", std) | ("ones" | "zeros", 0)`;
    return the number of elements this rank drew. `aliases`: copies drawn as the parameter they copy."""
    drawn, aliases = 0, aliases or {}
    for name, p in model.named_parameters():
        name = canonical_name(name)
        name = aliases.get(name, name)
        kind, std = rule(name)
        local = p.to_local() if isinstance(p, DTensor) else p
        if kind in ("ones", "zeros"):
            local.fill_(1.0 if kind == "ones" else 0.0)
        elif kind == "normal":
            fill_normal(p, name, seed, std)
            drawn += local.numel()
        else:
            raise ValueError(f"unknown initialisation {kind!r} for {name}")
    return drawn
