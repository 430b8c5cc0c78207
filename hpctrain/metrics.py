"""Step metrics: MFU against a peak-FLOPs table, and one logger for console, metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys

log = logging.getLogger("hpctrain")

# Dense peak TFLOPS per device by compute dtype (vendor datasheets, no sparsity).
PEAK_TFLOPS = {
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


def peak_flops(device, precision: str, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (then MFU is reported as null)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    import torch  # here, not at the top: reading metrics (the sweep report) must not pay for importing torch

    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():  # most specific names first
        if key in name:
            return table[precision] * 1e12 or None
    return None


def memory_gb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # Peak resident set size of this process (Linux reports KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """Writes each logged step to metrics.jsonl, TensorBoard and the console (rank 0 only)."""

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool, progress: bool | None,
                 total_steps: int, start_step: int):
        self.enabled = enabled
        self.jsonl = self.tb = self.bar = None
        if not enabled:
            return
        # A resumed or requeued run continues the same file and TensorBoard run; records a crashed
        # attempt wrote after the checkpoint we resume from are dropped, so each step appears once.
        path = os.path.join(run_dir, "metrics.jsonl")
        _truncate_after(path, start_step)
        self.jsonl = open(path, "a")  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed attempt logged after the checkpoint we resume from.
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step + 1 if start_step else None)
        if progress if progress is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"]
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key.replace("val_", "val/") if key.startswith("val_") else f"train/{key}",
                                       value, step)
        # With a progress bar the caller routes logging through tqdm (logging_redirect_tqdm).
        log.info("  ".join(f"{k} {_fmt(v)}" for k, v in record.items() if v is not None))

    def advance(self, steps: int = 1, loss: float | None = None) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}")

    def close(self) -> None:
        for obj in (self.bar, self.tb, self.jsonl):
            if obj is not None:
                obj.close()


def _truncate_after(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line, s in zip(lines, map(_step_of, lines)) if s is not None and s <= step]
    if len(kept) != len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def _step_of(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a line cut short by a crash
        return None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _status(run_dir: str) -> str:
    try:
        with open(os.path.join(run_dir, "result.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return "status: running or never finished (no result.json)"
    text = f"status: {result.get('status')} after step {result.get('steps')}"
    return text + (f" ({result['error']})" if result.get("error") else "")


def summarize(run_dir: str) -> str:
    """The run's status, then its loss curve in one glance: first and last logged train loss, last
    validation loss, throughput."""
    status = _status(run_dir)
    try:
        records = read_metrics(run_dir)
    except FileNotFoundError:
        return f"{run_dir}: {status}; no metrics.jsonl yet (no step logged)"
    except ValueError as e:
        return f"{run_dir}: {status}; metrics.jsonl is not JSON lines ({e})"
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    if not train:
        return f"{run_dir}: {status}; no training steps logged"
    first, last = train[0], train[-1]
    text = f"{status}; loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']})"
    if val:
        text += f"; val loss {val[-1]['val_loss']:.3f} (ppl {val[-1]['val_ppl']:.1f})"
    tps = [r["tokens_per_s"] for r in train[1:]] or [first["tokens_per_s"]]
    return text + f"; {sum(tps) / len(tps):,.0f} tokens/s"


def main(argv: list[str] | None = None) -> int:
    from hpctrain.cmdline import Parser

    p = Parser(prog="python -m hpctrain.metrics",
                                description="A run's status and loss curve in one line.")
    p.add_argument("run_dir", help="the directory of a training run")
    a = p.parse_args(argv)
    if not os.path.isdir(a.run_dir):
        print(f"hpctrain.metrics: error: {a.run_dir} is not a directory: pass a training run's directory",
              file=sys.stderr)
        return 2
    print(summarize(a.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
