"""One optimizer step over the micro-batches of a global batch; the layout supplies it to the loop."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.precision import Precision


@dataclass
class StepResult:
    loss: float  # mean over every token of the global batch
    grad_norm: float
    status: str  # "ok" | "overflow" (fp16 scale backed off, step skipped) | "nonfinite" (skipped)
    loss_scale: float | None = None


def token_loss_sum(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy of a [B, T+1] block of tokens."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0)


class TrainStep:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                 grad_clip: float, device: torch.device):
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.grad_clip, self.device = grad_clip, device
        self.params = [p for p in model.parameters() if p.requires_grad]

    def __call__(self, micro_batches: list[torch.Tensor]) -> StepResult:
        scaler = self.precision.scaler
        # Normalise by the global batch's token count, not per micro-batch: 8×1 accumulation then
        # yields exactly the gradients of 1×8.
        n_tokens = sum(b.shape[0] * (b.shape[1] - 1) for b in micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            batch = batch.to(self.device, non_blocking=True)
            with self.precision.autocast():
                loss = token_loss_sum(self.model, batch) / n_tokens
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach().float()
        if scaler:
            scaler.unscale_(self.optimizer)
        norm = grad_norm(self.params)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, norm)
        loss_value, norm_value = total.item(), norm.item()
        if not math.isfinite(loss_value):
            status = "nonfinite"
            if scaler:
                scaler.update()  # closes this iteration's unscale_; backs off if grads overflowed
        elif scaler:
            scale = scaler.get_scale()
            scaler.step(self.optimizer)  # skips the update itself when grads hold inf/nan
            scaler.update()
            status = "overflow" if scaler.get_scale() < scale else "ok"
        elif not math.isfinite(norm_value):
            status = "nonfinite"
        else:
            self.optimizer.step()
            status = "ok"
        return StepResult(loss_value, norm_value, status, scaler.get_scale() if scaler else None)


@torch.no_grad()
def evaluate(model: nn.Module, batches, precision: Precision, device: torch.device) -> float:
    """Mean token loss over the given batches."""
    was_training = model.training
    model.eval()
    total, n = torch.zeros((), device=device, dtype=torch.float64), 0
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        with precision.autocast():
            total += token_loss_sum(model, batch).double()
        n += batch.shape[0] * (batch.shape[1] - 1)
    model.train(was_training)
    return (total / max(n, 1)).item()
