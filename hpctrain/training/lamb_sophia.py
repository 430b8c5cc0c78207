"""Optimizers PyTorch does not ship, written for sharded parameters: LAMB and Sophia.

They update each rank's local pieces with grouped (foreach) kernels, so a DTensor parameter (FSDP2, tensor
parallel) and its state stay DTensors (checkpoints reshard them across layouts), and compute what needs a whole
parameter (LAMB's trust ratio) from global norms (`hpctrain.parallel.norms`): the same update as one process.
Sophia's curvature estimate needs a forward and backward of its own: `CurvaturePass`, a pass the train step runs
before the steps it is due at (`hpctrain.training.step.StepPass`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hpctrain.parallel.norms import all_finite, local, square_sums
from hpctrain.training.step import settle_pending_sums

log = logging.getLogger("hpctrain")


class _PerPiece(torch.optim.Optimizer):
    """The common part: each parameter's state (a step count and zero `BUFFERS` shaped, and for a DTensor sharded,
    like it) made at its first step, and `_update` called per group with the parameters that have gradients."""

    BUFFERS: tuple[str, ...] = ()

    def _state(self, params: list[torch.Tensor]) -> list[dict]:
        states = []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                for name in self.BUFFERS:
                    st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states.append(st)
        return states

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                states = self._state(params)
                torch._foreach_add_([st["step"] for st in states], 1.0)
                self._update(group, params, states)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor], states: list[dict]) -> None:
        raise NotImplementedError


class Lamb(_PerPiece):
    """LAMB: You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes" (ICLR),
    Algorithm 2. Adam's bias-corrected update u = m̂ / (√v̂ + eps) + weight_decay · w (decoupled: the group's
    weight decay, 0 for norms and biases), scaled per parameter by the trust ratio ‖w‖ / ‖u‖ (1 when either is 0,
    at most `max_trust`), so that every layer moves by about lr times its own scale whatever the batch size.
    ‖w‖ and ‖u‖ are over the whole parameter, not a rank's shard."""

    BUFFERS = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, max_trust: float = 10.0):
        if lr <= 0 or eps <= 0 or not all(0 <= b < 1 for b in betas) or max_trust <= 0:
            raise ValueError(f"Lamb: lr={lr}, betas={betas}, eps={eps}, max_trust={max_trust} out of range")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "max_trust": max_trust})

    def _update(self, group: dict, params: list[torch.Tensor], states: list[dict]) -> None:
        beta1, beta2 = group["betas"]
        t = float(states[0]["step"])  # every parameter of a group steps together
        w = [local(p) for p in params]
        g = [local(p.grad) for p in params]
        m = [local(st["exp_avg"]) for st in states]
        v = [local(st["exp_avg_sq"]) for st in states]
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, (1 - beta2 ** t) ** 0.5)
        torch._foreach_add_(denom, group["eps"])
        # The update made in place of the denominator: one parameter-sized temporary, as foreach AdamW.
        update = denom
        torch._foreach_reciprocal_(update)
        torch._foreach_mul_(update, m)
        torch._foreach_div_(update, 1 - beta1 ** t)
        if group["weight_decay"]:
            torch._foreach_add_(update, w, alpha=group["weight_decay"])
        w_norm, u_norm = square_sums(params).sqrt(), square_sums(update, like=params).sqrt()
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp(min=1e-30),
                            torch.ones_like(w_norm)).clamp(max=group["max_trust"])
        torch._foreach_mul_(update, (-group["lr"] * trust).tolist())  # one host sync per group and step
        torch._foreach_add_(w, update)


class SophiaG(_PerPiece):
    """Sophia with the Gauss-Newton-Bartlett estimator: Liu et al. 2023, "Sophia: A Scalable Stochastic
    Second-order Optimizer for Language Model Pre-training" (ICLR 2024), Algorithm 3, as the authors' SophiaG
    implementation scales it.

    Every `update_every` steps the train step runs a curvature pass: the loss of labels sampled from the model's
    own predictions, over the step's batch of B tokens, whose gradient ĝ gives the diagonal estimate B·ĝ⊙ĝ;
    `update_curvature` folds it into h (an EMA with beta2). Each step: m ← beta1·m + (1−beta1)·g;
    w ← w·(1 − lr·weight_decay) (decoupled, the group's: 0 for norms and biases);
    w ← w − lr·sign(m)·min(|m| / (rho·h + eps), 1), so no coordinate moves more than lr per step."""

    BUFFERS = ("exp_avg", "hessian")

    def __init__(self, params, lr: float = 3e-4, betas: tuple[float, float] = (0.965, 0.99), rho: float = 0.04,
                 eps: float = 1e-15, weight_decay: float = 0.0, update_every: int = 10):
        if lr <= 0 or eps <= 0 or rho <= 0 or update_every < 1 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"SophiaG: lr={lr}, betas={betas}, rho={rho}, eps={eps}, update_every={update_every} "
                             "out of range")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "rho": rho, "eps": eps,
                                  "weight_decay": weight_decay, "update_every": update_every})

    def steps_taken(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                if self.state[p]:
                    return int(self.state[p]["step"])
        return 0

    def wants_curvature(self) -> bool:
        """Whether the coming step needs a curvature pass first (its first step, then every `update_every`)."""
        return self.steps_taken() % self.param_groups[0]["update_every"] == 0

    @torch.no_grad()
    def update_curvature(self, tokens: int) -> None:
        """h ← beta2·h + (1−beta2)·tokens·ĝ⊙ĝ, from the gradients the curvature pass left (of its loss averaged over
        `tokens` sampled labels)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            h = [local(st["hessian"]) for st in self._state(params)]
            g = [local(p.grad) for p in params]
            torch._foreach_mul_(h, group["betas"][1])
            torch._foreach_addcmul_(h, g, g, value=(1 - group["betas"][1]) * tokens)

    def _update(self, group: dict, params: list[torch.Tensor], states: list[dict]) -> None:
        w = [local(p) for p in params]
        g = [local(p.grad) for p in params]
        m = [local(st["exp_avg"]) for st in states]
        h = [local(st["hessian"]) for st in states]
        torch._foreach_lerp_(m, g, 1 - group["betas"][0])
        if group["weight_decay"]:
            torch._foreach_mul_(w, 1 - group["lr"] * group["weight_decay"])
        # min(|m| / (rho·h + eps), 1) · sign(m), in one temporary
        ratio = torch._foreach_mul(h, group["rho"])
        torch._foreach_add_(ratio, group["eps"])
        torch._foreach_reciprocal_(ratio)
        torch._foreach_mul_(ratio, m)
        torch._foreach_clamp_min_(ratio, -1.0)
        torch._foreach_clamp_max_(ratio, 1.0)
        torch._foreach_add_(w, ratio, alpha=-group["lr"])


def sampled_labels(logits: torch.Tensor, tokens: torch.Tensor, salt: int) -> torch.Tensor:
    """[B, T] labels drawn from the model's own predictive distribution, softmax(logits [B, T, V]), one row at a
    time with a generator seeded by `salt` and the row's tokens [B, T+1]: every layout draws the same labels for the
    same sample (the vocab-sharded logits of tensor parallelism are gathered first)."""
    logits = logits.detach()
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    # Non-finite logits give non-finite curvature gradients, which the step then discards on every rank; here they
    # must not stop multinomial on one rank while the others wait in a collective.
    full = torch.nan_to_num(full.float(), nan=0.0, posinf=0.0, neginf=0.0)
    weights = (torch.arange(1, tokens.shape[1] + 1, device=tokens.device) * 2654435761) % 2**31
    seeds = ((tokens.long() * weights).sum(1) + salt * 1_000_003) % 2**62
    labels = torch.empty(full.shape[:2], dtype=torch.long, device=full.device)
    for i, seed in enumerate(seeds.tolist()):
        gen = torch.Generator(device=full.device).manual_seed(seed)
        labels[i] = torch.multinomial(torch.softmax(full[i], -1), 1, generator=gen).squeeze(-1)
    return labels


def sampled_token_loss_sum(model: nn.Module, batch: torch.Tensor, salt: int, documents=None) -> torch.Tensor:
    """Summed cross entropy against labels sampled from the model itself (`sampled_labels`): the loss whose
    gradient gives Sophia's Gauss-Newton-Bartlett curvature estimate (`documents`: the step's DocumentMask)."""
    logits = model(batch[:, :-1], **(documents.kwargs(batch[:, :-1]) if documents is not None else {}))
    labels = sampled_labels(logits, batch, salt)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


class CurvaturePass:
    """Sophia's curvature estimate, a StepPass: at its first step and then every `update_every` steps, the loss of
    labels sampled from the model over the step's batch, whose gradients `update_curvature` folds into h."""

    def __init__(self, optimizer: SophiaG):
        self.optimizer = optimizer

    def due(self) -> bool:
        return self.optimizer.wants_curvature()

    def run(self, step, micro_batches: list[torch.Tensor], n_tokens: int) -> None:
        salt = self.optimizer.steps_taken()
        step._forward_backward(micro_batches, n_tokens, lambda b: sampled_token_loss_sum(step.model, b, salt, step.documents))
        settle_pending_sums(step.params)
        if all_finite([p.grad for p in step.params if p.grad is not None]):  # every rank takes the same way
            self.optimizer.update_curvature(n_tokens)
        else:
            log.warning("the curvature estimate of step %d is not finite: Sophia keeps its previous one", salt + 1)
