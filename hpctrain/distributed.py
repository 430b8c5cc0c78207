"""Process group and the ("pp", "dp", "tp") device mesh: the same code for one process and for many."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Env:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_world() -> int | None:
    """World size given by torchrun/srun, or None when this process was started on its own."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if key in os.environ and ("RANK" in os.environ or "SLURM_PROCID" in os.environ):
            return int(os.environ[key])
    return None


def init(timeout_s: float = 600.0) -> Env:
    """Join (or, alone, create) the default process group; gloo on CPU, NCCL on GPU."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # gloo for CPU-side collectives (e.g. checkpoint planning)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            # One process: an in-memory store, no port to pick or collide on.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return Env(rank, world, local_rank, device)


def build_mesh(env: Env, pp: int, dp: int, tp: int) -> DeviceMesh:
    return init_device_mesh(env.device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
