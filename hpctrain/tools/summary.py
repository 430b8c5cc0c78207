"""`python -m hpctrain summary RUN_DIR`: a run's status and loss curve in one line."""

from __future__ import annotations

import os
import sys

from hpctrain.core.files import RUNNING, read_metrics, read_result


def _status(run_dir: str) -> str:
    result = read_result(run_dir)
    if result is None:
        return "status: running or never finished (no result.json)"
    if result.get("status") == RUNNING:
        return "status: running or never finished (this attempt has written no result yet)"
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
    except (OSError, ValueError) as e:  # not JSON lines, not a file, a runaway line
        return f"{run_dir}: {status}; metrics.jsonl is not hpctrain's JSON lines ({' '.join(str(e).split())})"
    train = [r for r in records if _numbers(r, "loss", "tokens_per_s")]
    val = [r for r in records if _numbers(r, "val_loss", "val_ppl")]
    if not train:
        return f"{run_dir}: {status}; no training steps logged"
    first, last = train[0], train[-1]
    text = f"{status}; loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']})"
    if val:
        bpb = f", {val[-1]['val_bpb']:.3f} bits/byte" if _numbers(val[-1], "val_bpb") else ""
        text += f"; val loss {val[-1]['val_loss']:.3f} (ppl {val[-1]['val_ppl']:.1f}{bpb})"
    tps = [r["tokens_per_s"] for r in train[1:]] or [first["tokens_per_s"]]
    return text + f"; {sum(tps) / len(tps):,.0f} tokens/s"


def _numbers(record: dict, *keys: str) -> bool:
    """A record with an integer step and these numbers (a line of another program's, or damaged, is passed over)."""
    return type(record.get("step")) is int and all(type(record.get(k)) in (int, float) for k in keys)


def main(argv: list[str] | None = None) -> int:
    from hpctrain.core.argparser import Parser

    p = Parser(prog="python -m hpctrain summary", description="A run's status and loss curve in one line.")
    p.add_argument("run_dir", help="the directory of a training run")
    a = p.parse_args(argv)
    if not os.path.isdir(a.run_dir):
        print(f"hpctrain summary: error: {a.run_dir} is not a directory: pass a training run's directory",
              file=sys.stderr)
        return 2
    print(summarize(a.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
