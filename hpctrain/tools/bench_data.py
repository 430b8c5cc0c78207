"""`hpctrain bench data`: loader throughput per process vs what training consumes, in one run.

Measures, on the demo shards (or --data DIR) from local disk:
  1. reading one shard: the fast local tar path vs webdataset's per-sample tar iterator;
  2. ShardStream end to end (int64 micro-batches out) for several lanes / dp / worker settings, and once
     with every shard read through webdataset only;
  3. the tiny model's training rate (real `hpctrain.training.run.train()`, model=tiny, default batch) and its
     data_wait_frac from metrics.jsonl.
Tokens are counted as training tokens (samples x seq_len) everywhere, so the ratios compare like with like.
Whatever is measured is reported; there is no pass/fail threshold.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from hpctrain.core.argparser import Parser
from hpctrain.core.files import read_metrics, write_json
from hpctrain.core.host import usable_cpus
from hpctrain.data import loader as data_mod
from hpctrain.data.loader import ShardStream, read_manifest, read_shard_wds

TARGET = 10e6  # loader tokens/s per process


def shard_read_rate(data_dir: str, reader, repeats: int) -> float:
    m = read_manifest(data_dir)
    shards = [s for s in m.splits["train"] if s.samples]
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for s in shards:
            reader(os.path.join(data_dir, s.name), s, m)
        best = max(best, sum(s.samples for s in shards) * m.seq_len / (time.perf_counter() - t0))
    return best


def stream_rate(data_dir: str, samples: int, repeats: int, batch: int = 8, **kw) -> float:
    """Training tokens/s this process gets out of a ShardStream (first batch, i.e. worker start, included)."""
    rates = []
    for _ in range(repeats):
        stream = ShardStream(data_dir, "train", batch, seed=0, **kw)
        n = samples // (batch * kw.get("dp_size", 1))
        it = iter(stream)
        t0 = time.perf_counter()
        for _ in range(n):
            next(it)
        dt = time.perf_counter() - t0
        it.close()
        rates.append(n * batch * stream.manifest.seq_len / dt)
    return statistics.median(rates)


def mixture_rate(data_dir: str, n_sources: int, samples: int, repeats: int, lanes: int, batch: int = 8) -> float:
    """Training tokens/s out of a MixtureStream of `n_sources` equal sources (the same shard set under n names)."""
    from hpctrain.data.mixture import MixtureStream, Source

    sources = [Source(f"s{i}", data_dir, 1.0) for i in range(n_sources)]
    rates = []
    for _ in range(repeats):
        stream = MixtureStream(sources, "train", batch, seed=0, lanes=lanes)
        n = samples // batch
        it = iter(stream)
        t0 = time.perf_counter()
        for _ in range(n):
            next(it)
        rates.append(n * batch * stream.manifest.seq_len / (time.perf_counter() - t0))
    return statistics.median(rates)


def _stream_rows(data_dir: str, samples: int, repeats: int, settings: list, report) -> None:
    """ShardStream in each setting, and once with webdataset's tar iterator as the only reader."""
    print(f"ShardStream, micro-batch 8, {samples} global samples (median of {repeats}):")
    for name, kw in settings:
        report(f"ShardStream {name}", stream_rate(data_dir, samples, repeats, **kw))
    real = data_mod.read_shard
    data_mod.read_shard = read_shard_wds  # what the stream gets from webdataset's tar iterator alone
    try:
        report("ShardStream lanes=1 workers=0, webdataset only", stream_rate(data_dir, samples, repeats))
    finally:
        data_mod.read_shard = real


def _mixture_rows(data_dir: str, samples: int, repeats: int, lanes: int, report, results: dict) -> None:
    """A mixture of 1 source against 8, and against ShardStream with the same lanes (issue 29: ≤ 10 % slower)."""
    print(f"MixtureStream (data.sources), lanes={lanes}, workers=0: 1 source against 8 (each the same shard set):")
    one = mixture_rate(data_dir, 1, samples, repeats, lanes)
    report(f"MixtureStream 1 source lanes={lanes}", one)
    eight = mixture_rate(data_dir, 8, samples, repeats, lanes)
    report(f"MixtureStream 8 sources lanes={lanes}", eight)
    print(f"  8 sources / 1 source: {eight / one:.2f}; 1 source / ShardStream lanes={lanes} workers=0: "
          f"{one / results[f'ShardStream lanes={lanes} workers=0']:.2f}")


def train_rate(steps: int, warmup: int, threads: int) -> dict:
    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train

    cfg = compose([
        "model=tiny", "data=demo", "parallel=single", "precision=fp32", f"train.max_steps={steps}",
        "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0", "logging.trackers=[]",
        "train.progress=false", "train.resume=never", f"cluster.num_threads={threads}"])
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-data-") as run_dir:
        train(cfg, run_dir)
        records = [r for r in read_metrics(run_dir) if "tokens_per_s" in r][warmup:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
            "data_wait_frac": statistics.mean(r["data_wait_frac"] for r in records),
            "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch}


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog="hpctrain bench data", description=__doc__.splitlines()[0])
    p.add_argument("--data", help="shard directory (default: the demo shards, built on first use)")
    p.add_argument("--samples", type=int, default=20_000, help="samples per stream measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=10, help="tiny-model training steps (0: skip)")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads for training")
    p.add_argument("--json", metavar="PATH", help="write the figures to PATH")
    a = p.parse_args(argv)
    data_dir = a.data
    if data_dir is None:
        from data_prep.demo import build_demo, default_out_dir

        data_dir = default_out_dir()
        build_demo(data_dir)
    m = read_manifest(data_dir)
    train_shards = [s for s in m.splits["train"] if s.samples]
    print(f"shards: {data_dir}: {len(train_shards)} train shards, {m.num_samples('train')} samples of "
          f"{m.block_len} {m.dtype} tokens; {os.cpu_count()} CPUs; torch {torch.__version__}", flush=True)

    results: dict[str, float] = {}

    def report(name: str, tps: float) -> None:
        results[name] = tps
        print(f"  {name:44} {tps / 1e6:8.2f} M tokens/s  ({tps / TARGET:5.2f}x the 10 M target)", flush=True)

    print("one process, reading every train shard once (best of repeats):")
    report("read_shard, fast local tar path", shard_read_rate(data_dir, data_mod.read_shard, a.repeats))
    report("read_shard via webdataset per-sample tar", shard_read_rate(data_dir, read_shard_wds, a.repeats))
    lanes = min(4, len(train_shards))
    settings = [("lanes=1 workers=0", dict(lanes=1)), (f"lanes={lanes} workers=0", dict(lanes=lanes)),
                (f"lanes={lanes} workers=2", dict(lanes=lanes, num_workers=2))]
    if lanes % 2 == 0:
        settings.append((f"lanes={lanes} dp=2 (rank 0) workers=1",
                         dict(lanes=lanes, dp_size=2, dp_rank=0, num_workers=1)))
    _stream_rows(data_dir, a.samples, a.repeats, settings, report)
    _mixture_rows(data_dir, a.samples, a.repeats, lanes, report, results)

    doc: dict = {"loader_tokens_per_s": results, "target_tokens_per_s": TARGET}
    if a.train_steps > 0:
        warmup = min(3, a.train_steps - 1)
        print(f"training model=tiny on the demo shards, {a.train_steps} steps ({warmup} warmup excluded), "
              f"{a.threads} threads ...", flush=True)
        tr = train_rate(a.train_steps, warmup, a.threads)
        doc["train"] = tr
        loader = results["ShardStream lanes=1 workers=0"]
        print(f"  training consumes {tr['tokens_per_s'] / 1e3:.1f} k tokens/s (global batch "
              f"{tr['global_batch']}, micro {tr['micro_batch']}); data_wait_frac {tr['data_wait_frac']:.4f}")
        print(f"  loader (lanes=1, workers=0, in the training process) / training consumption: "
              f"{loader / tr['tokens_per_s']:.0f}x")
    if a.json:
        write_json(a.json, doc)
    return doc


if __name__ == "__main__":
    main()
