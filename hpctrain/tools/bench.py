"""`python -m hpctrain bench`: training throughput of hpctrain vs a plain transformers loop, in one run.

Both sides train the same model (model=tiny), on the same batches of the demo shards, with the same
batch, precision, optimizer, grad clipping, seed and thread count. The hpctrain side runs the real
`hpctrain.training.run.train()` and reads its metrics.jsonl; the HF side is a hand-written
`LlamaForCausalLM` loop. Runs alternate and repeat (median taken) because shared machines are noisy.
Whatever is measured is reported: there is no pass/fail threshold.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from hpctrain.core.argparser import Parser, at_least
from hpctrain.core.files import read_metrics, write_json
from hpctrain.core.host import usable_cpus
from hpctrain.models import model_args
from hpctrain.runs.compose import compose, register
from hpctrain.runs.resolve import resolve

BATCH = 8
VARIANTS = {"hf": "transformers (HF)", "hpctrain": "hpctrain", "docmask": "hpctrain + docmask",
            "compile": "hpctrain + compile"}
# What each hpctrain variant adds to the run (train.document_mask: the step-time cost of document masking, on the same
# batches; its ratio to the plain hpctrain row is printed below the table).
VARIANT_OVERRIDES = {"hpctrain": [], "docmask": ["train.document_mask=true"], "compile": ["parallel.compile=true"]}


def compose_cfg(overrides: list[str]):
    return compose([
        "model=tiny", "data=demo", "optim=adamw", "parallel=single", f"train.global_batch={BATCH}",
        f"train.micro_batch={BATCH}", "train.eval_every=0", "train.ckpt_every=0",
        "logging.trackers=[]", "train.log_every=1", "train.progress=false", "train.resume=never",
        *overrides])


def measure(tokens: list[float], times: list[float], warmup: int, final_loss: float | None) -> dict:
    """tokens/s over the post-warmup steps, and a noise-robust variant from the median step time."""
    tokens, timed = tokens[warmup:], times[warmup:]
    return {"tokens_per_s": sum(tokens) / sum(timed),
            "median_step_tokens_per_s": statistics.median(tokens) / statistics.median(timed),
            "step_times_s": times, "final_loss": final_loss}


def run_hpctrain(precision: str, variant: str, steps: int, warmup: int, threads: int) -> dict:
    from hpctrain.training.run import train

    if variant == "compile":
        torch._dynamo.reset()  # every compiled run starts cold; its compile falls in the warmup steps
    cfg = compose_cfg([f"precision={precision}", *VARIANT_OVERRIDES[variant],
                       f"train.max_steps={steps}", f"cluster.num_threads={threads}"])
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-") as run_dir:
        train(cfg, run_dir)
        records = read_metrics(run_dir)
    per_step = [r for r in records if "tokens_per_s" in r]
    assert [r["step"] for r in per_step] == list(range(1, steps + 1)), "expected one metrics record per step"
    # log_every=1: each record is one step, so tokens_per_s * step_time_s is that step's token count.
    times = [r["step_time_s"] for r in per_step]
    tokens = [r["tokens_per_s"] * t for r, t in zip(per_step, times)]
    return measure(tokens, times, warmup, per_step[-1]["loss"])


def run_hf(precision: str, steps: int, warmup: int, args, data_dir: str, seed: int) -> dict:
    import transformers

    from hpctrain.data.loader import ShardStream
    from hpctrain.models import get_spec

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(get_spec("llama").hf().to_hf_config(args, attn_implementation="sdpa")).float().train()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    params = list(model.parameters())
    batches = iter(ShardStream(data_dir, "train", BATCH, seed))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    times, tokens, loss_value = [], [], None
    for _ in range(steps):
        t0 = time.perf_counter()  # data included, as in hpctrain's step_time_s
        block = next(batches)
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=block[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), block[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss_value = loss.item()
        times.append(time.perf_counter() - t0)
        tokens.append(block.shape[0] * (block.shape[1] - 1))
    return measure(tokens, times, warmup, loss_value)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="hpctrain bench", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=at_least(1), default=30, help="training steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="first steps excluded from tokens/s (default 5)")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated (default fp32,bf16)")
    p.add_argument("--repeats", type=at_least(1), default=1, help="alternating rounds; the median is reported")
    p.add_argument("--no-compile", action="store_true", help="skip the parallel.compile=true variant")
    p.add_argument("--threads", type=at_least(1), default=usable_cpus(), help="torch threads (default: CPUs)")
    p.add_argument("--json", metavar="PATH", help="write every measurement to PATH")
    p.add_argument("--quick", action="store_true", help="smoke run: --steps 6 --warmup 2 --no-compile")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.no_compile = 6, 2, True
    if not 0 <= a.warmup < a.steps:
        p.error(f"--warmup {a.warmup} must be >= 0 and below --steps {a.steps}")
    a.precisions = [s.strip() for s in a.precisions.split(",") if s.strip()]
    a.variants = ["hf", "hpctrain", "docmask"] + ([] if a.no_compile else ["compile"])
    return a


def _measure(a: argparse.Namespace, args, data_dir: str, seed: int) -> dict[str, dict[str, list[dict]]]:
    """Every (precision, variant) run of every repeat, sides alternating."""
    # The first training run in a process pays one-time costs (seconds per step for the first steps,
    # whichever side goes first); a short untimed round of each side and precision absorbs them.
    for pr in a.precisions:
        run_hf(pr, 2, 0, args, data_dir, seed)
        run_hpctrain(pr, "hpctrain", 2, 0, a.threads)
    runs: dict[str, dict[str, list[dict]]] = {pr: {v: [] for v in a.variants} for pr in a.precisions}
    for rep in range(a.repeats):
        for pr in a.precisions:
            for v in a.variants if rep % 2 == 0 else a.variants[::-1]:  # no side always runs first
                t0 = time.perf_counter()
                if v == "hf":
                    r = run_hf(pr, a.steps, a.warmup, args, data_dir, seed)
                else:
                    r = run_hpctrain(pr, v, a.steps, a.warmup, a.threads)
                torch.set_num_threads(a.threads)  # whatever a run changed, the next starts alike
                r["wall_s"] = time.perf_counter() - t0
                runs[pr][v].append(r)
                print(f"  [{rep + 1}/{a.repeats}] {pr:4} {VARIANTS[v]:18} {r['tokens_per_s']:9.1f} tokens/s "
                      f"(run {r['wall_s']:.0f} s, final loss {r['final_loss']:.3f})", flush=True)
    return runs


def _summarise(runs: dict[str, dict[str, list[dict]]], precisions: list[str], variants: list[str]) -> list[dict]:
    """The medians over repeats against HF transformers' loop, printed as a table."""
    summary = []
    print(f"\n{'precision':9} | {'variant':18} | {'tokens/s':>9} | {'vs HF':>6} | "
          f"{'median-step tok/s':>17} | vs HF")
    print("-" * 80)
    for pr in precisions:
        keys = ("tokens_per_s", "median_step_tokens_per_s")
        row = {v: {k: statistics.median(r[k] for r in runs[pr][v]) for k in keys} for v in variants}
        hf, hf_med = row["hf"]["tokens_per_s"], row["hf"]["median_step_tokens_per_s"]
        for v in variants:
            tps, med = row[v]["tokens_per_s"], row[v]["median_step_tokens_per_s"]
            summary.append({"precision": pr, "variant": v, "tokens_per_s": tps, "ratio_vs_hf": tps / hf,
                            "median_step_tokens_per_s": med, "median_step_ratio_vs_hf": med / hf_med})
            print(f"{pr:9} | {VARIANTS[v]:18} | {tps:9.1f} | {tps / hf:5.2f}× | {med:17.1f} | "
                  f"{med / hf_med:.2f}×")
        if "docmask" in row:
            masked = row["docmask"]["median_step_tokens_per_s"] / row["hpctrain"]["median_step_tokens_per_s"]
            summary.append({"precision": pr, "variant": "docmask_vs_hpctrain", "median_step_ratio": masked})
            print(f"{pr:9}   document masking: {masked:.2f}× hpctrain's median-step tokens/s (same batches)")
    print("tokens/s: post-warmup tokens / their summed step time (medians over repeats); median-step: tokens "
          "per step / median step time, less sensitive to load bursts on a shared machine")
    return summary


def main(argv: list[str] | None = None) -> dict:
    a = _parse(argv)
    register()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    import transformers

    from hpctrain.training.run import prepare_data

    cfg = compose_cfg([])
    data_dir, seq_len = prepare_data(cfg, resolve(cfg))  # builds the demo shards on first use
    args, seed = model_args(cfg.model), cfg.train.seed
    machine = (f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {a.threads} torch threads; "
               f"torch {torch.__version__}, transformers {transformers.__version__}, "
               f"python {platform.python_version()}")
    print(machine)
    print(f"model {cfg.model.name} (dim {args.dim}, {args.n_layers} layers), batch {BATCH}×{seq_len} tok, "
          f"{a.steps} steps/run ({a.warmup} warmup excluded), {a.repeats} repeat(s)", flush=True)
    runs = _measure(a, args, data_dir, seed)
    summary = _summarise(runs, a.precisions, a.variants)
    print(machine)
    doc = {"machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "threads": a.threads,
                       "torch": torch.__version__, "transformers": transformers.__version__},
           "settings": {"steps": a.steps, "warmup": a.warmup, "repeats": a.repeats, "batch": BATCH,
                        "seq_len": seq_len, "model": cfg.model.name, "seed": seed},
           "summary": summary, "runs": runs}
    if a.json:
        write_json(a.json, doc)
    return doc


if __name__ == "__main__":
    main()
