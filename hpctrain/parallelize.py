"""Apply a parallel layout to a model, as small functions in a fixed order.

Order (torchtitan's, for the reasons it gives): pipeline split -> tensor/sequence parallel ->
activation checkpointing -> compile -> FSDP on the "dp" mesh dim -> pipeline schedule. Every
function is a no-op for its dimension of size 1, so one process runs the same path as many.
Multi-process dimensions (pp, tp, dp sharding) arrive with the 3D-parallelism work.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.config import ActCkpt


def apply_activation_checkpointing(model: nn.Module, mode: ActCkpt, every: int) -> None:
    """Recompute block activations in backward: `full` for every block, `selective` every N-th."""
    if mode == ActCkpt.none:
        return
    for i, (name, block) in enumerate(model.layers.named_children()):
        if mode == ActCkpt.full or i % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_compile(model: nn.Module, enabled: bool) -> None:
    """Compile each block separately: identical blocks share one compiled graph, cold start stays short."""
    if not enabled:
        return
    for block in model.layers.children():
        block.compile(fullgraph=True)  # in place: parameter names keep no `_orig_mod.` prefix


def parallelize(model: nn.Module, mesh: DeviceMesh, pcfg) -> nn.Module:
    apply_activation_checkpointing(model, pcfg.activation_checkpointing, pcfg.ac_every)
    apply_compile(model, pcfg.compile)
    return model
