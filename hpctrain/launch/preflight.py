"""`python -m hpctrain preflight`: check every rank of an allocation before a long job lands on it.

Run as `srun python -m hpctrain preflight` (one rank per task) or locally with `--ranks N`. Each rank
times a GEMM (and checks its result), an all-reduce (and checks the sum) and a send/recv exchange with
each ring neighbour (so a slow link is pinned to a pair of ranks). Rank 0 prints one table and a verdict
naming the slow or broken nodes. Exit code: 0 ok, 1 slow/broken/failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hpctrain.core.argparser import Parser
from hpctrain.parallel import process_group
from hpctrain.parallel.process_group import node_name
from hpctrain.runtime import bad_nodes

JOIN_KEY = "preflight/joined/{}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(prog="python -m hpctrain preflight", description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=16.0, help="all-reduce / p2p message size in MiB")
    p.add_argument("--gemm", type=int, default=1024, help="GEMM size n (n x n @ n x n)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations of each check")
    p.add_argument("--slow-frac", type=float, default=0.7,
                   help="a rank below this fraction of the median (gemm or p2p) is slow")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for every rank to join / each collective")
    p.add_argument("--ranks", type=int, default=1, help="local ranks to fork when not under srun/torchrun")
    p.add_argument("--out", help="write the per-rank results as JSON here (rank 0)")
    p.add_argument("--bad-nodes", default=bad_nodes.default_path(),
                   help="the bad-node list the slow or broken nodes are added to (cluster.bad_nodes; none: no list)")
    a = p.parse_args(argv)
    for name, ok in [("--size-mb", a.size_mb > 0), ("--gemm", a.gemm > 0), ("--iters", a.iters > 0),
                     ("--slow-frac", 0 <= a.slow_frac <= 1), ("--timeout", a.timeout > 0), ("--ranks", a.ranks > 0)]:
        if not ok:
            p.error(f"{name} out of range: {getattr(a, name[2:].replace('-', '_'))}")
    return a


# ---- measurements (one rank) ----

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, iters: int, device: torch.device) -> float:
    """Median seconds of one call: robust to a rank being preempted once, still sees a sustained slowdown."""
    fn()  # warm-up (lazy init, NCCL communicators, caches)
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_gemm(n: int, iters: int, device: torch.device) -> dict:
    """TFLOP/s of n x n matmuls, and whether the result matches a float64 reference."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)  # same inputs on every rank, made on the CPU so they are identical
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    if device.type == "cuda":  # events time the GPU itself, not host launch gaps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def one():
            start.record()
            torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        one()
        sec = statistics.median(one() for _ in range(iters))
    else:
        sec = _timed(lambda: torch.mm(a, b, out=out), iters, device)
    ref = a.double() @ b.double()
    # bf16 keeps 8 mantissa bits; fp32 accumulation error over n terms stays far below 1e-3 of the max.
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-3
    finite = bool(torch.isfinite(out).all())
    err = float((out.double() - ref).abs().max() / ref.abs().max()) if finite else math.inf
    problem = None if finite and err <= tol else (
        "gemm result not finite" if not finite else f"gemm result wrong (rel err {err:.1e} > {tol:.0e})")
    return {"gemm_tflops": 2 * n**3 / sec / 1e12, "gemm_rel_err": err, "problem": problem}


def check_allreduce(numel: int, iters: int, env: process_group.Env) -> dict:
    """Verify one all-reduce of known values exactly, then time `iters` of them (nccl-tests' algbw/busbw)."""
    n = env.world
    buf = torch.arange(numel, device=env.device, dtype=torch.float32).remainder_(7).add_(env.rank + 1)
    dist.all_reduce(buf)
    # sum over ranks of (i % 7 + r + 1): small integers, so exact in float32.
    want = torch.arange(numel, device=env.device, dtype=torch.float32).remainder_(7).mul_(n).add_(n * (n + 1) / 2)
    problem = None if torch.equal(buf, want) else "all-reduce sum wrong"
    sec = _timed(lambda: dist.all_reduce(buf), iters, env.device)
    algbw = numel * 4 / sec / 1e9
    return {"allreduce_s": sec, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n, "problem": problem}


def ring_phases(n: int) -> list[list[tuple[int, int]]]:
    """Links (r, r+1 mod n) in phases of disjoint pairs, so each link is timed alone and all phases are O(1)."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    links = [(r, (r + 1) % n) for r in range(n)]
    even, odd = links[0:n - 1:2], links[1:n - 1:2]
    return [ph for ph in (even, odd, [links[-1]]) if ph] if n % 2 else [links[0::2], links[1::2]]


def check_p2p(numel: int, iters: int, env: process_group.Env) -> dict:
    """GB/s (one direction, both at once) of the exchange with each ring neighbour; received data checked."""
    send = torch.full((numel,), float(env.rank + 1), device=env.device)
    recv = torch.empty_like(send)
    res: dict = {"p2p_next_gbps": None, "p2p_prev_gbps": None, "problem": None}
    for phase in ring_phases(env.world):
        dist.barrier()  # keeps phases apart: a link is only timed while its pair is the only traffic
        for a, b in phase:
            if env.rank not in (a, b):
                continue
            peer = b if env.rank == a else a

            def exchange(peer=peer):
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            gbps = numel * 4 / _timed(exchange, iters, env.device) / 1e9
            if not bool((recv == peer + 1).all()):
                res["problem"] = f"p2p data from rank {peer} wrong"
            if env.world == 2:  # one link is both neighbours
                res["p2p_next_gbps"] = res["p2p_prev_gbps"] = gbps
            else:
                res["p2p_next_gbps" if env.rank == a else "p2p_prev_gbps"] = gbps
    return res


# ---- verdict (pure) ----

def verdict(results: list[dict], slow_frac: float) -> tuple[str, str]:
    """Classify gathered per-rank results: ("ok" | "slow" | "broken", one-line message naming nodes)."""
    return findings(results, slow_frac)[:2]


def findings(results: list[dict], slow_frac: float) -> tuple[str, str, list[str]]:
    """The verdict, with the nodes it names."""
    nodes = sorted({r["node"] for r in results})
    broken = [r for r in results if r.get("problem")]
    if broken:
        named = sorted({r["node"] for r in broken})
        why = "; ".join(f"rank {r['rank']}: {r['problem']}" for r in broken)
        return "broken", f"preflight: BROKEN: {', '.join(named)} ({why})", named
    slow: list[tuple[dict, str]] = []
    gemm_med = statistics.median(r["gemm_tflops"] for r in results)
    for r in results:
        if r["gemm_tflops"] < slow_frac * gemm_med:
            slow.append((r, f"gemm {r['gemm_tflops'] / gemm_med:.1f}x the median"))
    # Each link (r, r+1) is measured by rank r. A rank whose links on both sides are slow is the slow one;
    # a single slow link is reported as the pair (either end may be at fault).
    by_rank = {r["rank"]: r for r in results}
    links = {r["rank"]: r["p2p_next_gbps"] for r in results if r.get("p2p_next_gbps") is not None}
    if len(results) == 2:
        links = {0: links[0]} if 0 in links else {}  # one physical pair, measured twice
    if len(links) >= 2:
        med = statistics.median(links.values())
        bad = {a for a, v in links.items() if v < slow_frac * med}
        n = len(results)
        for a in sorted(bad):
            b = (a + 1) % n
            if b in bad:  # both links of rank b are slow
                slow.append((by_rank[b], f"p2p {min(links[a], links[b]) / med:.1f}x the median"))
            elif (a - 1) % n not in bad:
                ra, rb = by_rank[a], by_rank[b]
                slow.append((ra, f"link to rank {b} ({rb['node']}): p2p {links[a] / med:.1f}x the median"))
                slow.append((rb, f"link to rank {a} ({ra['node']}): p2p {links[a] / med:.1f}x the median"))
    if slow:
        named = sorted({r["node"] for r, _ in slow})
        why = "; ".join(f"rank {r['rank']}: {w}" for r, w in slow)
        return "slow", f"preflight: SLOW: {', '.join(named)} ({why})", named
    return "ok", (f"preflight: ok ({len(results)} rank{'s' * (len(results) != 1)} on {len(nodes)} "
                  f"node{'s' * (len(nodes) != 1)})"), []


def render(results: list[dict], allreduce: dict, size_mb: float, status_of: dict[int, str]) -> str:
    rows = [("rank", "node", "local", "device", "gemm TFLOP/s", "p2p GB/s", "status")]
    for r in results:
        p2p = "-" if r.get("p2p_next_gbps") is None else f"{r['p2p_next_gbps']:.3f}"
        rows.append((str(r["rank"]), r["node"], str(r["local_rank"]), r["device"], f"{r['gemm_tflops']:.4f}",
                     p2p, status_of.get(r["rank"], "ok")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"all-reduce {size_mb:g} MiB float32 over {len(results)} ranks: algbw "
                 f"{allreduce['algbw_gbps']:.3f} GB/s, busbw {allreduce['busbw_gbps']:.3f} GB/s "
                 f"({allreduce['allreduce_s'] * 1e3:.2f} ms, slowest rank)")
    return "\n".join(lines)


def _status_of(results: list[dict], message: str, status: str) -> dict[int, str]:
    """Per-rank status column: broken/slow for the ranks the verdict names, else ok."""
    if status == "ok":
        return {}
    return {r["rank"]: status for r in results if f"rank {r['rank']}:" in message}


# ---- one rank ----

def _register(rank: int, world: int, timeout_s: float):
    """Join the rendezvous store and leave a key, so a failed start can say which ranks never arrived.

    multi_tenant=True: the store torch creates for the process group on the same port (rank 0) reuses
    this server, so no second port is needed.
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True)
    store.set(JOIN_KEY.format(rank), node_name())
    return store


def _missing(store, world: int) -> list[int]:
    try:
        return [r for r in range(world) if not store.check([JOIN_KEY.format(r)])]
    except Exception:  # noqa: BLE001 - the store's server (rank 0) may be gone by now
        return []


def run_rank(args: argparse.Namespace) -> int:
    """Everything one rank does; returns the exit code (the same verdict on every rank)."""
    if "SLURM_CPUS_PER_TASK" in os.environ:  # ranks sharing a host must not each use all its cores
        torch.set_num_threads(int(os.environ["SLURM_CPUS_PER_TASK"]))
    process_group._slurm_env()  # RANK/WORLD_SIZE/MASTER_* from srun's variables, before the store needs them
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    store = None
    try:
        if world > 1:
            store = _register(rank, world, args.timeout)
        env = process_group.init(args.timeout)
    except RuntimeError as e:  # DistStoreError / DistNetworkError / gloo connect timeouts
        missing = _missing(store, world) if store is not None else []
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if store is None:
            msg = f"rank {rank} ({node_name()}) could not reach rank 0 at {where} within {args.timeout:g}s"
        elif missing:
            msg = (f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} of {world} never joined "
                   f"within {args.timeout:g}s (process not started, or cannot reach {where})")
        else:
            msg = f"rank {rank} ({node_name()}): process group failed to form: {str(e).splitlines()[0]}"
        print(f"preflight: BROKEN: {msg}", file=sys.stderr)
        return 1
    try:
        return _measure_and_report(args, env)
    except RuntimeError as e:  # a peer died or stalled past --timeout in a collective
        print(f"preflight: BROKEN: rank {env.rank} ({node_name()}): a collective failed (a peer died or "
              f"stalled past {args.timeout:g}s): {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        process_group.shutdown()


def _measure_and_report(args: argparse.Namespace, env: process_group.Env) -> int:
    numel = max(1, int(args.size_mb * 2**20) // 4)
    mine = {"rank": env.rank, "node": node_name(), "local_rank": env.local_rank, "device": str(env.device)}
    if env.device.type == "cuda":
        mine["device"] += f" {torch.cuda.get_device_name(env.device)}"
    parts = [check_gemm(args.gemm, args.iters, env.device), check_allreduce(numel, args.iters, env),
             check_p2p(numel, args.iters, env)]
    problems = [p for p in (part.pop("problem") for part in parts) if p]
    for part in parts:
        mine.update(part)
    mine["problem"] = "; ".join(problems) or None
    results: list = [None] * env.world
    dist.all_gather_object(results, mine)
    status, message, named = findings(results, args.slow_frac)
    if env.is_main:
        bad_nodes.record(None if args.bad_nodes == "none" else args.bad_nodes, named, "preflight", message,
                         "preflight")
        slowest = max(results, key=lambda r: r["allreduce_s"])  # a collective is as fast as its slowest rank
        allreduce = {k: slowest[k] for k in ("allreduce_s", "algbw_gbps", "busbw_gbps")}
        print(render(results, allreduce, args.size_mb, _status_of(results, message, status)))
        print(message, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"status": status, "message": message, "world": env.world,
                           "nodes": sorted({r["node"] for r in results}), "size_mb": args.size_mb,
                           "gemm": args.gemm, "iters": args.iters, "allreduce": allreduce, "ranks": results},
                          f, indent=1)
    return 0 if status == "ok" else 1


def _local_rank_main(args: argparse.Namespace, codes) -> None:
    codes[int(os.environ["RANK"])] = run_rank(args)  # the parent reads the verdict from shared memory


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse: --help exits 0, bad arguments 2
        return e.code if isinstance(e.code, int) else 2
    launched = process_group.launched_world()
    if launched is not None or args.ranks == 1:
        if launched is not None and args.ranks not in (1, launched):
            print(f"preflight: error: --ranks {args.ranks} but srun/torchrun started {launched}", file=sys.stderr)
            return 2
        return run_rank(args)
    from hpctrain.runtime.spawn import LaunchError, spawn

    codes = mp.get_context("fork").Array("i", [-1] * args.ranks, lock=False)
    try:
        spawn(args.ranks, _local_rank_main, (args, codes))
    except LaunchError as e:
        print(f"preflight: FAILED: {e}", file=sys.stderr)
        return 1
    return 1 if any(c != 0 for c in codes) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
