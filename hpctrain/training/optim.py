"""Optimizer, learning-rate schedule and the LR scaling rule."""

from __future__ import annotations

import math

import torch
from torch import nn

from hpctrain.config import Decay, LrScaling, OptimImpl, OptimName


def scaled_lr(ocfg, global_batch: int) -> float:
    """`optim.lr` was tuned at `ref_global_batch`; scale it to this run's global batch."""
    ratio = global_batch / ocfg.ref_global_batch
    factor = {LrScaling.none: 1.0, LrScaling.linear: ratio, LrScaling.sqrt: math.sqrt(ratio)}[ocfg.lr_scaling]
    return ocfg.lr * factor


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # Decay matrices (linear and embedding weights) only: norm gains and biases are 1-D.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def implementation(ocfg, dtensors: bool) -> OptimImpl:
    """The kernels the optimizer runs: optim.implementation, except foreach for SGD over DTensor parameters
    (any dp or tp layout), for which torch 2.13 has no fused kernel (no sharding rule for aten._fused_sgd_)."""
    impl = OptimImpl(ocfg.implementation)
    return OptimImpl.foreach if impl == OptimImpl.fused and ocfg.name == OptimName.sgd and dtensors else impl


def build_optimizer(model: nn.Module, ocfg, lr: float) -> torch.optim.Optimizer:
    from torch.distributed.tensor import DTensor

    groups = param_groups(model, ocfg.weight_decay)
    # foreach: grouped kernels (one parameter-sized temporary); fused: one kernel, no temporary (AdamW and SGD,
    # CPU and CUDA). Adafactor has only foreach.
    dtensors = any(isinstance(p, DTensor) for group in groups for p in group["params"])
    impl = {"fused": True} if implementation(ocfg, dtensors) == OptimImpl.fused else {"foreach": True}
    if ocfg.name == OptimName.adamw:
        return torch.optim.AdamW(groups, lr=lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, **impl)
    if ocfg.name == OptimName.adafactor:
        return torch.optim.Adafactor(groups, lr=lr, eps=(None, ocfg.eps), foreach=True)
    if ocfg.name == OptimName.sgd:
        return torch.optim.SGD(groups, lr=lr, momentum=ocfg.momentum, nesterov=ocfg.momentum > 0, **impl)
    if ocfg.name == OptimName.lamb:
        from hpctrain.training.optimizers import Lamb

        return Lamb(groups, lr=lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, max_trust=ocfg.max_trust)
    if ocfg.name == OptimName.sophia:
        from hpctrain.training.optimizers import SophiaG

        return SophiaG(groups, lr=lr, betas=(ocfg.beta1, ocfg.beta2), rho=ocfg.rho, eps=ocfg.eps,
                       update_every=ocfg.update_every)
    raise ValueError(f"unknown optimizer {ocfg.name}")


def lr_factor(step: int, warmup: int, decay_steps: int, decay: Decay, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): linear warmup, then decay."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == Decay.constant or decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup) / decay_steps)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == Decay.cosine else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


def build_scheduler(optimizer, ocfg, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    decay_steps = ocfg.decay_steps if ocfg.decay_steps is not None else max_steps - ocfg.warmup_steps
    args = (ocfg.warmup_steps, decay_steps, ocfg.decay, ocfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, *args))
