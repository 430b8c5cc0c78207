"""The parallel layout: one object that owns the degrees of every parallel dimension.

It derives `parallel.dp=auto`, checks the degrees against each other and against the ranks there are,
places them on Slurm nodes (`job_shape`), and builds the named device mesh. The planner, the config
checks (`hpctrain.runs.resolve`), the launcher and the step builder all read it; nothing else multiplies
degrees. Model-specific rules (which sizes a tensor-parallel degree must divide, how layers split into
pipeline stages) are the model spec's (`hpctrain.models`).

A new dimension is a name in `DIMS`, a field here, and one `apply_*` function in `hpctrain.parallel.parallelize`.
Context parallelism (`cp`) splits every sequence over its ranks: they read the same samples (the data is split over
dp only) and add up their losses and gradients (over dp×cp: `reduce_mesh`, which FSDP shards over). Expert
parallelism (`ep`) multiplies nothing: it splits the data-parallel ranks, whose batches stay their own, into groups
of `ep` that share out each MoE layer's experts (the mesh's "ep" dim, inside "dp": dp = dp_mod_ep × ep, the ranks of
an ep group neighbours), as torchtitan and Megatron do.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from hpctrain.core.config import ClusterConfig, ConfigError, GradCompression, ParallelConfig, ReduceDtype

# Mesh order, outermost first: pipeline stages span nodes, tensor parallel stays inside one (fastest links).
DIMS = ("pp", "dp", "cp", "tp")
# The device mesh's dims: dp split in two (expert parallel inside), flattened back into "dp" (and, with cp, "dp_cp").
MESH_DIMS = ("pp", "dp_mod_ep", "ep", "cp", "tp")
_SHOWN = ("dp", "tp", "pp")  # the order messages and logs name them in (as the docs do)

# parallel.pp_schedule -> (torch.distributed.pipelining class, whether a rank holds several stages).
PP_SCHEDULES = {"gpipe": ("ScheduleGPipe", False), "1f1b": ("Schedule1F1B", False),
                "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
                "zero_bubble": ("ScheduleInterleavedZeroBubble", True)}


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """The consecutive layers of each pipeline stage (model chunk): as even as can be, the first n_layers % n_stages
    one layer longer (the last stages, which also hold the output head, the shorter: 126 layers over 16 stages are
    14 of 8 and 2 of 7)."""
    sizes = [n_layers // n_stages + (i < n_layers % n_stages) for i in range(n_stages)]
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def layer_map(n_layers: int, pp: int, v: int = 1) -> list[list[range]]:
    """Per pipeline rank, its chunks of contiguous layers: rank s of virtual round r holds chunk r·pp + s
    (`stage_layers`' split)."""
    chunks = stage_layers(n_layers, pp * v)
    return [[chunks[r * pp + s] for r in range(v)] for s in range(pp)]


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1  # stages per pipeline rank (interleaved schedules)
    ep: int = 1  # expert parallel: the data-parallel ranks that share each MoE layer's experts (divides dp)
    cp: int = 1  # context parallel: the ranks that share each sequence

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMS}

    @property
    def world(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def pp_stages(self) -> int:
        return self.pp * self.pp_virtual_stages

    def check_microbatches(self, n: int) -> None:
        """The step's `n` local micro-batches are the pipeline's micro-batches: what the schedule needs of them."""
        if not self.pipelined:
            return
        fix = "lower train.micro_batch or raise train.global_batch (the step's micro-batches are the pipeline's)"
        if self.pp_schedule != "gpipe" and n < self.pp:
            raise ConfigError(f"train.grad_accum={n} micro-batches per step must be >= parallel.pp={self.pp} for "
                              f"pp_schedule={self.pp_schedule}: {fix}")
        if self.pp_schedule in _PP_INTERLEAVED and n % self.pp:
            raise ConfigError(f"train.grad_accum={n} micro-batches per step must be a multiple of parallel.pp="
                              f"{self.pp} for pp_schedule={self.pp_schedule}: {fix}")

    def bubble(self, n: int) -> float:
        """The idle share of a pipelined step of `n` micro-batches: (pp−1)/(n·v + pp−1)."""
        return (self.pp - 1) / (n * self.pp_virtual_stages + self.pp - 1)

    def in_flight(self, stage: int, n: int) -> float:
        """Micro-batches whose activations pipeline stage `stage` holds at once, of `n` per step: GPipe all of
        them, 1F1B min(n, pp − stage), interleaved and zero-bubble schedules ×(1 + (pp−1)/(pp·v))."""
        if not self.pipelined:
            return 1.0
        if self.pp_schedule == "gpipe":
            return float(n)
        v = self.pp_virtual_stages
        return min(n, self.pp - stage) * (1 + (self.pp - 1) / (self.pp * v) if v > 1 else 1)

    @property
    def loss_parallel(self) -> bool:
        """The output head yields vocab-sharded logits: the loss must run under `loss_parallel()`."""
        return self.tp > 1

    def batch_mesh(self, mesh):
        """The ranks the global batch is split over (data parallel): each reads its own samples, FSDP shards over
        them, and gradients, loss and token counts are summed over them."""
        return dp_mesh(mesh)

    @property
    def reduce_ranks(self) -> int:
        """The size of `reduce_mesh`: dp×cp."""
        return self.dp * self.cp

    def reduce_mesh(self, mesh):
        """The ranks whose shares of the loss, token counts and gradients add up to the step's (FSDP shards over
        them): dp, and with context parallelism dp×cp (each cp rank holds part of every sequence)."""
        return flattened(mesh, "dp_cp") if self.cp > 1 else dp_mesh(mesh)

    def expert_mesh(self, mesh):
        """The ranks an expert shared out over "ep" adds its gradients over (FSDP shards it over them): the rest of
        dp ("dp_mod_ep"), times cp with context parallelism."""
        return flattened(mesh, "dp_mod_ep_cp") if self.cp > 1 else mesh["dp_mod_ep"]

    def describe(self) -> str:
        """`dp×tp×pp=2×2×1` (`dp×cp×tp×pp=...` when sequences are split, and `, ep=2` when experts are shared out)."""
        names = [name for name in ("dp", "cp", "tp", "pp") if name != "cp" or self.cp > 1]
        shown = "×".join(names) + "=" + "×".join(str(getattr(self, name)) for name in names)
        return shown + (f", ep={self.ep}" if self.ep > 1 else "")

    @classmethod
    def from_config(cls, p: ParallelConfig, world: int) -> Layout:
        """The layout of `parallel` (a ParallelConfig) on `world` ranks; ConfigError naming the fix."""
        for name in DIMS:
            if name != "dp" and getattr(p, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(p, name)} must be >= 1")
        dp = _dp(p, world, f"world size {world}")
        _check_schedule(p)
        if p.ep < 1 or dp % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} must divide the data-parallel degree dp={dp}: expert parallelism "
                              "shares each MoE layer's experts among data-parallel ranks; choose an ep that divides "
                              "dp (or more ranks)")
        layout = cls(pp=p.pp, dp=dp, tp=p.tp, pp_schedule=p.pp_schedule,
                     pp_virtual_stages=p.pp_virtual_stages if p.pp > 1 else 1, ep=p.ep, cp=p.cp)
        if layout.world != world:
            raise ConfigError(f"parallel {layout.describe()}={layout.world} does not match world size {world}")
        _check_sharding(p, layout)
        return layout

    def build_mesh(self, device_type: str, timeout_s: float = 600.0):
        """The named device mesh ("pp", "dp_mod_ep", "ep", "cp", "tp", and flattened "dp" = dp_mod_ep × ep and
        "dp_cp" = dp × cp); every group fails within `timeout_s` when a rank dies."""
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp // self.ep, self.ep, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        flat = {"dp": mesh["dp_mod_ep", "ep"]._flatten("dp")}
        if self.cp > 1:
            flat["dp_cp"] = mesh["dp_mod_ep", "ep", "cp"]._flatten("dp_cp")
            flat["dp_mod_ep_cp"] = mesh["dp_mod_ep", "cp"]._flatten("dp_mod_ep_cp")
        _FLATTENED[id(mesh)] = weakref.ref(mesh), flat
        # Sub-groups are created with c10d's default timeout (30 min), not the one of the default group.
        timeout = timedelta(seconds=timeout_s)
        for group in [mesh[name].get_group() for name in MESH_DIMS] + [m.get_group() for m in flat.values()]:
            if group is not dist.group.WORLD and dist.get_world_size(group) > 1:
                dist.distributed_c10d._set_pg_timeout(timeout, group)
        return mesh


# id(root mesh) -> (the root, its flattened meshes by name): torch asks callers to keep a flattened mesh themselves
# (slicing it from the root is deprecated). By identity: meshes compare equal by their ranks, across runs of a process
# too.
_FLATTENED: dict[int, tuple] = {}


def _flattened_of(mesh) -> dict | None:
    """The flattened meshes `Layout.build_mesh` made for `mesh` (by name), or None for a mesh it did not make."""
    root, flat = _FLATTENED.get(id(mesh), (lambda: None, {}))
    return flat if root() is mesh else None


def flattened(mesh, name: str):
    """The flattened mesh `name` ("dp", "dp_cp") of a mesh `Layout.build_mesh` made."""
    flat = _flattened_of(mesh)
    return flat[name] if flat is not None else mesh[name]


def dp_mesh(mesh):
    """The "dp" mesh (dp_mod_ep × ep flattened) of a mesh `Layout.build_mesh` made."""
    return flattened(mesh, "dp")


def group_timeouts(mesh) -> dict[str, float]:
    """Timeout in seconds of each mesh dim's process group (CPU backend), for tests and diagnostics."""
    import torch

    meshes = {name: mesh[name] for name in MESH_DIMS} | (_flattened_of(mesh) or {"dp": dp_mesh(mesh)})
    return {name: m.get_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, m in meshes.items()}


def _replica(p: ParallelConfig) -> tuple[int, str]:
    """Ranks of one model replica (every dimension but dp) of a ParallelConfig, and how to name them."""
    others = [name for name in _SHOWN if name != "dp"] + (["cp"] if p.cp > 1 else [])
    sizes = [getattr(p, name) for name in others]
    return math.prod(sizes), "×".join(others) + "=" + "×".join(map(str, sizes))


def _dp(p: ParallelConfig, ranks: int, what: str) -> int:
    """parallel.dp as a number; `auto`: what the other dimensions leave of `ranks` (named `what`)."""
    others, named = _replica(p)
    if p.dp == "auto":
        if ranks % others:
            raise ConfigError(f"parallel.dp=auto: {what} is not divisible by {named}")
        return ranks // others
    try:
        dp = int(p.dp)
    except ValueError:
        raise ConfigError(f"parallel.dp={p.dp!r} must be a positive integer or 'auto'") from None
    if dp < 1:
        raise ConfigError(f"parallel.dp={dp} must be >= 1")
    return dp


def world_of(p: ParallelConfig, available: int) -> int:
    """Ranks the layout takes when `available` are there: dp·tp·pp, with dp=auto filling them (at least one
    replica). For a layout that cannot be read, 1: `Layout.from_config` names the bad value."""
    try:
        others = _replica(p)[0]
        return (max(1, available // others) if p.dp == "auto" else int(p.dp)) * others
    except (ValueError, TypeError, ZeroDivisionError):
        return 1


def job_shape(p: ParallelConfig, c: ClusterConfig) -> dict[str, int | None]:
    """Slurm shape of a run: nodes, tasks per node (= ranks), GPUs per node; ConfigError if it cannot fit."""
    per_node = c.gpus_per_node or c.tasks_per_node
    what = "cluster.gpus_per_node" if c.gpus_per_node else "cluster.tasks_per_node"
    if per_node < 1:
        raise ConfigError(f"{what}={per_node} must be >= 1")
    if p.dp == "auto" and not c.nodes:  # fill the nodes asked for
        raise ConfigError("parallel.dp=auto on Slurm needs cluster.nodes (or set parallel.dp)")
    others, named = _replica(p)
    if p.dp == "auto" and per_node % others:
        raise ConfigError(f"parallel.dp=auto: {what}={per_node} is not a multiple of {named}")
    world = _dp(p, (c.nodes or 1) * per_node, f"{what}={per_node}") * others
    nodes, tasks = (1, world) if world <= per_node else (world // per_node, per_node)
    if nodes * tasks != world:
        raise ConfigError(f"{'×'.join(_SHOWN)}={world} ranks do not fill whole nodes of {per_node} ({what}): make the "
                          f"layout a multiple of {per_node} ranks")
    if c.nodes and c.nodes != nodes:
        raise ConfigError(f"cluster.nodes={c.nodes} but the layout {'×'.join(_SHOWN)}={world} needs {nodes} node(s) of "
                          f"{per_node} ranks: drop cluster.nodes or change parallel.dp")
    return {"nodes": nodes, "tasks_per_node": tasks, "gpus_per_node": tasks if c.gpus_per_node else None}


def min_nodes(p: ParallelConfig, c: ClusterConfig) -> int | None:
    """cluster.min_nodes where it lets the run shrink (below the job's nodes): the fewest healthy nodes it goes on
    with when nodes fail; ConfigError if it cannot."""
    if c.min_nodes is None:
        return None
    nodes = job_shape(p, c)["nodes"]
    if p.dp != "auto":
        raise ConfigError(f"cluster.min_nodes={c.min_nodes} goes on on fewer nodes by shrinking dp: set "
                          "parallel.dp=auto (with cluster.nodes), or drop cluster.min_nodes")
    if c.min_nodes > nodes:
        raise ConfigError(f"cluster.min_nodes={c.min_nodes} is more than the run's {nodes} node(s): make it at most "
                          f"{nodes}, or drop it")
    return c.min_nodes if c.min_nodes < nodes else None


def restarts_in_allocation(p: ParallelConfig, c: ClusterConfig) -> bool:
    """Whether the run restarts inside its own allocation when a node fails (cluster.spare_nodes, or shrinking to
    cluster.min_nodes): a supervisor runs it as srun steps, in a job a lost node must not end; ConfigError as
    min_nodes."""
    return bool(c.spare_nodes or min_nodes(p, c))


_PP_INTERLEAVED = tuple(name for name, (_, multi) in PP_SCHEDULES.items() if multi)


def _check_schedule(p: ParallelConfig) -> None:
    """Pipeline schedule and virtual stages."""
    pp, v, sched = p.pp, p.pp_virtual_stages, p.pp_schedule
    if sched not in PP_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={sched!r} is not one of {', '.join(PP_SCHEDULES)}")
    if pp == 1:
        return
    if sched in _PP_INTERLEAVED and v < 2:
        raise ConfigError(f"parallel.pp_schedule={sched} needs parallel.pp_virtual_stages >= 2 (got {v}): "
                          "raise it or use pp_schedule=1f1b")
    if sched not in _PP_INTERLEAVED and v != 1:
        raise ConfigError(f"parallel.pp_schedule={sched} runs one stage per rank: parallel.pp_virtual_stages={v} "
                          "must be 1, or use pp_schedule=interleaved_1f1b")


def _check_sharding(p: ParallelConfig, layout: Layout) -> None:
    """How the dimensions are applied: ZeRO stage, offload, sequence parallel."""
    if layout.pipelined and p.pp_schedule == "zero_bubble" and layout.dp > 1 and p.zero_stage == 3:
        # Measured: its split weight-gradient pass does not match one process with parameters resharded.
        raise ConfigError("parallel.pp_schedule=zero_bubble with parallel.zero_stage=3 and dp > 1 gives wrong "
                          "gradients: use zero_stage=2 (or 0), or pp_schedule=interleaved_1f1b")
    if p.zero_stage not in (0, 2, 3):
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} must be 0 (replicate), 2 (shard gradients and "
                          "optimizer state) or 3 (shard parameters too)")
    if p.cpu_offload and (p.zero_stage != 3 or layout.dp == 1):
        raise ConfigError(f"parallel.cpu_offload needs parallel.zero_stage=3 and dp > 1 (got zero_stage="
                          f"{p.zero_stage}, dp={layout.dp}): set parallel=fsdp or parallel.cpu_offload=false")
    if p.cpu_offload and layout.ep > 1 and layout.dp // layout.ep * layout.cp == 1:
        raise ConfigError(f"parallel.cpu_offload with parallel.ep={layout.ep} = dp: each rank holds its experts whole, "
                          "outside FSDP, so they would stay on the device (most of an MoE model's memory) while the "
                          "plan counted them offloaded: use an ep below dp (FSDP shards and offloads the experts over "
                          "the rest of dp), or parallel.cpu_offload=false")
    if layout.ep > 1 and (p.zero_stage == 0 or GradCompression(p.grad_compression).value != "none"):
        raise ConfigError(f"parallel.ep={layout.ep} needs a sharded data parallel (zero_stage 2 or 3, no "
                          "grad_compression): the experts' gradients are reduced over the rest of dp only; use "
                          "parallel=fsdp")
    if layout.cp > 1 and GradCompression(p.grad_compression).value != "none":
        raise ConfigError(f"parallel.cp={layout.cp} with grad_compression: not supported yet (the compressed "
                          "gradients are summed over dp only); use cp=1 or grad_compression=none")
    if p.sequence_parallel and layout.tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1: set parallel.tp or drop it")
    method = GradCompression(p.grad_compression).value
    if method != "none":
        if p.zero_stage != 0:
            raise ConfigError(f"parallel.grad_compression={method} compresses ZeRO-0's all-reduce; zero_stage="
                              f"{p.zero_stage} reduce-scatters gradient shards, which it cannot: set parallel=ddp "
                              "(zero_stage=0), or grad_compression=none (grad_reduce_dtype=bf16 halves any stage's "
                              "bytes)")
        if layout.tp > 1 or layout.pp > 1:
            raise ConfigError(f"parallel.grad_compression={method} needs tp=1 and pp=1 (got tp={layout.tp}, pp="
                              f"{layout.pp}): it exchanges whole gradients of a replicated model; use "
                              "grad_compression=none with this layout")
        if method == "powersgd" and p.compression_start_step < 2:
            # torch's PowerSGD: its error feedback and warm start need two plain steps first.
            raise ConfigError(f"parallel.compression_start_step={p.compression_start_step} with grad_compression="
                              "powersgd must be >= 2 (PowerSGD starts after two plain all-reduce steps)")
        reduce_dtype = ReduceDtype(p.grad_reduce_dtype).value
        if reduce_dtype != "fp32":
            raise ConfigError(f"parallel.grad_compression={method} exchanges its compressed gradients in fp32: drop "
                              f"parallel.grad_reduce_dtype={reduce_dtype} (or the compression)")
    if p.compile and layout.tp > 1:
        # Measured on torch 2.13 (CPU, gloo): a compiled block hands a plain tensor to DTensor's redistribute in
        # the first backward. Upstream: compiled backward expecting DTensor tangents, pytorch/pytorch#143134.
        raise ConfigError(f"parallel.compile=true with parallel.tp={layout.tp} fails in the first backward on this "
                          "torch ('Tensor' object has no attribute '_local_tensor', pytorch/pytorch#143134): set "
                          "parallel.compile=false, or compile without tensor parallelism")
