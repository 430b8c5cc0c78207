"""`hpctrain bench scale` (`make bench-scale`): a billion-parameter run on this machine.

`llama_1b` (1.24 B parameters, Llama 3's 128,256-token vocabulary) trains two bf16 steps under FSDP (ZeRO-3) over
dp=2 local ranks, on a synthetic shard set made for that vocabulary (`data_prep.synthetic`), and prints each
rank's start-up and step peaks against the planner's estimate for its device, with the start-up and step times.

On CPU a peak is the rank's resident high-water mark over its size before the model was built (see
`hpctrain.monitoring.memory`); glibc's mmap threshold is fixed at 64 KiB first, so that freed tensors leave the
resident set as they leave a GPU allocator's count, instead of lingering in malloc's heap. The planner counts
tensor bytes only: the rest of a step peak is the runtime's own (gloo buffers, autograd, Python).
Nothing is saved (train.checkpointing=false): a 1.24 B-parameter AdamW checkpoint is 15 GB.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys

from hpctrain.core.argparser import Parser
from hpctrain.core.files import read_metrics

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
SEQ_LEN = 256


def _fix_mmap_threshold(nbytes: int = 64 * 1024) -> bool:
    """Allocations from `nbytes` up get their own mapping, returned to the kernel when freed (inherited by the
    forked ranks). False where this is not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False


def _overrides(data: str, run_dir: str, extra: list[str]) -> list[str]:
    return [f"run_dir={run_dir}", "model=llama_1b", "parallel=fsdp", "parallel.dp=2", "precision=bf16",
            f"data.path={data}", "data.prepare_demo=false", f"train.seq_len={SEQ_LEN}", "train.global_batch=2",
            "train.micro_batch=1", "train.max_steps=2", "train.log_every=1", "train.eval_every=0",
            "train.checkpointing=false", "train.resume=never", "logging.trackers=[]", "train.progress=false",
            "optim.warmup_steps=0", "cluster.num_threads=1", *extra]


def _cell(value: float | None, width: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.2f}"


def report(result: dict, run_dir: str) -> list[str]:
    mem = result["memory"]
    lines = [f"{'rank':>4} {'start-up GiB':>13} {'step GiB':>9} {'planner GiB':>12} {'step/planner':>13}"]
    for rank, (start, step, plan) in enumerate(zip(mem["startup_gib"], mem["step_gib"], mem["planned_gib"])):
        lines.append(f"{rank:>4} {_cell(start, 13)} {_cell(step, 9)} {_cell(plan, 12)} "
                     f"{_cell(None if step is None else step / plan, 13)}")
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    lines.append("steps: " + "; ".join(f"{r['step']}: loss {r['loss']:.3f}, {r['step_time_s']:.1f} s" for r in steps))
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = Parser(prog="hpctrain bench scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join("outputs", "bench-scale"),
                    help="its data (data/) and run directory (run/); a previous run is moved aside, never deleted")
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. parallel.activation_checkpointing=full")
    a = ap.parse_args(argv)
    fixed = _fix_mmap_threshold()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the run's lines: init time, memory, steps
    from data_prep.synthetic import cached_synthetic
    from hpctrain.core.shard_format import DataError
    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train

    try:
        data = cached_synthetic(os.path.join(a.out, "data"), 128256, SEQ_LEN, samples=16)
    except DataError as e:
        sys.exit(f"bench-scale: {e} (or pass --out elsewhere)")
    run_dir = os.path.join(a.out, "run")
    cfg = compose(_overrides(data, run_dir, a.overrides))
    result = train(cfg, run_dir)
    print(f"bench-scale: {cfg.model.name}, {result['params'] / 1e9:.3f} B parameters, fsdp dp=2, {cfg.precision}, "
          f"{result['steps']} steps of 2 × {SEQ_LEN} tokens ({result['status']}); peaks over each rank's size "
          f"before the model{'' if fixed else ' (glibc mmap threshold not fixed: malloc heap included)'}:")
    for line in report(result, run_dir):
        print("  " + line)
    print(json.dumps({"memory": result["memory"], "status": result["status"]}))
    return result


if __name__ == "__main__":
    main()
