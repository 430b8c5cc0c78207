"""`hpctrain bench monitor` (`make bench-monitor`): what watching a run costs.

The same run (the tiny model, ddp over dp=2 local ranks, nothing saved) trains with the `monitor` defaults (every
alert rule, a profiled step in `monitor.sample_every` gathered from both ranks, the loss-spike check, heartbeats)
and with all of it off, `--repeats` pairs in alternating order (off-on, on-off, ...: a machine that speeds up or
slows down during the benchmark favours neither side); the figure is the wall time per step of the whole loop (a
sampled step's profiling and gathering happen after the step's own timer, so step_time_s would miss them), as the
median over the pairs of on / off. Target: at most 1 % more.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from hpctrain.core.argparser import Parser

OFF = ["monitor.rules={}", "monitor.sample_every=0", "monitor.loss_spike.action=none", "monitor.heartbeat_s=3600"]


def _overrides(data: str, run_dir: str, steps: int, extra: list[str]) -> list[str]:
    return [f"run_dir={run_dir}", "model=tiny", "parallel=ddp", "parallel.dp=2", f"data.path={data}",
            "data.prepare_demo=false", "train.global_batch=16", "train.micro_batch=8", f"train.max_steps={steps}",
            "train.eval_every=0", "train.checkpointing=false", "train.resume=never", "logging.trackers=[]",
            "train.progress=false", "cluster.num_threads=1", *extra]


def main(argv: list[str] | None = None) -> dict:
    ap = Parser(prog="hpctrain bench monitor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join("outputs", "bench-monitor"),
                    help="the runs' directories (a previous one is moved aside, never deleted)")
    ap.add_argument("--data", default=None, help="a shard directory for the model (default: the demo shards)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="more Hydra overrides for both sides")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.repeats < 1:
        sys.exit("bench-monitor: --steps and --repeats must be >= 1")
    from data_prep.demo import build_demo, default_out_dir
    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train

    data = a.data
    if data is None:
        data = default_out_dir()
        build_demo(data)
    per_step: dict[str, list[float]] = {"off": [], "on": []}
    counted = []  # the "on" runs' own account of sampling's cost, as a share of their wall time
    for i in range(a.repeats):
        for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
            run_dir = os.path.join(a.out, f"{side}-{i}")
            cfg = compose(_overrides(data, run_dir, a.steps, a.overrides + (OFF if side == "off" else [])))
            result = train(cfg, run_dir)
            per_step[side].append(result["wall_time_s"] / result["steps"])
            if side == "on":
                counted.append(100.0 * result["monitor_overhead_s"] / result["wall_time_s"])
                sample_every = cfg.monitor.sample_every
            print(f"bench-monitor: {side:>3} #{i}: {per_step[side][-1] * 1e3:.2f} ms per step", flush=True)
    ratio = statistics.median(on / off for on, off in zip(per_step["on"], per_step["off"]))
    overhead = 100.0 * (ratio - 1.0)
    samples = a.steps // sample_every if sample_every else 0
    print(f"bench-monitor: monitoring on / off = {ratio:.4f} ({overhead:+.2f} % per step; median of {a.repeats} "
          f"pairs of runs of {a.steps} steps, {samples} sampled steps per run; target <= +1 %): "
          f"{'met' if overhead <= 1.0 else 'MISSED'}")
    # The A/B ratio carries the machine's noise (a few % on a shared one); the runs' own account of sampling
    # (profiler, gather, the sampled steps' extra time) does not.
    print(f"bench-monitor: sampling's own cost, counted by the runs: {statistics.median(counted):.2f} % of wall "
          f"time (median; per run: {', '.join(f'{c:.2f}' for c in counted)} %)")
    out = {"off_s_per_step": per_step["off"], "on_s_per_step": per_step["on"], "overhead_pct": overhead,
           "sampling_pct": counted}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
