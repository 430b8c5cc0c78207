"""`hpctrain bench gpu` (`make bench-gpu`): training throughput and MFU of a model on one GPU, hpctrain
against a plain transformers loop on the same model, data and global batch.

Default: `model=llama_1b` (1.24 B parameters, 128,256-token vocabulary), bf16, 2048-token samples, on a synthetic
shard set made for that vocabulary (`data_prep.synthetic`). hpctrain runs the real `hpctrain.training.run.train()`
with per-block compile, the fused (chunked) loss and fused AdamW, at the largest micro-batch the planner says fits
the device (halved on an out-of-memory error), with `--grad-accum` micro-batches a step. The baseline is a
hand-written `transformers.LlamaForCausalLM` loop: fp32 weights under bf16 autocast (as hpctrain), SDPA attention,
`torch.optim.AdamW` with its defaults, gradient clipping, the same global batch (its own largest micro-batch).

MFU = tokens/s per device × FLOPs per token / the device's dense peak (`hpctrain.monitoring.metrics.PEAK_TFLOPS`),
FLOPs per token = 6·N + 12·L·H·Q·T (N: every matmul weight, output head included; full attention, no causal
discount). Steps before `--warmup` (compile, allocator growth) are excluded. Whatever is measured is reported.
`--variants` adds hpctrain runs with one optimisation taken away each (their effect, in the same process).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from hpctrain.core.argparser import Parser

BASE = ["parallel.compile=true", "train.fused_loss=true", "optim.implementation=fused"]
# Each variant takes one optimisation away from BASE (or adds activation checkpointing, document masking): its effect,
# measured.
VARIANTS = {
    "hpctrain": [],
    "eager": ["parallel.compile=false"],
    "logits-loss": ["train.fused_loss=false"],
    "foreach-adamw": ["optim.implementation=foreach"],
    "ac-full": ["parallel.activation_checkpointing=full"],
    # what document masking costs: SDPA with a [B, 1, T, T] mask instead of its causal kernel
    "document-mask": ["train.document_mask=true"],
}
ATTENTION_WORDS = ("flash", "fmha", "cudnn", "attention", "attn", "efficient")


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _overrides(a, data: str, run_dir: str, variant: str, micro_batch: int, grad_accum: int) -> list[str]:
    return [f"run_dir={run_dir}", f"model={a.model}", f"precision={a.precision}", f"data.path={data}",
            "data.prepare_demo=false", f"train.seq_len={a.seq_len}", f"train.micro_batch={micro_batch}",
            f"train.grad_accum={grad_accum}", "train.global_batch=null", f"train.max_steps={a.steps}",
            "train.log_every=1", "train.eval_every=0", "train.checkpointing=false", "train.resume=never",
            "logging.trackers=[]", "train.progress=false", "optim.warmup_steps=2", *BASE, *VARIANTS[variant],
            *a.overrides]


def largest_micro_batch(a, data: str, variant: str, capacity: float, limit: int = 64) -> int:
    """The largest power-of-two micro-batch whose planner estimate fits `capacity` bytes (the planner's headroom
    applied); 1 if none does."""
    from hpctrain.runs.compose import compose
    from hpctrain.runs.resolve import resolve
    from hpctrain.training.planner import HEADROOM, stage_bytes

    best, mb = 1, 1
    while mb <= limit:
        cfg = compose(_overrides(a, data, "unused", variant, mb, 1))
        need = max(device_bytes for device_bytes, _ in stage_bytes(cfg, resolve(cfg), a.seq_len))
        if need > HEADROOM * capacity:
            break
        best, mb = mb, mb * 2
    return best


def _smaller_divisor(global_batch: int, micro_batch: int) -> int:
    """The largest micro-batch below `micro_batch` (about half of it or less) that divides the global batch."""
    return next(m for m in range(micro_batch // 2 or 1, 0, -1) if global_batch % m == 0)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _summary(name: str, micro_batch: int, grad_accum: int, step_times: list[float], tokens_per_step: int,
             warmup: int, flops_per_token: float, peak: float | None, peak_gib: float, final_loss: float) -> dict:
    timed = step_times[warmup:]
    tps = len(timed) * tokens_per_step / sum(timed)
    return {"side": name, "micro_batch": micro_batch, "grad_accum": grad_accum, "tokens_per_s": tps,
            "mfu": tps * flops_per_token / peak if peak else None, "peak_gib": peak_gib, "final_loss": final_loss,
            "step_times_s": step_times}


def run_hpctrain(a, data: str, variant: str, micro_batch: int, global_batch: int, flops_per_token: float,
                 peak: float | None) -> dict:
    """One hpctrain run at `micro_batch` (or a smaller one on an out-of-memory error)."""
    from hpctrain.core.files import read_metrics
    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train

    run_dir = os.path.join(a.out, f"run-{variant}")

    def attempt(mb: int) -> int:
        torch._dynamo.reset()  # each run compiles from cold (inside its warm-up steps)
        train(compose(_overrides(a, data, run_dir, variant, mb, global_batch // mb)), run_dir)
        return mb

    micro_batch = _shrinking_on_oom(variant, global_batch, micro_batch, attempt)
    records = [r for r in read_metrics(run_dir) if "step_time_s" in r]
    times = [r["step_time_s"] for r in records]
    peak_gib = max(r["mem_gb"] for r in records)
    return _summary(variant, micro_batch, global_batch // micro_batch, times, global_batch * a.seq_len, a.warmup,
                    flops_per_token, peak, peak_gib, records[-1]["loss"])


def run_transformers(a, data: str, model_args, micro_batch: int, global_batch: int, flops_per_token: float,
                     peak: float | None, seed: int) -> dict:
    """The plain loop, at `micro_batch` (a smaller one on an out-of-memory error), accumulating to `global_batch`."""
    return _shrinking_on_oom("transformers", global_batch, micro_batch, lambda mb: _transformers_loop(
        a, data, model_args, mb, global_batch, flops_per_token, peak, seed))


def _shrinking_on_oom(side: str, global_batch: int, micro_batch: int, attempt):
    """attempt(micro_batch), retried at smaller micro-batches (dividing the global batch) while it runs out of
    memory; its result."""
    while True:
        _free_memory()
        try:
            return attempt(micro_batch)
        except torch.OutOfMemoryError:
            if micro_batch == 1:
                raise
            smaller = _smaller_divisor(global_batch, micro_batch)
            print(f"  {side}: micro-batch {micro_batch} ran out of memory; trying {smaller}", flush=True)
            micro_batch = smaller


def _transformers_loop(a, data, model_args, micro_batch, global_batch, flops_per_token, peak, seed) -> dict:
    from transformers import LlamaForCausalLM

    from hpctrain.data.loader import ShardStream
    from hpctrain.models.llama.hf import to_hf_config

    dev = device()
    model = opt = params = None
    torch.manual_seed(seed)
    with dev:
        model = LlamaForCausalLM(to_hf_config(model_args, attn_implementation="sdpa")).float().train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    batches = iter(ShardStream(data, "train", micro_batch, seed, pin_memory=dev.type == "cuda"))
    accum = global_batch // micro_batch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    times, loss_value = [], float("nan")
    try:
        for _ in range(a.steps):
            _sync(dev)
            t0 = time.perf_counter()
            total = torch.zeros((), device=dev)
            for _ in range(accum):
                block = next(batches).to(dev, non_blocking=True)
                with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    logits = model(input_ids=block[:, :-1], use_cache=False).logits
                    loss = F.cross_entropy(logits.flatten(0, 1), block[:, 1:].flatten()) / accum
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_value = total.item()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        peak_gib = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
    finally:
        del model, opt, params
    return _summary("transformers", micro_batch, accum, times, global_batch * a.seq_len, a.warmup, flops_per_token,
                    peak, peak_gib, loss_value)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def attention_kernels(model_args, seq_len: int, precision: str = "bf16") -> list[str]:
    """The names of the attention kernels a forward and backward of one block of this model runs (profiled on this
    device): which SDPA backend hpctrain actually gets."""
    import dataclasses

    from torch.profiler import ProfilerActivity, profile

    from hpctrain.models.llama.model import Llama

    dev = device()
    small = dataclasses.replace(model_args, n_layers=1, vocab_size=256)  # the same attention, a cheap model
    with dev:
        model = Llama(small)
    x = torch.randint(0, small.vocab_size, (1, seq_len), device=dev)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    activities = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            model(x).float().sum().backward()
        _sync(dev)
    names = {e.name for e in prof.events() if (e.device_type.name == "CUDA") == (dev.type == "cuda")}
    return sorted(n for n in names if any(w in n.lower() for w in ATTENTION_WORDS))


def table(rows: list[dict], ref: dict | None) -> list[str]:
    out = [f"{'side':14} {'micro×accum':>11} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'vs transformers':>16}"]
    for r in rows:
        mfu = f"{100 * r['mfu']:6.1f}%" if r["mfu"] is not None else f"{'n/a':>7}"
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:15.2f}×" if ref else f"{'':>16}"
        out.append(f"{r['side']:14} {r['micro_batch']:>5}×{r['grad_accum']:<5} {r['tokens_per_s']:10.0f} {mfu} "
                   f"{r['peak_gib']:9.1f} {ratio}")
    return out


def parse_args(argv):
    ap = Parser(prog="hpctrain bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama_1b")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32", "tf32"])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, help="hpctrain's micro-batch (default: the largest the planner fits; "
                    "required without CUDA)")
    ap.add_argument("--grad-accum", type=int, default=4, help="hpctrain's micro-batches per step (default 4)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=6, help="first steps left out of tokens/s (compile, allocator)")
    ap.add_argument("--variants", default="hpctrain",
                    help=f"comma-separated hpctrain runs, of: {', '.join(VARIANTS)} (default hpctrain)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--out", default=os.path.join("outputs", "bench-gpu"),
                    help="its data (data/) and run directories; previous runs are moved aside, never deleted")
    ap.add_argument("--json", metavar="PATH", help="write every measurement to PATH")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for the hpctrain runs")
    a = ap.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        ap.error(f"--variants: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    if not 0 <= a.warmup < a.steps:
        ap.error(f"--warmup {a.warmup} must be >= 0 and below --steps {a.steps}")
    if a.micro_batch is None and not torch.cuda.is_available():
        ap.error("--micro-batch is needed without a CUDA device (the automatic choice reads the GPU's memory)")
    a.variants = variants
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    from data_prep.synthetic import cached_synthetic
    from hpctrain.models import model_args, spec_of
    from hpctrain.monitoring.metrics import peak_flops
    from hpctrain.runs.compose import compose

    cfg = compose([f"model={a.model}", f"precision={a.precision}", *a.overrides])
    args, spec, dev = model_args(cfg.model), spec_of(cfg.model), device()
    flops_per_token = spec.flops_per_token(args, a.seq_len)
    peak = peak_flops(dev, a.precision, cfg.cluster.peak_tflops)
    os.makedirs(a.out, exist_ok=True)
    data = cached_synthetic(os.path.join(a.out, f"data-{args.vocab_size}-{a.seq_len}"), args.vocab_size, a.seq_len,
                            samples=256)
    import transformers

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    header = (f"bench-gpu: {a.model} ({spec.num_params(args) / 1e9:.3f} B parameters), {a.precision}, seq_len "
              f"{a.seq_len}; {name}; torch {torch.__version__}, transformers {transformers.__version__}; "
              f"{peak.describe()}; {flops_per_token / 1e9:.3f} GFLOPs/token; {a.steps} steps, {a.warmup} warm-up "
              "steps left out")
    print(header, flush=True)
    capacity = torch.cuda.mem_get_info(dev)[1] if dev.type == "cuda" else None
    micro = a.micro_batch or largest_micro_batch(a, data, a.variants[0], capacity)
    global_batch = micro * a.grad_accum
    rows = []
    for variant in a.variants:
        mb = micro if variant == a.variants[0] or a.micro_batch else min(
            micro, largest_micro_batch(a, data, variant, capacity))
        if global_batch % mb:
            mb = _smaller_divisor(global_batch, mb)
        t0 = time.perf_counter()
        rows.append(run_hpctrain(a, data, variant, mb, global_batch, flops_per_token, peak.flops))
        print(f"  {variant}: {rows[-1]['tokens_per_s']:.0f} tokens/s at micro-batch {rows[-1]['micro_batch']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    ref = None
    if not a.no_transformers:
        t0 = time.perf_counter()
        ref = run_transformers(a, data, args, micro, global_batch, flops_per_token, peak.flops, cfg.train.seed)
        print(f"  transformers: {ref['tokens_per_s']:.0f} tokens/s at micro-batch {ref['micro_batch']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        rows.append(ref)
    _free_memory()
    kernels = attention_kernels(args, a.seq_len, a.precision)
    lines = table(rows, ref)
    print(f"global batch {global_batch} × {a.seq_len} tokens")
    for line in lines:
        print("  " + line)
    print("attention kernels: " + (", ".join(kernels) or "none with a fused-attention name (SDPA's math path)"))
    doc = {"header": header, "device": name, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "global_batch": global_batch, "seq_len": a.seq_len,
           "flops_per_token": flops_per_token, "peak_flops": peak.flops, "peak_source": peak.source, "rows": rows,
           "attention_kernels": kernels, "table": lines}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
