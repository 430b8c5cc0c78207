"""`hpctrain bench ckpt` (`make bench-ckpt`): how long a checkpoint holds training back, written
synchronously and in the background (train.ckpt_async), against the disk's own sequential write speed.

Two runs of the same model, data and steps, a checkpoint every `--every` steps: one with synchronous saves, one
with train.ckpt_async=true. Each save's stall (the time the training loop waited for it) comes from the run's
result.json. The ceiling is measured in the same invocation, on the same filesystem, between and after the runs:
one checkpoint's bytes written sequentially in 64 MiB blocks with O_DIRECT (the disk, not the page cache). Targets:
async stall ≤ 10 % of the sync stall; a sync save at ≥ 50 % of the raw bandwidth. The first background save also
allocates the host copy (kept for later saves), so it is shown apart.

Everything is written into a new directory under --out, removed at the end (--keep keeps it); the synthetic shard
set is kept in --out/data for later invocations.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

from hpctrain.core.argparser import Parser
from hpctrain.core.files import read_metrics

SEQ_LEN = 64
BLOCK = 64 * 2**20


def raw_write_speed(directory: str, nbytes: int) -> tuple[float, str]:
    """(bytes per second, how) of one sequential write of `nbytes` into a new file in `directory` (removed after):
    with O_DIRECT, the disk's own speed, past the page cache (whose state makes buffered writes vary 3x here);
    where the filesystem refuses O_DIRECT, buffered and fsynced."""
    block = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    block.write(bytes(range(256)) * (BLOCK // 256))
    path = os.path.join(directory, "raw-write.bin")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd, how = os.open(path, flags | getattr(os, "O_DIRECT", 0)), "O_DIRECT"
    except OSError:
        fd, how = os.open(path, flags), "buffered + fsync"
    try:
        t0 = time.perf_counter()
        for _ in range(max(1, nbytes // BLOCK)):
            os.write(fd, block)
        os.fsync(fd)
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
    written = os.path.getsize(path)
    os.remove(path)
    return written / elapsed, how


def _overrides(model: str, data: str, run_dir: str, steps: int, every: int, ckpt_async: bool,
               extra: list[str] = ()) -> list[str]:
    return [f"run_dir={run_dir}", f"model={model}", f"data.path={data}", "data.prepare_demo=false",
            f"train.seq_len={SEQ_LEN}", "train.global_batch=1", "train.micro_batch=1", f"train.max_steps={steps}",
            "train.log_every=1", "train.eval_every=0", f"train.ckpt_every={every}", "train.ckpt_keep=1",
            f"train.ckpt_async={str(ckpt_async).lower()}", "train.resume=never", "logging.trackers=[]",
            "train.progress=false", "optim.warmup_steps=0", *extra]


def _checkpoint_bytes(run_dir: str) -> int:
    from hpctrain.storage import checkpoint

    path = checkpoint.latest(run_dir)
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def _run(model: str, data: str, run_dir: str, steps: int, every: int, ckpt_async: bool, extra: list[str]) -> dict:
    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train

    result = train(compose(_overrides(model, data, run_dir, steps, every, ckpt_async, extra)), run_dir)
    step_s = {r["step"]: r["step_time_s"] for r in read_metrics(run_dir) if "loss" in r}
    # Steps while a background write runs (those right after a save) against the others.
    after_save = [t for s, t in step_s.items() if s > every and (s - 1) % every == 0]
    others = [t for s, t in step_s.items() if s > 1 and (s - 1) % every != 0]
    return {"stall_s": result["checkpoints"]["stall_s"], "write_s": result["checkpoints"]["write_s"],
            "bytes": _checkpoint_bytes(run_dir), "wall_s": result["wall_time_s"], "status": result["status"],
            "step_after_save_s": statistics.mean(after_save) if after_save else None,
            "step_other_s": statistics.mean(others) if others else None, "params": result["params"]}


def report(sync: dict, asy: dict, raws: list[tuple[float, str]]) -> tuple[list[str], dict]:
    """`raws`: the raw write speeds measured between and after the runs; the fastest is the ceiling."""
    gb, raw_bps = 1e9, max(r for r, _ in raws)
    sync_stall = statistics.mean(sync["stall_s"][1:] or sync["stall_s"])
    async_later = asy["stall_s"][1:] or asy["stall_s"]
    async_stall = statistics.mean(async_later)
    sync_bps = sync["bytes"] / sync_stall
    figures = {"checkpoint_gb": sync["bytes"] / gb, "raw_write_gb_s": [r / gb for r, _ in raws],
               "sync_stall_s": sync_stall, "sync_gb_s": sync_bps / gb, "sync_vs_raw": sync_bps / raw_bps,
               "async_first_stall_s": asy["stall_s"][0], "async_stall_s": async_stall,
               "async_vs_sync": async_stall / sync_stall, "async_write_s": asy["write_s"],
               "sync_stalls_s": sync["stall_s"], "async_stalls_s": asy["stall_s"],
               "step_s_while_writing": asy["step_after_save_s"], "step_s_otherwise": asy["step_other_s"],
               "wall_s": {"sync": sync["wall_s"], "async": asy["wall_s"]}}
    f = figures
    lines = [
        f"checkpoint {f['checkpoint_gb']:.2f} GB; the disk's sequential write ({raws[0][1]}) between and after the "
        "runs: " + ", ".join(f"{r:.2f}" for r in f["raw_write_gb_s"]) + " GB/s (the fastest is the ceiling)",
        f"sync:  stall per save {f['sync_stall_s']:.2f} s = {f['sync_gb_s']:.2f} GB/s = {f['sync_vs_raw']:.0%} of raw "
        f"(target >= 50 %: {'met' if f['sync_vs_raw'] >= 0.5 else 'MISSED'}); each: "
        + ", ".join(f"{s:.2f}" for s in sync["stall_s"]),
        f"async: stall per save {f['async_stall_s']:.2f} s = {f['async_vs_sync']:.1%} of sync (target <= 10 %: "
        f"{'met' if f['async_vs_sync'] <= 0.1 else 'MISSED'}); first save (allocates the host copy) "
        f"{f['async_first_stall_s']:.2f} s; each: " + ", ".join(f"{s:.2f}" for s in asy["stall_s"])
        + "; written in the background in " + ", ".join(f"{s:.1f}" for s in asy["write_s"]) + " s",
    ]
    if asy["step_after_save_s"] and asy["step_other_s"]:
        lines.append(f"async: a step while a write runs {asy['step_after_save_s']:.2f} s, otherwise "
                     f"{asy['step_other_s']:.2f} s (the write shares this machine's cores)")
    lines.append(f"run wall time: sync {sync['wall_s']:.1f} s, async {asy['wall_s']:.1f} s")
    return lines, figures


def main(argv: list[str] | None = None) -> dict:
    ap = Parser(prog="hpctrain bench ckpt", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama_350m", help="a model= option (default: the largest that fits here)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4, help="a checkpoint every N steps (long enough for a write)")
    ap.add_argument("--out", default=os.path.join("outputs", "bench-ckpt"))
    ap.add_argument("--keep", action="store_true", help="keep the runs (checkpoints included)")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for both runs, e.g. train.ckpt_write_threads=4")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from data_prep.synthetic import cached_synthetic
    from hpctrain.core.shard_format import DataError
    from hpctrain.runs.compose import compose

    vocab = compose([f"model={a.model}", *a.overrides]).model.vocab_size
    os.makedirs(a.out, exist_ok=True)
    try:
        data = cached_synthetic(os.path.join(a.out, "data"), vocab, SEQ_LEN, samples=64)
    except DataError as e:
        sys.exit(f"bench-ckpt: {e} (or pass --out elsewhere)")
    work = tempfile.mkdtemp(prefix="run-", dir=a.out)
    try:
        sync = _run(a.model, data, os.path.join(work, "sync"), a.steps, a.every, False, a.overrides)
        raw = [raw_write_speed(work, sync["bytes"])]
        asy = _run(a.model, data, os.path.join(work, "async"), a.steps, a.every, True, a.overrides)
        raw.append(raw_write_speed(work, sync["bytes"]))
        raw.append(raw_write_speed(work, sync["bytes"]))
    finally:
        if not a.keep:
            shutil.rmtree(work)
    lines, figures = report(sync, asy, raw)
    print(f"bench-ckpt: {a.model}, {sync['params'] / 1e6:.0f} M parameters, fp32 AdamW, one process, "
          f"{' '.join(a.overrides) + ', ' if a.overrides else ''}"
          f"{a.steps} steps of {SEQ_LEN} tokens, a checkpoint every {a.every} steps (kept: {work if a.keep else 'none'})")
    for line in lines:
        print("  " + line)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
