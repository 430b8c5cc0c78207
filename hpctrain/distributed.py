"""Process group and the ("pp", "dp", "tp") device mesh: the same code for one process and for many."""

from __future__ import annotations

import os
import shutil
import subprocess
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
    """World size given by torchrun/srun (or our own launcher), or None when this process was started alone."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and "SLURM_STEP_ID" in os.environ:
        return int(os.environ["SLURM_NTASKS"])  # a task of `srun`, not just a batch script in an allocation
    return None


def launched_rank() -> int:
    """This process's rank under torchrun/srun (or our own launcher); 0 when started alone."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return int(os.environ["SLURM_PROCID"]) if launched_world() else 0


def _slurm_env() -> None:
    """Map an srun task's variables onto the ones torch reads: rank, world, local rank, and the master at
    the allocation's first node on a port derived from the job id (same on every node, differs per job)."""
    e = os.environ
    if "RANK" in e or launched_world() is None:  # a plain batch script is not a rank, even with --ntasks
        return
    e["RANK"], e["WORLD_SIZE"] = e["SLURM_PROCID"], e["SLURM_NTASKS"]
    e.setdefault("LOCAL_RANK", e.get("SLURM_LOCALID", "0"))
    if "MASTER_ADDR" not in e:
        host = "127.0.0.1"
        nodes = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST")
        if nodes and shutil.which("scontrol"):
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True)
            host = (out.stdout.split() or [host])[0]
        e["MASTER_ADDR"] = host
    e.setdefault("MASTER_PORT", str(20000 + int(e.get("SLURM_JOB_ID", "0")) % 20000))


def apply_env(settings: dict[str, str | None] | None) -> dict[str, str]:
    """Export cluster.nccl before the process group starts (NCCL reads its variables then). A variable the
    job's environment already sets (a site module, the sbatch script) is kept. Returns {key: "value (source)"}."""
    effective = {}
    for key, value in (settings or {}).items():
        if key in os.environ:
            effective[key] = f"{os.environ[key]} (environment)"
        elif value is not None:
            os.environ[key] = str(value)
            effective[key] = f"{value} (cluster.nccl)"
    return effective


def init(timeout_s: float = 600.0) -> Env:
    """Join (or, alone, create) the default process group; gloo on CPU, NCCL on GPU."""
    _slurm_env()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        # One GPU per local rank; a site that binds GPUs per task (--gpus-per-task, --gpu-bind) shows each
        # rank only its own, as cuda:0.
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
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


def build_mesh(env: Env, pp: int, dp: int, tp: int, timeout_s: float = 600.0) -> DeviceMesh:
    mesh = init_device_mesh(env.device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
    # Sub-groups are created with c10d's default timeout (30 min), not the one of the default group:
    # set it on each, so a rank that dies or stalls makes the others fail within timeout_s.
    timeout = timedelta(seconds=timeout_s)
    for name in MESH_DIMS:
        group = mesh[name].get_group()
        if group is not dist.group.WORLD and dist.get_world_size(group) > 1:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    return mesh


def group_timeouts(mesh: DeviceMesh) -> dict[str, float]:
    """Timeout in seconds of each mesh dim's process group (CPU backend), for tests and diagnostics."""
    return {name: mesh[name].get_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name in MESH_DIMS}


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
