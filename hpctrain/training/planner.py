"""`python -m hpctrain plan <overrides>`: layer-to-stage map, per-device memory, bubble and FLOPs of a layout.

Nothing is allocated: parameters are counted on a model built on the meta device, the rest is arithmetic.
Memory per device, in bytes, with P the parameters a device holds (TP-sharded matrices / tp + replicated
norms), c the compute dtype size (2 for bf16/fp16, else 4), s·b tokens of one micro-batch:

  parameters   4·P / (dp if zero_stage>=2)            fp32 master weights (FSDP2 shards them at ZeRO-2 too)
  buffers      the model's own buffers on every stage: the RoPE tables, 2 · 4 · max_seq_len · head_dim
  gradients    4·P / (dp if zero_stage>=2)            + 4·P with accumulation and sharded_accumulation=false
                                                      + 4·P: grad_compression's residual (8·P with
                                                        loss_spike.action=skip_batch: the previous one kept)
  optimizer    AdamW, LAMB, Sophia 8·P, SGD+momentum 4·P, Adafactor 4·(rows+cols of matrices + norms);
               / (dp if zero>=2);
               the step's temporary: 4·P (same share) with optim.implementation=foreach, none fused
  compute copy zero 3: 2 blocks gathered · c; zero 2 and replicate (dp>1): P · c; one replica in bf16/fp16:
               P · 2 (autocast's weight casts, kept for backward)
  activations  per block, s·b · ACT_BYTES (measured with saved-tensor hooks; see block_act_bytes); a
               checkpointed block keeps its input. Times the micro-batches in flight (m = grad_accum per step):
               1F1B min(m, pp−stage), GPipe m, interleaved / zero-bubble ×(1+(pp−1)/(pp·v)).
  loss         s·b·vocab/tp · 12 (16 with loss_parallel): fp32 log-probabilities kept, their gradient, the
               logits' gradient; a pipeline's last stage also keeps its output logits (· c). train.fused_loss:
               4·vocab·dim + 4·s·b·dim (the gradients it made in forward) + one chunk's logits (· (4 + c)) or
               the weight gradient's per-chunk temporaries, whichever is larger
  reducing     dp>1: the last unit backward reduces (root, else a block; replicate: the model) · (2c + 4);
               grad_compression: 3 buckets (a bucket: 25 MB of gradients, or the embedding's if larger):
               its flat buffer, PowerSGD's copy, the new residual
The peak is the largest of three moments (`total`): backward's start, backward's end under data parallelism,
the optimizer step. With parallel.cpu_offload the first three live on the host. Verdict: worst stage <= 90 %
of cluster.gpu_mem_gb. docs/planner.md gives the measured accuracy and how it was measured.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from hpctrain.core.config import (
    ActCkpt,
    ConfigError,
    GradCompression,
    OptimImpl,
    OptimName,
    PrecisionName,
    SpikeAction,
)
from hpctrain.models import ModelSpec, spec_of
from hpctrain.monitoring.metrics import PEAK_TFLOPS
from hpctrain.parallel.compression import BUCKET_BYTES
from hpctrain.parallel.layout import world_of
from hpctrain.parallel.process_group import local_device_count
from hpctrain.runs.resolve import RunShape, resolve
from hpctrain.training.optimizer import implementation

GiB = 2**30
HEADROOM = 0.9  # usable share of device memory: allocator fragmentation, NCCL buffers, CUDA context
MFU = 0.4


def layer_map(n_layers: int, pp: int, v: int = 1) -> list[list[range]]:
    """Per stage, its chunks of contiguous layers: stage s of virtual round r holds chunk r·pp + s.

    Chunks split the layers evenly; the first n_layers % (pp·v) chunks get one layer more.
    """
    n = pp * v
    sizes = [n_layers // n + (i < n_layers % n) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [[range(starts[r * pp + s], starts[r * pp + s] + sizes[r * pp + s]) for r in range(v)]
            for s in range(pp)]


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

    def per_device(self, tp: int) -> int:
        return self.sharded // tp + self.replicated


def _count(st: StageParams, params) -> int:
    total = 0
    for p in params:
        total += p.numel()
        if p.dim() > 1:
            st.sharded += p.numel()
            st.factored += p.shape[0] + p.shape[1]
        else:
            st.replicated += p.numel()
            st.factored += p.numel()
    return total


def stage_params(args, pp: int, v: int = 1, spec: ModelSpec | None = None) -> list[StageParams]:
    """Count each stage's parameters on a meta-device model (no memory is allocated)."""
    spec = spec or _default_spec()
    with torch.device("meta"):
        model = spec.build(args)
    stages = [StageParams(chunks) for chunks in layer_map(args.n_layers, pp, v)]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # (conservative: a block's, everywhere)
    for i, st in enumerate(stages):
        st.buffers = buffers
        for chunk in st.layers:
            for layer in chunk:
                st.largest_block = max(st.largest_block, _count(st, model.layers[str(layer)].parameters()))
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


# Bytes a Llama block saves for backward, per token, measured with saved-tensor hooks (see the module docstring):
# (norm-side, linear inputs) × h replicated over tp (the first split by sequence parallelism), then
# (h, kv_dim, ffn) coefficients of what tp shards.
ACT_BYTES = {"fp32": (16, 8, (8, 8, 16)),  # fp32 / tf32
             "autocast": (16, 10, (4, 4, 8)),  # bf16/fp16 autocast over fp32 parameters: fp32 residual stream
             "lowp": (12, 4, (4, 4, 8))}  # bf16/fp16 parameters (FSDP/replicate MixedPrecisionPolicy)


def act_kind(c: int, dp: int) -> str:
    """Which activations a block saves: fp32; autocast over fp32 parameters (one process per replica);
    low-precision parameters, which data parallel gathers (FSDP2's MixedPrecisionPolicy)."""
    return "fp32" if c == 4 else "lowp" if dp > 1 else "autocast"


def block_act_bytes(args, tokens: int, kind: str, tp: int, sp: int) -> float:
    """What one block saves for backward over `tokens` tokens (tp-sharded parts / tp, norm side / sp)."""
    norm, lin, (kh, kkv, kf) = ACT_BYTES[kind]
    per_token = (norm * args.dim / sp + lin * args.dim
                 + (kh * args.dim + kkv * args.kv_heads * args.head_dim + kf * args.ffn_hidden) / tp
                 + 8 + 4 * args.n_heads / tp)  # RMSNorm statistics, attention log-sum-exp
    return tokens * per_token


def estimate(cfg, plan: RunShape, seq_len: int) -> dict:
    """Per-stage memory parts in bytes, keyed by activation-checkpointing mode, plus the step numbers."""
    spec, p, pr, layout = spec_of(cfg), cfg.parallel, cfg.precision, plan.layout
    args = spec.args(cfg.model)
    dp, tp, pp, v = layout.dp, layout.tp, layout.pp, layout.pp_virtual_stages
    c = 2 if PrecisionName(pr.name) in (PrecisionName.bf16, PrecisionName.fp16) else 4
    z2 = dp if p.zero_stage >= 2 else 1  # FSDP2 shards parameters, gradients and state from ZeRO-2 on
    # ZeRO-2/3 accumulating without reducing each micro-batch holds full-size gradients too (not pipelines:
    # each schedule run reduces).
    full_grads = z2 > 1 and plan.grad_accum > 1 and not p.sharded_accumulation and not layout.pipelined
    # A pipelined step runs its grad_accum micro-batches through one schedule: they are the pipeline's.
    m = plan.grad_accum if layout.pipelined else 1
    b = plan.micro_batch
    sp = tp if p.sequence_parallel else 1
    # parallel.grad_compression: fp32 parameters under autocast as one process, plus each rank's residual (4·P,
    # kept between steps) and, at backward's end, three buckets (below).
    compressed = dp > 1 and GradCompression(p.grad_compression) != GradCompression.none
    residuals = 2 if SpikeAction(cfg.monitor.loss_spike.action) == SpikeAction.skip_batch else 1  # + the undo's
    replicas = 1 if compressed else dp
    kind = act_kind(c, replicas)
    act_layer = block_act_bytes(args, seq_len * b, kind, tp, sp)
    act_input = seq_len * b * (2 if kind == "lowp" else 4) * args.dim / sp  # a checkpointed block keeps its input
    schedule = layout.pp_schedule if layout.pipelined else "none"
    stages = stage_params(args, pp, v, spec)
    rows = []
    for i, st in enumerate(stages):
        P = st.per_device(tp)
        opt, opt_temp = _optimizer_bytes(cfg.optim, st, P, tp, dtensors=dp > 1 or tp > 1)
        flight = _in_flight(schedule, pp, i, m, v)
        idx = [j for chunk in st.layers for j in chunk]
        n, acts, recompute = len(idx), {}, {}
        for mode in ActCkpt:  # selective checkpoints blocks whose global index is a multiple of ac_every
            ck = 0 if mode == ActCkpt.none else n if mode == ActCkpt.full else sum(j % p.ac_every == 0 for j in idx)
            acts[mode.value] = flight * (ck * act_input + (n - ck) * act_layer)
            recompute[mode.value] = act_layer if ck else 0  # one block recomputed at a time, in backward
        # The loss at the start of backward: fp32 log-probabilities kept for backward, their gradient and the
        # logits' (one more with loss_parallel, which keeps its own softmax statistics of the vocab shard).
        # A pipeline schedule also keeps the last stage's output (the logits, in the compute dtype).
        logits = (_loss_bytes(args, seq_len * b, tp, c, layout.pipelined, cfg.train.fused_loss)
                  if i == pp - 1 else 0)
        off = 0 if p.cpu_offload else 1  # FSDP CPU offload keeps sharded params, grads and state on the host
        grads = off * 4 * P / z2 + (4 * P if full_grads else 0) + (residuals * 4 * P if compressed else 0)
        # train.ckpt_async copies the checkpoint's shard (fp32 parameters, optimizer state) to host memory, kept
        # between saves.
        async_copy = (4 * P + opt) / z2 if cfg.train.ckpt_async and cfg.train.checkpointing else 0
        rows.append({"stage": i, "desc": _describe(i, st, pp), "params_per_device": P, "params": off * 4 * P / z2,
                     "buffers": st.buffers,
                     "grads": grads, "held_grads": grads if plan.grad_accum > 1 else 0,  # only when accumulating
                     "optim": off * opt / z2, "opt_temp": off * opt_temp / z2,
                     "copies": _copies(p.zero_stage, replicas, c, st, P, tp),
                     # A bucket: 25 MB of whole gradients, or one larger gradient (the embedding's); PowerSGD
                     # also holds its copy, and the new residual.
                     "reducing": (3 * min(max(BUCKET_BYTES, 4 * args.vocab_size * args.dim), 4 * P) if compressed
                                  else _reducing(p.zero_stage, dp, c, st, P, tp)),
                     "acts": acts, "recompute": recompute, "logits": logits, "flight": flight,
                     "async_copy": async_copy})
    bubble = layout.bubble(m)
    flops = spec.flops_per_token(args, seq_len) * plan.global_batch * seq_len
    return {"stages": stages, "rows": rows, "m": m, "b": b, "schedule": schedule, "bubble": bubble,
            "flops": flops, "args": args, "c": c}


def _loss_bytes(args, tokens: int, tp: int, c: int, pipelined: bool, fused: bool) -> float:
    """The loss's buffers at the start of backward. Plain: fp32 log-probabilities kept for backward, their
    gradient and the logits' (one more with loss_parallel, which keeps its own softmax statistics of the vocab
    shard); a pipeline schedule also keeps the last stage's output (the logits, in the compute dtype).
    train.fused_loss: the gradients it computed in forward (the weight's in fp32, the hidden states'), its
    compute-dtype copies of both inputs, and one chunk's fp32 logits with their compute-dtype gradient."""
    if not fused:
        return tokens * args.vocab_size / tp * ((16 if tp > 1 else 12) + (c if pipelined else 0))
    from hpctrain.models.cross_entropy import chunk_tokens

    weight, hidden = args.vocab_size * args.dim, tokens * args.dim
    copies = (weight + hidden) * c if c == 2 else 0
    chunk = min(tokens, chunk_tokens(args.vocab_size)) * args.vocab_size
    # A chunk's peak: its fp32 logits (the gradient is made in place) and, in bf16/fp16, the gradient's cast; then
    # that gradient and the weight gradient's matmul result with, in bf16/fp16, its fp32 copy.
    low = c == 2
    return 4 * weight + 4 * hidden + copies + max(chunk * (4 + (c if low else 0)),
                                                   chunk * c + weight * (c + (4 if low else 0)))


def _optimizer_bytes(ocfg, st: StageParams, P: int, tp: int, dtensors: bool) -> tuple[float, float]:
    """(state, the step's temporary): foreach optimizers make one parameter-sized temporary (AdamW: the square
    root of the second moment, LAMB's update made from it in place); fused ones none (`dtensors`: the layout's
    parameters are DTensors)."""
    name = OptimName(ocfg.name)
    state = {OptimName.adamw: 8 * P, OptimName.lamb: 8 * P, OptimName.sophia: 8 * P,
             OptimName.sgd: 4 * P if ocfg.momentum > 0 else 0, OptimName.adafactor: 4 * st.factored / tp}[name]
    plain_sgd = name == OptimName.sgd and ocfg.momentum == 0
    return state, 0 if plain_sgd or implementation(ocfg, dtensors) == OptimImpl.fused else 4 * P


def _copies(zero_stage: int, dp: int, c: int, st: StageParams, P: int, tp: int) -> float:
    """Parameters in the compute dtype beside the fp32 ones, from forward to backward."""
    if dp > 1 and zero_stage == 3:  # two blocks gathered: the current one and the prefetched next
        return 2 * st.largest_block / tp * c
    if dp > 1:  # ZeRO-2 and replicate keep every gathered parameter
        return P * c
    return P * 2 if c == 2 else 0  # autocast's casts of the weights, kept for backward


def _reducing(zero_stage: int, dp: int, c: int, st: StageParams, P: int, tp: int) -> float:
    """The end of backward under data parallelism: the last unit reduced (the root's embedding, else a block;
    replicate's whole model) holds its gathered parameters, its unsharded gradients and their fp32 reduce copy;
    the other units are resharded by then (ZeRO-2 too: it reshards after backward)."""
    if dp == 1:
        return 0
    unit = P if zero_stage == 0 else (st.root or st.largest_block) / tp
    return unit * (2 * c + 4)


def _in_flight(schedule: str, pp: int, stage: int, m: int, v: int) -> float:
    """Micro-batches whose activations a stage holds at once."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    return min(m, pp - stage) * (1 + (pp - 1) / (pp * v) if v > 1 else 1)


def total(row: dict, mode: str) -> float:
    """The largest of three peaks: backward's start (the saved activations and the loss's buffers, or a recomputed
    block instead of the latter; gradients only when accumulating), backward's end under data parallelism (every
    gradient, the last unit's being reduced) and the optimizer step (its temporary)."""
    resident = row["params"] + row["optim"] + row["buffers"]
    backward = (resident + row["held_grads"] + row["copies"] + row["acts"][mode]
                + max(row["logits"], row["recompute"][mode]))
    reduced = resident + row["grads"] + row["reducing"] if row["reducing"] else 0
    step = resident + row["grads"] + row["opt_temp"]
    return max(backward, reduced, step)


# The parts `largest_part` names, with what shrinks each.
PARTS = {
    "weights": ("the weights, gradients and optimizer state", "spread them over more ranks (parallel.dp with "
                "parallel.zero_stage=3, parallel.tp, parallel.pp)"),
    "acts": ("the activations", "lower train.micro_batch (train.grad_accum keeps the global batch) or set "
             "parallel.activation_checkpointing=full"),
    "logits": ("the loss's buffers (tokens × vocabulary)", "set train.fused_loss=true or lower train.micro_batch"),
    "buffers": ("the RoPE tables (model.max_seq_len × head_dim)", "lower model.max_seq_len to the longest sequence "
                "this model will see"),
}


def largest_part(cfg, plan: RunShape, seq_len: int) -> tuple[str, float, str]:
    """(what, bytes, how to shrink it): the largest part of the most loaded device's estimate."""
    mode = ActCkpt(cfg.parallel.activation_checkpointing).value
    row = max(estimate(cfg, plan, seq_len)["rows"], key=lambda r: total(r, mode))
    parts = {"weights": sum(row[k] for k in ("params", "grads", "optim", "opt_temp", "copies", "reducing")),
             "acts": row["acts"][mode] + row["recompute"][mode], "logits": row["logits"], "buffers": row["buffers"]}
    name = max(parts, key=parts.get)
    return PARTS[name][0], parts[name], PARTS[name][1]


def stage_bytes(cfg, plan: RunShape, seq_len: int) -> list[tuple[float, float]]:
    """Estimated memory of a device of each pipeline stage, with the run's activation checkpointing, and the host
    memory its rank holds besides (train.ckpt_async's copy)."""
    mode = ActCkpt(cfg.parallel.activation_checkpointing).value
    return [(total(row, mode), row["async_copy"]) for row in estimate(cfg, plan, seq_len)["rows"]]


def _peak_tflops(cfg) -> float | None:
    if cfg.cluster.peak_tflops:
        return cfg.cluster.peak_tflops
    gpu = OmegaConf.select(cfg, "gpu")  # optional `+gpu=H100`
    table = PEAK_TFLOPS.get(str(gpu)) if gpu else None
    return table[str(PrecisionName(cfg.precision.name).value)] if table else None


def report(cfg, plan: RunShape, seq_len: int, notes: list[str]) -> tuple[str, bool | None]:
    """The printed plan and the verdict (None when cluster.gpu_mem_gb is unset)."""
    e = estimate(cfg, plan, seq_len)
    p, args, rows = cfg.parallel, e["args"], e["rows"]
    mode = ActCkpt(p.activation_checkpointing).value
    out = [f"model {cfg.model.name}: {sum(s.sharded + s.replicated for s in e['stages']) / 1e9:.3f}B parameters "
           f"(counted on the meta device); layout pp×dp×tp = {plan.pp}×{plan.dp}×{plan.tp} = {plan.world} devices",
           f"batch: global {plan.global_batch} = micro {plan.micro_batch} × accum {plan.grad_accum} × dp {plan.dp}"
           f", seq_len {seq_len}; precision {PrecisionName(cfg.precision.name).value}, zero_stage {p.zero_stage}"
           f", sequence_parallel {p.sequence_parallel}, activation_checkpointing {mode}"]
    out += [f"note: {n}" for n in notes]
    out.append(f"\nlayer-to-stage map ({plan.pp} stage(s) × {plan.layout.pp_virtual_stages} virtual):")
    out += [f"  stage {r['stage']}: {r['desc']}  ({r['params_per_device'] / 1e6:.1f}M params per device)" for r in rows]
    gib = lambda x: f"{x / GiB:8.2f}"  # noqa: E731
    out.append("\nper-device memory, GiB (one column per stage):")
    out.append(f"  {'':28}" + "".join(f"{'stage ' + str(r['stage']):>10}" for r in rows))
    lines = [("parameters (fp32)", "params"), ("buffers (RoPE tables)", "buffers"), ("gradients (fp32)", "grads"),
             (f"optimizer ({OptimName(cfg.optim.name).value})", "optim"),
             (f"optimizer temporary ({implementation(cfg.optim, plan.dp > 1 or plan.tp > 1).value})", "opt_temp"),
             (f"compute copies ({'bf16/fp16' if e['c'] == 2 else 'fp32'})", "copies"),
             ("loss buffers", "logits"), ("last unit being reduced", "reducing")]
    for label, key in lines:
        out.append(f"  {label:28}" + "".join(f"{gib(r[key]):>10}" for r in rows))
    for m in dict.fromkeys(["none", "full", mode]):
        out.append(f"  {'activations, ckpt=' + m:28}" + "".join(f"{gib(r['acts'][m]):>10}" for r in rows))
    for m in dict.fromkeys(["none", "full", mode]):
        out.append(f"  {'TOTAL, ckpt=' + m:28}" + "".join(f"{gib(total(r, m)):>10}" for r in rows))
    out.append("  (TOTAL is the largest of three moments, not the sum: backward's start, backward's end under data "
               "parallelism, the optimizer step)")
    if any(r["async_copy"] for r in rows):
        out.append(f"  {'host copy (train.ckpt_async)':28}" + "".join(f"{gib(r['async_copy']):>10}" for r in rows)
                   + "  (host memory per rank, besides the above)")
    flight = ", ".join(f"{r['flight']:g}" for r in rows)
    out.append(f"  micro-batches in flight: {flight} "
               f"(schedule {e['schedule']}, m={e['m']} micro-batches of {e['b']:g} sample(s))")
    pp, v, m = plan.pp, plan.layout.pp_virtual_stages, e["m"]
    out.append(f"\npipeline bubble: (pp−1)/(m·v + pp−1) = ({pp}−1)/({m}·{v} + {pp}−1) = {e['bubble']:.1%} "
               "of each step's schedule (m = micro-batches per step, v = virtual stages)")
    line = f"FLOPs per step: flops_per_token × global_batch × seq_len = {e['flops']:.3e}"
    peak = _peak_tflops(cfg)
    if peak:
        line += (f"; ideal step time at {MFU:.0%} MFU on {plan.world} × {peak:g} TFLOPS: "
                 f"{e['flops'] / (plan.world * peak * 1e12 * MFU):.2f} s")
    out.append(line)
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
        out.append("suggestion: " + _suggest(cfg, plan, worst, usable, args))
    return "\n".join(out), fits


def _suggest(cfg, plan: RunShape, worst: dict, usable: float, args) -> str:
    p, tips = cfg.parallel, []
    if ActCkpt(p.activation_checkpointing) != ActCkpt.full and worst["full"] <= usable:
        return "set parallel.activation_checkpointing=full (fits then)"
    if ActCkpt(p.activation_checkpointing) != ActCkpt.full:
        tips.append("parallel.activation_checkpointing=full")
    if plan.dp > 1 and p.zero_stage < 3:
        tips.append("parallel.zero_stage=3")
    elif plan.dp == 1:
        tips.append("shard over data parallel: parallel.dp=N with parallel.zero_stage=3")
    if plan.tp < 8 and args.kv_heads % (plan.tp * 2) == 0:
        tips.append(f"raise parallel.tp to {plan.tp * 2}")
    if not p.sequence_parallel and plan.tp > 1:
        tips.append("parallel.sequence_parallel=true")
    tips.append("raise parallel.pp or lower train.micro_batch")
    return "; ".join(tips)


def main(cfg) -> int:
    """Validate like a run would, then print the plan; returns 0 (or exits 2 on a config error)."""
    notes, world = [], world_of(cfg.parallel, local_device_count())
    if cfg.parallel.dp == "auto":
        notes.append(f"parallel.dp=auto: planned for dp={world // (cfg.parallel.tp * cfg.parallel.pp)} "
                     "(this node's devices); set parallel.dp to plan another size")
    try:
        plan = resolve(cfg, world)  # the same checks, and one-line errors, as a run
    except ConfigError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    seq_len = cfg.train.seq_len
    if seq_len is None:
        seq_len = cfg.model.max_seq_len
        notes.append(f"train.seq_len unset: planned for model.max_seq_len={seq_len}")
    text, _ = report(cfg, plan, seq_len, notes)
    print(text)
    return 0
