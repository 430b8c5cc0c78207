"""Step metrics: what a logged step reports (throughput, MFU against a peak-FLOPs table, data wait, memory),
when (`train.log_every`), and where: pluggable sinks (metrics.jsonl, TensorBoard, the console; a tracker or an
alert rule is one more sink) and a progress bar."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
from dataclasses import dataclass

from hpctrain.core.config import LoggingConfig, MonitorConfig, TrainConfig
from hpctrain.core.errors import TrainingError
from hpctrain.core.files import METRICS_FILE, FileCheckError, lines, step_of
from hpctrain.monitoring.monitor import AlertSink, Context
from hpctrain.monitoring.prometheus import prometheus_sinks
from hpctrain.monitoring.sink import Sink, display_name
from hpctrain.monitoring.trackers import chosen, tracker_sinks

log = logging.getLogger("hpctrain")

# Dense peak TFLOPS per device by compute dtype (vendor datasheets, no sparsity: NVIDIA's headline Hopper figure of
# 1,979 bf16 TFLOP/s counts 2:4 sparsity), looked up by the device name (`torch.cuda.get_device_name`), most
# specific names first.
PEAK_TFLOPS = {
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "V100": {"bf16": 0.0, "fp16": 125.0, "tf32": 15.7, "fp32": 15.7},
    "MI300X": {"bf16": 1307.0, "fp16": 1307.0, "tf32": 653.7, "fp32": 163.4},
    "MI250X": {"bf16": 383.0, "fp16": 383.0, "tf32": 95.7, "fp32": 95.7},
}


@dataclass(frozen=True)
class Peak:
    """The FLOP/s one device could do at best in the run's precision, and where that figure comes from."""

    flops: float | None  # None: unknown, MFU is reported as null
    source: str

    def describe(self) -> str:
        if self.flops is None:
            return f"MFU not reported: {self.source} (set cluster.peak_tflops to the device's dense peak)"
        return f"MFU against {self.flops / 1e12:g} TFLOP/s per device ({self.source})"


def peak_flops(device, precision: str, override_tflops: float | None) -> Peak:
    """Peak FLOP/s of one device: cluster.peak_tflops, else the dense peak of the device's model in the table."""
    if override_tflops:
        return Peak(override_tflops * 1e12, "cluster.peak_tflops")
    if device.type != "cuda":
        return Peak(None, f"no peak known for a {device.type} device")
    import torch  # here, not at the top: reading metrics (the sweep report) must not pay for importing torch

    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():
        if key in name and table[precision]:
            return Peak(table[precision] * 1e12, f"the dense {precision} peak of {name}")
    return Peak(None, f"{name} is not in hpctrain's peak table for {precision}")


def memory_gb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # Peak resident set size of this process (Linux reports KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class JsonlSink(Sink):
    """<run_dir>/metrics.jsonl, one JSON record per line. A resumed or requeued run continues the same file;
    records a crashed attempt wrote after the checkpoint it resumes from are dropped, so each step appears once."""

    def __init__(self, run_dir: str, start_step: int):
        self.path = os.path.join(run_dir, METRICS_FILE)
        try:
            _truncate_after(self.path, start_step)
        except FileCheckError as e:  # a device, a runaway line: not the file this run writes
            raise TrainingError(f"{e} (this run's {METRICS_FILE}): move it aside to resume the run") from None
        self.file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def rewind(self, step: int) -> None:
        """The run went back to `step` (a loss-spike rollback): the records after it are dropped, as on resume."""
        self.file.close()
        _truncate_after(self.path, step)
        self.file = open(self.path, "a")  # noqa: SIM115

    def close(self) -> None:
        self.file.close()


class TensorBoardSink(Sink):
    """<run_dir>/tb: every finite number as a scalar, `train/...`, `val/...` and `eval/...` (downstream tasks)."""

    def __init__(self, run_dir: str, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events a crashed attempt logged after the checkpoint we resume from (all of them, from
        # step 1, for a requeued job that had written none)
        self.dir = os.path.join(run_dir, "tb")
        self.tb = SummaryWriter(self.dir, purge_step=start_step + 1)

    def rewind(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.tb.close()
        self.tb = SummaryWriter(self.dir, purge_step=step + 1)

    def write(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(display_name(key), value, record["step"])

    def close(self) -> None:
        self.tb.close()


class ConsoleSink(Sink):
    """One log line per record (through tqdm while a progress bar is shown: see `Metrics.redirect`)."""

    def write(self, record: dict) -> None:
        log.info("  ".join(f"{k} {_fmt(v)}" for k, v in record.items() if v is not None))


def run_sinks(lcfg: LoggingConfig, mcfg: MonitorConfig, run_dir: str, start_step: int, max_steps: int, ctx: Context,
              conf: dict) -> tuple[list[Sink], AlertSink]:
    """The main rank's sinks: metrics.jsonl, TensorBoard (logging.trackers), the console, MLflow and W&B
    (logging.trackers, given the run's config `conf`), a Prometheus endpoint (monitor.prometheus_port) and the alert
    rules, which pass their events on to the trackers; returns (every sink, the alert rules)."""
    sinks: list[Sink] = [JsonlSink(run_dir, start_step)]
    if "tensorboard" in chosen(lcfg.trackers):
        sinks.append(TensorBoardSink(run_dir, start_step))
    sinks.append(ConsoleSink())
    trackers = [*tracker_sinks(lcfg, run_dir, start_step, max_steps, conf), *prometheus_sinks(mcfg, run_dir)]
    alerts = AlertSink(run_dir, mcfg, ctx, trackers=trackers, start_step=start_step)
    return [*sinks, *trackers, alerts], alerts


@dataclass(frozen=True)
class Throughput:
    """What turns a window of steps into tokens/s and MFU."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None  # per device; None: MFU unknown
    world: int
    device: object


class Metrics:
    """The metrics component: decides which steps are logged and sends each record to every sink (main rank).

    Every rank calls `after_step` (a logged step sums the corrupt-shard count over data-parallel ranks).
    """

    def __init__(self, sinks: list, throughput: Throughput, log_every: int, last_step: int, start_step: int,
                 bar=None, data_figures=lambda samples: {}, groups: list[str] = ()):
        """`groups`: the names of the step's groups of samples (a mixture's sources), logged as loss/<name>."""
        self.sinks, self.throughput, self.bar = sinks, throughput, bar
        self.log_every, self.last_step, self.first_step = log_every, last_step, start_step + 1
        self.data_figures = data_figures  # (global samples) -> the data's figures (collective: every rank calls it)
        self.groups = list(groups)
        self._window = _Window(len(self.groups))
        self._noted: dict = {}

    @classmethod
    def for_run(cls, tcfg: TrainConfig, sinks: list[Sink], start_step: int, throughput: Throughput,
                data_figures, groups: list[str] = ()) -> Metrics:
        """`sinks`: the main rank's (`run_sinks`), none on the others; a progress bar where train.progress asks."""
        bar = None
        if sinks and (tcfg.progress if tcfg.progress is not None else sys.stderr.isatty()):
            from tqdm import tqdm

            bar = tqdm(total=tcfg.max_steps, initial=start_step, unit="step", dynamic_ncols=True)
        return cls(sinks, throughput, tcfg.log_every, tcfg.max_steps, start_step, bar, data_figures, groups)

    def due(self, step: int) -> bool:
        """Every log_every-th step, and always the first (the loss curve's start) and the last."""
        return step % self.log_every == 0 or step in (self.first_step, self.last_step)

    def after_step(self, state, result, lr: float, step_time_s: float, data_wait_s: float) -> None:
        self._window.add(step_time_s, data_wait_s, result.groups)
        if self.bar is not None:
            self.bar.update(1)
            if result.loss is not None:
                self.bar.set_postfix(loss=f"{result.loss:.4f}")
        if self.due(state.step):
            record = self._window.record(state, result, lr, self.throughput)
            record.update(self._window.group_losses(self.groups))
            record.update(self.data_figures(state.samples))
            record.update(self._noted)
            self._noted = {}
            self.log(record)
            self._window = _Window(len(self.groups))

    def note(self, values: dict) -> None:
        """Figures measured now and then (a sampled step's): they go into the next logged record."""
        self._noted.update(values)

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def rewind(self, step: int) -> None:
        """The run went back to `step` (a rollback): sinks that can drop what they hold after it do."""
        for sink in self.sinks:
            sink.rewind(step)
        self._window = _Window(len(self.groups))

    def redirect(self):
        """While a progress bar is shown, log lines go through tqdm (they would tear the bar otherwise)."""
        if self.bar is None:
            return contextlib.nullcontext()
        from tqdm.contrib.logging import logging_redirect_tqdm

        return logging_redirect_tqdm()

    def close(self) -> None:
        for obj in (self.bar, *self.sinks):
            if obj is not None:
                obj.close()


class _Window:
    """The steps since the last logged one: their time, the part of it spent waiting for data, and the loss summed
    over each group's tokens (a mixture's sources; steps with a non-finite loss left out)."""

    def __init__(self, groups: int = 0):
        self.steps, self.time, self.data = 0, 0.0, 0.0
        self.loss, self.tokens = [0.0] * groups, [0.0] * groups

    def add(self, step_time_s: float, data_wait_s: float, groups: list[float] | None = None) -> None:
        self.steps += 1
        self.time += step_time_s
        self.data += data_wait_s
        n = len(self.loss)
        if groups and all(map(math.isfinite, groups[:n])):
            self.loss = [a + b for a, b in zip(self.loss, groups[:n])]
            self.tokens = [a + b for a, b in zip(self.tokens, groups[n:])]

    def group_losses(self, names: list[str]) -> dict:
        """loss/<name>: the mean token loss of each group over the window (a group without tokens in it: none)."""
        return {f"loss/{name}": loss / tokens for name, loss, tokens in zip(names, self.loss, self.tokens) if tokens}

    def record(self, state, result, lr: float, tp: Throughput) -> dict:
        elapsed = max(self.time, 1e-9)
        tps = self.steps * tp.tokens_per_step / elapsed
        return {
            "step": state.step,
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps / tp.world,
            "mfu": (tp.flops_per_token * tps / (tp.peak_flops * tp.world)) if tp.peak_flops else None,
            "data_wait_frac": self.data / elapsed,
            "mem_gb": memory_gb(tp.device),
            "step_time_s": elapsed / self.steps,
            "loss_scale": result.loss_scale,
            "skipped_nonfinite": state.skipped_nonfinite,
            "skipped_overflow": state.skipped_overflow,
            "skipped_spike": state.skipped_spike,
        }


def _truncate_after(path: str, step: int) -> None:
    """Drop the records after `step` (and lines that are no record), streamed: memory stays one line."""
    if not os.path.lexists(path):
        return
    tmp, changed = f"{path}.{os.getpid()}.tmp", False
    try:
        with open(tmp, "wb") as out:
            for line in lines(path):
                s = step_of(line)
                if s is not None and s <= step:
                    changed |= not line.endswith(b"\n")  # the next record must start a line of its own
                    out.write(line if line.endswith(b"\n") else line + b"\n")
                else:
                    changed = True
            out.flush()
            os.fsync(out.fileno())
        if changed:
            os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)  # ours: named for this process


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
