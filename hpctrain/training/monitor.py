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
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from hpctrain.config import AlertRule, AlertWhen, ConfigError

log = logging.getLogger("hpctrain")
ALERTS_FILE = "alerts.jsonl"
NOTIFY_TIMEOUT_S = 30


@dataclass(frozen=True)
class Context:
    """What turns a logged record into the rules' metrics."""

    device: object
    world: int


def _memory_usage(record: dict, ctx: Context) -> float | None:
    """Percent of the device's memory in use now (the host's, for a CPU rank): this rank's."""
    import torch

    if ctx.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(ctx.device)
        return 100.0 * (total - free) / total
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 100.0 * resident / (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


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


def _not_measured(ctx: Context) -> str:
    return "not measured by this version of hpctrain"


# metric -> (value from a logged record, why this run cannot measure it: None when it can)
METRICS: dict[str, tuple[Callable[[dict, Context], float | None], Callable[[Context], str | None]]] = {
    "loss": (lambda r, c: r.get("loss"), lambda c: None),
    "gradient_norm": (lambda r, c: r.get("grad_norm"), lambda c: None),
    "throughput": (lambda r, c: r["tokens_per_s"] / c.world if r.get("tokens_per_s") is not None else None,
                   lambda c: None),  # tokens/s per device
    "memory_usage": (_memory_usage, lambda c: None),
    "gpu_utilization": (_gpu_utilization, _gpu_utilization_missing),
    "communication_overhead": (lambda r, c: None, _not_measured),
    "synchronization_time": (lambda r, c: None, _not_measured),
    "node_failure_rate": (lambda r, c: None, _not_measured),
}


def parse_rules(mcfg) -> dict[str, AlertRule]:
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
                                "threshold": float(raw.get("threshold", 0.0)), "for_s": float(raw.get("for_s", 60.0))})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"monitor.rules.{name}: {e} (when: above or below; threshold and for_s numbers)") from None
        rules[name] = rule
    return rules


def check_monitor(mcfg) -> None:
    """One-line ConfigErrors for rules and a notify command that cannot work (before anything starts)."""
    for name, rule in parse_rules(mcfg).items():
        if rule.metric not in METRICS:
            raise ConfigError(f"monitor.rules.{name}.metric={rule.metric!r} is not a metric alerts can watch: use "
                              f"one of {', '.join(METRICS)}")
        if rule.for_s < 0 or rule.threshold != rule.threshold:
            raise ConfigError(f"monitor.rules.{name}: for_s={rule.for_s} must be >= 0 and threshold a number")
    cmd = mcfg.notify_cmd
    if cmd is not None and (not cmd or not all(isinstance(a, str) and a for a in cmd)):
        raise ConfigError(f"monitor.notify_cmd={list(cmd)!r} must be a non-empty list of arguments, e.g. "
                          "'monitor.notify_cmd=[/usr/local/bin/page-me,--team,llm]'")


class _State:
    def __init__(self):
        self.since: float | None = None  # wall time the metric went past the threshold
        self.firing = False


class AlertSink:
    """The rules, evaluated at every logged record (a metrics sink: main rank only)."""

    def __init__(self, run_dir: str, mcfg, ctx: Context, clock: Callable[[], float] = time.time):
        self.rules, self.ctx, self.clock = parse_rules(mcfg), ctx, clock
        self.notify_cmd = list(mcfg.notify_cmd) if mcfg.notify_cmd else None
        self.path = os.path.join(run_dir, ALERTS_FILE)
        self.state = {name: _State() for name in self.rules}
        self.inactive = {}
        for name, rule in self.rules.items():
            reason = METRICS[rule.metric][1](ctx)
            if reason:
                self.inactive[name] = reason
                self._emit({"event": "inactive", "rule": name, "metric": rule.metric, "reason": reason}, None)

    def write(self, record: dict) -> None:
        now = self.clock()
        for name, rule in self.rules.items():
            if name in self.inactive:
                continue
            value = METRICS[rule.metric][0](record, self.ctx)
            if value is None:  # e.g. a skipped step's loss: no evidence either way
                continue
            st = self.state[name]
            past = value > rule.threshold if AlertWhen(rule.when) == AlertWhen.above else value < rule.threshold
            if past:
                st.since = now if st.since is None else st.since
                if not st.firing and now - st.since >= rule.for_s:
                    st.firing = True
                    self._emit(self._event("firing", name, rule, value, record, now - st.since), record)
            else:
                st.since = None
                if st.firing:
                    st.firing = False
                    self._emit(self._event("cleared", name, rule, value, record, 0.0), record)

    @staticmethod
    def _event(kind: str, name: str, rule, value: float, record: dict, for_s: float) -> dict:
        return {"event": kind, "rule": name, "metric": rule.metric, "value": value, "threshold": rule.threshold,
                "when": AlertWhen(rule.when).value, "for_s": round(for_s, 3), "step": record.get("step")}

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
        else:
            log.info("alert %s inactive: %s (%s)", event["rule"], event["metric"], event["reason"])
        self._notify(event)

    def _notify(self, event: dict) -> None:
        if not self.notify_cmd:
            return
        try:
            p = subprocess.run(self.notify_cmd, input=json.dumps(event), text=True, capture_output=True,
                               timeout=NOTIFY_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.error("monitor.notify_cmd failed for alert %s: %s", event["rule"], e)
            return
        if p.returncode != 0:
            log.error("monitor.notify_cmd exited %d for alert %s: %s", p.returncode, event["rule"],
                      p.stderr.strip()[-500:])

    def close(self) -> None:
        pass
