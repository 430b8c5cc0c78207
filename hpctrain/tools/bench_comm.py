"""`hpctrain bench comm` (`make bench-comm`): what each gradient-communication option sends, and
what it costs the loss.

The same run (the tiny model on the demo corpus, data parallel over dp=2 local ranks, `--steps` steps, the same
global batches) trains once per option: fp32, bf16 and fp16 sums under ZeRO-0 (`ddp`) and ZeRO-3 (`fsdp`), PowerSGD
and top-k with error feedback under ZeRO-0. Bytes: what the busiest rank handed to collectives in one step after
compression has started: the input bytes of every gloo operation in a sampled step (the profiler's recorded shapes
× dtypes, every thread: the gradients' reduction and the step's small collectives — loss, stop votes), turned into
the bytes a rank sends as ring algorithms do (`sent_bytes`); the ratio against fp32 `ddp`. Loss:
the mean training loss of the last `--tail` steps and the validation loss at the end, against fp32 `ddp`'s.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from hpctrain.core.argparser import Parser

OPTIONS = {
    "ddp fp32": ["parallel=ddp"],
    "ddp bf16": ["parallel=ddp", "parallel.grad_reduce_dtype=bf16"],
    "ddp fp16": ["parallel=ddp", "parallel.grad_reduce_dtype=fp16"],
    "fsdp fp32": ["parallel=fsdp"],
    "fsdp bf16": ["parallel=fsdp", "parallel.grad_reduce_dtype=bf16"],
    "powersgd r4": ["parallel=ddp", "parallel.grad_compression=powersgd", "parallel.powersgd_rank=4"],
    "powersgd r1": ["parallel=ddp", "parallel.grad_compression=powersgd", "parallel.powersgd_rank=1"],
    "topk 1%": ["parallel=ddp", "parallel.grad_compression=topk", "parallel.topk_fraction=0.01"],
    "topk 10%": ["parallel=ddp", "parallel.grad_compression=topk", "parallel.topk_fraction=0.1"],
}


def _overrides(data: str, run_dir: str, steps: int, extra: list[str]) -> list[str]:
    return [f"run_dir={run_dir}", "model=tiny", "parallel.dp=2", f"data.path={data}", "data.prepare_demo=false",
            "train.global_batch=16", "train.micro_batch=8", f"train.max_steps={steps}", f"train.eval_every={steps}",
            "train.eval_batches=8", "train.log_every=1", "train.checkpointing=false", "train.resume=never",
            "logging.trackers=[]", "train.progress=false", "cluster.num_threads=1", "optim.lr=3e-3",
            "optim.warmup_steps=10", f"monitor.sample_every={steps - 5}", "parallel.compression_start_step=10",
            *extra]


def sent_bytes(by_op: dict[str, int], world: int) -> int:
    """What a rank sends for collectives given their input bytes, as ring algorithms do (NCCL's and gloo's rings):
    an all-reduce 2(W−1)/W of its input, a reduce-scatter (W−1)/W, an all-gather its piece to W−1 ranks."""
    total = 0.0
    for name, n in by_op.items():
        op = name.split(":", 1)[-1]
        if "reduce_scatter" in op:
            total += n * (world - 1) / world
        elif "all_gather" in op or "allgather" in op:
            total += n * (world - 1)
        elif "all_reduce" in op or "allreduce" in op:
            total += n * 2 * (world - 1) / world
        else:
            total += n
    return round(total)


def table(rows: list[dict]) -> list[str]:
    ref = rows[0]
    out = [f"{'option':12} {'bytes sent':>11} {'vs first':>8} {'train loss':>10} {'Δ':>8} {'val loss':>9} {'Δ':>8}"]
    for r in rows:
        out.append(f"{r['option']:12} {r['sent']:11,d} {r['sent'] / ref['sent']:8.4f} {r['train_loss']:10.4f} "
                   f"{r['train_loss'] - ref['train_loss']:+8.4f} {r['val_loss']:9.4f} "
                   f"{r['val_loss'] - ref['val_loss']:+8.4f}")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = Parser(prog="hpctrain bench comm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join("outputs", "bench-comm"),
                    help="the runs' directories (a previous one is moved aside, never deleted)")
    ap.add_argument("--data", default=None, help="a shard directory for the model (default: the demo shards)")
    ap.add_argument("--steps", type=int, default=200, help="steps per run (>= 20; compression starts at step 10)")
    ap.add_argument("--tail", type=int, default=20, help="the last steps whose training loss is averaged")
    # argparse formats help with %: "topk 1%" must reach it as "topk 1%%"
    ap.add_argument("--options", default=",".join(OPTIONS),
                    help="comma-separated, of: " + ", ".join(OPTIONS).replace("%", "%%"))
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    a = ap.parse_args(argv)
    options = [o.strip() for o in a.options.split(",") if o.strip()]
    bad = [o for o in options if o not in OPTIONS]
    if bad or not options:
        sys.exit(f"bench-comm: --options: unknown {', '.join(bad) or '(none given)'}; choose from "
                 f"{', '.join(OPTIONS)}")
    if a.steps < 20 or not 1 <= a.tail <= a.steps:
        sys.exit("bench-comm: --steps must be >= 20 and --tail within [1, --steps]")
    from data_prep.demo import build_demo, default_out_dir
    from hpctrain.core.files import read_metrics
    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train

    data = a.data
    if data is None:
        data = default_out_dir()
        build_demo(data)
    rows = []
    for name in options:
        run_dir = os.path.join(a.out, name.replace(" ", "-").replace("%", "pct"))
        result = train(compose(_overrides(data, run_dir, a.steps, OPTIONS[name] + a.overrides)), run_dir)
        if result["status"] != "completed":
            sys.exit(f"bench-comm: {name}: the run ended {result['status']} ({result.get('error')})")
        records = read_metrics(run_dir)
        by_op = [r["comm_bytes_by_op"] for r in records if "comm_bytes_by_op" in r][-1]
        losses = [r["loss"] for r in records if "loss" in r]
        val = [r["val_loss"] for r in records if "val_loss" in r]
        rows.append({"option": name, "sent": sent_bytes(by_op, 2), "by_op": by_op, "overrides": OPTIONS[name],
                     "train_loss": statistics.fmean(losses[-a.tail:]), "val_loss": val[-1]})
        print(f"bench-comm: {name}: {rows[-1]['sent']:,d} bytes sent per step per rank ({by_op}), train loss "
              f"{rows[-1]['train_loss']:.4f}, val loss {rows[-1]['val_loss']:.4f}", flush=True)
    print(f"bench-comm: tiny model, dp=2 (gloo), {a.steps} steps of global batch 16, compression from step 10; "
          f"train loss: mean of the last {a.tail} steps; Δ against {rows[0]['option']}")
    for line in table(rows):
        print("  " + line)
    out = {"steps": a.steps, "rows": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
