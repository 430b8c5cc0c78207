"""MoE layers on a layout: expert parallelism (parallel.ep), each layer's experts shared out over the "ep" ranks,
E/ep each, with the routed tokens exchanged by all-to-all around them; and under tensor parallelism the layer kept
whole on every tp rank (its parameters replicated DTensors, as the rest of a tp model is distributed). The
numbers one process computes.

The experts' weights become Shard(0) DTensors on the "ep" mesh: checkpoints hold whole [E, ...] tensors, so a run
resumes at any ep, and the gradient norm counts each expert once. The experts module's forward (tokens sorted by
expert, a count per expert: hpctrain.models.moe) becomes dispatch -> local experts -> combine:

- dispatch: the counts are exchanged (all-to-all of E integers), then the tokens (all-to-all with uneven splits):
  each rank receives, from every rank of its group, the tokens routed to its own experts, and regroups them by
  expert;
- combine: the inverse permutation and the inverse all-to-all; autograd runs both exchanges backwards
  (torch's functional all_to_all_single_autograd).

The module's class becomes a subclass with that forward, as FSDP2 does for its own: the model code stays
unaware of it. Under tp the experts (whole, or their ep share) are Replicate on the "tp" mesh and run on their
local pieces (the router and shared experts are replicated like the rest: parallelize.apply_tp_replicate): every
tp rank routes the same tokens the same way, and no gradient needs a tp reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from hpctrain.core.config import MoEDims
from hpctrain.models.moe import GroupedExperts, is_sparse, moe_layers, run_experts

WEIGHTS = ("w1", "w3", "w2")


class LocalExperts(GroupedExperts):
    """GroupedExperts whose weights are DTensors, run on this rank's pieces."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return run_experts(x, counts, *local_weights(self, x.dtype), grouped=self.grouped)


def local_weights(experts: GroupedExperts, dtype: torch.dtype) -> list[torch.Tensor]:
    """This rank's pieces of the experts' weights in the tokens' dtype: experts that FSDP does not manage (ep = dp)
    keep fp32 parameters where its mixed precision hands the others over in bf16."""
    return [getattr(experts, name).to_local().to(dtype) for name in WEIGHTS]


class ExpertParallelExperts(GroupedExperts):
    """GroupedExperts whose experts are shared out over `ep_group` (set by apply_experts)."""

    ep_group: dist.ProcessGroup

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group = self.ep_group
        ranks = dist.get_world_size(group)
        local = counts.numel() // ranks
        # Tokens each rank sends to each of my experts: [ranks, local]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        received = received.view(ranks, local)
        send = counts.view(ranks, local).sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()
        tokens = all_to_all_single_autograd(x, recv, send, group)
        # Arrived by source rank, then expert: regrouped expert by expert (stable: sources in rank order).
        segment = torch.repeat_interleave(torch.arange(ranks * local, device=x.device), received.flatten())
        order = ((segment % local) * ranks + segment // local).argsort(stable=True)
        out = run_experts(tokens[order], received.sum(dim=0), *local_weights(self, x.dtype), grouped=self.grouped)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_single_autograd(out[back], send, recv, group)


def apply_experts(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every MoE layer placed on the "ep" and "tp" dims of `mesh` (a no-op when both are 1)."""
    ep, tp = mesh["ep"].size(), mesh["tp"].size()
    if ep == 1 and tp == 1:
        return
    on, placements = (mesh["ep", "tp"], [Shard(0), Replicate()]) if ep > 1 and tp > 1 else \
        (mesh["ep"], [Shard(0)]) if ep > 1 else (mesh["tp"], [Replicate()])
    for _, layer in moe_layers(model):
        experts = layer.experts
        for name in WEIGHTS:
            weight = getattr(experts, name)
            experts.register_parameter(name, nn.Parameter(distribute_tensor(weight, on, placements)))
        experts.__class__ = ExpertParallelExperts if ep > 1 else LocalExperts
        if ep > 1:
            experts.ep_group = mesh["ep"].get_group()


def moe_tp_style(sequence_parallel: bool) -> PrepareModuleInputOutput | None:
    """An MoE layer under tensor parallelism: with sequence parallelism its input gathered from the sequence shards
    and its output cut back to this rank's (every tp rank computes the same whole output: the cut is local); without,
    nothing (its input is whole already)."""
    if not sequence_parallel:
        return None
    return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_input=True, output_layouts=(Replicate(),),
                                    desired_output_layouts=(Shard(1),), use_local_output=True)


def expert_modules(model: nn.Module) -> list[ExpertParallelExperts]:
    """The experts modules expert parallelism shares out (data parallelism reduces them over the rest of dp only)."""
    return [layer.experts for _, layer in moe_layers(model) if isinstance(layer.experts, ExpertParallelExperts)]


def all_to_all_bytes(moe: MoEDims, layers: list[int], dim: int, tokens: int, ep: int, c: int, recomputed: bool) -> float:
    """Bytes one device sends per step in its MoE layers' all-to-alls at even load: in each sparse layer of `layers`
    each of its `tokens` tokens' k choices leaves the rank with probability (ep−1)/ep, dispatched and combined (dim
    elements of c bytes), in forward, in backward (the same again) and in an activation checkpoint's
    recomputation."""
    sparse = sum(is_sparse(moe, i) for i in layers)
    return sparse * tokens * moe.top_k * (ep - 1) / ep * dim * c * 2 * (3 if recomputed else 2)
