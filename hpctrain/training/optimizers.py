"""Optimizers PyTorch does not ship, written for sharded parameters: LAMB.

They update each rank's local pieces with grouped (foreach) kernels, so a DTensor parameter (FSDP2, tensor
parallel) and its state stay DTensors (checkpoints reshard them across layouts), and compute what needs a whole
parameter (LAMB's trust ratio) from global norms (`hpctrain.parallel.norms`): the same update as one process.
"""

from __future__ import annotations

import torch

from hpctrain.parallel.norms import local, square_sums


class Lamb(torch.optim.Optimizer):
    """LAMB: You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes" (ICLR),
    Algorithm 2. Adam's bias-corrected update u = m̂ / (√v̂ + eps) + weight_decay · w (decoupled: the group's
    weight decay, 0 for norms and biases), scaled per parameter by the trust ratio ‖w‖ / ‖u‖ (1 when either is 0,
    at most `max_trust`), so that every layer moves by about lr times its own scale whatever the batch size.
    ‖w‖ and ‖u‖ are over the whole parameter, not a rank's shard."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, max_trust: float = 10.0):
        if lr <= 0 or eps <= 0 or not all(0 <= b < 1 for b in betas) or max_trust <= 0:
            raise ValueError(f"Lamb: lr={lr}, betas={betas}, eps={eps}, max_trust={max_trust} out of range")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "max_trust": max_trust})

    def _state(self, params: list[torch.Tensor]) -> list[dict]:
        states = []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
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
            if not params:
                continue
            states = self._state(params)
            beta1, beta2 = group["betas"]
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1.0)
            t = float(steps[0])  # every parameter of a group steps together
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
        return loss
