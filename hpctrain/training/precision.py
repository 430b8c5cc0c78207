"""Precision modes: matmul precision, autocast and the fp16 loss scaler."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpctrain.core.config import MAX_LOSS_SCALE, PrecisionConfig, PrecisionName


@dataclass
class Precision:
    autocast_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None
    device_type: str

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)


class AgreedGradScaler(torch.amp.GradScaler):
    """fp16 loss scaling with one scale for every rank of a multi-process layout.

    Each rank unscales the pieces of the gradients it holds (a DTensor's local shard: tensor parallelism and FSDP2
    shard them), and an inf/nan anywhere is an overflow everywhere: the found-inf flag is all-reduced (MAX) over
    all ranks, so every rank skips the same steps and backs the scale off alike. One process: plain GradScaler.
    """

    @staticmethod
    def check(doc: dict) -> tuple[float, int]:
        """(scale, growth tracker) of a saved scaler; TypeError for a document that is not one."""
        from hpctrain.training.state import count, number

        if not isinstance(doc, dict):
            raise TypeError("scaler is not an object")
        return number(doc, "scale", math.ulp(0.0), MAX_LOSS_SCALE), count(doc, "_growth_tracker")

    def load_state_dict(self, state_dict: dict) -> None:
        """A checkpoint's scale and growth tracker, checked (TypeError); the growth settings stay this run's
        (precision.loss_scale_growth_interval applies on resume)."""
        scale, tracker = self.check(state_dict)
        super().load_state_dict({**self.state_dict(), "scale": scale, "_growth_tracker": tracker})

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                        by_dtype.setdefault(g.dtype, []).append(g)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)  # on the gradients' device: gloo CPU, NCCL GPU
        return {found_inf.device: found_inf}


def compute_dtype(pcfg: PrecisionConfig) -> torch.dtype | None:
    """The low-precision compute dtype of precision=bf16|fp16; None for fp32 and tf32."""
    return {PrecisionName.bf16: torch.bfloat16, PrecisionName.fp16: torch.float16}.get(PrecisionName(pcfg.name))


def setup_precision(pcfg: PrecisionConfig, device: torch.device) -> Precision:
    name = PrecisionName(pcfg.name)
    # fp32 means fp32: PyTorch would otherwise let cuBLAS/cuDNN pick TF32 on Ampere+.
    torch.backends.cuda.matmul.allow_tf32 = name == PrecisionName.tf32
    torch.backends.cudnn.allow_tf32 = name == PrecisionName.tf32
    torch.set_float32_matmul_precision("high" if name == PrecisionName.tf32 else "highest")
    dtype = compute_dtype(pcfg)
    scaler = None
    if name == PrecisionName.fp16:
        scaler = AgreedGradScaler(
            device.type, init_scale=pcfg.loss_scale_init, growth_interval=pcfg.loss_scale_growth_interval
        )
    return Precision(dtype, scaler, device.type)
