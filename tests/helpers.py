"""Reading a run directory while a job writes it, and waiting on Slurm: shared by the tests of real jobs."""

from __future__ import annotations

import json
import os
import subprocess
import time

from hpctrain.sweep import sacct_state


def read(path) -> str:
    with open(path) as f:
        return f.read()


def records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def last_step(run_dir) -> int:
    """The last logged training step, 0 before the first (or while a line is being written)."""
    try:
        return max(losses(run_dir), default=0)
    except (OSError, ValueError):
        return 0


def until(what: str, check, timeout: float, every: float = 0.5):
    """Poll `check()` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def job_gone(job: str) -> bool:
    p = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=30)
    return p.returncode != 0 or not p.stdout.strip()


def wait_job(job: str, timeout: float = 240) -> str:
    """Wait for a Slurm job to end; return its final state, lowercased ("completed", "failed", ...). Polls:
    `sbatch --wait` sleeps 2, 8, then 32 s between its checks."""
    until(f"job {job} to end", lambda: job_gone(job), timeout, every=0.3)
    active = (None, "pending", "running", "requeued", "completing")  # sacct can lag squeue by a moment
    return until(f"sacct to record the end of job {job}", lambda: (s := sacct_state(job)) not in active and s, 30)


def sbatch_run(args: list[str], cwd, env=None, timeout: float = 240) -> tuple[str, str]:
    """Submit a batch job and wait for it to end: (job id, final state as `wait_job` returns it)."""
    p = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"sbatch failed: {p.stdout}{p.stderr}"
    job = p.stdout.strip().split(";")[0]
    return job, wait_job(job, timeout)
