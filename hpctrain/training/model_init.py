"""The run's model on its layout, with the weights one process would draw."""

from __future__ import annotations

import torch

from hpctrain.models import ModelSpec
from hpctrain.parallel.init import init_parameters
from hpctrain.parallel.layout import Layout
from hpctrain.parallel.parallelize import parallelize
from hpctrain.training.precision import compute_dtype


def build_model(cfg, spec: ModelSpec, layout: Layout, device: torch.device, mesh) -> torch.nn.Module:
    """Build on the meta device, parallelize, then allocate and initialise: each rank materialises and draws only
    its shards, with the values one process draws (`hpctrain.parallel.init`). No full copy on any rank."""
    args = spec.args(cfg.model)
    with torch.device("meta"):
        model = spec.build(args)
    model = parallelize(model, layout, mesh, cfg.parallel, spec, compute_dtype(cfg.precision))
    model.to_empty(device=device)
    model.init_buffers()
    model.tie_weights()
    init_parameters(model, spec.init_rule(args), cfg.train.seed)
    return model.train()
