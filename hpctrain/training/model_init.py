"""The run's model on its layout, with the weights one process would draw."""

from __future__ import annotations

import torch

from hpctrain.models import ModelSpec
from hpctrain.parallel.layout import Layout
from hpctrain.parallel.parallelize import parallelize


def build_model(cfg, spec: ModelSpec, layout: Layout, device: torch.device, mesh) -> torch.nn.Module:
    """Build on the meta device, parallelize, then allocate: each rank only materialises its shard."""
    args = spec.args(cfg.model)
    with torch.device("meta"):
        model = spec.build(args)
    model = parallelize(model, layout, mesh, cfg.parallel, spec)
    model.to_empty(device=device)
    if layout.world == 1:
        torch.manual_seed(cfg.train.seed)
        model.init_weights()
        return model.train()
    # Shards drawn locally would not match the one-process weights: rank 0 draws the whole model exactly
    # as one process does (on CPU) and every rank receives its shards. Identical weights for every layout.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.init_buffers()
    model.tie_weights()
    full = {}
    if torch.distributed.get_rank() == 0:
        with torch.device("meta"):
            ref = spec.build(args)
        ref.to_empty(device="cpu")
        torch.manual_seed(cfg.train.seed)
        ref.init_weights()
        full = ref.state_dict()
    # Every key is broadcast; a pipeline stage keeps its own (rank 0's full dict holds the other stages' too).
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=not layout.pipelined))
    return model.train()
