"""Alert rules over a run's logged metrics (the `monitor` config group), as a metrics sink on the main rank.

A rule names a metric, a threshold, `above`/`below` and a duration: it fires once the metric has been past the
threshold for that many seconds of wall time (checked at each logged step: it fires at the first logged step after
the duration), and clears at the first logged step where the metric is back. A rule whose metric this run cannot
measure is reported once as inactive, never silently dropped. Every event goes to `<run_dir>/alerts.jsonl`,
train.log and `monitor.notify_cmd` (an argument list, run with the event as JSON on stdin; never a shell).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from hpctrain.core.config import AlertAction, AlertRule, AlertWhen, ConfigError, MonitorConfig, SpikeAction
from hpctrain.core.errors import TrainingError
from hpctrain.core.files import FileCheckError, read_records
from hpctrain.monitoring.sink import Sink

log = logging.getLogger("hpctrain")
ALERTS_FILE = "alerts.jsonl"
NOTIFY_TIMEOUT_S = 30


@dataclass(frozen=True)
class Context:
    """What turns a logged record into the rules' metrics."""

    device: object
    world: int
    sample_every: int = 0  # monitor.sample_every: communication and synchronisation are measured that often
    node_failures: tuple[list[float], int] | None = None  # (failure times, nodes) of a Slurm job (cluster.job)
    failure_window_s: float = 3600.0  # node_failure_rate is per this much time
    scores: bool = False  # eval.tasks set: downstream scores (eval/<task>/<metric>) are logged
    moe: bool = False  # the model has MoE layers: their figures (moe/...) are logged


def _memory_usage(record: dict, ctx: Context) -> float | None:
    """Percent of the device's memory in use now (the host's, for a CPU rank): this rank's."""
    import torch

    if ctx.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(ctx.device)
        return 100.0 * (total - free) / total
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 100.0 * resident / (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _node_failure_rate(record: dict, ctx: Context) -> float:
    """Percent of the job's nodes that failed (a restart the run did not ask for) within the last window."""
    times, nodes = ctx.node_failures
    return 100.0 * sum(time.time() - t <= ctx.failure_window_s for t in times) / nodes


def _not_on_slurm(ctx: Context) -> str | None:
    return None if ctx.node_failures is not None else "not a Slurm job (node failures are counted from its restarts)"


def _gpu_utilization(record: dict, ctx: Context) -> float | None:
    import torch

    return float(torch.cuda.utilization(ctx.device))


def _gpu_utilization_missing(ctx: Context) -> str | None:
    if ctx.device.type != "cuda":
        return "no GPU on this rank"
    try:
        import torch

        torch.cuda.utilization(ctx.device)
    except Exception as e:  # noqa: BLE001 - pynvml missing, or a driver without NVML
        return f"the GPU's utilisation cannot be read ({type(e).__name__}: install pynvml)"
    return None


def _sampled_missing(ctx: Context) -> str | None:
    if ctx.world == 1:
        return "a single rank has no collectives"
    return None if ctx.sample_every else "monitor.sample_every=0 measures nothing"


# metric -> (value from a logged record, why this run cannot measure it: None when it can)
METRICS: dict[str, tuple[Callable[[dict, Context], float | None], Callable[[Context], str | None]]] = {
    "loss": (lambda r, c: r.get("loss"), lambda c: None),
    "gradient_norm": (lambda r, c: r.get("grad_norm"), lambda c: None),
    "throughput": (lambda r, c: r["tokens_per_s"] / c.world if r.get("tokens_per_s") is not None else None,
                   lambda c: None),  # tokens/s per device
    "memory_usage": (_memory_usage, lambda c: None),
    "gpu_utilization": (_gpu_utilization, _gpu_utilization_missing),
    "communication_overhead": (lambda r, c: r.get("communication_overhead"), _sampled_missing),
    "synchronization_time": (lambda r, c: r.get("synchronization_time"), _sampled_missing),
    "node_failure_rate": (_node_failure_rate, _not_on_slurm),
}


def metric_of(name: str):
    """(value from a record, why this run cannot measure it) of a metric a rule names: METRICS', or a logged figure
    as logged: a downstream score eval/<task>/<metric>, an MoE figure moe/... (hpctrain.training.expert_balance);
    None for neither."""
    def logged(r, c):
        return r.get(name) if isinstance(r.get(name), (int, float)) else None

    if name.startswith("eval/") and name.count("/") >= 2:
        return logged, lambda c: None if c.scores else "eval.tasks is empty: no downstream score is logged"
    if name.startswith("moe/"):
        return logged, lambda c: None if c.moe else "the model has no MoE layers (model.moe.num_experts=0)"
    return METRICS.get(name)


def run_bounded(cmd: list[str], stdin: bytes, timeout: float, keep: int = 500) -> tuple[int, bytes]:
    """Run `cmd` (never a shell) with `stdin`: (exit code, the last `keep` bytes of its stderr). Its stdout is
    discarded and its stderr read as it comes, keeping only the tail: a command that prints without end costs
    this process `keep` bytes, never its memory. Killed after `timeout` s (TimeoutExpired)."""
    import threading

    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tail = bytearray()

    def drain() -> None:
        while chunk := p.stderr.read1(65536):
            tail.extend(chunk)
            del tail[:-keep]

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        try:
            p.stdin.write(stdin)
            p.stdin.close()
        except BrokenPipeError:  # it did not read its input: its exit code tells the rest
            pass
        code = p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    finally:
        reader.join(5)
        p.stderr.close()
    return code, bytes(tail)


def parse_rules(mcfg: MonitorConfig) -> dict[str, AlertRule]:
    """monitor.rules as AlertRules; a one-line ConfigError for a rule that cannot work."""
    known = {f.name for f in fields(AlertRule)}
    rules = {}
    for name, raw in mcfg.rules.items():
        raw = dict(raw) if hasattr(raw, "items") else None
        if raw is None or set(raw) - known:
            raise ConfigError(f"monitor.rules.{name} must be a mapping of {', '.join(sorted(known))}, e.g. "
                              "'+monitor.rules.spiky={metric:gradient_norm,threshold:50,when:above,for_s:60}'")
        try:
            rule = AlertRule(**{**raw, "when": AlertWhen(raw.get("when", "above")),
                                "threshold": float(raw.get("threshold", 0.0)), "for_s": float(raw.get("for_s", 60.0)),
                                "action": AlertAction(raw.get("action", "warn"))})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"monitor.rules.{name}: {e} (when: above or below; action: warn, checkpoint or stop; "
                              "threshold and for_s numbers)") from None
        if not isinstance(rule.metric, str):
            raise ConfigError(f"monitor.rules.{name}.metric={rule.metric!r} must be a metric's name, e.g. "
                              "metric:gradient_norm")
        rules[name] = rule
    return rules


def check_monitor(mcfg: MonitorConfig, checkpointing: bool = True) -> None:
    """One-line ConfigErrors for rules, a notify command and a spike action that cannot work (before anything
    starts); `checkpointing`: train.checkpointing."""
    if SpikeAction(mcfg.loss_spike.action) == SpikeAction.rollback and not checkpointing:
        raise ConfigError("monitor.loss_spike.action=rollback reloads the last checkpoint, but train.checkpointing="
                          "false writes none: set train.checkpointing=true or monitor.loss_spike.action=skip_batch")
    for name, rule in parse_rules(mcfg).items():
        if metric_of(rule.metric) is None:
            raise ConfigError(f"monitor.rules.{name}.metric={rule.metric!r} is not a metric alerts can watch: use "
                              f"one of {', '.join(METRICS)}, a downstream score eval/<task>/<metric> or an MoE "
                              "figure moe/<name>")
        if not rule.for_s >= 0 or rule.threshold != rule.threshold:  # (NaN is neither)
            raise ConfigError(f"monitor.rules.{name}: for_s={rule.for_s} must be >= 0 and threshold a number")
    cmd = mcfg.notify_cmd
    if cmd is not None and (not cmd or not all(isinstance(a, str) and a for a in cmd)):
        raise ConfigError(f"monitor.notify_cmd={list(cmd)!r} must be a non-empty list of arguments, e.g. "
                          "'monitor.notify_cmd=[/usr/local/bin/page-me,--team,llm]'")
    if cmd and not shutil.which(cmd[0]):
        raise ConfigError(f"monitor.notify_cmd={list(cmd)!r}: {cmd[0]} is not an executable program (on PATH or as a "
                          "path): give the full path of the command to run")


class _State:
    def __init__(self):
        self.since: float | None = None  # wall time the metric went past the threshold
        self.firing = False


class AlertSink(Sink):
    """The rules, evaluated at every logged record (a metrics sink: main rank only)."""

    def __init__(self, run_dir: str, mcfg: MonitorConfig, ctx: Context, clock: Callable[[], float] = time.time,
                 trackers=(), start_step: int = 0):
        self.rules, self.ctx, self.clock = parse_rules(mcfg), ctx, clock
        self.trackers = tuple(trackers)  # MLflow / W&B sinks: every event goes to them too
        self.notify_cmd = list(mcfg.notify_cmd) if mcfg.notify_cmd else None
        self.path = os.path.join(run_dir, ALERTS_FILE)
        self.state = {name: _State() for name in self.rules}
        self._restore("resumed", start_step)  # a rule firing then clears when back within, and does not fire again
        self.straggling: list[str] = []
        self.actions: list[tuple[str, AlertAction]] = []  # (rule, action) of rules fired since `take_actions`
        self.straggler_frac = mcfg.straggler_frac
        self.inactive = {}
        for name, rule in self.rules.items():
            reason = metric_of(rule.metric)[1](ctx)
            if reason:
                self.inactive[name] = reason
                self._emit({"event": "inactive", "rule": name, "metric": rule.metric, "reason": reason}, None)

    def write(self, record: dict) -> None:
        self._stragglers(record)
        now = self.clock()
        for name, rule in self.rules.items():
            if name in self.inactive:
                continue
            value = metric_of(rule.metric)[0](record, self.ctx)
            if value is None:  # e.g. a skipped step's loss: no evidence either way
                continue
            st = self.state[name]
            past = value > rule.threshold if AlertWhen(rule.when) == AlertWhen.above else value < rule.threshold
            if past:
                st.since = now if st.since is None else st.since
                if not st.firing and now - st.since >= rule.for_s:
                    st.firing = True
                    self._emit(self._event("firing", name, rule, value, record, now - st.since), record)
                    if AlertAction(rule.action) != AlertAction.warn:
                        self.actions.append((name, AlertAction(rule.action)))
            else:
                st.since = None
                if st.firing:
                    st.firing = False
                    self._emit(self._event("cleared", name, rule, value, record, 0.0), record)

    def rewind(self, step: int) -> None:
        """A loss-spike rollback to `step`: the rules' states as they were there."""
        self._restore("rewound", step)

    def _restore(self, why: str, step: int) -> None:
        """The rules' firing states at `step` (where a run resumes, or a rollback went back to), from alerts.jsonl,
        where that step is marked (`why`: resumed, rewound) so that a later replay leaves out what this timeline
        went back past. How long a metric had been past its threshold without firing yet is not recorded: for_s
        counts again from here."""
        if not os.path.exists(self.path):
            return
        try:
            events = read_records(self.path, lenient=True)
        except FileCheckError as e:  # a device, a runaway line: not the file this run writes
            raise TrainingError(f"{e} (this run's {ALERTS_FILE}): move it aside to resume the run") from None
        changes = []  # (step, rule, firing) in the timeline that leads here
        for event in [*events, {"event": why, "step": step}]:
            at, kind = event.get("step"), event.get("event")
            if not isinstance(at, int):
                continue
            if kind in ("resumed", "rewound"):  # an attempt or a rollback went back to `at`: what came after it is gone
                changes = [c for c in changes if c[0] <= at]
            elif kind in ("firing", "cleared") and event.get("rule") in self.rules:
                changes.append((at, event["rule"], kind == "firing"))
        for state in self.state.values():
            state.firing, state.since = False, None
        for _, name, firing in changes:
            self.state[name].firing = firing
        with open(self.path, "a") as f:  # (a marker only: no tracker or notify_cmd hears of it)
            f.write(json.dumps({"time": round(time.time(), 3), "event": why, "rule": "*", "step": step}) + "\n")

    def _stragglers(self, record: dict) -> None:
        """Stragglers named when they appear or change (a sampled record), and when there are none again."""
        now = record.get("stragglers")
        if now is None or now == self.straggling:
            return
        kind = "straggler" if now else "straggler_cleared"
        self.straggling = now
        if now:
            log.warning("stragglers at step %s (compute time above %s × the median): %s", record.get("step"),
                        f"{1 + self.straggler_frac:g}", ", ".join(now))
        else:
            log.info("no straggler at step %s any more", record.get("step"))
        self._emit({"event": kind, "rule": "stragglers", "metric": "stragglers", "ranks": now,
                    "compute_s_by_rank": record.get("compute_s_by_rank"), "step": record.get("step")}, record)

    def take_actions(self) -> list[tuple[str, AlertAction]]:
        """The checkpoint and stop actions of the rules fired since the last call."""
        actions, self.actions = self.actions, []
        return actions

    @staticmethod
    def _event(kind: str, name: str, rule, value: float, record: dict, for_s: float) -> dict:
        return {"event": kind, "rule": name, "metric": rule.metric, "value": value, "threshold": rule.threshold,
                "when": AlertWhen(rule.when).value, "for_s": round(for_s, 3), "action": AlertAction(rule.action).value,
                "step": record.get("step")}

    def _emit(self, event: dict, record: dict | None) -> None:
        event = {"time": round(time.time(), 3), **event}
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")
        if event["event"] == "firing":
            log.warning("alert %s firing at step %s: %s %s %s %g for %.0f s", event["rule"], event["step"],
                        event["metric"], f"{event['value']:.4g}", event["when"], event["threshold"], event["for_s"])
        elif event["event"] == "cleared":
            log.info("alert %s cleared at step %s: %s %.4g", event["rule"], event["step"], event["metric"],
                     event["value"])
        elif event["event"] == "inactive":
            log.info("alert %s inactive: %s (%s)", event["rule"], event["metric"], event["reason"])
        for tracker in self.trackers:
            tracker.alert(event)
        self._notify(event)

    def record(self, event: dict) -> None:
        """Another component's event (a loss spike, logged by it): alerts.jsonl, notify_cmd and the trackers."""
        self._emit(event, None)

    def _notify(self, event: dict) -> None:
        if not self.notify_cmd:
            return
        try:
            code, err = run_bounded(self.notify_cmd, json.dumps(event).encode(), NOTIFY_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.error("monitor.notify_cmd failed for alert %s: %s", event["rule"], e)
            return
        if code != 0:
            log.error("monitor.notify_cmd exited %d for alert %s: %s", code, event["rule"],
                      err.decode(errors="replace").strip())
