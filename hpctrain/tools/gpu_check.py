"""`hpctrain gpu-check` (`make gpu-check`): every GPU path on this machine's GPU, then the throughput
run, in one table.

1. The GPU-marked tests (`pytest -m gpu tests/test_gpu.py`): bf16/fp16/tf32 steps against fp32 on CUDA, compile, the
   SDPA kernel actually run, pinned-memory loading, no host sync inside a step's micro-batches, an NCCL process group
   with FSDP2 and a DCP round trip, preflight's GEMM and all-reduce, the planner against the CUDA allocator's peak.
   Without a CUDA device each is skipped, with its reason.
2. The throughput run (`hpctrain.tools.bench_gpu`): llama_1b in bf16 at 2048 tokens, hpctrain against a plain
   transformers loop, tokens/s and MFU (skipped without a CUDA device).

Everything lands in --out (junit-*.xml, bench-*.json: new files each time; table.txt); the exit status is 1 when
a test, pytest itself or the run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
FIGURE_PREFIXES = ("preflight:", "planner ", "attention kernels:")  # lines the tests print with their numbers


def machine() -> str:
    import torch

    when = datetime.date.today().isoformat()
    if not torch.cuda.is_available():
        return f"no CUDA device; torch {torch.__version__}; {when}"
    return (f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version()}); {when}")


def run_tests(out: str, pytest_args: list[str]) -> list[dict]:
    """Each GPU test's outcome, time and the figures it printed (from pytest's JUnit report)."""
    fd, junit = tempfile.mkstemp(prefix="junit-", suffix=".xml", dir=out)  # a new report, never an old one's
    os.close(fd)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", os.path.join(ROOT, "tests", "test_gpu.py"), "-q", "-rs",
           "-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_logging=system-out", *pytest_args]
    print("$ " + " ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=ROOT).returncode
    try:
        cases = list(ET.parse(junit).getroot().iter("testcase"))
    except ET.ParseError:  # pytest died before writing it (a CUDA or NCCL abort)
        cases = []
    rows = []
    if code not in (0, 1) or not cases:  # 1: some test failed (listed); anything else: pytest itself did
        rows.append({"name": "pytest", "outcome": "failed", "time": 0.0,
                     "detail": f"pytest exited with {code}{'' if cases else ' and no report'}"})
    for case in cases:
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                detail = (node.get("message") or "").splitlines()[0][:100] if node.get("message") else tag
        out_text = case.findtext("system-out") or ""
        figures = [line.strip() for line in out_text.splitlines() if line.strip().startswith(FIGURE_PREFIXES)]
        rows.append({"name": case.get("name"), "outcome": outcome, "time": float(case.get("time") or 0),
                     "detail": "; ".join(figures) or detail})
    return rows


def run_throughput(out: str, bench_args: list[str]) -> dict | None:
    """The throughput run in its own process (a fresh CUDA context and allocator), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    fd, path = tempfile.mkstemp(prefix="bench-", suffix=".json", dir=out)  # this run's, never an old one's
    os.close(fd)
    cmd = [sys.executable, "-m", "hpctrain.tools.bench_gpu", "--out", os.path.join(out, "bench"), "--json", path,
           *bench_args]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT)
    if p.returncode != 0 or not os.path.getsize(path):
        return {"error": f"bench_gpu exited with {p.returncode}"}
    with open(path) as f:
        return json.load(f)


def render(header: str, tests: list[dict], bench: dict | None) -> list[str]:
    width = max([len(t["name"]) for t in tests] + [40])
    lines = [f"gpu-check: {header}", f"{'test':{width}}  {'result':7} {'time':>7}  figures / reason"]
    for t in tests:
        lines.append(f"{t['name']:{width}}  {t['outcome']:7} {t['time']:6.1f}s  {t['detail']}")
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    lines.append(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if bench is None:
        lines.append("throughput run: skipped (no CUDA device)")
    elif "error" in bench:
        lines.append(f"throughput run: FAILED ({bench['error']})")
    else:
        lines.append(f"throughput: {bench['header']}")
        lines.append(f"  global batch {bench['global_batch']} × {bench['seq_len']} tokens")
        lines.extend("  " + line for line in bench["table"])
        lines.append("  attention kernels: " + (", ".join(bench["attention_kernels"]) or "none fused"))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hpctrain gpu-check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("outputs", "gpu-check"), help="reports (default outputs/gpu-check)")
    ap.add_argument("--no-throughput", action="store_true", help="only the tests")
    ap.add_argument("--pytest-args", default="", help="more pytest arguments, e.g. '-k planner'")
    ap.add_argument("--bench-args", default="", help="more bench_gpu arguments, e.g. '--variants hpctrain,eager'")
    a = ap.parse_args(argv)
    import shlex

    a.out = os.path.abspath(a.out)  # pytest and the benchmark run from the repository's root
    os.makedirs(a.out, exist_ok=True)
    header = machine()
    print(f"gpu-check: {header}", flush=True)
    tests = run_tests(a.out, shlex.split(a.pytest_args))
    bench = None if a.no_throughput else run_throughput(a.out, shlex.split(a.bench_args))
    lines = render(header, tests, bench)
    with open(os.path.join(a.out, "table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    failed = any(t["outcome"] == "failed" for t in tests) or bool(bench and "error" in bench)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
