"""Precision modes: matmul precision, autocast and the fp16 loss scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hpctrain.config import PrecisionName


@dataclass
class Precision:
    autocast_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None
    device_type: str

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)


def compute_dtype(pcfg) -> torch.dtype | None:
    """The low-precision compute dtype of precision=bf16|fp16; None for fp32 and tf32."""
    return {PrecisionName.bf16: torch.bfloat16, PrecisionName.fp16: torch.float16}.get(PrecisionName(pcfg.name))


def setup_precision(pcfg, device: torch.device) -> Precision:
    name = PrecisionName(pcfg.name)
    # fp32 means fp32: PyTorch would otherwise let cuBLAS/cuDNN pick TF32 on Ampere+.
    torch.backends.cuda.matmul.allow_tf32 = name == PrecisionName.tf32
    torch.backends.cudnn.allow_tf32 = name == PrecisionName.tf32
    torch.set_float32_matmul_precision("high" if name == PrecisionName.tf32 else "highest")
    dtype = compute_dtype(pcfg)
    scaler = None
    if name == PrecisionName.fp16:
        scaler = torch.amp.GradScaler(
            device.type, init_scale=pcfg.loss_scale_init, growth_interval=pcfg.loss_scale_growth_interval
        )
    return Precision(dtype, scaler, device.type)
