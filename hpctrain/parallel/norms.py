"""Norms of tensors that may be sharded (DTensor), equal to one process's: each rank sums the squares of its local
pieces, grouped by the mesh dims a piece is sharded over, and each group's sums are completed over exactly those
dims (a replicated piece is counted once). One collective per group and dim, whatever the number of tensors.
`all_finite` asks the same of their values: finite on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from hpctrain.parallel.vote import any_rank


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t` (`t` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _is_shard(placement) -> bool:
    # FSDP on top of TP shards the same dim twice: dp's piece is a _StridedShard, not a Shard subclass.
    return placement.is_shard() or isinstance(placement, _StridedShard)


def sharded_dims(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of `t`'s device mesh it is sharded over (none for a plain tensor or a replicated DTensor)."""
    if not isinstance(t, DTensor):
        return ()
    return tuple(i for i, pl in enumerate(t.placements) if _is_shard(pl))


def square_sums(tensors: list[torch.Tensor], like: list[torch.Tensor] | None = None) -> torch.Tensor:
    """[len(tensors)] float32: each tensor's global sum of squares (collective over the dims they are sharded on;
    every rank holding a piece of them calls it with the same list). `like`: where `tensors` are local pieces,
    the DTensors (parameters) whose placements they follow."""
    if not tensors:
        return torch.zeros(0)
    like = like or tensors
    out = torch.zeros(len(tensors), device=local(tensors[0]).device)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(like):
        mesh = t.device_mesh if isinstance(t, DTensor) else None
        groups.setdefault((id(mesh), sharded_dims(t)), []).append(i)
    for (_, dims), idx in groups.items():
        # One grouped (foreach) kernel per group instead of a Python loop over hundreds of tensors.
        pieces = [local(tensors[i]) for i in idx]
        sums = torch.stack(torch._foreach_norm(pieces, dtype=torch.float32)).square()
        mesh = like[idx[0]].device_mesh if dims else None
        for d in dims:
            if mesh.size(d) > 1:
                dist.all_reduce(sums, group=mesh.get_group(d))
        out[idx] = sums
    return out


def all_finite(tensors, group=None) -> bool:
    """Whether these tensors (DTensors: their local shards) are all finite on every rank of `group` (collective
    when distributed). One max-abs per tensor (NaN and inf carry through it): no tensor-sized temporaries."""
    pieces = [t for t in map(local, tensors) if t.numel()]
    norms = torch._foreach_norm(pieces, float("inf")) if pieces else []
    ok = bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()) if norms else True  # one host sync
    return not any_rank(not ok, group)
