"""`python -m hpctrain plan <overrides>`: layer-to-stage map, per-device memory, bubble and FLOPs of a layout.

Nothing is allocated: parameters are counted on a model built on the meta device, the rest is arithmetic. Each
feature states its own memory term beside its code (core/memory.py: the bytes it holds at each moment of a step);
the planner gathers them per pipeline stage and takes the worst moment (`total`). With P a device's parameters
(TP-sharded matrices / tp + replicated norms), c the compute dtype's size (2 for bf16/fp16, else 4):

  parameters, gradients   parallel/parallelize.sharded_weights    4·P each, / dp from ZeRO-2 on
  buffers                 the model's own (the RoPE tables, 2 · 4 · max_seq_len · head_dim), counted here
  optimizer, temporary    training/optimizer.memory_terms         AdamW/LAMB/Sophia 8·P, SGD 4·P, Adafactor factored
  compute copies          parallel/parallelize.gathered_copies    gathered or autocast-cast weights, · c
  activations             the model's spec.block_activations (measured per token) × parallelize.checkpointed_
                          activations × Layout.in_flight (the pipeline schedule's micro-batches in flight)
  loss buffers            models/cross_entropy.loss_buffers       ~ tokens × vocab / tp × 12 (fused: one chunk)
  document masks          models/packing.mask_bytes               micro_batch × seq_len² · c per micro-batch in flight
  last unit reduced       parallel/parallelize.last_unit_reduced  (parallel/compression.memory_terms instead when
                                                                  gradients are compressed, with its residual)
  host copy               training/save_resume.host_copy_bytes   train.ckpt_async, host memory beside the device's
  host: offloaded         parallel/parallelize.offloaded_bytes    parallel.cpu_offload: (8·P + optimizer) / dp on the host

A checkpoint on disk (disk_bytes): save_resume.checkpoint_bytes, plus parallel/compression.saved_bytes.

Verdict: worst stage <= 90 % of cluster.gpu_mem_gb. docs/planner.md gives the measured accuracy and how it was
measured.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from hpctrain.core.config import ActCkpt, ConfigError, GradCompression, OptimName, PrecisionName, SpikeAction
from hpctrain.core.memory import Term, merge, peak
from hpctrain.core.shard_format import DataError, read_manifest
from hpctrain.models import ModelSpec, spec_of
from hpctrain.models.cross_entropy import loss_buffers
from hpctrain.models.packing import mask_bytes, packed_masks
from hpctrain.parallel import compression
from hpctrain.parallel.context import cp_mask_bytes, gathered_bytes
from hpctrain.parallel.layout import job_shape, layer_map, world_of
from hpctrain.parallel.parallelize import (
    checkpointed_activations,
    gathered_copies,
    last_unit_reduced,
    offloaded_bytes,
    saved_activation_kind,
    sharded_weights,
)
from hpctrain.parallel.process_group import local_device_count
from hpctrain.runs.resolve import RunShape, check_cp_seq_len, resolve
from hpctrain.training import optimizer, step_time
from hpctrain.training.save_resume import checkpoint_bytes, host_copy_bytes

GiB = 2**30
HEADROOM = 0.9  # usable share of device memory: allocator fragmentation, NCCL buffers, CUDA context
MFU = 0.4


@dataclass
class StageParams:
    """Parameter counts of one pipeline stage, before TP: tp-sharded matrices, replicated norms."""

    layers: list[range]
    sharded: int = 0
    replicated: int = 0
    factored: int = 0  # Adafactor state elements: rows + cols per matrix, numel per vector
    largest_block: int = 0  # the largest block: an FSDP unit
    root: int = 0  # embedding / final norm / output head held: the root FSDP unit
    buffers: int = 0  # bytes of the model's own buffers every stage holds (the RoPE tables: max_seq_len × head_dim)
    experts: int = 0  # the routed experts' parameters (in `replicated`: whole on every tp rank)

    def per_device(self, tp: int) -> int:
        return self.sharded // tp + self.replicated

    def held(self, tp: int, ep: int) -> int:
        """What a device holds of the stage before data parallel shards it: its tp share, and its ep share of the
        experts (what a replica, ZeRO-2's gathered weights and full-size gradients count)."""
        return self.per_device(tp) - self.experts + self.experts // ep


def _count(st: StageParams, params, whole: bool = False) -> int:
    """`whole`: parameters every tp rank holds whole however many dims they have (an MoE layer's)."""
    total = 0
    for p in params:
        total += p.numel()
        if p.dim() > 1 and not whole:
            st.sharded += p.numel()
            st.factored += p.shape[0] + p.shape[1]
        else:
            st.replicated += p.numel()
            # (Adafactor factors the last two dims of each matrix: an [E, out, in] weight E row and column sums)
            st.factored += p.numel() if p.dim() == 1 else p.numel() // p.shape[-1] + p.numel() // p.shape[-2]
    return total


def _count_block(st: StageParams, block, ep: int) -> int:
    """A block's parameters counted; returns what FSDP gathers of it on a device: all but the experts, and of the
    experts the share of its ep group (expert parallelism keeps E/ep per rank; FSDP gathers that over dp/ep)."""
    from hpctrain.models.moe import moe_layers

    moe = [m for _, m in moe_layers(block)]
    inside = {id(p) for m in moe for p in m.parameters()}
    gathered = _count(st, [p for p in block.parameters() if id(p) not in inside])
    for m in moe:  # (held whole on every tp rank: the router and shared experts, and the experts of its ep share)
        gathered += _count(st, [p for name, p in m.named_parameters() if not name.startswith("experts.")], whole=True)
        experts = _count(st, m.experts.parameters(), whole=True)
        st.experts += experts
        gathered += experts // ep
    return gathered


def stage_params(args, pp: int, v: int = 1, spec: ModelSpec | None = None, ep: int = 1,
                 model: torch.nn.Module | None = None) -> list[StageParams]:
    """Count each stage's parameters on a meta-device model (no memory is allocated): `model`, when given (a search
    counting many splits of one model), else built here."""
    spec = spec or _default_spec()
    model = spec.meta(args) if model is None else model
    stages = [StageParams(chunks) for chunks in layer_map(args.n_layers, pp, v)]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # (conservative: a block's, everywhere)
    for i, st in enumerate(stages):
        st.buffers = buffers
        for chunk in st.layers:
            for layer in chunk:
                st.largest_block = max(st.largest_block, _count_block(st, model.layers[str(layer)], ep))
        names = (spec.first_stage if i == 0 else ()) + (spec.last_stage if i == pp - 1 else ())
        root = {id(t): t for name in names for t in getattr(model, name).parameters()}  # a tied weight once
        st.root = _count(st, root.values())
    return stages


def _default_spec() -> ModelSpec:
    from hpctrain.models import get_spec

    return get_spec("llama")


def _describe(i: int, st: StageParams, pp: int) -> str:
    parts = ["embed"] if i == 0 else []
    parts += [f"layers {c.start}-{c.stop - 1}" if len(c) > 1 else f"layer {c.start}" for c in st.layers if len(c)]
    if i == pp - 1:
        parts.append("norm + output")
    return " + ".join(parts) or "(nothing)"


# The plan's memory lines: the names the features' terms carry.
LINES = ("params", "buffers", "grads", "optim", "opt_temp", "copies", "logits", "masks", "reducing")


@dataclass(frozen=True)
class _Run:
    """What every stage's terms share: the run's settings, turned into the quantities the terms take."""

    cfg: object
    plan: RunShape
    spec: ModelSpec
    args: object
    c: int  # the compute dtype's bytes
    shard: int  # ranks sharing parameters, gradients and state: dp from ZeRO-2 on (FSDP2 shards them there)
    compressed: bool  # parallel.grad_compression: one process's model with its own exchange, no data-parallel unit
    m: int  # micro-batches per schedule: a pipelined step runs its grad_accum micro-batches through one
    tokens: int  # of one micro-batch
    seq_len: int

    @staticmethod
    def compressing(p, plan: RunShape) -> bool:
        return plan.layout.dp > 1 and GradCompression(p.grad_compression) != GradCompression.none

    @classmethod
    def of(cls, cfg, plan: RunShape, seq_len: int) -> _Run:
        spec, layout, p = spec_of(cfg.model), plan.layout, cfg.parallel
        low = PrecisionName(cfg.precision.name) in (PrecisionName.bf16, PrecisionName.fp16)
        return cls(cfg, plan, spec, spec.args(cfg.model), c=2 if low else 4,
                   shard=layout.reduce_ranks if p.zero_stage >= 2 else 1,
                   compressed=cls.compressing(p, plan),
                   m=plan.grad_accum if layout.pipelined else 1, tokens=seq_len * plan.micro_batch // layout.cp,
                   seq_len=seq_len)


def _stage_terms(r: _Run, i: int, st: StageParams) -> dict[str, Term]:
    """Stage `i`'s device: every feature's term, by the plan's line it shows on."""
    p, layout, tp = r.cfg.parallel, r.plan.layout, r.plan.layout.tp
    # FSDP spans the dp×cp ranks (context parallel ranks add up gradients as data parallel ones do)
    P, accumulating, replicas = st.per_device(tp), r.plan.grad_accum > 1, 1 if r.compressed else layout.reduce_ranks
    # sharded by data parallel (ZeRO-2/3), each rank's 1/dp of them all (experts: 1/ep, then 1/(dp/ep)); else what
    # the device holds whole
    held = st.held(tp, layout.ep)
    own = P if r.shard > 1 else held
    # ZeRO-2/3 accumulating without reducing each micro-batch holds full-size gradients too; so does any ZeRO stage
    # under a pipeline schedule, which keeps the gradients unreduced and the weights gathered from one micro-batch to
    # the next (torch.distributed.pipelining reduces after the last; measured: tests/test_plan.py pp2_dp2_zero2/3).
    full_grads = r.shard > 1 and accumulating and (layout.pipelined or not p.sharded_accumulation)
    in_flight = layout.in_flight(i, r.m)
    pipelined_full = ("steady" if r.m > in_flight else "first") if layout.pipelined else ""
    terms = [sharded_weights(own, r.shard, p.cpu_offload, accumulating, full_grads, pipelined_full, held),
             {"buffers": Term.held(st.buffers)},
             optimizer.memory_terms(r.cfg.optim, own, st.factored / tp, layout.world > layout.pp, r.shard,
                                    p.cpu_offload),
             # ZeRO-3 under a pipeline keeps every unit gathered from its backward to the next forward: as ZeRO-2
             {"copies": gathered_copies(2 if layout.pipelined and p.zero_stage == 3 else p.zero_stage, replicas, r.c,
                                        held, st.largest_block / tp)}]
    flight = in_flight * len(st.layers)  # one mask per micro-batch in flight on each chunk
    if layout.cp > 1:
        rows = r.plan.micro_batch if r.cfg.train.document_mask else 1
        terms.append({"masks": cp_mask_bytes(rows, r.seq_len, layout.cp, r.c, flight)})
    elif r.cfg.train.document_mask:
        terms.append({"masks": mask_bytes(r.plan.micro_batch, r.seq_len, r.c, flight)})
    if i == layout.pp - 1:
        terms.append({"logits": loss_buffers(r.args.vocab_size, r.args.dim, r.tokens, tp, r.c, layout.pipelined,
                                             r.cfg.train.fused_loss)})
    if r.compressed:
        undo = SpikeAction(r.cfg.monitor.loss_spike.action) == SpikeAction.skip_batch
        terms.append(compression.memory_terms(P, 4 * r.args.vocab_size * r.args.dim, undo))
    else:
        tied = r.args.tie_embeddings and not layout.pipelined  # (a pipeline's end stages each hold their own copy)
        terms.append({"reducing": last_unit_reduced(p.zero_stage, replicas, r.c, held, st.root / tp,
                                                    st.largest_block / tp, tied)})
    return merge(*terms)


def _activations(r: _Run, i: int, st: StageParams) -> dict[str, Term]:
    """Stage `i`'s activations, for each activation-checkpointing mode (selective checkpoints the blocks whose
    global index is a multiple of parallel.ac_every)."""
    p, layout = r.cfg.parallel, r.plan.layout
    kind = saved_activation_kind(r.c, 1 if r.compressed else layout.reduce_ranks)
    saved, kept_input = r.spec.block_activations(r.args, r.tokens, kind, layout.tp,
                                                 layout.tp if p.sequence_parallel else 1, r.seq_len,
                                                 packed_masks(r.cfg.train.document_mask, layout.cp), layout.cp,
                                                 p.compile)
    layers = [j for chunk in st.layers for j in chunk]
    return {mode.value: checkpointed_activations(mode, p.ac_every, layers, saved, kept_input,
                                                 layout.in_flight(i, r.m)) for mode in ActCkpt}


def estimate(cfg, plan: RunShape, seq_len: int, stages: list[StageParams] | None = None) -> dict:
    """Per stage: each feature's term (`terms`), the activations' per checkpointing mode (`activations`), and the
    sizes the plan's lines show (LINES; `acts` and `recompute` per mode; `async_copy`: host memory); plus the
    step's numbers. `stages`: the stages' parameter counts when known (they do not depend on seq_len)."""
    r = _Run.of(cfg, plan, seq_len)
    layout = plan.layout
    stages = stages or stage_params(r.args, layout.pp, layout.pp_virtual_stages, r.spec, layout.ep)
    rows = []
    for i, st in enumerate(stages):
        terms, acts = _stage_terms(r, i, st), _activations(r, i, st)
        P = st.per_device(layout.tp)
        state = optimizer.state_bytes(cfg.optim, P, st.factored / layout.tp)
        rows.append({"stage": i, "desc": _describe(i, st, layout.pp), "params_per_device": P,
                     "terms": terms, "activations": acts,
                     **{name: terms.get(name, Term()).size for name in LINES},
                     "acts": {mode: t.backward for mode, t in acts.items()},
                     "recompute": {mode: t.recompute - t.backward for mode, t in acts.items()},
                     "flight": layout.in_flight(i, r.m), "async_copy": host_copy_bytes(cfg.train, P, state, r.shard),
                     "offload": offloaded_bytes(P, r.shard, state, cfg.parallel.cpu_offload)})
    flops = r.spec.flops_per_token(r.args, seq_len) * plan.global_batch * seq_len
    return {"stages": stages, "rows": rows, "m": r.m, "b": plan.micro_batch,
            "schedule": layout.pp_schedule if layout.pipelined else "none", "bubble": layout.bubble(r.m),
            "flops": flops, "args": r.args, "c": r.c}


def total(row: dict, mode: str) -> float:
    """The device's peak with checkpointing `mode`: the worst moment of every term (core/memory.py): backward's
    start, a block recomputed, backward's end under data parallelism, the optimizer step."""
    return peak([*row["terms"].values(), row["activations"][mode]])


# The parts `largest_part` names, with what shrinks each.
PARTS = {
    "weights": ("the weights, gradients and optimizer state", "spread them over more ranks (parallel.dp with "
                "parallel.zero_stage=3, parallel.tp, parallel.pp)"),
    "acts": ("the activations", "lower train.micro_batch (train.grad_accum keeps the global batch) or set "
             "parallel.activation_checkpointing=full"),
    "logits": ("the loss's buffers (tokens × vocabulary)", "set train.fused_loss=true or lower train.micro_batch"),
    "masks": ("the document masks (micro_batch × seq_len², train.document_mask)", "lower train.micro_batch "
              "(train.grad_accum keeps the global batch)"),
    "buffers": ("the RoPE tables (model.max_seq_len × head_dim)", "lower model.max_seq_len to the longest sequence "
                "this model will see"),
}


def largest_part(cfg, plan: RunShape, seq_len: int) -> tuple[str, float, str]:
    """(what, bytes, how to shrink it): the largest part of the most loaded device's estimate."""
    mode = ActCkpt(cfg.parallel.activation_checkpointing).value
    row = max(estimate(cfg, plan, seq_len)["rows"], key=lambda r: total(r, mode))
    parts = {"weights": sum(row[k] for k in ("params", "grads", "optim", "opt_temp", "copies", "reducing")),
             "acts": row["acts"][mode] + row["recompute"][mode], "logits": row["logits"], "buffers": row["buffers"],
             "masks": row["masks"]}
    name = max(parts, key=parts.get)
    return PARTS[name][0], parts[name], PARTS[name][1]


def stage_bytes(cfg, plan: RunShape, seq_len: int) -> list[tuple[float, float]]:
    """Estimated memory of a device of each pipeline stage, with the run's activation checkpointing, and the host
    memory its rank holds besides (train.ckpt_async's copy, parallel.cpu_offload's weights and state)."""
    mode = ActCkpt(cfg.parallel.activation_checkpointing).value
    return [(total(row, mode), host(row)) for row in estimate(cfg, plan, seq_len)["rows"]]


def host(row: dict) -> float:
    """A stage's host memory per rank besides its device's."""
    return row["async_copy"] + row["offload"]


def whole_model(cfg) -> StageParams:
    """The model's parameters counted as one stage: each once (a tied embedding once, all experts)."""
    spec = spec_of(cfg.model)
    (whole,) = stage_params(spec.args(cfg.model), 1, 1, spec)
    return whole


def disk_bytes(cfg, plan: RunShape) -> float:
    """A checkpoint's bytes on disk: the model's fp32 parameters and optimizer state (save_resume), each parameter
    once whatever the layout (counted as one stage: a tied embedding once, all experts; a tied weight's second
    name not counted, so the figure errs low), and with parallel.grad_compression every replica's residuals."""
    if not cfg.train.checkpointing:
        return 0.0
    whole = whole_model(cfg)
    params = whole.sharded + whole.replicated
    residuals = compression.saved_bytes(params, plan.layout.dp) if _Run.compressing(cfg.parallel, plan) else 0
    return checkpoint_bytes(cfg.train, params, optimizer.state_bytes(cfg.optim, params, whole.factored)) + residuals


def _predicted(cfg, plan: RunShape, seq_len: int):
    """(the step-time model's prediction, the hardware) for cluster.gpu_type; None without one."""
    hw = step_time.hardware_of(cfg.cluster, cfg.precision.name)
    if hw is None:
        return None
    return step_time.predict(step_time.StepInputs.of(cfg.model, cfg.parallel, cfg.precision, plan, seq_len,
                                                     document_mask=cfg.train.document_mask), hw), hw


def _step_time(cfg, plan: RunShape, seq_len: int) -> list[str]:
    """The step-time model's `predicted:` line and breakdown (training/step_time.py), for cluster.gpu_type, and the
    whole run's."""
    predicted = _predicted(cfg, plan, seq_len)
    if predicted is None:
        return ["predicted: no step time without a GPU type: set cluster.gpu_type (A100, H100, H200)"]
    got, hw = predicted
    jobs = RunJobs.of(cfg.train, cfg.cluster, got.step_s)
    t = cfg.train
    return [got.line(), got.breakdown(), f"  hardware {hw.describe()}",
            f"whole run: train.max_steps={t.max_steps} ({t.max_steps * plan.global_batch * seq_len:.3g} tokens) × "
            f"{got.step_s:.3g} s = {t.max_steps * got.step_s / 3600:.3g} h of training", f"  {jobs.line()}"]


@dataclass(frozen=True)
class RunJobs:
    """The Slurm jobs a run takes at a step time under hydra/launcher=slurm: a job trains until the time limit's
    warning (cluster.signal_lead_s before cluster.time_min), then requeues, and submitit requeues a timed-out job
    cluster.max_timeouts times, so a run that needs more jobs stops short of train.max_steps. (A job's start-up and
    its saves are not counted: a run that needs every job it is allowed is warned too.)"""

    time_min: int
    lead_s: int
    max_timeouts: int
    per_job: int  # steps
    jobs: int | None  # for the steps still to train; None: no step fits before the warning
    done: int = 0  # steps the run has (its latest checkpoint's)

    @classmethod
    def of(cls, t, c, step_s: float, done: int = 0) -> RunJobs:
        per_job = int(max(0, c.time_min * 60 - c.signal_lead_s) // step_s)
        left = max(0, t.max_steps - done)
        return cls(c.time_min, c.signal_lead_s, c.max_timeouts, per_job, -(-left // per_job) if per_job else None,
                   done)

    @property
    def counted(self) -> bool:
        """Whether submitit counts a stop at the warning as a time-out: only after min(0.8·limit, limit − 10 min) of
        the job (its has_timed_out); an earlier stop is a preemption, requeued without limit."""
        limit = 60 * self.time_min
        return limit - self.lead_s >= min(0.8 * limit, limit - 600)

    @property
    def stops_short(self) -> bool:
        return self.jobs is None or (self.counted and self.jobs >= self.max_timeouts + 1)

    def line(self) -> str:
        if self.jobs is None:
            return (f"cluster.time_min={self.time_min} leaves no step before the time limit's warning "
                    f"(cluster.signal_lead_s={self.lead_s}): raise cluster.time_min")
        allowed, head = self.max_timeouts + 1, (f"cluster.time_min={self.time_min} holds about {self.per_job:,} steps "
                                                f"a job (less its start-up): {self.jobs:,} ")
        limit = f"cluster.max_timeouts={self.max_timeouts}"
        if not self.counted:
            return (f"{head}job(s), requeued without limit: submitit counts a stop cluster.signal_lead_s={self.lead_s} "
                    f"before the limit as a preemption")
        if self.jobs > allowed:
            return (f"{head}jobs, more than the {allowed} that {limit} allows: under hydra/launcher=slurm the run stops "
                    f"after about {self.done + allowed * self.per_job:,} steps; raise cluster.time_min or cluster.max_timeouts, or "
                    "submit it again to go on")
        if self.jobs == allowed:
            return (f"{head}jobs, all {allowed} that {limit} allows, with nothing left for start-ups and saves: raise "
                    "cluster.time_min or cluster.max_timeouts")
        return f"{head}job(s) of the {allowed} that {limit} allows"


def jobs_warning(cfg, plan: RunShape, seq_len: int, done: int = 0) -> str | None:
    """For a submission with cluster.gpu_type: the plan's jobs line where the run (from step `done`) would stop short
    of its steps."""
    predicted = _predicted(cfg, plan, seq_len)
    if predicted is None:
        return None
    step_s = predicted[0].step_s
    jobs = RunJobs.of(cfg.train, cfg.cluster, step_s, done)
    return (f"at the predicted {step_s:.3g} s per step{f', from step {done}' if done else ''}, {jobs.line()}"
            if jobs.stops_short else None)


def report(cfg, plan: RunShape, seq_len: int, notes: list[str]) -> tuple[str, bool | None]:
    """The printed plan and the verdict (None when cluster.gpu_mem_gb is unset)."""
    e = estimate(cfg, plan, seq_len)
    p, rows = cfg.parallel, e["rows"]
    mode = ActCkpt(p.activation_checkpointing).value
    whole, cp = whole_model(cfg), plan.layout.cp
    shape = f"pp×dp×cp×tp = {plan.pp}×{plan.dp}×{cp}×{plan.tp}" if cp > 1 else \
        f"pp×dp×tp = {plan.pp}×{plan.dp}×{plan.tp}"
    out = [f"model {cfg.model.name}: {(whole.sharded + whole.replicated) / 1e9:.3f}B parameters "
           f"(counted on the meta device); layout {shape} = {plan.world} devices"
           + (f" (each sequence split over {cp} ranks)" if cp > 1 else "")
           + (f", experts shared out over ep={plan.layout.ep}" if plan.layout.ep > 1 else ""),
           f"batch: global {plan.global_batch} = micro {plan.micro_batch} × accum {plan.grad_accum} × dp {plan.dp}"
           f", seq_len {seq_len}; precision {PrecisionName(cfg.precision.name).value}, zero_stage {p.zero_stage}"
           f", sequence_parallel {p.sequence_parallel}, activation_checkpointing {mode}"]
    out += [f"note: {n}" for n in notes]
    out.append(f"\nlayer-to-stage map ({plan.pp} stage(s) × {plan.layout.pp_virtual_stages} virtual):")
    out += [f"  stage {r['stage']}: {r['desc']}  ({r['params_per_device'] / 1e6:.1f}M params per device)" for r in rows]
    out += _memory_lines(cfg, plan, e, mode)
    pp, v, m = plan.pp, plan.layout.pp_virtual_stages, e["m"]
    out.append(f"\npipeline bubble: (pp−1)/(m·v + pp−1) = ({pp}−1)/({m}·{v} + {pp}−1) = {e['bubble']:.1%} "
               "of each step's schedule (m = micro-batches per step, v = virtual stages)")
    out += _expert_exchange(plan, e, seq_len, mode) + _context_exchange(plan, e, seq_len, mode)
    line = f"FLOPs per step: flops_per_token × global_batch × seq_len = {e['flops']:.3e}"
    peak = cfg.cluster.peak_tflops  # (with cluster.gpu_type, the step-time model's line instead)
    if peak and not cfg.cluster.gpu_type:
        line += (f"; ideal step time at {MFU:.0%} MFU on {plan.world} × {peak:g} TFLOPS: "
                 f"{e['flops'] / (plan.world * peak * 1e12 * MFU):.2f} s")
    out.append(line)
    out += _step_time(cfg, plan, seq_len) + _node_lines(cfg, plan, rows, mode) + _disk_lines(cfg, plan)
    worst = {k: max(total(r, k) for r in rows) for k in ("none", "full", mode)}
    cap = cfg.cluster.gpu_mem_gb
    if not cap:
        out.append(f"\nworst stage needs {worst[mode] / GiB:.2f} GiB per device (ckpt={mode}): "
                   "set cluster.gpu_mem_gb to check fit")
        return "\n".join(out), None
    usable = cap * HEADROOM * GiB
    fits = worst[mode] <= usable
    out.append(f"\nworst stage needs {worst[mode] / GiB:.2f} GiB per device (ckpt={mode}); usable "
               f"{HEADROOM:.0%} of cluster.gpu_mem_gb={cap:g}: {usable / GiB:.1f} GiB -> "
               f"{'FITS' if fits else 'DOES NOT FIT'}")
    if not fits:
        out.append("suggestion: " + _suggest(cfg, plan, worst, usable, seq_len))
    longest, reach = longest_seq_len(cfg, plan, mode, usable, e["stages"]), cfg.model.max_seq_len
    out.append(f"longest train.seq_len that fits this layout (micro_batch {plan.micro_batch}, ckpt={mode}): "
               + (f"{reach} tokens (model.max_seq_len; the memory would hold {longest}: raise model.max_seq_len to "
                  "train longer)" if longest > reach else f"{longest} tokens" if longest else
                  "none (not even the shortest)"))
    return "\n".join(out), fits


def node_bytes(stages: list[tuple[float, float]], gpus: bool, world: int, per_node: int) -> tuple[float, int, bool]:
    """(the most host memory any node's ranks hold together, how many ranks that node has, whether they hold unequal
    shares): a rank of pipeline stage i holds `stages[i]`'s host bytes, and on CPUs its device's too (stage_bytes'
    pairs); stages are the mesh's outermost dimension (ranks [i·world/pp, (i+1)·world/pp) hold stage i), nodes hold
    `per_node` consecutive ranks, as Slurm's block distribution and the local launchers place them."""
    per_rank = [host + (0 if gpus else device) for device, host in stages]
    n, per_stage = min(per_node, world), max(1, world // len(per_rank))
    return max(sum(per_rank[min(r // per_stage, len(per_rank) - 1)] for r in range(start, min(start + n, world)))
               for start in range(0, world, n)), n, len(set(per_rank)) > 1


def _node_lines(cfg, plan: RunShape, rows: list[dict], mode: str) -> list[str]:
    """With cluster.mem_gb (--mem, per node): what a node's ranks hold in host memory against it, as a submission
    checks it (training/run.NodeMemory): on GPUs train.ckpt_async's copies, on CPUs their devices' memory too."""
    gib = cfg.cluster.mem_gb
    gpus = bool(cfg.cluster.gpus_per_node)
    need, ranks, unequal = node_bytes([(total(r, mode), host(r)) for r in rows], gpus, plan.world,
                                      cfg.cluster.gpus_per_node or cfg.cluster.tasks_per_node)
    if not gib or not need:
        return []
    held = [name for key, name in (("async_copy", "train.ckpt_async's copy"),
                                   ("offload", "parallel.cpu_offload's weights and optimizer state"))
            if any(r[key] for r in rows)]
    what = " and ".join(held if gpus else ["its device's memory", *held])
    return [f"host memory per node: {ranks} rank(s) × {need / ranks / GiB:.2f} GiB"
            + (" on average" if unequal else "") + f" ({what}) = {need / GiB:.2f} GiB; "
            f"cluster.mem_gb={gib}: {'FITS' if need <= gib * GiB else 'DOES NOT FIT'} (the processes' own memory "
            "not counted)"]


def _disk_lines(cfg, plan: RunShape) -> list[str]:
    """A checkpoint's size on disk, and what train.ckpt_keep of them take while the next is written."""
    each, keep = disk_bytes(cfg, plan), cfg.train.ckpt_keep
    if not each:
        return []
    what = "fp32 weights and optimizer state" + (", every replica's residuals" if _Run.compressing(cfg.parallel, plan)
                                                  else "")
    return [f"checkpoints on disk: {each / GiB:.2f} GiB each ({what}); "
            f"train.ckpt_keep={keep} and the one being written: {(keep + 1) * each / GiB:.2f} GiB"]


def longest_seq_len(cfg, plan: RunShape, mode: str, usable: float, stages: list[StageParams],
                    limit: int = 1 << 22) -> int:
    """The longest sequence (a multiple of what the layout splits it into) whose worst stage fits `usable` bytes with
    checkpointing `mode`, up to `limit` tokens; 0 when none does. The memory grows with the length: bisection."""
    layout = plan.layout
    unit = 2 * layout.cp if layout.cp > 1 else 1
    unit *= layout.tp if cfg.parallel.sequence_parallel else 1

    def fits(n: int) -> bool:
        return max(total(r, mode) for r in estimate(cfg, plan, n * unit, stages)["rows"]) <= usable

    lo, hi = 0, limit // unit  # fits(lo) (or lo = 0), not fits(hi + 1) assumed past the limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * unit


def _memory_lines(cfg, plan: RunShape, e: dict, mode: str) -> list[str]:
    """The per-device memory table: a column per stage, a line per term, the activations and totals by mode."""
    rows, out = e["rows"], []
    gib = lambda x: f"{x / GiB:8.2f}"  # noqa: E731
    out.append("\nper-device memory, GiB (one column per stage):")
    out.append(f"  {'':28}" + "".join(f"{'stage ' + str(r['stage']):>10}" for r in rows))
    lines = [("parameters (fp32)", "params"), ("buffers (RoPE tables)", "buffers"), ("gradients (fp32)", "grads"),
             (f"optimizer ({OptimName(cfg.optim.name).value})", "optim"),
             (f"optimizer temporary ({optimizer.implementation(cfg.optim, plan.world > plan.pp).value})", "opt_temp"),
             (f"compute copies ({'bf16/fp16' if e['c'] == 2 else 'fp32'})", "copies"),
             ("loss buffers", "logits"), ("last unit being reduced", "reducing")]
    if packed_masks(cfg.train.document_mask, plan.layout.cp):
        lines.insert(-1, ("attention masks" if plan.layout.cp > 1 else "document masks", "masks"))
    for label, key in lines:
        out.append(f"  {label:28}" + "".join(f"{gib(r[key]):>10}" for r in rows))
    for m in dict.fromkeys(["none", "full", mode]):
        out.append(f"  {'activations, ckpt=' + m:28}" + "".join(f"{gib(r['acts'][m]):>10}" for r in rows))
    for m in dict.fromkeys(["none", "full", mode]):
        out.append(f"  {'TOTAL, ckpt=' + m:28}" + "".join(f"{gib(total(r, m)):>10}" for r in rows))
    out.append("  (TOTAL is the largest of three moments, not the sum: backward's start, backward's end under data "
               "parallelism, the optimizer step)")
    for key, label in (("async_copy", "host copy (train.ckpt_async)"), ("offload", "host: offloaded (cpu_offload)")):
        if any(r[key] for r in rows):
            out.append(f"  {label:28}" + "".join(f"{gib(r[key]):>10}" for r in rows)
                       + "  (host memory per rank, besides the above)")
    flight = ", ".join(f"{r['flight']:g}" for r in rows)
    out.append(f"  micro-batches in flight: {flight} "
               f"(schedule {e['schedule']}, m={e['m']} micro-batches of {e['b']:g} sample(s))")
    return out


def _expert_exchange(plan: RunShape, e: dict, seq_len: int, mode: str) -> list[str]:
    """Expert parallelism's all-to-all volume, the busiest stage's (nothing without ep)."""
    if plan.layout.ep == 1:
        return []
    from hpctrain.parallel.experts import all_to_all_bytes

    args, tokens = e["args"], plan.micro_batch * seq_len * plan.grad_accum
    sent = max(all_to_all_bytes(args.moe, [j for c in st.layers for j in c], args.dim, tokens, plan.layout.ep,
                                e["c"], mode != "none") for st in e["stages"])
    return [f"\nexpert all-to-all (ep={plan.layout.ep}): {sent / 1e9:.3g} GB sent per device per step at even load "
            "(dispatch + combine of each routed token, forward, backward and recomputation)"]


def _context_exchange(plan: RunShape, e: dict, seq_len: int, mode: str) -> list[str]:
    """Context parallelism's K/V all-gathers, the busiest stage's (nothing without cp)."""
    cp = plan.layout.cp
    if cp == 1:
        return []
    args, tokens = e["args"], plan.micro_batch * seq_len * plan.grad_accum // cp
    kv_dim = args.kv_heads * args.head_dim // plan.tp
    moved = max(gathered_bytes(kv_dim, tokens, cp, sum(len(c) for c in st.layers), e["c"], mode != "none")
                for st in e["stages"])
    return [f"\ncontext all-gather (cp={cp}): {moved / 1e9:.3g} GB received per device per step (keys and values of "
            "every layer, forward, backward's reduce-scatter and recomputation)"]


def _suggest(cfg, plan: RunShape, worst: dict, usable: float, seq_len: int) -> str:
    """What would shrink the worst stage: each concrete change tried as a run takes it (`resolve`'s checks; one it
    refuses is not offered) and shown with the worst stage it gives."""
    p, changes = cfg.parallel, []
    if ActCkpt(p.activation_checkpointing) != ActCkpt.full:
        if worst["full"] <= usable:
            return "set parallel.activation_checkpointing=full (fits then)"
        changes.append({"parallel.activation_checkpointing": "full"})
    if plan.dp > 1 and p.zero_stage < 3:
        changes.append({"parallel.zero_stage": 3})
    if plan.tp < 8:
        changes.append({"parallel.tp": plan.tp * 2})
    if not p.sequence_parallel and plan.tp > 1:
        changes.append({"parallel.sequence_parallel": True})
    tips = [tip for tip in (_tried(cfg, plan, change, seq_len) for change in changes) if tip]
    if plan.dp == 1:
        tips.append("shard over data parallel: parallel.dp=N with parallel.zero_stage=3")
    return "; ".join([*tips, "raise parallel.pp or lower train.micro_batch"])


def _tried(cfg, plan: RunShape, change: dict, seq_len: int) -> str | None:
    """`change` applied (on as many devices, where dp=auto, else tp's more), as `key=value (worst stage GiB)`; None
    where a run would refuse it."""
    import copy

    from omegaconf import OmegaConf

    trial = copy.deepcopy(cfg)
    for key, value in change.items():
        OmegaConf.update(trial, key, value)
    grown = 1 if cfg.parallel.dp == "auto" else trial.parallel.tp // cfg.parallel.tp
    try:
        shape = resolve(trial, plan.world * grown)
    except ConfigError:
        return None
    mode = ActCkpt(trial.parallel.activation_checkpointing).value
    need = max(total(r, mode) for r in estimate(trial, shape, seq_len)["rows"])
    what = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items())
    return f"{what} ({need / GiB:.2f} GiB)"


def _shards_seq_len(path) -> tuple[int | None, str | None]:
    """(the sequence length of the shards in data.path, where it came from); (None, None) where they cannot be read
    (a plan made away from the data)."""
    try:
        return read_manifest(os.path.expanduser(str(path))).seq_len, f"the shards in {path}"
    except Exception:  # noqa: BLE001 - missing, unreadable: the model's longest then
        return None, None


def main(cfg) -> int:
    """Validate like a run would, then print the plan; returns 0 (or exits 2 on a config error)."""
    notes, world = [], world_of(cfg.parallel, local_device_count())
    try:
        if cfg.cluster.gpus_per_node and (cfg.parallel.dp != "auto" or cfg.cluster.nodes):  # as a submission
            shape = job_shape(cfg.parallel, cfg.cluster)  # places it: whole nodes (dp=auto: filling cluster.nodes)
            world = shape["nodes"] * shape["tasks_per_node"]
            notes.append(f"a Slurm job of {shape['nodes']} node(s) × {shape['tasks_per_node']} rank(s)")
        elif cfg.parallel.dp == "auto":
            notes.append(f"parallel.dp=auto: planned for dp={world // (cfg.parallel.tp * cfg.parallel.pp)} "
                         "(this node's devices); set parallel.dp, or cluster.nodes and cluster.gpus_per_node, to "
                         "plan another size")
        plan = resolve(cfg, world)  # the same checks, and one-line errors, as a run
    except ConfigError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    seq_len, origin = cfg.train.seq_len, "train.seq_len"
    if seq_len is None:  # as the run takes it: the shards' blocks, where they can be read here
        seq_len, origin = _shards_seq_len(cfg.data.path)
        if seq_len is None:
            seq_len, origin = cfg.model.max_seq_len, "model.max_seq_len"
        notes.append(f"train.seq_len unset: planned for seq_len {seq_len} ({origin})")
    try:
        check_cp_seq_len(seq_len, plan.layout, cfg.parallel.sequence_parallel, f"seq_len ({origin})")
        text, _ = report(cfg, plan, seq_len, notes)
    except ConfigError as e:  # (cluster.gpu_type without rates of its own)
        print(f"hpctrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(text)
    if cfg.data.sources:
        from hpctrain.training.feed import mixture_summary

        try:
            print(mixture_summary(cfg.data, cfg.train.max_steps, plan.global_batch, seq_len))
        except DataError as e:
            print(f"hpctrain: error: {e}", file=sys.stderr)
            sys.exit(2)
    return 0
