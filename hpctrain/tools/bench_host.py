"""`hpctrain bench host`: per-step host costs that grow with the model and the cluster, each against
its baseline measured in the same run.

- the global gradient norm + clipping over 723 gradient tensors (a 70B Llama's count): a Python loop of one
  kernel per tensor (the old way) vs the grouped foreach kernels of `hpctrain.training.step`;
- the preemption/termination vote at 2, 4 and 8 local ranks: a blocking all-reduce after every step (the old
  way) vs `StopSignals.agreed`, which overlaps it with the next step, vs no vote at all.
Timings on a shared machine are noisy: compare the ratios, not the milliseconds.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from hpctrain.core.argparser import Parser, at_least

# 723 tensors as in llama_70b (80 layers × 9 + 3), small so that the per-tensor overhead dominates.
SHAPES = [(64, 64)] * 560 + [(64,)] * 161 + [(512, 64)] * 2


def _ms(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def bench_norm(repeats: int) -> dict:
    from hpctrain.training.step import clip_grads, grad_norm

    params = []
    for shape in SHAPES:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape)
        params.append(p)

    def loop():  # the baseline: one norm and one multiply per tensor
        total = torch.zeros(())
        for p in params:
            total = total + torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
        for p in params:
            p.grad.mul_(0.999999)
        return total.sqrt()

    def grouped():
        norm = grad_norm(params)
        clip_grads(params, 1.0, 1.0 / 0.999999)  # the same multiply by 0.999999 as the loop
        return norm

    return {"loop_ms": _ms(loop, repeats), "foreach_ms": _ms(grouped, repeats)}


def _vote_rank(steps: int, out: str) -> None:
    import torch.distributed as dist

    from hpctrain.parallel import process_group
    from hpctrain.runtime.job import StopSignals

    env = process_group.init(60.0)
    signals = StopSignals("USR2")
    work = torch.randn(256, 256)
    res = {}
    for mode in ("none", "blocking", "overlapped"):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(steps):
            a = work
            for _ in range(8):  # ~2 ms of compute standing in for a step
                a = a @ a
                a = a / a.norm()
            if mode == "blocking":
                flag = torch.tensor([0], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                flag.item()
            elif mode == "overlapped":
                signals.agreed()
        res[f"{mode}_ms"] = (time.perf_counter() - t) / steps * 1e3
    signals.restore()
    if env.rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    process_group.shutdown()


def bench_vote(ranks: list[int], steps: int) -> dict:
    from hpctrain.runtime.spawn import spawn

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in ranks:
            path = os.path.join(tmp, f"vote{n}.json")
            spawn(n, _vote_rank, (steps, path), threads=1)
            with open(path) as f:
                out[n] = json.load(f)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = Parser(prog="hpctrain bench host", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=at_least(1), default=50, help="norm + clip calls timed (default 50)")
    p.add_argument("--steps", type=at_least(1), default=200, help="steps timed per vote mode (default 200)")
    p.add_argument("--ranks", default="2,4,8", help="local rank counts for the vote (default 2,4,8)")
    a = p.parse_args(argv)
    try:
        ranks = [int(n) for n in a.ranks.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 2:
        p.error(f"--ranks {a.ranks}: local rank counts of 2 or more, comma-separated, e.g. 2,4,8")
    torch.set_num_threads(1)
    norm = bench_norm(a.repeats)
    print(f"grad norm + clip over {len(SHAPES)} tensors: loop {norm['loop_ms']:.2f} ms, foreach "
          f"{norm['foreach_ms']:.2f} ms per step; ratio {norm['loop_ms'] / norm['foreach_ms']:.1f}x")
    vote = bench_vote(ranks, a.steps)
    for n, r in vote.items():
        print(f"stop vote, {n} ranks: step {r['none_ms']:.2f} ms without a vote; blocking +"
              f"{r['blocking_ms'] - r['none_ms']:.2f} ms, overlapped +{r['overlapped_ms'] - r['none_ms']:.2f} ms")
    return {"norm": norm, "vote": vote}


if __name__ == "__main__":
    main()
