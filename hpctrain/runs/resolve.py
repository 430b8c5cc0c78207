"""From a composed config to the numbers a run is built from: the layout, the batch split, the sequence length.

`resolve()` runs every check that relates several keys, before anything is spawned, submitted or written,
and raises ConfigError with one line that names the numbers and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.core.config import (
    MAX_LR,
    ConfigError,
    GradCompression,
    LrScaling,
    OptimConfig,
    OptimImpl,
    OptimName,
    PrecisionName,
    check_keys,
    check_sbatch_text,
    check_values,
    signal_number,
)
from hpctrain.models import spec_of
from hpctrain.parallel.layout import Layout


@dataclass(frozen=True)
class RunShape:
    """A run's layout and batch split, after derivation and checks."""

    layout: Layout
    global_batch: int
    micro_batch: int
    grad_accum: int
    seq_len: int | None  # None until the data manifest is known

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp


def _batch(global_batch, micro_batch, grad_accum, dp) -> tuple[int, int, int]:
    fix = "set two of train.global_batch / train.micro_batch / train.grad_accum and let the third be derived"
    for name, v in (("global_batch", global_batch), ("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        if v is not None and v < 1:
            raise ConfigError(f"train.{name}={v} must be >= 1")
    if micro_batch is None and grad_accum is None:
        grad_accum = 1
    if global_batch is None:
        if micro_batch is None:
            raise ConfigError(f"train.global_batch and train.micro_batch are both unset: {fix}")
        return micro_batch * (grad_accum or 1) * dp, micro_batch, grad_accum or 1
    if micro_batch is None:
        if global_batch % (grad_accum * dp):
            raise ConfigError(
                f"train.global_batch={global_batch} is not divisible by grad_accum×dp={grad_accum}×{dp}: "
                f"choose a global_batch that is a multiple of {grad_accum * dp}"
            )
        return global_batch, global_batch // (grad_accum * dp), grad_accum
    if grad_accum is None:
        if global_batch % (micro_batch * dp):
            raise ConfigError(
                f"train.global_batch={global_batch} is not divisible by micro_batch×dp={micro_batch}×{dp}: "
                f"choose a global_batch that is a multiple of {micro_batch * dp}, or another micro_batch"
            )
        return global_batch, micro_batch, global_batch // (micro_batch * dp)
    if micro_batch * grad_accum * dp != global_batch:
        raise ConfigError(
            f"train.global_batch={global_batch} != micro_batch×grad_accum×dp={micro_batch}×{grad_accum}×{dp}"
            f"={micro_batch * grad_accum * dp}: {fix}"
        )
    return global_batch, micro_batch, grad_accum


def scaled_lr(ocfg: OptimConfig, global_batch: int) -> float:
    """`optim.lr` was tuned at `ref_global_batch`; scale it to this run's global batch."""
    ratio = global_batch / ocfg.ref_global_batch
    factor = {LrScaling.none: 1.0, LrScaling.linear: ratio, LrScaling.sqrt: math.sqrt(ratio)}[ocfg.lr_scaling]
    return ocfg.lr * factor


def _check_schedule(ocfg: OptimConfig, global_batch: int) -> None:
    if ocfg.decay_steps is not None and ocfg.decay_steps <= ocfg.warmup_steps:
        raise ConfigError(f"optim.decay_steps={ocfg.decay_steps} must be > optim.warmup_steps={ocfg.warmup_steps}: it "
                          "is the step the decay ends at (null: train.max_steps)")
    lr = scaled_lr(ocfg, global_batch)
    if lr > MAX_LR:
        raise ConfigError(f"optim.lr={ocfg.lr} scaled ({LrScaling(ocfg.lr_scaling).value}) from "
                          f"optim.ref_global_batch={ocfg.ref_global_batch} to the global batch {global_batch} is {lr:.4g},"
                          f" above {MAX_LR:g}: lower optim.lr, or set optim.ref_global_batch to the batch it was tuned at")


def _check_profile_steps(steps, max_steps: int) -> None:
    if steps is None:
        return
    steps = list(steps)
    if len(steps) != 2 or not all(isinstance(s, int) for s in steps) or not 1 <= steps[0] <= steps[1] <= max_steps:
        raise ConfigError(f"train.profile_steps={steps} must be [first, last] steps with 1 <= first <= last <= "
                          f"train.max_steps={max_steps}, e.g. train.profile_steps=[10,12] (leave out the first steps: "
                          "compile and allocator warm-up)")


def _check_sophia(cfg, layout: Layout) -> None:
    """Sophia's curvature pass samples labels from the model's logits, in a forward and backward of its own."""
    if cfg.optim.name != OptimName.sophia:
        return
    why = None
    if cfg.train.fused_loss:
        why = "train.fused_loss=true never makes the logits its labels are sampled from: drop train.fused_loss"
    elif layout.pipelined:
        why = (f"parallel.pp={layout.pp}: its curvature pass is a forward and backward outside the pipeline schedule; "
               "use dp/tp, or optim=adamw")
    elif cfg.precision.name == PrecisionName.fp16:
        why = "precision=fp16: its curvature pass would need its own loss scaling; use precision=bf16"
    elif cfg.parallel.grad_compression != GradCompression.none:
        why = (f"parallel.grad_compression={cfg.parallel.grad_compression.value} would compress the curvature "
               "pass's gradients into the error feedback: drop one of them")
    if why:
        raise ConfigError(f"optim=sophia with {why}")


def _check_adafactor(cfg, layout: Layout) -> None:
    """torch.optim.Adafactor factors a matrix's second moment along its rows and columns, which a DTensor sharded
    along one of them cannot (foreach or not: "in-place operations that require placement changes are not
    supported", at the first step)."""
    sharded = "parallel.tp" if layout.tp > 1 else \
        "parallel.zero_stage" if cfg.parallel.zero_stage >= 2 and layout.dp * layout.cp > 1 else None
    if cfg.optim.name == OptimName.adafactor and sharded:
        value = layout.tp if sharded == "parallel.tp" else cfg.parallel.zero_stage
        raise ConfigError(f"optim=adafactor with sharded weights ({sharded}={value}): "
                          "torch's Adafactor cannot update a sharded matrix; use parallel=ddp (zero_stage=0, tp=1), "
                          "or optim=adamw")


def _check_cp(cfg, layout: Layout, args) -> None:
    """What context parallelism does not (yet) compose with, and the sequence length it splits."""
    if layout.cp == 1:
        return
    why = None
    if cfg.optim.name == OptimName.sophia:
        why = "optim=sophia: its sampled labels are drawn per position of the whole sequence"
    elif args.rope_scaling.type.value == "dynamic":
        why = "model.rope_scaling.type=dynamic: its tables depend on the whole sequence's length"
    if why:
        raise ConfigError(f"parallel.cp={layout.cp} with {why}; use cp=1 for this run")
    check_cp_seq_len(cfg.train.seq_len, layout, cfg.parallel.sequence_parallel, "train.seq_len")


def check_cp_seq_len(seq_len: int | None, layout: Layout, sequence_parallel: bool, what: str) -> None:
    """Context parallelism cuts each sequence into 2·cp equal chunks, each rank's pair split further over tp with
    sequence parallelism; `what` names where `seq_len` came from."""
    unit = 2 * layout.cp * (layout.tp if sequence_parallel else 1)
    if layout.cp > 1 and seq_len is not None and seq_len % unit:
        raise ConfigError(f"{what}={seq_len} is not divisible by {unit} (2 chunks per cp rank, parallel.cp="
                          f"{layout.cp}{f', times tp={layout.tp} with sequence parallel' if unit > 2 * layout.cp else ''}"
                          f"): choose a seq_len that is a multiple of {unit}")


def resolve(cfg, world: int = 1) -> RunShape:
    """Derive and check the numbers a run on `world` ranks needs; raise ConfigError on the first problem."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    check_keys(cfg)
    check_values(cfg)
    check_sbatch_text(cfg.cluster)
    signal_number(cfg.cluster.signal)
    spec = spec_of(cfg.model)
    layout = Layout.from_config(p, world)
    spec.check_layout(spec.args(m), layout, p.sequence_parallel)
    if t.export_hf_at_end and spec.args(m).moe.bias_update_rate:  # (else the run ends failed, after training)
        raise ConfigError("train.export_hf_at_end=true with model.moe.bias_update_rate: transformers' MoE classes have "
                          "no routing bias, so export-hf refuses a checkpoint whose bias has moved: drop one of them")
    if p.compile and spec.args(m).moe.num_experts:
        # Measured on torch 2.13 (CPU): fullgraph tracing fails in _grouped_mm's fake kernel (bf16 only), and the
        # routed shapes are data-dependent.
        raise ConfigError("parallel.compile=true with MoE layers is not supported (torch.compile cannot trace the "
                          "routed experts' data-dependent shapes): set parallel.compile=false")
    if p.sequence_parallel and t.seq_len is not None and t.seq_len % layout.tp:
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by parallel.tp={layout.tp} with "
                          "sequence_parallel: choose a seq_len that is a multiple of tp")
    _check_sophia(cfg, layout)
    _check_adafactor(cfg, layout)
    _check_cp(cfg, layout, spec.args(m))
    if cfg.optim.name in (OptimName.adafactor, OptimName.lamb, OptimName.sophia) and \
            cfg.optim.implementation == OptimImpl.fused:
        raise ConfigError(f"optim.implementation=fused: {cfg.optim.name.value} has no fused kernel; use "
                          "optim.implementation=foreach (or optim=adamw)")
    if t.export_hf_at_end and not t.checkpointing:
        raise ConfigError("train.export_hf_at_end=true exports the final checkpoint, and train.checkpointing=false "
                          "writes none: drop one of them")
    if t.fused_loss and (layout.pipelined or layout.loss_parallel):
        raise ConfigError(f"train.fused_loss=true needs parallel.tp=1 and parallel.pp=1 (got tp={layout.tp}, "
                          f"pp={layout.pp}: tensor parallelism computes the loss on vocab-sharded logits, a pipeline "
                          "inside its schedule): drop train.fused_loss")
    if t.restart_positions and not t.document_mask:
        raise ConfigError("train.restart_positions=true restarts positions at each packed document, and "
                          "train.document_mask=false keeps none apart: set train.document_mask=true too")
    if p.grad_compression != GradCompression.none and cfg.precision.name == PrecisionName.fp16:
        raise ConfigError(f"parallel.grad_compression={p.grad_compression.value} with precision=fp16: the loss "
                          "scale changes the units of its error-feedback residual from step to step; use "
                          "precision=bf16 (no loss scale) or grad_compression=none")
    _check_profile_steps(t.profile_steps, t.max_steps)
    gb, mb, ga = _batch(t.global_batch, t.micro_batch, t.grad_accum, layout.dp)
    layout.check_microbatches(ga)
    _check_schedule(cfg.optim, gb)
    if t.seq_len is not None and t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: lower train.seq_len "
            f"or raise model.max_seq_len"
        )
    return RunShape(layout, gb, mb, ga, t.seq_len)
