"""Apply a parallel layout to a model, as small functions in a fixed order.

Order (torchtitan's, for the reasons it gives): pipeline split -> tensor/sequence parallel -> expert parallel ->
context parallel -> activation checkpointing -> compile -> FSDP on the "dp" (×"cp") ranks -> pipeline schedule. Every
function is a no-op for its dimension of size 1, so one process runs the same path as many.
What is model-specific (module names, the tensor-parallel plan) comes from the model's spec.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from hpctrain.core.config import ActCkpt, GradCompression, ParallelConfig, ReduceDtype
from hpctrain.core.memory import Term
from hpctrain.models import ModelSpec
from hpctrain.models.moe import MoE
from hpctrain.parallel.compression import apply_grad_compression
from hpctrain.parallel.context import apply_cp
from hpctrain.parallel.experts import apply_experts, expert_modules, moe_tp_style
from hpctrain.parallel.layout import Layout, stage_layers

# parallel.grad_reduce_dtype
REDUCE_DTYPES = {ReduceDtype.fp32: torch.float32, ReduceDtype.bf16: torch.bfloat16, ReduceDtype.fp16: torch.float16}


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Pipeline stages held by one pp rank: looped (rank r holds r, r+pp, ...), as interleaved schedules need."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


class StageParts(nn.Module):
    """The pipeline stages (model chunks) of one rank, seen as one module with the one-process FQNs.

    Each chunk is the model with the other stages' layers deleted (and embedding / norm / head None
    where another stage holds them). This view registers the chunks' submodules under their usual
    names, so optimizer, state dicts and DCP checkpoints use `layers.{global index}...` in every
    layout and reshard across them. It has no forward: the pipeline schedule runs the chunks.

    Tied parameters on different stages (a tied embedding: the first stage's table, the last stage's head), as
    Megatron does: each stage holds its own copy, drawn (and loaded) with the same values; their gradients are
    summed across the two every step (`sync_tied_grads`), so both take the same steps. `tied_aliases` maps this
    rank's copies to the one-process name of the Parameter they copy (for initialisation and optimizer state);
    `tied_copies` are left out of the gradient norm, which counts a tied Parameter once as one process does.
    """

    def __init__(self, chunks: list[nn.Module], stages: list[int], n_stages: int, spec: ModelSpec,
                 tied: dict[str, str] | None = None, tie_group=None):
        super().__init__()
        self.chunks, self.stages, self.n_stages = chunks, stages, n_stages  # a plain list: no duplicate FQNs
        self.layers = nn.ModuleDict()
        for chunk in chunks:
            for name in (*spec.first_stage, *spec.last_stage):
                if getattr(chunk, name) is not None:
                    self.register_module(name, getattr(chunk, name))
            for name, block in chunk.layers.items():
                self.layers[name] = block
        here = {name for name, _ in self.named_parameters()}
        tied = tied or {}
        self.tied_aliases = {copy: source for copy, source in tied.items() if copy in here and source not in here}
        self._tie_group = tie_group
        self._tied_names = [n for pair in tied.items() for n in pair if n in here and tie_group is not None]

    @property
    def tied_copies(self) -> list[nn.Parameter]:
        return [self.get_parameter(name) for name in self.tied_aliases]

    def sync_tied_grads(self) -> None:
        """Sum the gradients of tied copies across their stages (collective for the first and last stages); a
        tensor-parallel embedding's is this rank's vocabulary shard, as the head's."""
        for name in self._tied_names:
            p = self.get_parameter(name)
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                # the embedding hook's cut once more (`Module._apply` after a forward loses the hook): the stages'
                # shapes must match
                p.grad = _in_placement(p.device_mesh, p.placements, p.grad)
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=self._tie_group)

    def _apply(self, fn, recurse=True):  # to_empty / to(): the chunks' own buffers (RoPE) too
        for chunk in self.chunks:
            chunk._apply(fn, recurse)
        return self

    def train(self, mode: bool = True):
        for chunk in self.chunks:
            chunk.train(mode)
        return super().train(mode)

    def init_buffers(self) -> None:
        for chunk in self.chunks:
            chunk.init_buffers()

    def tie_weights(self) -> None:
        pass  # tied parameters on different stages are copies, drawn and loaded alike

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline-parallel model runs through its schedule (PipelineTrainStep), not forward()")


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """{name: the name it shares a Parameter with} of a (meta) model, as one process ties them."""
    first, tied = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """This rank's copies of tied Parameters held on another pipeline stage, by the name of what they copy."""
    return model.tied_aliases if isinstance(model, StageParts) else {}


def end_stages_group(mesh: DeviceMesh):
    """The group of the first and last pipeline ranks at this rank's (dp, tp) coordinate, or None on the ranks in
    between (collective: every rank makes every such group, in the same order)."""
    pp_dim = mesh.mesh_dim_names.index("pp")
    pp = mesh.mesh.shape[pp_dim]
    if pp == 2:
        return mesh["pp"].get_group()
    mine = None
    for column in mesh.mesh.movedim(pp_dim, -1).reshape(-1, pp).tolist():
        group = dist.new_group([column[0], column[-1]])
        if dist.get_rank() in (column[0], column[-1]):
            mine = group
    return mine


def apply_pipeline_split(model: nn.Module, pp_mesh: DeviceMesh, virtual_stages: int,
                         spec: ModelSpec) -> list[nn.Module]:
    """Manual split into pp × virtual_stages stages of consecutive layers (layout.stage_layers: as even as can be);
    returns this rank's chunks.

    A chunk is a copy of the (meta) model keeping only its stage's layers; the first stage keeps the
    spec's first-stage modules (the embedding), the last its last-stage ones (final norm, output head).
    pp=1: the model itself, untouched.
    """
    pp = pp_mesh.size()
    if pp == 1:
        return [model]
    import copy

    n_stages = pp * virtual_stages
    names = list(model.layers.keys())
    layers = stage_layers(len(names), n_stages)
    chunks = []
    for s in stage_ids(pp_mesh.get_local_rank(), pp, virtual_stages):
        chunk = copy.deepcopy(model)
        keep = {names[i] for i in layers[s]}
        for name in names:
            if name not in keep:
                del chunk.layers[name]
        for name in (spec.first_stage if s != 0 else ()) + (spec.last_stage if s != n_stages - 1 else ()):
            setattr(chunk, name, None)
        chunks.append(chunk)
    return chunks


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, spec: ModelSpec) -> None:
    """Tensor (and sequence) parallel with the model's own plan: its root modules, then each block."""
    if tp_mesh.size() == 1:
        return
    root_plan, block_plan = spec.tp_plan(sequence_parallel)
    parallelize_module(model, tp_mesh, {k: v for k, v in root_plan.items() if getattr(model, k, None) is not None})
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # both halves of a tied embedding are sharded Shard(0) on the vocab: re-share one
    for block in model.layers.values():
        # An MoE block has no dense feed-forward: its experts stay whole on every tp rank, fed the same tokens
        # (under sequence parallelism: all of them, gathered, and each rank keeps its part of the output).
        plan = {k: v for k, v in block_plan.items() if _has(block, k)}
        plan.update({name: moe_tp_style(sequence_parallel) for name, m in block.named_children() if isinstance(m, MoE)})
        parallelize_module(block, tp_mesh, {k: v for k, v in plan.items() if v is not None})
    keep_embedding_grads_sharded(model)


def keep_embedding_grads_sharded(model: nn.Module) -> None:
    """A vocabulary-sharded (tensor-parallel) embedding's gradient comes back replicated, the whole table on every
    rank: DTensor's embedding backward has no rule that yields the parameter's Shard(0). Accumulated across
    micro-batches it stayed whole until the optimizer step (or FSDP's reduction); each micro-batch's is cut to this
    rank's rows as it arrives instead (from torch 2.13's replicated gradient a local slice: no communication):
    (1 - 1/tp) of the table's gradient bytes less per rank while accumulating (measured: tp2, 8k x 256 fp32, 4 MiB).
    The gradient hook goes on the weight the embedding computes with, at its forward (a hook on the meta parameter
    would not survive `to_empty`; under FSDP it is the unsharded parameter)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding) and isinstance(module.weight, DTensor):
            module.register_forward_pre_hook(_hook_weight_grad)


def _hook_weight_grad(module: nn.Module, args) -> None:
    """At every forward, on the weight it computes with now (FSDP's unsharded parameter). The handle, not the
    weight, is kept: a weakref to the weight would make `Module._apply` refuse to swap it, the weight itself a
    reference cycle. (A swap after a backward leaves every tensor hook of the weight dead, this one too: the
    gradient is then whole again, as before this hook.)"""
    old = module.__dict__.pop("_grad_hook", None)  # (a plain attribute, not a submodule or parameter)
    if old is not None:
        old.remove()
    weight = module.weight
    if weight.requires_grad:
        cut = functools.partial(_in_placement, weight.device_mesh, weight.placements)
        module.__dict__["_grad_hook"] = weight.register_hook(cut)


def _in_placement(mesh: DeviceMesh, placements, grad: DTensor) -> DTensor:
    return grad if grad.placements == placements else grad.redistribute(mesh, placements)


def apply_tp_replicate(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The parameters no tensor-parallel plan placed (norms without sequence parallelism, an MoE layer's router and
    shared experts) replicated on "tp", their modules fed and returning plain tensors: every parameter of a tp
    model is then a DTensor, as one optimizer kernel needs (fused AdamW refuses a mix)."""
    if tp_mesh.size() == 1:
        return
    for module in model.modules():
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, _replicate, _as_replicated, _as_local)


def _replicate(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            module.register_parameter(key, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))


def _as_replicated(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, torch.Tensor)
                 and not isinstance(x, DTensor) else x for x in inputs)


def _as_local(module: nn.Module, output, mesh: DeviceMesh):
    return output.to_local() if isinstance(output, DTensor) else output


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def apply_activation_checkpointing(model: nn.Module, mode: ActCkpt, every: int) -> None:
    """Recompute block activations in backward: `full` for every block, `selective` every N-th."""
    if mode == ActCkpt.none:
        return
    for name, block in model.layers.named_children():
        if mode == ActCkpt.full or int(name) % every == 0:  # global layer index: the same blocks in every layout
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def checkpointed_activations(mode: ActCkpt, every: int, layers: list[int], saved: float, kept_input: float,
                              in_flight: float) -> Term:
    """What a stage's blocks hold for backward over its micro-batches in flight: a block what it saves (`saved`,
    the model's own count), a checkpointed one only its input (`kept_input`); in backward one checkpointed block at
    a time is recomputed, its activations alive again."""
    ck = 0 if mode == ActCkpt.none else len(layers) if mode == ActCkpt.full else sum(j % every == 0 for j in layers)
    kept = in_flight * (ck * kept_input + (len(layers) - ck) * saved)
    return Term(backward=kept, recompute=kept + (saved if ck else 0))


def apply_compile(model: nn.Module, enabled: bool) -> None:
    """Compile each block separately: identical blocks share one compiled graph, cold start stays short. A model
    whose loss has compilable kernels of its own (`compile_loss`) gets them compiled too."""
    if not enabled:
        return
    for block in model.layers.children():
        block.compile(fullgraph=True)  # in place: parameter names keep no `_orig_mod.` prefix
    if hasattr(model, "compile_loss"):
        model.compile_loss = True


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, param_dtype: torch.dtype | None,
               cpu_offload: bool, reduce_dtype: torch.dtype = torch.float32,
               expert_mesh: DeviceMesh | None = None) -> None:
    """Data parallel over the "dp" mesh dim (with context parallelism "dp_cp": its ranks' gradients add up too) with
    FSDP2, as a ZeRO stage.

    0: replicated parameters, all-reduced gradients (FSDP2's replicate: unlike DDP it takes TP DTensors);
    2: parameters gathered once per step (no reshard between forward and backward), gradients and
       optimizer state sharded; 3: parameters resharded after each block's forward as well.
    Gradients are SUMMED over dp (divide factor 1): the step normalises the loss by the global token count;
    in `reduce_dtype` (parallel.grad_reduce_dtype), cast back to the parameters' dtype after.
    Experts shared out by expert parallelism (already sharded over "ep", inside dp) are sharded and reduced over
    the rest of dp only (`expert_mesh`: "dp_mod_ep"; none left when ep = dp).
    """
    if dp_mesh.size() == 1:
        return
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if zero_stage == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model, mesh=dp_mesh, mp_policy=mp)
    else:
        kw = {"mesh": dp_mesh, "mp_policy": mp,
              # Pinned host memory needs an accelerator; a CPU-only run offloads to ordinary memory.
              "offload_policy": (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload
                                 else OffloadPolicy())}
        experts = expert_modules(model)
        rest_of_dp = expert_mesh is not None and expert_mesh.size() > 1
        ignored = {p for m in experts for p in m.parameters()} if experts and not rest_of_dp else None
        for block in model.layers.values():
            for m in expert_modules(block) if rest_of_dp else ():
                fully_shard(m, reshard_after_forward=zero_stage == 3, **{**kw, "mesh": expert_mesh})
            fully_shard(block, reshard_after_forward=zero_stage == 3, ignored_params=ignored, **kw)
        fully_shard(model, reshard_after_forward=zero_stage == 3, ignored_params=ignored, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def saved_activation_kind(compute_bytes: int, replicas: int) -> str:
    """Which activations a block saves: fp32; autocast over fp32 parameters (one process per replica); or
    low-precision parameters, which data parallel gathers (FSDP2's MixedPrecisionPolicy)."""
    return "fp32" if compute_bytes == 4 else "lowp" if replicas > 1 else "autocast"


def sharded_weights(params: float, shard: int, on_host: bool, accumulating: bool, full_grads: bool,
                    pipelined_full: str = "", full: float | None = None) -> dict[str, Term]:
    """fp32 parameters and gradients, `params` per device before data parallel: FSDP2 shards both from ZeRO-2 on
    (`shard` = dp); accumulating at ZeRO-2/3 without reducing each micro-batch (`full_grads`) also holds full-size
    gradients; CPU offload keeps the sharded ones on the host. Under a pipeline schedule (`pipelined_full`) the
    full-size gradients last from the stage's first backward to the reduction after its last: not at the optimizer
    step, and at a backward's start only in 1F1B's steady state ("steady": more micro-batches than the stage holds in
    flight; "first": the stage's backward starts all come before any gradient exists but the last ones'). `full`:
    what a full-size gradient covers (`params` unless expert parallelism holds a share of the experts)."""
    own, full = 0 if on_host else 4 * params / shard, params if full is None else full
    grads = Term.gradients(own + (4 * full if full_grads and not pipelined_full else 0), accumulating)
    if full_grads and pipelined_full:
        early = 4 * full if pipelined_full == "steady" else 0.0
        grads = grads + Term(backward=early, recompute=early, reduced=4 * full)
    return {"params": Term.held(own), "grads": grads}


def offloaded_bytes(params: float, shard: int, optimizer_state: float, on_host: bool) -> float:
    """Host memory per rank under parallel.cpu_offload: the fp32 parameters and gradients FSDP keeps there, sharded
    (what `sharded_weights` leaves off the device), and the optimizer's state, which steps there."""
    return (8 * params + optimizer_state) / shard if on_host else 0.0


def gathered_copies(zero_stage: int, replicas: int, compute_bytes: int, params: float, largest_block: float) -> Term:
    """Parameters in the compute dtype beside the fp32 ones, from forward to backward: ZeRO-3 two blocks gathered
    (the current one and the prefetched next); ZeRO-2 and replicate every gathered parameter; one replica in
    bf16/fp16 autocast's casts of the weights, kept for backward."""
    if replicas > 1 and zero_stage == 3:
        return Term.in_backward(2 * largest_block * compute_bytes)
    if replicas > 1:
        return Term.in_backward(params * compute_bytes)
    return Term.in_backward(params * 2 if compute_bytes == 2 else 0)


def last_unit_reduced(zero_stage: int, dp: int, compute_bytes: int, params: float, root: float,
                      largest_block: float, tied: bool = False) -> Term:
    """The end of backward under data parallelism: the last unit reduced (the root's embedding, else a block;
    replicate's whole model) holds its gathered parameters, its unsharded gradients and their fp32 reduce copy;
    the other units are resharded by then (ZeRO-2 too: it reshards after backward). A sharded root whose embedding is
    tied to the output head peaks earlier, at the embedding's gradient: the head's gradient, the embedding's and
    their sum beside the gathered parameters, 4 copies in the compute dtype (measured at the tied embedding's
    `add` in backward: 16 bytes per parameter of the root in fp32, 8 in bf16; docs/planner.md)."""
    if dp == 1:
        return Term()
    unit = params if zero_stage == 0 else root or largest_block
    # (replicate computing in fp32 gathers nothing: its parameters are the fp32 ones already counted; measured 8, not
    # 12, bytes per parameter at backward's end of a ddp fp32 run whose peak is there)
    per_param = (compute_bytes if zero_stage or compute_bytes != 4 else 0) + compute_bytes + 4
    if zero_stage and root and tied:
        per_param = max(per_param, 4 * compute_bytes)
    return Term(reduced=unit * per_param)


def parallelize(model: nn.Module, layout: Layout, mesh: DeviceMesh, pcfg: ParallelConfig, spec: ModelSpec,
                param_dtype: torch.dtype | None = None) -> nn.Module:
    """The layout's model: the model itself (pp=1) or a StageParts view of this rank's pipeline stages."""
    tied = tied_parameters(model)
    chunks = apply_pipeline_split(model, mesh["pp"], layout.pp_virtual_stages, spec)
    for chunk in chunks:
        apply_tp(chunk, mesh["tp"], pcfg.sequence_parallel, spec)
        apply_experts(chunk, mesh)
        apply_tp_replicate(chunk, mesh["tp"])
        apply_cp(chunk, mesh["cp"])
        apply_activation_checkpointing(chunk, pcfg.activation_checkpointing, pcfg.ac_every)
        apply_compile(chunk, pcfg.compile)
        if GradCompression(pcfg.grad_compression) == GradCompression.none:
            apply_fsdp(chunk, layout.reduce_mesh(mesh), pcfg.zero_stage, param_dtype, pcfg.cpu_offload,
                       REDUCE_DTYPES[ReduceDtype(pcfg.grad_reduce_dtype)], layout.expert_mesh(mesh) if layout.ep > 1 else None)
        else:  # ZeRO-0, tp = pp = 1 (checked)
            apply_grad_compression(chunk, layout.batch_mesh(mesh), pcfg.grad_compression, pcfg.powersgd_rank,
                                   pcfg.topk_fraction, pcfg.compression_start_step)
    if not layout.pipelined:
        return chunks[0]
    stages = stage_ids(mesh["pp"].get_local_rank(), layout.pp, layout.pp_virtual_stages)
    return StageParts(chunks, stages, layout.pp_stages, spec, tied, end_stages_group(mesh) if tied else None)
