"""The step-time model: how long one optimizer step of a layout takes on a GPU type, from first principles.

Nothing runs: FLOPs at the rate a GPU reaches on matrices of the run's shapes, memory-bound kernels at its memory
bandwidth, and every collective the layout issues from its size and the link it crosses (NVLink inside a node,
InfiniBand across), with the overlaps hpctrain implements, inside the pipeline's schedule. Per micro-batch, on the
busiest pipeline stage (one GPU of it):

  compute       2·tokens·matmul weights per pass (forward 1, backward 2, recomputation 1 for every checkpointed
                block) / tp, at `gemm_tflops` × a shape factor (h/tp)/(h/tp + 128); attention's 4·tokens·seq·dim
                per pass at `attn_frac` of that (the causal kernel skips the masked half); under an explicit mask
                (document masking, context parallelism's chunks, a window shorter than the sequence) every score
                the mask spans, at MASKED_ATTN_FRAC of that rate; a materialized score matrix (no fused kernel)
                costs its reads and writes at `hbm_gbps` instead
  elementwise   norms, residual adds, RoPE, the SwiGLU product: ~20·dim values read or written per token, layer
                and forward pass fused (parallel.compile), 133 eager (measured), at `hbm_gbps` (sharded by tp where
                sequence parallelism shards them)
  tp            per layer and pass two all-reduces (or all-gather + reduce-scatter) of the micro-batch's activations
  cp, ep        the K/V all-gathers (parallel/context.gathered_bytes), the experts' all-to-alls
                (parallel/experts.all_to_all_bytes)
  pp            the activation a stage sends forward and its gradient back
  fsdp          ZeRO-3 gathers the weights in forward and again in backward, ZeRO-2 once; both reduce-scatter the
                gradients: exposed where they exceed the compute they are prefetched under
then the step: m micro-batches / (1 − bubble) (layout.bubble), plus the data-parallel all-reduce (ZeRO-0) beyond the
last micro-batch's backward it overlaps with, plus the optimizer's pass over its shard at `hbm_gbps`.

A collective of n ranks, g on each of k nodes (the mesh order puts tp innermost: parallel/layout.MESH_DIMS):
an all-reduce of S bytes takes 2·S·(g−1)/g over NVLink plus 2·S·(k−1)/k over the g NICs of a node (NCCL's
rings are hierarchical in effect), an all-gather or reduce-scatter half that; latency 2·(g−1 + log2 k) steps for an
all-reduce (NCCL's trees), one per rank of the ring for an all-gather or reduce-scatter.

docs/choosing-a-layout.md checks the predictions against published runs (the validation table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from hpctrain.core.config import ActCkpt, ConfigError, PrecisionName, ReduceDtype
from hpctrain.models.moe import expert_hidden, is_sparse
from hpctrain.models.packing import packed_masks, window_masks
from hpctrain.monitoring.metrics import PEAK_TFLOPS
from hpctrain.parallel.context import gathered_bytes
from hpctrain.parallel.experts import all_to_all_bytes
from hpctrain.parallel.layout import Layout, layer_map

# dim-wide values a block's memory-bound kernels read or write per token in its forward pass. Fused (torch.compile,
# Megatron's fused kernels): the norms, residual adds, RoPE and the SwiGLU product each read and write once, ~20.
# Eager PyTorch, as hpctrain's blocks run without parallel.compile: RMSNorm in fp32 (~18 per norm), RoPE through
# complex views (~15), the residual adds (6), SwiGLU's silu and product (~17), attention's layout copies (~5): ~80
# counted, 133 measured (llama_1b bf16 eager: 45,581 tokens/s on an H100 and 51,593 on an H200, both within 0.3 %
# with 133; 80 said +17 % and +12 %).
ELEMENTWISE_FUSED, ELEMENTWISE_EAGER = 20, 133
OPTIMIZER_BYTES_PER_PARAM = 30  # AdamW: read param, grad, two moments; write param, moments, the compute copy
SHAPE_HALF = 128  # the per-rank width at which a GEMM reaches half its large-matrix rate
OVERLAP_COST = 0.12  # NCCL's kernels take ~1/8 of the SMs: overlapped communication slows compute this much


@dataclass(frozen=True)
class Hardware:
    """One GPU type in a cluster: the rates the step-time model uses. Links are *bus* bandwidths per GPU, as
    nccl-tests and `hpctrain preflight` report them."""

    name: str
    peak_tflops: float  # dense, in the compute dtype (monitoring/metrics.PEAK_TFLOPS)
    gemm_tflops: float  # what a large GEMM reaches in training (preflight's gemm figure calibrates it)
    attn_frac: float  # flash attention's rate against gemm_tflops
    hbm_gbps: float
    intra_gbps: float  # all-reduce bus bandwidth inside a node (NVLink)
    inter_gbps: float  # per GPU across nodes (its NIC: rail-optimized InfiniBand)
    gpus_per_node: int = 8
    latency_us: float = 6.0  # per step of a collective (NCCL's per-hop latency across nodes: a few µs)

    def describe(self) -> str:
        return (f"{self.name}: {self.gemm_tflops:g} of {self.peak_tflops:g} TFLOP/s on large GEMMs, attention at "
                f"{self.attn_frac:.0%} of that, HBM {self.hbm_gbps:g} GB/s, NVLink {self.intra_gbps:g} GB/s, "
                f"network {self.inter_gbps:g} GB/s per GPU, {self.gpus_per_node} GPUs per node")


# Defaults per GPU type (bf16). Peaks, memory bandwidth and link rates are the datasheets' (NVLink 3: 300 GB/s a
# direction per GPU, NVLink 4: 450; HDR InfiniBand 200 Gb/s per GPU, NDR 400) at the share nccl-tests reaches
# (~77 % of NVLink, ~92 % of a NIC). The GEMM rate is what cuBLAS sustains on large bf16 matrices under training's
# power and clocks (A100: 73 % of peak, H100: 62 %); flash attention runs at ~75 % / ~65 % of that (FlashAttention-2
# on A100, SDPA's kernels on H100). These two were fitted once per GPU type, the same for every row of the validation
# table (docs/choosing-a-layout.md); ELEMENTWISE_EAGER and MASKED_ATTN_FRAC were fitted later, to hpctrain's own rows.
# Attention under an explicit mask (document masking, a window shorter than the sequence, hpctrain's context-parallel
# chunks) cannot use the causal kernels: every score the mask spans is computed, at this share of the causal kernel's
# rate (the mask's reads folded in). Measured on one H200 (docs/benchmarks.md): llama_1b, bf16, compiled, micro-batch
# 16 × 4, 59,143 tokens/s with the mask against the 67,553 the model gives without it.
MASKED_ATTN_FRAC = 0.68
HARDWARE = {
    "A100": Hardware("A100", 312.0, 228.0, 0.75, 2039.0, 230.0, 23.0),
    "H100": Hardware("H100", 989.0, 613.0, 0.65, 3350.0, 350.0, 46.0),
    "H200": Hardware("H200", 989.0, 613.0, 0.65, 4800.0, 350.0, 46.0),
    # The HBM2e H100s of Meta's Grand Teton capped at 500 W that torchtitan's published runs used: the NVL's dense
    # peak (the page puts it between SXM's and NVL's), 2.4 TB/s, the H100's shares of peak.
    "H100-500W": Hardware("H100-500W", 835.0, 518.0, 0.65, 2400.0, 350.0, 46.0),
}
PEAK_ROW = {"H100-500W": "H100 NVL"}  # whose peaks by precision (monitoring.metrics.PEAK_TFLOPS) a type takes


def hardware_of(cluster, precision: str) -> Hardware | None:
    """The `cluster` group's GPU (cluster.gpu_type, its rates overridden by cluster.gemm_tflops / intra_node_gbps /
    inter_node_gbps / gpus_per_node where set); None without a GPU type."""
    name = cluster.gpu_type
    if not name:
        return None
    base = HARDWARE.get(str(name).upper())
    if base is None:
        known = ", ".join(HARDWARE)
        raise ConfigError(f"cluster.gpu_type={name} has no default rates (known: {known}): name one of them, or the "
                          "nearest with cluster.gemm_tflops, cluster.intra_node_gbps and cluster.inter_node_gbps "
                          "measured by `hpctrain preflight`")
    rates = PEAK_TFLOPS.get(PEAK_ROW.get(base.name, base.name))
    if rates is None:  # (every type has a row: a bf16 rate would be taken for fp32 without one)
        raise ConfigError(f"cluster.gpu_type={name} has no peak by precision: add its row to PEAK_TFLOPS")
    peak = rates[str(PrecisionName(precision).value)]
    hw = replace(base, peak_tflops=cluster.peak_tflops or peak,
                 gemm_tflops=base.gemm_tflops * (peak / base.peak_tflops))  # fp32/tf32: the same share of its peak
    overrides = {"gemm_tflops": cluster.gemm_tflops, "intra_gbps": cluster.intra_node_gbps,
                 "inter_gbps": cluster.inter_node_gbps, "gpus_per_node": cluster.gpus_per_node or None}
    return replace(hw, **{k: v for k, v in overrides.items() if v})


@dataclass(frozen=True)
class Software:
    """How the implementation being modelled behaves (hpctrain's by default; the validation table describes the
    published runs' with it)."""

    flash_attention: bool = True  # SDPA's fused kernel; False: the score matrix is written out
    overlap_grad_reduce: bool = True  # gradient reduction overlaps backward (FSDP2 / replicate do)
    # ZeRO-2 across a step's micro-batches: weights gathered once and gradients reduced once (Llama 3's); hpctrain's
    # FSDP2 gathers again for every micro-batch
    gather_once_per_step: bool = False
    scatter_gather: bool = False  # Megatron's: a pipeline stage sends its activation split over tp, gathered after
    # hpctrain's context parallelism passes each chunk's prefix mask to SDPA: no causal kernel (Llama 3's does not)
    cp_prefix_mask: bool = True


@dataclass(frozen=True)
class StepInputs:
    """What the model needs of a run: the model's arguments and spec, the layout and batch, the settings that
    change the work."""

    args: object
    spec: object
    layout: Layout
    micro_batch: int
    grad_accum: int
    seq_len: int
    c: int  # compute dtype bytes
    zero_stage: int = 0
    sequence_parallel: bool = False
    ac: str = "none"  # none | selective | full
    ac_every: int = 1
    grad_bytes: int = 4
    sharded_accumulation: bool = True
    compiled: bool = False  # parallel.compile: fused memory-bound kernels
    document_mask: bool = False  # train.document_mask: SDPA under an explicit mask

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.layout.dp

    @classmethod
    def of(cls, model, parallel, precision, plan, seq_len: int, *, document_mask: bool) -> StepInputs:
        """From the run's `model`, `parallel` and `precision` groups, its RunShape and train.document_mask."""
        from hpctrain.models import spec_of
        from hpctrain.parallel.parallelize import REDUCE_DTYPES
        from hpctrain.training.precision import compute_dtype

        spec, p = spec_of(model), parallel
        return cls(spec.args(model), spec, plan.layout, plan.micro_batch, plan.grad_accum, seq_len,
                   c=(compute_dtype(precision) or torch.float32).itemsize, zero_stage=p.zero_stage,
                   sequence_parallel=p.sequence_parallel, ac=ActCkpt(p.activation_checkpointing).value,
                   ac_every=p.ac_every, grad_bytes=REDUCE_DTYPES[ReduceDtype(p.grad_reduce_dtype)].itemsize,
                   sharded_accumulation=p.sharded_accumulation, compiled=p.compile, document_mask=document_mask)


@dataclass
class Prediction:
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float  # model FLOPs (no recomputation) per second per GPU over the peak
    tflops_per_gpu: float  # model FLOP/s per GPU
    parts: dict[str, float] = field(default_factory=dict)  # seconds per step by kind (exposed communication)

    def line(self) -> str:
        return (f"predicted: {self.step_s:.3g} s per step, {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
                f"MFU {self.mfu:.1%} ({self.tflops_per_gpu:.0f} TFLOP/s per GPU)")

    def breakdown(self) -> str:
        shown = {k: v for k, v in self.parts.items() if v >= 0.0005 * self.step_s}
        return "  " + ", ".join(f"{k} {v:.3g} s ({v / self.step_s:.0%})" for k, v in shown.items())


def _span(layout: Layout, dim: str, hw: Hardware) -> tuple[int, int]:
    """(g, k): a `dim` group's ranks per node and nodes. Mesh order pp, dp, cp, tp (tp innermost)."""
    order = ("pp", "dp", "cp", "tp")
    n = getattr(layout, dim)
    stride = math.prod(getattr(layout, d) for d in order[order.index(dim) + 1:])
    if stride * n <= hw.gpus_per_node:
        return n, 1
    g = max(1, hw.gpus_per_node // stride)
    return g, max(1, n // g)


def _tree_hops(g: int, k: int, hw: Hardware) -> float:
    """An all-reduce's latency: NCCL's trees across nodes, a ring inside one."""
    return 2 * ((g - 1) + math.ceil(math.log2(k))) * hw.latency_us * 1e-6 if g * k > 1 else 0.0


def all_reduce_s(nbytes: float, g: int, k: int, hw: Hardware) -> float:
    """An all-reduce of `nbytes` over g ranks on each of k nodes."""
    if g * k == 1:
        return 0.0
    return (2 * nbytes * (g - 1) / g / (hw.intra_gbps * 1e9) + 2 * nbytes * (k - 1) / k / (g * hw.inter_gbps * 1e9)
            + _tree_hops(g, k, hw))


def gather_s(nbytes: float, g: int, k: int, hw: Hardware) -> float:
    """An all-gather (or reduce-scatter) whose whole result is `nbytes`: a ring through all g·k ranks, a step of
    latency each."""
    if g * k == 1:
        return 0.0
    return (nbytes * (g - 1) / g / (hw.intra_gbps * 1e9) + nbytes * (k - 1) / k / (g * hw.inter_gbps * 1e9)
            + (g * k - 1) * hw.latency_us * 1e-6)


def _exposed(comm: float, compute: float, units: int) -> float:
    """What `comm` seconds of communication overlapped with `compute` seconds add: the part the compute cannot hide,
    the first (or last) unit's, which nothing overlaps, and the compute's slowdown while NCCL's kernels hold some of
    the SMs and memory bandwidth (OVERLAP_COST of the overlapped time)."""
    return max(0.0, comm - compute) + comm / units + OVERLAP_COST * min(comm, compute)


def _stage_layers(n_layers: int, pp: int, v: int) -> tuple[int, ...]:
    """The layers the busiest pipeline rank holds."""
    return max((tuple(i for chunk in chunks for i in chunk) for chunks in layer_map(n_layers, pp, v)), key=len)


@dataclass(frozen=True)
class _Work:
    """What every term of one micro-batch on the busiest stage's rank starts from."""

    tokens: int  # the micro-batch's tokens on this rank
    layer_ids: tuple[int, ...]  # the stage's
    layer_params: float  # matmul weights one token goes through, per layer
    head_params: int
    attn_width: int  # heads × head_dim
    head_dim: int
    recomputed: float  # share of the blocks recomputed in backward
    rate: float  # GEMM FLOP/s on this rank's matrix shapes
    params: int  # the whole model's
    flops_per_token: float  # the whole model's, training

    @property
    def passes(self) -> float:
        return 3.0 + self.recomputed  # forward, backward (2), recomputation

    @property
    def layers(self) -> int:
        return len(self.layer_ids)

    @classmethod
    def of(cls, x: StepInputs, hw: Hardware) -> _Work:
        a, lay = x.args, x.layout
        head_dim = getattr(a, "head_dim", None) or a.dim // a.n_heads
        attn_width = a.n_heads * head_dim
        head_params = a.vocab_size * a.dim
        params, flops_per_token = _model_counts(x)
        matmul = (flops_per_token - 12.0 * a.n_layers * attn_width * x.seq_len) / 6
        width = a.dim / lay.tp
        return cls(x.micro_batch * x.seq_len // lay.cp, _stage_layers(a.n_layers, lay.pp, lay.pp_virtual_stages),
                   (matmul - head_params) / a.n_layers, head_params, attn_width, head_dim,
                   {"none": 0.0, "full": 1.0, "selective": 1.0 / max(1, x.ac_every)}[x.ac],
                   hw.gemm_tflops * 1e12 * width / (width + SHAPE_HALF), params, flops_per_token)


def _compute(x: StepInputs, w: _Work, hw: Hardware, sw: Software) -> dict[str, float]:
    """One micro-batch's compute on this rank: matmuls, attention, memory-bound kernels (seconds)."""
    a, tp, cp, hbm = x.args, x.layout.tp, x.layout.cp, hw.hbm_gbps * 1e9
    dense = 2.0 * w.tokens * w.layer_params * w.layers / tp * w.passes
    head = 2.0 * w.tokens * w.head_params / tp * 3.0  # on the last stage (not recomputed)
    attn_fwd = 4.0 * w.tokens * x.seq_len * w.attn_width / tp * w.layers  # this rank's queries against every key
    # (Llama 3's published context parallelism keeps the causal kernel: no prefix masks)
    masked = (packed_masks(x.document_mask, cp if sw.cp_prefix_mask else 1)
              or window_masks(getattr(a, "sliding_window", None), x.seq_len))
    if sw.flash_attention and masked:
        # every score the mask spans: all of them in one process; under cp a rank's two chunks (i and 2cp−1−i of
        # c = seq/2cp tokens) see their prefixes, c²·(2cp+1) of its 4cp·c² pairs
        spanned = (2 * cp + 1) / (4 * cp) if cp > 1 else 1.0
        attention = attn_fwd * spanned * w.passes / (w.rate * hw.attn_frac * MASKED_ATTN_FRAC)
    elif sw.flash_attention:
        attention = attn_fwd * 0.5 * w.passes / (w.rate * hw.attn_frac)
    else:  # the score matrix written and read: ~4 values per score element and pass
        scores = x.micro_batch * (a.n_heads / tp) * (x.seq_len / cp) * x.seq_len * w.layers
        attention = attn_fwd * w.passes / w.rate + scores * 4 * w.passes * x.c / hbm
    # half of it is inside the tp-sharded MLP and attention; the norms and residual adds only with sequence parallel
    share = 0.5 / tp + 0.5 / (tp if x.sequence_parallel else 1)
    values = ELEMENTWISE_FUSED if x.compiled else ELEMENTWISE_EAGER
    elementwise = values * a.dim * x.c * w.tokens * w.layers * w.passes * share / hbm
    return {"compute": (dense + head) / w.rate, "attention": attention, "elementwise": elementwise}


def _exchanges(x: StepInputs, w: _Work, hw: Hardware, sw: Software) -> dict[str, float]:
    """One micro-batch's tensor, context, expert and pipeline communication (seconds, not overlapped)."""
    a, lay = x.args, x.layout
    act = w.tokens * a.dim * x.c  # the micro-batch's activation on this rank before tp splits it
    out = {"tp": 0.0, "cp": 0.0, "ep": 0.0, "pp p2p": 0.0}
    if lay.tp > 1:
        out["tp"] = (4 + 2 * w.recomputed) * w.layers * all_reduce_s(act, *_span(lay, "tp", hw), hw)
    if lay.cp > 1:
        kv = getattr(a, "kv_heads", a.n_heads) * w.head_dim // lay.tp
        # (forward and backward, and the share of the blocks recomputed)
        moved = gathered_bytes(kv, w.tokens, lay.cp, w.layers, x.c, False) * (2 + w.recomputed) / 2
        out["cp"] = gather_s(moved * lay.cp / (lay.cp - 1), *_span(lay, "cp", hw), hw)
    moe = getattr(a, "moe", None)
    if lay.ep > 1 and moe is not None:
        sent = all_to_all_bytes(moe, list(w.layer_ids), a.dim, w.tokens, lay.ep, x.c, False) * (2 + w.recomputed) / 2
        g, k = _span(replace(lay, dp=lay.ep), "dp", hw)
        out["ep"] = sent * ((g - 1) / max(1, g * k - 1) / (hw.intra_gbps * 1e9)
                            + (g * k - g) / max(1, g * k - 1) / (hw.inter_gbps * 1e9))
    if lay.pp > 1:
        link = hw.inter_gbps if _span(lay, "pp", hw)[1] > 1 else hw.intra_gbps
        split = lay.tp if x.sequence_parallel or sw.scatter_gather else 1
        out["pp p2p"] = 2 * act / split / (link * 1e9) * lay.pp_virtual_stages
    return out


def _expert_params(a, layer_ids) -> float:
    """The routed experts' matmul weights in these layers (held whole on every tp rank, shared out over ep)."""
    moe = getattr(a, "moe", None)
    if moe is None or not moe.num_experts:
        return 0.0
    return sum(3.0 * a.dim * expert_hidden(moe, a.ffn_hidden) * moe.num_experts for i in layer_ids
               if is_sparse(moe, i))


def _weights(x: StepInputs, w: _Work, hw: Hardware, sw: Software, compute_mb: float) -> tuple[float, float, float]:
    """(exposed FSDP traffic per micro-batch, exposed traffic once per step, the optimizer's pass).

    What FSDP2 does in hpctrain: without a pipeline, ZeRO-2 gathers the weights for each micro-batch (kept through
    its backward), ZeRO-3 in forward and again in backward, and gradients are reduce-scattered each micro-batch
    (parallel.sharded_accumulation) or once. Under a pipeline schedule torch keeps the weights gathered and the
    gradients unreduced from one micro-batch to the next: ZeRO-2 gathers once per step, ZeRO-3 once per micro-batch
    (for backward), and the reduction runs once, after the last micro-batch, exposed (ZeRO-0's all-reduce too).
    Routed experts are shared out over ep and sharded over the rest of dp (dp_mod_ep)."""
    a, lay = x.args, x.layout
    embeddings = w.head_params * (1 if getattr(a, "tie_embeddings", False) else 2)
    experts = _expert_params(a, w.layer_ids)
    blocks = (w.params - embeddings) / a.n_layers * w.layers - experts
    # the busiest stage is the last: its layers and the output head (one process: every weight)
    dense = (blocks + (embeddings if lay.pp == 1 else w.head_params)) / lay.tp
    groups = [(dense, _span(replace(lay, dp=lay.dp * lay.cp, cp=1), "dp", hw), lay.dp * lay.cp),
              (experts / lay.ep, _span(replace(lay, dp=lay.dp // lay.ep, cp=lay.cp * lay.ep), "dp", hw),
               lay.dp // lay.ep)]
    units = w.layers + 1  # FSDP's: a block each, and the root (embedding, head)

    def traffic(collective, bytes_per_param: float) -> float:  # one collective per unit: its latency each time
        return sum(units * collective(n * bytes_per_param / units, g, k, hw) for n, (g, k), _ in groups if n)

    pipelined, m = lay.pipelined, x.grad_accum
    backward = compute_mb * 2 / w.passes  # the last micro-batch's backward, which a gradient reduction overlaps
    if x.zero_stage >= 2:
        once = x.zero_stage == 2 and (pipelined or sw.gather_once_per_step)
        gathers = 0 if once else 1 if pipelined else 2 if x.zero_stage == 3 else 1
        reduce_each = not (pipelined or once) and (x.sharded_accumulation or m == 1)
        per_mb = gathers * traffic(gather_s, x.c) + (traffic(gather_s, x.grad_bytes) if reduce_each else 0.0)
        fsdp_mb = _exposed(per_mb, compute_mb, units)  # prefetched under the compute
        step = _exposed(traffic(gather_s, x.c), compute_mb, units) if once else 0.0
        if not reduce_each:
            reduce = traffic(gather_s, x.grad_bytes)
            step += reduce if pipelined else _exposed(reduce, backward, units)
    else:
        fsdp_mb = 0.0
        reduce = traffic(all_reduce_s, x.grad_bytes)
        step = _exposed(reduce, backward, units) if sw.overlap_grad_reduce and not pipelined else reduce
    optimizer = sum(n / (shard if x.zero_stage >= 2 else 1) for n, _, shard in groups)
    return fsdp_mb, step, optimizer * OPTIMIZER_BYTES_PER_PARAM / (hw.hbm_gbps * 1e9)


_COUNTS: dict[tuple, tuple[int, float]] = {}


def _model_counts(x: StepInputs) -> tuple[int, float]:
    """(parameters, training FLOPs per token) of x's model, counted once: `plan --search` predicts ~20,000 layouts
    of one model, and counting a 128-layer model's every layer for each was 70 % of a search (17-40 s for GPT 1008B).
    Keyed by the arguments' repr: a dataclass's repr holds every field, nested ones included."""
    key = (x.spec.family, repr(x.args), x.seq_len)
    if key not in _COUNTS:
        if len(_COUNTS) >= 256:  # (a long-lived process planning many models)
            _COUNTS.clear()
        _COUNTS[key] = (x.spec.num_params(x.args), x.spec.flops_per_token(x.args, x.seq_len))
    return _COUNTS[key]


def predict(x: StepInputs, hw: Hardware, sw: Software = Software()) -> Prediction:
    """One optimizer step of `x` on `hw`: its time and what it is made of."""
    w = _Work.of(x, hw)
    compute = _compute(x, w, hw, sw)
    exchanges = _exchanges(x, w, hw, sw)
    compute_mb = sum(compute.values())
    fsdp_mb, dp_step, optimizer = _weights(x, w, hw, sw, compute_mb)
    m, mb = x.grad_accum, compute_mb + sum(exchanges.values()) + fsdp_mb
    bubble = x.layout.bubble(m) if x.layout.pipelined else 0.0
    step = m * mb / (1 - bubble) + dp_step + optimizer
    parts = {**{k: m * v for k, v in {**compute, **exchanges, "fsdp": fsdp_mb}.items()}, "dp": dp_step,
             "bubble": m * mb * bubble / (1 - bubble), "optimizer": optimizer}
    tokens = x.global_batch * x.seq_len
    flops = w.flops_per_token * tokens / step / x.layout.world
    return Prediction(step, tokens / step / x.layout.world, flops / (hw.peak_tflops * 1e12), flops / 1e12, parts)
