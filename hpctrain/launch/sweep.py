"""`python -m hpctrain report <sweep_dir>`: one table (and a PNG) for a Hydra multirun sweep.

A sweep dir holds `multirun.yaml` and one run dir per grid point, named by job number. Points that never
started have no dir; they are listed from the grid in multirun.yaml. Status comes from each point's
result.json, and from Slurm (sacct) where result.json cannot tell: missing, or a preempted, requeued job.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import subprocess
import sys

from hpctrain.core.errors import ConfigError
from hpctrain.core.files import RUNNING, read_evals, read_metrics, read_object, read_result, read_yaml

HEATMAP_KEYS = ("optim.lr", "train.global_batch")
# Order of the summary line; states sacct reports beyond these follow in the order seen.
STATUS_ORDER = ("completed", "running", "pending", "requeued", "preempted", "failed", "interrupted",
                "terminated", "stopped", "timeout", "node_fail", "cancelled", "unknown", "not started")


class SweepError(Exception):
    """A path that is neither a sweep dir nor a run dir."""


# ---------------------------------------------------------------------------------------------- status


def _first_word(cmd: list[str]) -> str | None:
    """The first word of a Slurm command's first line of output, or None when it cannot say."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    words = out.stdout.split("\n")[0].split() if out.returncode == 0 else []
    return words[0] if words else None


def sacct_state(job_id: str) -> str | None:
    """Slurm's state of a job, lowercased ("running", "cancelled", ...), or None when sacct cannot say."""
    state = _first_word(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    return state.lower() if state else None  # "CANCELLED by 1000" -> "cancelled"


def pending_reason(job_id: str) -> str | None:
    """Why Slurm has not started a pending job (squeue's reason: Priority, Resources, PartitionTimeLimit, ...)."""
    return _first_word(["squeue", "-h", "-j", job_id, "-o", "%r"])


def point_status(result: dict | None, job_id: str | None, has_metrics: bool, started: bool) -> str:
    """A point's status: result.json's, unless it is missing, "preempted" or "terminated" and Slurm knows better;
    a pending job's with Slurm's reason (`pending (PartitionTimeLimit)`: one it will never start)."""
    status = (result or {}).get("status")
    if status and status not in ("preempted", "terminated", RUNNING):  # (running: killed, or still going)
        return status
    # A preempted job is requeued by Slurm: it may be pending or running again by now. A terminated one was
    # cancelled, timed out or lost a node: only Slurm knows which.
    state = sacct_state(job_id) if job_id else None
    if state == "pending":
        reason = pending_reason(job_id)
        return f"pending ({reason})" if reason and reason != "None" else state
    if state:
        return state
    if status:
        return status
    if has_metrics:
        return "running"
    return "unknown" if started else "not started"


# ----------------------------------------------------------------------------------------------- grid


def _parse(overrides: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(overrides)


def _typed(overrides: list[str]) -> dict:
    """{key: value} of non-sweep override strings, values typed as Hydra types them (1e-2 -> 0.01)."""
    values = {}
    for line in overrides:
        try:
            values[_key(line)] = _parse([line])[0].value()
        except Exception:  # an override this Hydra cannot parse: keep its text
            values[_key(line)] = line.partition("=")[2]
    return values


def _key(override: str) -> str:
    return override.partition("=")[0]


def sweep_grid(sweep_dir: str) -> tuple[list[str], list[list[str]] | None]:
    """(varying keys, override strings per job number) from multirun.yaml, as the basic sweeper expands it.

    The grid is None when multirun.yaml is missing or holds sweeps that cannot be enumerated
    (e.g. an Optuna interval); the keys are still found where the overrides parse.
    """
    from omegaconf import OmegaConf

    path = os.path.join(sweep_dir, "multirun.yaml")
    if not os.path.isfile(path):
        return [], None
    try:
        conf = read_yaml(path)
        task = list(OmegaConf.select(conf, "hydra.overrides.task") or [])
        # The basic sweeper puts hydra.sweeper.params before the command line.
        params = OmegaConf.select(conf, "hydra.sweeper.params")
        params = OmegaConf.to_container(params) if params is not None else {}
        lines = [f"{k}={v}" for k, v in params.items()] + task
        parsed = _parse(lines)
    except Exception:
        return [], None
    keys, axes = [], []
    for o in (o for o in parsed if o.is_sweep_override()):  # the others are the same on every point
        keys.append(o.get_key_element())
        try:
            axes.append([f"{keys[-1]}={v}" for v in o.sweep_string_iterator()])
        except Exception:
            return keys, None
    return keys, [list(combo) for combo in itertools.product(*axes)]


def _submitit_jobs(sweep_dir: str) -> dict[int, str]:
    """{task index: Slurm job id} from hydra-submitit's `.submitit/<jobid>_<index>/` folders."""
    found = {}
    try:
        names = os.listdir(os.path.join(sweep_dir, ".submitit"))
    except OSError:
        return found
    for name in sorted(names, key=lambda n: [int(p) for p in re.findall(r"\d+", n)]):
        m = re.fullmatch(r"(\d+)_(\d+)", name)
        if m:
            found[int(m.group(2))] = name  # a later array (a re-launch) wins
    return found


# ------------------------------------------------------------------------------------------------ rows


def _records(run_dir: str) -> list[dict] | None:
    try:
        # A live or crashed run can end in a line cut short; a resume drops it, the report skips it.
        return read_metrics(run_dir, lenient=True)
    except OSError:
        return None


def _run_row(run_dir: str) -> dict:
    """Everything the table and the plot show of one run dir that exists."""
    result = read_result(run_dir)
    slurm = read_object(os.path.join(run_dir, "slurm.json")) or {}
    records = _records(run_dir)
    train = [r for r in records or [] if isinstance(r, dict) and _num(r.get("loss")) is not None]
    val = [r for r in records or [] if isinstance(r, dict) and _num(r.get("val_loss")) is not None]
    evals = _eval_records(run_dir, records or [])
    res = result or {}
    # The first record's throughput includes warm-up (compilation, first data reads).
    tps = [_num(r.get("tokens_per_s")) for r in (train[1:] or train)]
    tps = [t for t in tps if t is not None]
    wall = _num(res.get("wall_time_s"))
    if wall is None and train:
        # Each record's step_time_s is the mean over the steps since the previous record.
        steps = [0] + [r["step"] for r in train]
        wall = sum((_num(r.get("step_time_s")) or 0.0) * (s - p) for r, s, p in zip(train, steps[1:], steps))
    try:
        cfg = read_yaml(os.path.join(run_dir, ".hydra", "config.yaml"))
    except Exception:
        cfg = None
    try:
        overrides = [str(o) for o in read_yaml(os.path.join(run_dir, ".hydra", "overrides.yaml"))]
    except Exception:
        overrides = []
    job_id = slurm.get("job_id") or _submitted_job(run_dir)  # (slurm.json: written once the job runs)
    return {
        "dir": run_dir,
        "all_overrides": overrides,
        "config": cfg,
        "result": result,
        "has_metrics": records is not None,
        "slurm_job_id": str(job_id) if job_id else None,
        # result.json is written at the end; a run without one has its last logged values.
        "final_loss": _first(_num(res.get("final_loss")), train[-1]["loss"] if train else None),
        "final_val_loss": _first(_num(res.get("final_val_loss")), val[-1]["val_loss"] if val else None),
        # a mixture's sources: the last logged train loss of each (loss/<source>), and each on its own validation
        # split (the last evaluation's val_loss/<source>)
        "loss_by_source": _by_source(train[-1] if train else {}, "loss/"),
        "val_by_source": _by_source(val[-1] if val else {}, "val_loss/"),
        # downstream tasks: the scores of the latest step evaluated (in the loop, or by `hpctrain eval`)
        "eval_scores": _by_source(_latest_step(evals), "eval/"),
        "tokens_per_s": sum(tps) / len(tps) if tps else None,
        "wall_time_s": wall,
        "steps": res.get("steps") if isinstance(res.get("steps"), int)
        else max((r["step"] for r in train + val if isinstance(r.get("step"), int)), default=None),
        "curve": [(r["step"], r["loss"]) for r in train if isinstance(r.get("step"), (int, float))],
        "stragglers": _stragglers(res, records or []),
        # energy where the run measured it (hpctrain.monitoring.energy): joules per token over the run
        "joules_per_token": _num((res.get("energy") or {}).get("joules_per_token")
                                 if isinstance(res.get("energy"), dict) else None),
    }


def bad_nodes_line(rows: list[dict]) -> str | None:
    """The nodes the sweep's bad-node list (its runs' cluster.bad_nodes) leaves out of submissions now, and why."""
    from hpctrain.runtime import bad_nodes

    for row in rows:
        if not row.get("bad_node_list"):
            continue
        path, expiry_h = row["bad_node_list"]
        try:
            left_out = bad_nodes.excluded(path, expiry_h)
        except ConfigError as e:
            return f"bad nodes: {e}"
        return (f"bad nodes, left out of submissions ({path}; python -m hpctrain nodes): "
                + "; ".join(f"{n} ({why})" for n, why in sorted(left_out.items()))) if left_out else None
    return None


def _stragglers(result: dict, records: list) -> list[str]:
    """The ranks (with their nodes) a run found straggling: its result's, or while it runs, the last sample's."""
    named = result.get("stragglers")
    if isinstance(named, dict):
        return sorted(str(k) for k in named)
    sampled = [r["stragglers"] for r in records if isinstance(r, dict) and isinstance(r.get("stragglers"), list)]
    return sorted(map(str, sampled[-1])) if sampled else []


def _eval_records(run_dir: str, records: list) -> list[dict]:
    """Records holding downstream scores, by step: metrics.jsonl's and evals.jsonl's (`hpctrain eval`)."""
    found = [r for r in records if isinstance(r, dict) and any(str(k).startswith("eval/") for k in r)]
    with contextlib.suppress(OSError):  # unreadable: the loop's own scores only
        found += read_evals(run_dir)
    return sorted((r for r in found if isinstance(r.get("step"), int)), key=lambda r: r["step"])


def _latest_step(records: list[dict]) -> dict:
    """The records of the latest step merged, later ones over earlier (each task scored last; none: {})."""
    merged: dict = {}
    for r in records:
        if r["step"] == records[-1]["step"]:
            merged.update(r)
    return merged


def _by_source(record: dict, prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: _num(v) for k, v in record.items() if k.startswith(prefix) and _num(v) is not None}


def _first(value, fallback):
    return value if value is not None else fallback


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _is_run_dir(path: str) -> bool:
    """A run's directory: it has logged or ended, or a single-run submission made it (its job may still wait)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("result.json", "metrics.jsonl")) or bool(
        _submitted_job(path))


def _submitted_job(run_dir: str) -> str | None:
    """The Slurm job a single-run submission (`hydra/launcher=slurm` without -m) made for `run_dir`: its newest
    `.submitit/<job id>` folder (a sweep's are `<job id>_<index>`)."""
    try:
        names = os.listdir(os.path.join(run_dir, ".submitit"))
    except OSError:
        return None
    return max((n for n in names if n.isdigit()), key=int, default=None)


def report(sweep_dir: str) -> list[dict]:
    """One row per point of a sweep (or a single row for a run dir), in job-number order.

    Row keys: job (None for a single run dir), overrides (the varying ones), status, final_loss,
    final_val_loss, tokens_per_s, wall_time_s, steps, slurm_job_id, dir (None if never started),
    params ({key: value} of the varying keys and optim.lr / train.global_batch), curve ([(step, loss)]).
    Raises SweepError for a path that is neither a sweep dir nor a run dir.
    """
    if not os.path.isdir(sweep_dir):
        raise SweepError(f"{sweep_dir} is not a directory; pass the sweep dir of a multirun "
                         "(hydra.sweep.dir, e.g. multirun/<date>/<time>) or one run dir")
    if _is_run_dir(sweep_dir) and not os.path.isfile(os.path.join(sweep_dir, "multirun.yaml")):
        row = _run_row(sweep_dir)
        return [_finish(row, None, [], [])]
    keys, grid = sweep_grid(sweep_dir)
    dirs = {int(n): os.path.join(sweep_dir, n) for n in os.listdir(sweep_dir)
            if n.isdigit() and os.path.isdir(os.path.join(sweep_dir, n))}
    if grid is None and not dirs:
        raise SweepError(f"{sweep_dir} has no multirun.yaml and no point dirs (0, 1, ...); pass the dir a "
                         "`python -m hpctrain -m ...` multirun wrote, or a run dir with metrics.jsonl")
    rows = {n: _run_row(d) for n, d in dirs.items()}
    if not keys:
        # No (readable) multirun.yaml: the varying keys are those whose values differ between points.
        seen = {}
        for row in rows.values():
            for o in row["all_overrides"]:
                seen.setdefault(_key(o), []).append(o)
        keys = [k for k, v in seen.items() if len(set(v)) > 1 or len(v) < len(rows)]
    submitit = _submitit_jobs(sweep_dir)
    jobs = sorted(set(dirs) | set(range(len(grid or []))))
    out = []
    for n in jobs:
        row = rows.get(n) or {"dir": None, "all_overrides": [], "config": None, "result": None,
                              "has_metrics": False, "slurm_job_id": None, "final_loss": None,
                              "final_val_loss": None, "loss_by_source": {}, "val_by_source": {},
                              "eval_scores": {}, "tokens_per_s": None,
                              "wall_time_s": None, "steps": None, "curve": [], "stragglers": []}
        row["slurm_job_id"] = row["slurm_job_id"] or submitit.get(n)
        planned = grid[n] if grid and n < len(grid) else []
        out.append(_finish(row, n, keys, planned))
    for key in HEATMAP_KEYS:
        # A point with no dir has no config.yaml; a key the sweep does not vary has the same value on it.
        values = {r["params"][key] for r in out} - {None}
        for r in out:
            if r["params"][key] is None and len(values) == 1:
                r["params"][key] = next(iter(values))
    return out


def _finish(row: dict, job: int | None, keys: list[str], planned: list[str]) -> dict:
    """Add job, status, the varying overrides and their values; drop what only building the row needed."""
    from omegaconf import OmegaConf

    # The point's own overrides.yaml is what ran; the grid is what was planned (no dir yet).
    by_key = {_key(o): o for o in planned} | {_key(o): o for o in row.pop("all_overrides")}
    shown = [by_key[k] for k in keys if k in by_key]
    typed = _typed(shown)
    cfg = row.pop("config")
    params = {}
    for key in list(keys) + [k for k in HEATMAP_KEYS if k not in keys]:
        value = OmegaConf.select(cfg, key.lstrip("+~"), default=None) if cfg is not None else None
        params[key] = value if isinstance(value, (int, float, str, bool)) else typed.get(key)
    try:  # the run's bad-node list (a config from before the list existed has none)
        row["bad_node_list"] = (cfg.cluster.bad_nodes, float(cfg.cluster.bad_node_expiry_h)) if cfg is not None \
            else None
    except Exception:  # noqa: BLE001 - an unreadable value: no list shown
        row["bad_node_list"] = None
    result = row.pop("result")
    status = point_status(result, row["slurm_job_id"], row.pop("has_metrics"), row["dir"] is not None)
    return {"job": job, "overrides": shown, "status": status, **row, "params": params}


# ----------------------------------------------------------------------------------------------- output


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    s = round(s)
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m{s % 60:02d}s" if h else f"{m}m{s % 60:02d}s"


def _best(rows: list[dict]) -> tuple[dict | None, str]:
    """The point with the lowest final val loss, or train loss when no point has a val loss."""
    key = "final_val_loss" if any(r["final_val_loss"] is not None for r in rows) else "final_loss"
    done = [r for r in rows if r[key] is not None]
    return (min(done, key=lambda r: r[key]) if done else None), key


def format_table(rows: list[dict]) -> str:
    """Aligned text columns and a one-line summary."""
    head = ["job", "overrides", "status", "loss", "val_loss", "tokens/s", "wall", "steps", "stragglers"]
    body = [[
        "-" if r["job"] is None else str(r["job"]),
        " ".join(r["overrides"]) or "-",
        r["status"],
        "-" if r["final_loss"] is None else f"{r['final_loss']:.4f}",
        "-" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}",
        "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
        _fmt_time(r["wall_time_s"]),
        "-" if r["steps"] is None else str(r["steps"]),
        ", ".join(r["stragglers"]) or "-",
    ] for r in rows]
    # a mixture: each source's own loss beside the loss, its own val loss beside val_loss
    for at, key, name in ((5, "eval_scores", "downstream (last eval)"), (5, "val_by_source", "val by source"),
                          (4, "loss_by_source", "loss by source")):
        if any(r.get(key) for r in rows):
            head.insert(at, name)
            for line, r in zip(body, rows):
                line.insert(at, " ".join(f"{k} {v:.4f}" for k, v in (r.get(key) or {}).items()) or "-")
    if any(r.get("joules_per_token") is not None for r in rows):
        head.append("J/token")
        for line, r in zip(body, rows):
            line.append("-" if r.get("joules_per_token") is None else f"{r['joules_per_token']:.3g}")
    widths = [max(len(line[i]) for line in [head] + body) for i in range(len(head))]
    numeric = {i for i, name in enumerate(head)
               if name in ("job", "loss", "val_loss", "tokens/s", "wall", "steps", "J/token")}
    lines = ["  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
             .rstrip() for line in [head] + body]
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    order = sorted(counts, key=lambda s: STATUS_ORDER.index(s) if s in STATUS_ORDER else len(STATUS_ORDER))
    summary = f"{len(rows)} point{'s' if len(rows) != 1 else ''}: " + ", ".join(f"{counts[s]} {s}" for s in order)
    best, key = _best(rows)
    if best is not None:
        what = " ".join(best["overrides"]) or best["dir"]
        label = "val loss" if key == "final_val_loss" else "train loss"
        job = "" if best["job"] is None else f"job {best['job']} "
        summary += f"; best: {job}({what}) {label} {best[key]:.4f}"
    return "\n".join(lines + [summary])


def _heatmap_axes(rows: list[dict]) -> tuple[str, str] | str:
    """(x key, y key) of the heatmap, or the reason there is none."""
    varying = list(dict.fromkeys(_key(o) for r in rows for o in r["overrides"]))
    if set(varying) <= set(HEATMAP_KEYS):
        return HEATMAP_KEYS
    if len(varying) == 2:
        return varying[0], varying[1]
    shown = varying[:6] + ([f"... and {len(varying) - 6} more"] if len(varying) > 6 else [])
    return f"no heatmap: it needs two varying keys,\nthe sweep varies {len(varying)}:\n" + "\n".join(shown)


def plot(rows: list[dict], path: str) -> str:
    """Loss curves (left) and a final-loss heatmap (right) as a PNG; returns the path written."""
    import matplotlib

    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), layout="constrained")  # (colorbar and long labels)
    for r in rows:
        if r["curve"]:
            steps, losses = zip(*r["curve"])
            name = " ".join(r["overrides"]) or (f"job {r['job']}" if r["job"] is not None else "run")
            name = name if len(name) <= 60 else name[:59] + "…"  # (a point whose sweep keys are unknown: all of its)
            left.plot(steps, losses, marker="." if len(steps) < 30 else None, label=name)
    left.set(xlabel="step", ylabel="train loss", title="train loss")
    if 0 < len(left.lines) <= 16:  # beyond that a legend hides the curves
        left.legend(fontsize="small")
    left.grid(alpha=0.3)

    axes = _heatmap_axes(rows)
    key = "final_val_loss" if any(r["final_val_loss"] is not None for r in rows) else "final_loss"
    xs = sorted({r["params"].get(axes[0]) for r in rows} - {None}, key=_order) if isinstance(axes, tuple) else []
    ys = sorted({r["params"].get(axes[1]) for r in rows} - {None}, key=_order) if isinstance(axes, tuple) else []
    if isinstance(axes, str) or not xs or not ys:
        right.axis("off")
        right.text(0.5, 0.5, axes if isinstance(axes, str) else "no heatmap: no point has those keys",
                   ha="center", va="center", transform=right.transAxes)
    else:
        grid = np.full((len(ys), len(xs)), np.nan)
        for r in rows:
            x, y = r["params"].get(axes[0]), r["params"].get(axes[1])
            if x in xs and y in ys and r[key] is not None:
                grid[ys.index(y), xs.index(x)] = r[key]
        image = right.imshow(np.ma.masked_invalid(grid), cmap="viridis_r", aspect="auto", origin="lower")
        title = key.replace("final_", "final ").replace("_", " ")
        fig.colorbar(image, ax=right, label=title)
        right.set_xticks(range(len(xs)), [f"{x:g}" if isinstance(x, float) else str(x) for x in xs])
        right.set_yticks(range(len(ys)), [f"{y:g}" if isinstance(y, float) else str(y) for y in ys])
        right.set(xlabel=axes[0], ylabel=axes[1], title=title)
        finite = grid[np.isfinite(grid)]
        middle = (finite.min() + finite.max()) / 2 if finite.size else 0.0
        for (i, j), v in np.ndenumerate(grid):
            # Dark text on the light (low loss) end of viridis_r, light text on the dark end.
            color = "black" if np.isnan(v) or v < middle else "white"
            right.text(j, i, "-" if np.isnan(v) else f"{v:.4g}", ha="center", va="center", color=color)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _order(v):
    # Numbers by value, then anything else by its text, so mixed types still sort.
    return (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))


# -------------------------------------------------------------------------------------------------- cli


def main(argv: list[str] | None = None) -> int:
    from hpctrain.core.argparser import Parser

    parser = Parser(
        prog="python -m hpctrain",
        description="Summarize a Hydra multirun sweep of hpctrain runs: status, losses, throughput per point.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="print a table of the sweep's points and write a PNG of their losses")
    rep.add_argument("sweep_dir", help="the multirun's hydra.sweep.dir, or one run dir")
    rep.add_argument("--plot", metavar="PATH", help="PNG to write (default: <sweep_dir>/sweep_report.png)")
    rep.add_argument("--no-plot", action="store_true", help="print the table only")
    rep.add_argument("--sort", choices=["job", "loss"], default="job",
                     help="row order: job number (default) or final loss (val, else train), best first")
    args = parser.parse_args(argv)
    try:
        rows = report(args.sweep_dir)
    except SweepError as e:
        print(f"hpctrain report: error: {e}", file=sys.stderr)
        return 2
    if args.sort == "loss":
        _, key = _best(rows)
        rows = sorted(rows, key=lambda r: (r[key] is None, r[key] or 0.0))
    print(format_table(rows))
    left_out = bad_nodes_line(rows)
    if left_out:
        print(left_out)
    if not args.no_plot:
        path = args.plot or os.path.join(args.sweep_dir, "sweep_report.png")
        try:
            print(f"plot: {plot(rows, path)}")
        except OSError as e:
            print(f"hpctrain report: error: cannot write {path}: {e.strerror}; pass --plot PATH", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
