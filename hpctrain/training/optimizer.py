"""Optimizer, learning-rate schedule and the LR scaling rule."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from hpctrain.core.config import Decay, OptimConfig, OptimImpl, OptimName
from hpctrain.core.memory import Term

log = logging.getLogger("hpctrain")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # Decay matrices (linear and embedding weights) only: norm gains and biases are 1-D.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def implementation(ocfg: OptimConfig, dtensors: bool) -> OptimImpl:
    """The kernels the optimizer runs: optim.implementation, except foreach for SGD over DTensor parameters
    (any dp or tp layout), for which torch 2.13 has no fused kernel (no sharding rule for aten._fused_sgd_)."""
    impl = OptimImpl(ocfg.implementation)
    return OptimImpl.foreach if impl == OptimImpl.fused and ocfg.name == OptimName.sgd and dtensors else impl


def state_bytes(ocfg: OptimConfig, params: int, factored: float) -> float:
    """The optimizer's state for `params` parameters: AdamW, LAMB, Sophia two fp32 moments (8·P); SGD with
    momentum 4·P; Adafactor 4·(rows + cols) per matrix and numel per vector (`factored` elements)."""
    name = OptimName(ocfg.name)
    return {OptimName.adamw: 8 * params, OptimName.lamb: 8 * params, OptimName.sophia: 8 * params,
            OptimName.sgd: 4 * params if ocfg.momentum > 0 else 0, OptimName.adafactor: 4 * factored}[name]


def memory_terms(ocfg: OptimConfig, params: int, factored: float, dtensors: bool, shard: int, on_host: bool) -> dict[str, Term]:
    """The state on the device, and the step's temporary: foreach kernels make one parameter-sized temporary (AdamW:
    the square root of the second moment, LAMB's update made from it in place), fused ones none. `shard`: the ranks
    sharing the state (ZeRO-2/3); `on_host`: FSDP CPU offload keeps both on the host."""
    plain_sgd = OptimName(ocfg.name) == OptimName.sgd and ocfg.momentum == 0
    temp = 0 if plain_sgd or implementation(ocfg, dtensors) == OptimImpl.fused else 4 * params
    if on_host:
        return {}
    return {"optim": Term.held(state_bytes(ocfg, params, factored) / shard), "opt_temp": Term(step=temp / shard)}


def step_passes(optimizer: torch.optim.Optimizer) -> list:
    """The passes an optimizer needs the train step to run before some steps (Sophia's curvature estimate)."""
    from hpctrain.training.lamb_sophia import CurvaturePass, SophiaG

    return [CurvaturePass(optimizer)] if isinstance(optimizer, SophiaG) else []


def build_optimizer(model: nn.Module, ocfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
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
        from hpctrain.training.lamb_sophia import Lamb

        return Lamb(groups, lr=lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, max_trust=ocfg.max_trust)
    if ocfg.name == OptimName.sophia:
        from hpctrain.training.lamb_sophia import SophiaG

        return SophiaG(groups, lr=lr, betas=(ocfg.beta1, ocfg.beta2), rho=ocfg.rho, eps=ocfg.eps,
                       update_every=ocfg.update_every)
    raise ValueError(f"unknown optimizer {ocfg.name}")


def lr_factor(step: int, warmup: int, decay_end: int, decay: Decay, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): linear warmup, then decay to `min_ratio` at
    step `decay_end` (a run shorter than its warmup never decays)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == Decay.constant or decay_end <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (decay_end - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == Decay.cosine else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


def build_scheduler(optimizer, ocfg: OptimConfig, max_steps: int) -> Schedule:
    decay_end = ocfg.decay_steps if ocfg.decay_steps is not None else max_steps
    args = (ocfg.warmup_steps, decay_end, ocfg.decay, ocfg.min_lr_ratio)
    return Schedule(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, *args)))


class Schedule:
    """The LR schedule, as the loop steps it and as checkpoints hold it. A checkpoint gives it only the step it
    is at: the peak LR and the schedule's shape are this run's settings (optim.*, train.max_steps), so a resumed run
    with a changed optim.lr trains with the new one from the resumed step on (said in the log), and no saved
    value (a crafted `base_lrs=-0.5`) can set the rate."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler

    def step(self) -> None:
        self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    @staticmethod
    def check(doc: dict) -> tuple[int, list[float]]:
        """(the step, the peak LRs) of a saved schedule; TypeError for a document that is not one."""
        from hpctrain.training.state import count, number

        if not isinstance(doc, dict) or not isinstance(doc.get("base_lrs"), list):
            raise TypeError("scheduler is not a saved LR schedule")
        return count(doc, "last_epoch"), [number({"base_lrs": lr}, "base_lrs") for lr in doc["base_lrs"]]

    def load_state_dict(self, doc: dict) -> None:
        """TypeError for a document that is not a saved schedule."""
        step, saved = self.check(doc)
        sched = self.scheduler
        if saved and max(abs(a - b) for a, b in zip(saved, sched.base_lrs)) > 1e-12 * max(sched.base_lrs):
            log.info("optim.lr: %.4g in the checkpoint, %.4g now: the new one applies from step %d", saved[0],
                     sched.base_lrs[0], step)
        sched.last_epoch, sched._step_count = step, step + 1
        for group, base, factor in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(step)
        sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]


def hyperparameters(optimizer) -> list[dict]:
    """Each parameter group's settings besides its parameters and the scheduled LR."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]


def reapply(optimizer, wanted: list[dict]) -> list[str]:
    """Put this run's settings (`hyperparameters` of the optimizer as built from optim.*) back over what a
    checkpoint's optimizer state brought; the keys that differed, e.g. ["betas (0.9, 0.95) -> (0.9, 0.99)"]."""
    changed = []
    for group, want in zip(optimizer.param_groups, wanted):
        for key, value in want.items():
            old = group.get(key)
            if (tuple(old) if isinstance(old, list) else old) != (tuple(value) if isinstance(value, list) else value):
                changed.append(f"{key} {old} -> {value}")
            group[key] = value
    return list(dict.fromkeys(changed))
