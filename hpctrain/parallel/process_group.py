"""The process group: who this process is (torchrun, srun or our own launcher), NCCL settings, init and shutdown.

The same code for one process and for many; the device mesh over it is the layout's (`Layout.build_mesh`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hpctrain.core.slurm import hostnames, job_port, tasks_on_node


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


def launched_local_world() -> int | None:
    """Ranks the launcher started on this node: torchrun's (or our own launcher's) LOCAL_WORLD_SIZE, an srun step's
    tasks on this node; 1 where a launcher says only the world (or in a heterogeneous Slurm job); None when this
    process was started alone. (The points of a packed sweep are steps of their own: another point's ranks on the
    node are not counted.)"""
    e = os.environ
    if "LOCAL_WORLD_SIZE" in e:
        return int(e["LOCAL_WORLD_SIZE"])
    if launched_world() is None:
        return None
    if "SLURM_HET_SIZE" in e:  # (a heterogeneous job's lists are per component: not read)
        return 1
    return tasks_on_node(e.get("SLURM_STEP_TASKS_PER_NODE", ""), int(e.get("SLURM_NODEID", "0"))) or 1


def local_device_count() -> int:
    """Ranks this machine can start (for parallel.dp=auto): one per GPU, or one without. Counted through NVML
    (torch.cuda.device_count), not the CUDA runtime: the local launcher forks its ranks after this, and after a
    runtime call (torch.cuda.is_available() makes one unless PYTORCH_NVML_BASED_CUDA_CHECK=1) CUDA does not work
    in a forked child. (Where NVML cannot answer, no library or MIG devices in CUDA_VISIBLE_DEVICES, torch falls back
    to the runtime.)"""
    return torch.cuda.device_count() or 1


def node_name() -> str:
    """This process's node: Slurm's name for it (several slurmd daemons may share one host), else the host's."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


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
    e.setdefault("LOCAL_WORLD_SIZE", str(launched_local_world()))
    if "MASTER_ADDR" not in e:
        host = "127.0.0.1"
        nodes = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST")
        if nodes and shutil.which("scontrol"):
            host = (hostnames(nodes) or [host])[0]
        e["MASTER_ADDR"] = host
    e.setdefault("MASTER_PORT", str(job_port(int(e.get("SLURM_JOB_ID", "0")))))


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


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
