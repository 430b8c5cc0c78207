"""The sbatch templates (sbatch/train.sbatch, sbatch/sweep.sbatch) on a real Slurm cluster (`make slurm-up`).

Skipped when no cluster answers; with HPCTRAIN_REQUIRE_SLURM=1 (CI, after `make slurm-up`) a missing
cluster is a failure instead.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import uuid

import pytest
from conftest import SMALL_MODEL
from helpers import job_gone, last_step, list_unused_node, losses, read, records, sbatch_run, until, wait_job

from hpctrain.runtime import bad_nodes

pytestmark = pytest.mark.slow

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
ENV = dict(os.environ, PYTHON=sys.executable)
TWO_NODES = ["-N2", "--ntasks-per-node=1", "--cpus-per-task=1"]
# The same knobs as conftest's make_cfg, so an in-process reference run is the same run.
TINY = ["train.global_batch=8", "train.micro_batch=4", "train.log_every=1", "train.eval_every=0",
        "optim.lr=1e-2", "optim.warmup_steps=2", "cluster.num_threads=1"]


def _logs(run_dir) -> str:
    return "".join(read(f) for f in sorted(glob.glob(os.path.join(run_dir, "slurm-*.out"))))


def _train_args(run, *overrides, demo_data) -> list[str]:
    """sbatch arguments of a 2-node train.sbatch run."""
    return [*TWO_NODES, "-o", f"{run}.sbatch-%j.out", "sbatch/train.sbatch", *SMALL_MODEL, f"data.path={demo_data}",
            "data.prepare_demo=false", "parallel=ddp", "cluster.pg_timeout_s=180", "data.lanes=2", *TINY, *overrides,
            f"run_dir={run}"]


# --- sbatch/train.sbatch ------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_train_sbatch_two_nodes(slurm, demo_data, tmp_path, slurm_jobs):
    run = tmp_path / "run"
    job, state = sbatch_run(_train_args(run, "train.max_steps=3", demo_data=demo_data), cwd=ROOT, env=ENV)
    slurm_jobs.append(job)
    log = run / f"slurm-{job}.out"
    assert state == "completed", read(log) if log.exists() else state
    assert f"logs in {log}" in read(f"{run}.sbatch-{job}.out")
    text = read(log)
    assert f"job {job} restart 0" in text and "step 3" in text and "loss" in text, text
    result = json.loads(read(run / "result.json"))
    assert result["status"] == "completed" and result["world"] == 2 and result["steps"] == 3, text
    assert sorted(losses(run)) == [1, 2, 3]


@pytest.mark.timeout(420)
def test_train_sbatch_preempted_requeues_and_matches(slurm, demo_data, make_cfg, tmp_path, slurm_jobs):
    """USR2 mid-run: the ranks checkpoint, the job requeues itself and resumes in the same run dir, appending
    to the same log; the final loss equals an uninterrupted run's."""
    from hpctrain.training.run import train

    steps, run = 150, tmp_path / "run"
    # ckpt_every=0: the only checkpoint is the one the signal writes, so the resume must use it.
    p = subprocess.run(["sbatch", "--parsable", *_train_args(run, f"train.max_steps={steps}", "train.ckpt_every=0",
                                                            demo_data=demo_data)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    job = p.stdout.strip().split(";")[0]
    slurm_jobs.append(job)
    until("step 10 of the job", lambda: last_step(run) >= 10, 180, every=0.2)
    free = list_unused_node(job, ENV["HPCTRAIN_BAD_NODES"])  # the requeued job must leave it out
    try:
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        until("the job to be requeued", lambda: "restart 1" in _logs(run) or job_gone(job), 120)
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    finally:  # the list is this worker's session's (ENV): a node left on it would be left out of its later jobs
        bad_nodes.clear(ENV["HPCTRAIN_BAD_NODES"])
    assert f"ExcNodeList={free}" in shown, shown
    # The reference while the requeued job runs: 2 local ranks, since 2 ranks and 1 process drift apart by
    # float summation order alone (~1e-5 over 100+ steps), which would hide what a resume gets wrong.
    train(make_cfg(*TINY, f"train.max_steps={steps}", "train.ckpt_every=0", "data.lanes=2", "parallel=ddp",
                   "parallel.dp=2"), str(tmp_path / "ref"))
    ref = losses(tmp_path / "ref")
    state = wait_job(job)
    full = _logs(run)
    logs = full[-4000:]
    assert state == "completed", (state, logs)
    assert json.loads(read(run / "slurm.json"))["restart_count"] == 1, logs
    # One log for both attempts (--open-mode=append), and it shows the requeue.
    assert f"job {job} restart 0" in full and f"job {job} restart 1" in full, logs
    assert "stopped by SIGUSR2" in full and f"requeued Slurm job {job}" in full, logs
    assert full.index("stopped by SIGUSR2") < full.index(f"job {job} restart 1") < full.index("resumed from")
    result = json.loads(read(run / "result.json"))
    assert result["status"] == "completed" and result["steps"] == steps, (result, logs)
    logged = [r["step"] for r in records(run) if "loss" in r]
    assert logged == list(range(1, steps + 1)), "each step once: records after the resume step were dropped"
    got = losses(run)
    worst = max(abs(got[s] - ref[s]) for s in ref)
    assert worst <= 1e-5 and abs(result["final_loss"] - ref[steps]) <= 1e-5, (worst, result, ref[steps])


# --- sbatch/sweep.sbatch ------------------------------------------------------------------------------


@pytest.mark.timeout(420)
def test_sweep_sbatch_grid_and_report(slurm, demo_data, make_cfg, tmp_path, slurm_jobs):
    from omegaconf import OmegaConf

    from hpctrain.launch.sweep import report
    from hpctrain.training.run import train

    sweep = tmp_path / "sweep"
    common = [*SMALL_MODEL, f"data.path={demo_data}", "data.prepare_demo=false", "train.max_steps=3",
              *[o for o in TINY if not o.startswith(("optim.lr", "train.global_batch"))]]
    env = dict(ENV, SWEEP_DIR=str(sweep), SWEEP_SBATCH_ARGS=f"--cpus-per-task=1 -o {tmp_path}/sbatch-%A_%a.out")
    p = subprocess.run(["bash", "sbatch/sweep.sbatch", "optim.lr=1e-2,3e-3", "train.global_batch=8,16", "--",
                        *common], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "submitted sweep array" in p.stdout, p.stdout + p.stderr
    job = p.stdout.split("submitted sweep array ")[1].split(":")[0]
    slurm_jobs.append(job)
    assert f"python -m hpctrain report {sweep}" in p.stdout
    until("every array task to end", lambda: job_gone(job), 300, every=1)
    logs = "".join(_logs(d)[-2000:] for d in sorted(glob.glob(str(sweep / "*"))))

    rep = subprocess.run([sys.executable, "-m", "hpctrain.launch.sweep", "report", str(sweep), "--no-plot"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0 and "4 points: 4 completed" in rep.stdout, rep.stdout + rep.stderr + logs
    grid = [["optim.lr=1e-2", "train.global_batch=8"], ["optim.lr=1e-2", "train.global_batch=16"],
            ["optim.lr=3e-3", "train.global_batch=8"], ["optim.lr=3e-3", "train.global_batch=16"]]
    rows = report(str(sweep))
    assert [(r["job"], r["overrides"], r["status"]) for r in rows] == [(i, g, "completed") for i, g in
                                                                       enumerate(grid)], logs
    for i, (row, point) in enumerate(zip(rows, grid)):
        run = sweep / str(i)
        assert [str(o) for o in OmegaConf.load(run / ".hydra" / "overrides.yaml")] == [f"run_dir={run}", *point,
                                                                                       *common]
        assert (run / f"slurm-{job}_{i}.out").exists(), logs
        result = json.loads(read(run / "result.json"))
        slurm_doc = json.loads(read(run / "slurm.json"))
        assert (slurm_doc["array_job_id"], slurm_doc["array_task_id"]) == (job, str(i))
        assert row["final_loss"] == result["final_loss"] and row["slurm_job_id"] == slurm_doc["job_id"]
        # The point is the run its overrides describe: the same final loss as training it in-process.
        ref = train(make_cfg(*TINY, "train.max_steps=3", *point), str(tmp_path / f"ref{i}"))
        assert abs(result["final_loss"] - ref["final_loss"]) <= 1e-5, (i, result, ref)


def _max_array_size() -> int:
    from hpctrain.launch.submit import max_array_size

    return max_array_size() or 1001  # (Slurm's default)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("args, words", [
    ([], ["key=v1,v2"]),
    (["optim.lr=1e-2,", "--", "model=tiny"], ["key=v1,v2"]),
    # Every point is checked as its task would be, before anything is submitted: one bad value, one typo.
    (["optim.lr=-1,1e-2", "--", "model=tiny"], ["sweep point #0 (optim.lr=-1", "optim.lr=-1.0 must be"]),
    (["optim.lr=1e-2,3e-3", "--", "train.max_stepz=1"], ["sweep point #0", "unknown config key train.max_stepz"]),
    # More points than this cluster's job arrays hold (its MaxArraySize, read from scontrol).
    (lambda: ["optim.lr=" + ",".join(f"{i + 1}e-5" for i in range(_max_array_size() + 1))], ["MaxArraySize"]),
], ids=["no-args", "empty-value", "bad-point", "unknown-key", "beyond-max-array-size"])
def test_sweep_sbatch_bad_usage_submits_nothing(slurm, tmp_path, args, words):
    args = args() if callable(args) else args
    name = f"hpctrain-test-{uuid.uuid4().hex[:8]}"  # a job name nobody else uses: find what was submitted
    env = dict(ENV, SWEEP_DIR=str(tmp_path / "sweep"), SWEEP_SBATCH_ARGS=f"--job-name={name}")
    # (its check is a fresh `python -m hpctrain check`: up to ~90 s before its first line on a busy machine)
    p = subprocess.run(["bash", "sbatch/sweep.sbatch", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and all(w in p.stderr for w in words), p.stderr
    assert not (tmp_path / "sweep").exists()
    q = subprocess.run(["squeue", "-h", "-n", name], capture_output=True, text=True, timeout=30)
    assert q.returncode == 0 and q.stdout.strip() == ""
