"""Published large-scale training runs, and the step-time model's prediction for each (`hpctrain plan --validate`).

Each row is what its paper or benchmark page states: the model, the GPUs, the layout, the batch and the measured
throughput, in the unit it was published in; where the source leaves a setting out, the row says what is assumed.
The hardware parameters are step_time.HARDWARE's, the same for every row of a GPU type (the torchtitan H100s ran
at 500 W with HBM2e memory: the same type here, a reason those rows may come out fast). docs/choosing-a-layout.md
shows the table.

Sources: Narayanan et al. 2021 (Megatron-LM, SC21, arXiv:2104.04473) Table 1 with the authors' script
examples/sc21/run_table_1.sh (micro-batch, interleaving, DDP implementation); Llama 3 (arXiv:2407.21783) Tables 3-4
(row 3's DP is 8: v1 prints 4, which adds up to neither the GPUs nor the tokens); torchtitan's
benchmarks/llama3_h100_202412_torchtitan.md and docs/performance.md of 2024-04-24 and 2024-08-23 (sequence length
8,192 from the repo's train configs of the time, which reproduces the page's stated MFU).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.core.config import ModelConfig
from hpctrain.models import get_spec
from hpctrain.parallel.layout import Layout
from hpctrain.training import layout_search, step_time
from hpctrain.training.step_time import Software, StepInputs

MEGATRON = "Megatron-LM SC21 Table 1"
LLAMA3 = "Llama 3 Table 4"
TITAN = "torchtitan"


@dataclass(frozen=True)
class Published:
    source: str
    name: str
    gpu: str
    model: dict  # ModelConfig fields
    layout: Layout
    micro_batch: int
    grad_accum: int
    seq_len: int
    published: float
    unit: str  # "TFLOP/s" (Megatron's formula with recomputation, or 6N+12LHQT) or "tokens/s"
    zero_stage: int = 0
    ac: str = "none"
    software: Software = Software()
    assumed: str = ""
    sequence_parallel: bool = False
    compiled: bool = False  # fused memory-bound kernels (Megatron's, torch.compile)
    gpu_mem_gb: float = 80.0
    grad_bytes: int = 4  # per gradient element reduced

    @property
    def ac_every(self) -> int:
        return 2 if self.ac == "selective" else 1  # (selective: every 2nd block)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.layout.dp

    def shown_layout(self) -> str:
        lay = self.layout
        return lay.describe() + (f" v{lay.pp_virtual_stages}" if lay.pp_virtual_stages > 1 else "") + \
            f" mb{self.micro_batch}"

    def inputs(self) -> StepInputs:
        spec = get_spec("llama")
        return StepInputs(spec.args(ModelConfig(**self.model)), spec, self.layout, self.micro_batch, self.grad_accum,
                          self.seq_len, c=2, zero_stage=self.zero_stage, ac=self.ac,
                          sequence_parallel=self.sequence_parallel, grad_bytes=self.grad_bytes,
                          compiled=self.compiled, ac_every=self.ac_every)

    def metric(self, prediction: step_time.Prediction) -> float:
        """The prediction in the unit the source published."""
        if self.unit == "tokens/s":
            return prediction.tokens_per_s_per_gpu
        if self.source == MEGATRON:  # the paper's eq. 3: counts the recomputation's forward pass, full attention
            m = self.model
            h, L, s, V = m["dim"], m["n_layers"], self.seq_len, m["vocab_size"]
            flops = 96 * self.global_batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
            return flops / prediction.step_s / self.layout.world / 1e12
        return prediction.tflops_per_gpu  # 6·N + 12·L·H·Q·T per token (PaLM's, as Llama 3 and torchtitan count)


def _gpt(h: int, layers: int, heads: int) -> dict:
    """A GPT of Megatron's Table 1 as the Llama-style model with the same matmul FLOPs: a 4h GeLU MLP (8h² weights)
    is a SwiGLU of 8h/3 (three matrices), rounded to a multiple of 128 (within 0.4 %) so that tp divides it."""
    return {"dim": h, "n_layers": layers, "n_heads": heads, "n_kv_heads": heads,
            "ffn_hidden": round(8 * h / 3 / 128) * 128, "vocab_size": 51200, "max_seq_len": 2048}


def _megatron() -> list[Published]:
    # (params B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s, micro-batch, chunks per pipeline rank)
    table = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
             (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
             (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
             (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
             (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
             (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1)]
    rows = []
    for params, heads, h, layers, tp, pp, gpus, batch, tflops, mb, v in table:
        dp = gpus // (tp * pp)
        # 2021: fp16 gradients, no flash attention; torch DDP (overlapping backward) without a pipeline, Megatron's
        # "local" DDP (reducing after it) with one
        sw = Software(flash_attention=False, overlap_grad_reduce=pp == 1, scatter_gather=True)
        rows.append(Published(MEGATRON, f"GPT {params:g}B", "A100", _gpt(h, layers, heads),
                              Layout(pp=pp, dp=dp, tp=tp, pp_schedule="interleaved_1f1b" if v > 1 else "1f1b",
                                     pp_virtual_stages=v), mb, batch // (dp * mb), 2048, tflops, "TFLOP/s",
                              ac="full", software=sw, compiled=True, grad_bytes=2))
    return rows


LLAMA3_8B = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336, "vocab_size": 128256,
             "max_seq_len": 8192}
LLAMA3_70B = {**LLAMA3_8B, "dim": 8192, "n_layers": 80, "n_heads": 64, "ffn_hidden": 28672}
LLAMA3_405B = {**LLAMA3_8B, "dim": 16384, "n_layers": 126, "n_heads": 128, "ffn_hidden": 53248}


def _llama3() -> list[Published]:
    # Parameters kept gathered from forward to backward, gradients and optimizer state sharded: ZeRO-2; fp32
    # reduce-scatter; no activation checkpointing at 8K. Not given: the micro-batch (1 sequence assumed), the
    # interleaving (4 virtual stages per rank assumed: ~2 of the rank's ~8 layers each).
    sw = Software(gather_once_per_step=True, cp_prefix_mask=False)  # (its CP kernel is causal)
    assumed = "micro-batch 1, 4 virtual stages per pipeline rank, sequence parallel, fused kernels"
    rows = []
    for gpus, cp, dp, seq, per_dp, tflops in ((8192, 1, 64, 8192, 32, 430), (16384, 1, 128, 8192, 16, 400),
                                              (16384, 16, 8, 131072, 16, 380)):
        rows.append(Published(LLAMA3, f"Llama 3 405B, {gpus:,} GPUs, seq {seq:,}", "H100",
                              {**LLAMA3_405B, "max_seq_len": seq},
                              Layout(pp=16, dp=dp, tp=8, cp=cp, pp_schedule="interleaved_1f1b", pp_virtual_stages=4),
                              1, per_dp, seq, tflops, "TFLOP/s", zero_stage=2, software=sw, assumed=assumed,
                              sequence_parallel=True, compiled=True))
    return rows


def _torchtitan() -> list[Published]:
    # bf16 rows without torch.compile or Float8 (which the model does not describe); FSDP2 = ZeRO-3, fp32 reduce.
    op_sac = "op-level selective checkpointing, which recomputes every other matmul: as every 2nd block recomputed"
    return [
        Published(TITAN, "Llama 3.1 8B, 8 GPUs, FSDP (2024-12)", "H100-500W", LLAMA3_8B, Layout(dp=8), 2, 1, 8192, 5762,
                  "tokens/s", zero_stage=3, ac="selective", assumed=op_sac, gpu_mem_gb=96),
        Published(TITAN, "Llama 3.1 8B, 128 GPUs, FSDP (2024-12)", "H100-500W", LLAMA3_8B, Layout(dp=128), 2, 1, 8192,
                  5605, "tokens/s", zero_stage=3, ac="selective", assumed=op_sac, gpu_mem_gb=96),
        Published(TITAN, "Llama 3.1 405B, 128 GPUs, FSDP 16 × TP 8 (2024-08)", "H100-500W", LLAMA3_405B,
                  Layout(dp=16, tp=8), 2, 1, 8192, 109, "tokens/s", zero_stage=3, ac="full",
                  sequence_parallel=True, gpu_mem_gb=96),  # (torchtitan's TP plan shards the norms: SequenceParallel)
        Published(TITAN, "Llama 3 8B, 64 A100s, FSDP, selective layer AC (2024-04)", "A100", LLAMA3_8B,
                  Layout(dp=64), 1, 1, 8192, 2904, "tokens/s", zero_stage=3, ac="selective",
                  assumed="every 2nd block checkpointed"),
        Published(TITAN, "Llama 3 70B, 64 A100s, FSDP, full AC (2024-04)", "A100", LLAMA3_70B, Layout(dp=64), 1, 1,
                  8192, 331, "tokens/s", zero_stage=3, ac="full"),
    ]


def rows() -> list[Published]:
    return _megatron() + _llama3() + _torchtitan()


def predicted(row: Published) -> tuple[float, step_time.Prediction]:
    got = step_time.predict(row.inputs(), step_time.HARDWARE[row.gpu], row.software)
    return row.metric(got), got


def table() -> str:
    """The validation table, one line per published row."""
    out = ["| run | GPU | layout | published | predicted | error |", "|---|---|---|---:|---:|---:|"]
    published = rows()
    for row in published:
        value, _ = predicted(row)
        out.append(f"| {row.source}: {row.name} | {row.gpu} | {row.shown_layout()} | {row.published:g} "
                   f"{row.unit} | {value:.4g} | {value / row.published - 1:+.0%} |")
    hws = sorted({row.gpu for row in published})
    out += ["", "hardware: " + "; ".join(step_time.HARDWARE[g].describe() for g in hws)]
    return "\n".join(out)


def search_row(row: Published) -> tuple[layout_search.Found | None, step_time.Prediction, str]:
    """`plan --search` for the row's model, GPUs, batch, sequence and GPU memory, the published layout's
    prediction under the same software (hpctrain's: eager kernels, FSDP2), and why hpctrain would not run the
    published layout ("" when it would)."""
    from hpctrain.runs.compose import compose

    cfg = compose([f"model.{k}={v}" for k, v in {**row.model, "max_seq_len": row.seq_len}.items()]
                  + [f"train.global_batch={row.global_batch}", f"train.seq_len={row.seq_len}", "train.micro_batch=null",
                     "train.grad_accum=null", "precision=bf16", f"cluster.gpu_type={row.gpu}",
                     f"cluster.gpu_mem_gb={row.gpu_mem_gb:g}"])
    searcher = layout_search.Searcher(cfg, row.layout.world)
    found, _, _, _ = searcher.search(top=1)
    theirs = layout_search.Candidate(row.layout, row.zero_stage, row.micro_batch, row.grad_accum, row.ac,
                                     row.ac_every)
    _, why = searcher.check(theirs)
    return (found[0] if found else None), searcher.predict(theirs), why


def search_table() -> str:
    """For every published row: the published layout and `--search`'s best, both predicted for hpctrain."""
    out = ["| run | published layout, as hpctrain | --search's best | tokens/s per GPU: published layout → best |",
           "|---|---|---|---:|"]
    for row in rows():
        best, theirs, why = search_row(row)
        shown = row.shown_layout() + (f" (hpctrain: {why})" if why else "")
        if best is None:
            out.append(f"| {row.name} | {shown} | none fits | {theirs.tokens_per_s_per_gpu:,.0f} → – |")
            continue
        gain = best.prediction.tokens_per_s_per_gpu / theirs.tokens_per_s_per_gpu - 1
        out.append(f"| {row.name} | {shown} | {best.candidate.describe()} | "
                   f"{theirs.tokens_per_s_per_gpu:,.0f} → {best.prediction.tokens_per_s_per_gpu:,.0f} ({gain:+.0%}) |")
    return "\n".join(out)
