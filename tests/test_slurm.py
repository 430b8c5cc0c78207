"""Jobs on a real Slurm cluster (`make slurm-up` starts a local one: several slurmd nodes on this machine).

Skipped when no cluster answers; with HPCTRAIN_REQUIRE_SLURM=1 (CI, after `make slurm-up`) a missing
cluster is a failure instead.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from unittest.mock import ANY

import pytest
from conftest import SMALL_MODEL
from helpers import (
    job_gone,
    last_step,
    list_unused_node,
    losses,
    read,
    records,
    run_forked,
    sbatch_run,
    until,
    wait_job,
)

from hpctrain import cli
from hpctrain.core.slurm import hostnames
from hpctrain.runtime import bad_nodes
from hpctrain.runtime.task_exits import exit_trap

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


@pytest.mark.timeout(300)
def test_two_node_job_equals_one_process(slurm, make_cfg, demo_data, tmp_path):
    from hpctrain.training.run import train

    common = ["train.max_steps=3", "train.eval_every=0", "data.lanes=2", "cluster.num_threads=1",
              "optim.lr=1e-2", "optim.warmup_steps=2"]
    train(make_cfg(*common), str(tmp_path / "ref"))
    run = tmp_path / "job"
    cmd = " ".join([sys.executable, "-m", "hpctrain", f"run_dir={run}", f"data.path={demo_data}",
                    "data.prepare_demo=false", *SMALL_MODEL, "train.global_batch=8", "train.micro_batch=4",
                    "train.log_every=1", "parallel=ddp", "cluster.pg_timeout_s=180",
                    "cluster.nccl.NCCL_SOCKET_IFNAME=ib0", *common])
    # A site setting in the job's environment wins over cluster.nccl; the rest of cluster.nccl is exported.
    # (Submitted without what the in-process reference run exported into this process.)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_NCCL_"))}
    _, state = sbatch_run(["-N2", "--ntasks-per-node=1", "--cpus-per-task=1", "-o", str(tmp_path / "slurm-%j.out"),
                           "--export=ALL,NCCL_IB_TIMEOUT=20", "--wrap", f"srun --kill-on-bad-exit=1 {cmd}"], cwd=ROOT, env=env)
    assert state == "completed", read(glob.glob(str(tmp_path / "slurm-*.out"))[0])
    assert json.loads(read(run / "slurm.json"))["nccl"] == {
        "NCCL_IB_TIMEOUT": "20 (environment)", "NCCL_SOCKET_IFNAME": "ib0 (cluster.nccl)",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1 (cluster.nccl)"}
    ref, got = losses(tmp_path / "ref"), losses(run)
    assert sorted(got) == [1, 2, 3], read(glob.glob(str(tmp_path / "slurm-*.out"))[0])
    assert json.loads(read(run / "result.json"))["world"] == 2
    for s in ref:
        assert abs(ref[s] - got[s]) <= 1e-5, (s, ref[s], got[s])


@pytest.mark.timeout(120)
def test_a_steps_ranks_per_node_are_what_srun_says(slurm):
    """The memory check counts a node's ranks from the variables srun gives each task (core.slurm.tasks_on_node on
    SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID): both are the step's own, also for a step on part of the allocation
    (a supervised restart on the healthy nodes): 3 tasks on the last 2 of 3 nodes are 2 on the first, 1 on the other."""
    code = ("import os\nfrom hpctrain.core.slurm import tasks_on_node\ne = os.environ\nprint(e['SLURM_PROCID'], "
            "e['SLURMD_NODENAME'], tasks_on_node(e['SLURM_STEP_TASKS_PER_NODE'], int(e['SLURM_NODEID'])))")
    p = subprocess.run(["salloc", "-N3", "-n6", "srun", "-N2", "-n3", "--relative=1", sys.executable, "-c", code],
                       cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    tasks = sorted(line.split() for line in p.stdout.splitlines())
    assert [(rank, count) for rank, _, count in tasks] == [("0", "2"), ("1", "2"), ("2", "1")], p.stdout
    assert tasks[0][1] == tasks[1][1] != tasks[2][1], p.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_ends_the_job_in_seconds_and_is_named(slurm, slurm_jobs, demo_data, tmp_path, victim):
    """SIGKILL one rank of a two-node job mid-run, at cluster.pg_timeout_s=600: the job ends within seconds, and the
    run's error (result.json, the log) names that rank and its node, not gloo's 'Connection closed by peer
    [address]': rank 1 from its heartbeat; rank 0 (whose process held the heartbeats' store, and writes result.json)
    from the store that no longer answers, with rank 1 writing result.json. What killed it is srun's word, which the
    batch script's exit trap adds to result.json. The node goes on the bad-node list, and the next submission leaves
    it out (--exclude) and has the same trap."""
    run = tmp_path / "job"
    cmd = " ".join([sys.executable, "-m", "hpctrain", f"run_dir={run}", f"data.path={demo_data}",
                    "data.prepare_demo=false", *SMALL_MODEL, "train.global_batch=8", "train.micro_batch=4",
                    "parallel=ddp", "cluster.pg_timeout_s=600", "train.max_steps=100000", "train.eval_every=0",
                    "train.ckpt_every=0", "cluster.num_threads=1", "data.lanes=2", "train.log_every=1"])
    out = tmp_path / "slurm.out"
    trap = exit_trap(sys.executable, shlex.quote(str(run)))  # as hpctrain's job scripts have it
    p = subprocess.run(["sbatch", "--parsable", "-N2", "--ntasks-per-node=1", "--cpus-per-task=1", "-o", str(out),
                        "--wrap", f"{trap}\nsrun --kill-on-bad-exit=1 {cmd}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip().split(";")[0]
    slurm_jobs.append(job)
    until("a logged step", lambda: (run / "metrics.jsonl").exists() and '"step"' in read(run / "metrics.jsonl"), 120)

    def rank_of(rank: int) -> tuple[int, str] | None:  # (the nodes are slurmds on this machine: ranks are visible)
        for pid in subprocess.run(["pgrep", "-f", f"run_dir={run}"], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(OSError):
                env = read(f"/proc/{pid}/environ").split("\0")
                python = read(f"/proc/{pid}/cmdline").split("\0")[0] == sys.executable  # (not the batch step's srun)
                if python and f"SLURM_PROCID={rank}" in env:
                    return int(pid), next(e for e in env if e.startswith("SLURMD_NODENAME=")).split("=")[1]
        return None

    pid, node = until(f"rank {victim}'s process", lambda: rank_of(victim), 30)
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    until(f"job {job} to end", lambda: job_gone(job), 60, every=0.2)
    took = time.time() - t0
    result = json.loads(read(run / "result.json"))
    assert result["status"] == "failed", result
    if victim == 1:
        assert "lost its peer on rank 0 (node " in result["error"] and f"rank 1 (node {node}, " in result["error"], \
            result["error"]
    else:
        assert "lost its peer on rank 1 (node " in result["error"] and f"the store on rank 0 ({node}) does not " \
            "answer" in result["error"] and "rank 0 is likely the one that stopped" in result["error"], result["error"]
    # Seconds, not the 600 s collective timeout (2-5 s alone; bounded loosely, the suite's cores being shared).
    assert took < 60, (took, read(out))
    assert re.search(rf"srun: error: {node}: task {victim}: Killed", read(out)), read(out)
    # what killed it, as srun said, in result.json too (the batch script's exit trap, once srun returned)
    assert [lost.get("cause") for lost in result["lost"]] == ["Killed"], result
    assert f"srun: rank {victim} on {node} ended first: Killed (job {job})" in result["error"], result["error"]
    assert bad_nodes.excluded(os.environ["HPCTRAIN_BAD_NODES"], 72) == {node: ANY}
    # the run's node-hours count, whoever died (the learned MTBF's exposure): rank 1 adds them when rank 0 is gone
    assert json.loads(read(os.environ["HPCTRAIN_BAD_NODES"]))["node_hours"] > 0
    if victim == 0:
        return
    p = subprocess.run([sys.executable, "-m", "hpctrain", "hydra/launcher=slurm", f"run_dir={tmp_path / 'next'}",
                        f"data.path={demo_data}", "data.prepare_demo=false", *SMALL_MODEL, "train.max_steps=1",
                        "cluster.num_threads=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and f"leaving out {node}: see python -m hpctrain nodes" in p.stdout, p.stdout + p.stderr
    job = re.search(r"submitted job (\d+)", p.stdout).group(1)
    slurm_jobs.append(job)
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert f"ExcNodeList={node}" in shown, shown
    script = read(re.search(r"Command=(\S+)", shown).group(1))  # submitit's: its ranks fail fast as the ones above
    assert re.search(r"^srun .*--kill-on-bad-exit=1", script, re.M), script
    assert re.search(rf"^hpctrain_since=.*; trap .*hpctrain\.runtime\.task_exits "
                     rf"{re.escape(shlex.quote(str(tmp_path / 'next')))} ", script, re.M), script


def _tree_digest(d) -> dict[str, str]:
    out = {}
    for path in sorted(glob.glob(os.path.join(d, "*"))):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.timeout(300)
def test_preprocess_sbatch_array_and_merge(slurm, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        with open(corpus / f"part{i}.jsonl", "w") as f:
            for j in range(150):
                f.write(json.dumps({"text": f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}\n"}) + "\n")
    tok = tmp_path / "tok"
    subprocess.run([sys.executable, "-m", "data_prep.tokenizer", "--corpus", str(corpus / "*.jsonl"),
                    "--vocab", "300", "--out", str(tok)], check=True, capture_output=True, timeout=120)
    args = ["--corpus", str(corpus / "*.jsonl"), "--tokenizer", str(tok), "--seq-len", "32", "--shard-mb", "0.01",
            "--unit-mb", "0.005", "--val-fraction", "0.2"]
    subprocess.run([sys.executable, "-m", "data_prep.shards", *args, "--out", str(tmp_path / "local")],
                   check=True, capture_output=True, timeout=120)
    out = tmp_path / "array"
    env = dict(os.environ, PYTHON=sys.executable,
               PREP_SBATCH_ARGS=f"--array=0-2 --cpus-per-task=1 -o {tmp_path}/prep-%A_%a.out")
    p = subprocess.run(["bash", "sbatch/preprocess.sbatch", *args, "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "merge job" in p.stdout, p.stdout + p.stderr
    merge_id = p.stdout.split("merge job ")[1].split()[0]
    state = wait_job(merge_id)  # the merge job starts only after every array task succeeded
    logs = "".join(read(f) for f in glob.glob(str(tmp_path / "prep-*.out")))
    assert state == "completed", (state, logs)
    assert _tree_digest(out) == _tree_digest(tmp_path / "local"), logs


# --- hydra/launcher=slurm: one run, a sweep, preemption, node failure, cancellation -----------------------

COMMON = ["data.lanes=2", "cluster.num_threads=1", "optim.lr=1e-2", "optim.warmup_steps=2", "train.eval_every=0",
          "train.global_batch=8", "train.micro_batch=4", "train.log_every=1"]


def _submit(tmp_path, run, *overrides, wait=False, timeout=120) -> subprocess.CompletedProcess:
    """`python -m hpctrain hydra/launcher=slurm ...`: the documented one-run submission (2 nodes × 1 rank)."""
    demo = os.environ["HPCTRAIN_TEST_DATA"]
    cmd = [sys.executable, "-m", "hpctrain", "hydra/launcher=slurm", f"run_dir={run}", f"data.path={demo}",
           "data.prepare_demo=false", *SMALL_MODEL, "parallel=ddp", "cluster.nodes=2", "cluster.cpus_per_task=1",
           "cluster.pg_timeout_s=120", f"cluster.wait={str(wait).lower()}", *COMMON, *overrides]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def _job_id(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout.split("submitted job ")[1].split()[0]


def _job_logs(run) -> str:
    return "".join(read(f)[-3000:] for f in sorted(glob.glob(str(run / ".submitit" / "*" / "*_log.*"))))


@pytest.fixture
def data_env(demo_data, monkeypatch):
    monkeypatch.setenv("HPCTRAIN_TEST_DATA", demo_data)


def _reference(make_cfg, tmp_path, steps: int) -> dict[int, float]:
    """The same run uninterrupted, with 2 local ranks: over 100+ steps, 2 ranks and 1 process drift apart by
    float summation order alone (~1e-5 by step 40), which would hide what a resume gets wrong."""
    from hpctrain.training.run import train

    train(make_cfg(*COMMON, f"train.max_steps={steps}", "train.ckpt_every=0", "parallel=ddp", "parallel.dp=2"),
          str(tmp_path / "ref"))
    return losses(tmp_path / "ref")


def _assert_same_run(run, ref: dict[int, float], steps: int) -> None:
    result = json.loads(read(run / "result.json"))
    assert result["status"] == "completed" and result["steps"] == steps, (result, _job_logs(run))
    logged = [r["step"] for r in records(run) if "loss" in r]
    assert logged == sorted(set(logged)), "metrics.jsonl continues without duplicated steps after the resume"
    got = losses(run)
    assert sorted(got) == sorted(ref)
    worst = max(abs(got[s] - ref[s]) for s in ref)
    assert worst <= 1e-5, (worst, got[steps], ref[steps])


@pytest.mark.timeout(300)
def test_submitted_run_preempted_requeues_and_matches(slurm, data_env, make_cfg, tmp_path, slurm_jobs):
    """USR2 mid-run: every rank stops at a step boundary, checkpoints, the job requeues and resumes in the
    same run dir; the final loss equals an uninterrupted one-process run."""
    steps, run = 120, tmp_path / "run"
    job = _job_id(_submit(tmp_path, run, f"train.max_steps={steps}", "train.ckpt_every=0"))
    slurm_jobs.append(job)
    until("step 10 of the job", lambda: last_step(run) >= 10, 150, every=0.2)
    free = list_unused_node(job, os.environ["HPCTRAIN_BAD_NODES"])  # the requeued job must leave it out
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
    until(f"the requeued job to leave out {free}", lambda: f"ExcNodeList={free}" in subprocess.run(
        ["scontrol", "show", "job", job], capture_output=True, text=True).stdout, 120, every=0.2)
    ref = _reference(make_cfg, tmp_path, steps)  # after the signal: the job must not finish before it
    until("the job to end", lambda: job_gone(job), 200, every=1)
    slurm_doc = json.loads(read(run / "slurm.json"))
    assert slurm_doc["restart_count"] == 1, (slurm_doc, _job_logs(run))
    log = read(run / "train.log")
    assert "stopped by SIGUSR2" in log
    # the save at the signal, measured against the lead Slurm gives before the kill (the default 120 s)
    assert re.search(r"a save at the time limit's warning signal needs at most about [\d.]+ s \(two steps of [\d.]+ "
                     r"s, (an evaluation of [\d.]+ s, )?and two writes of [\d.]+ s: .*\) of the 120 s cluster.signal_lead_s "
                     r"gives", log), log
    _assert_same_run(run, ref, steps)


@pytest.mark.timeout(240)
def test_cancelled_job_is_reported_cancelled(slurm, data_env, tmp_path):
    """scancel while the submitting command waits: it ends with one line naming the cancelled job (no hang),
    and the report says cancelled."""
    from hpctrain.launch.sweep import report

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpctrain", "hydra/launcher=slurm", f"run_dir={run}",
           f"data.path={os.environ['HPCTRAIN_TEST_DATA']}", "data.prepare_demo=false", *SMALL_MODEL, "parallel=ddp",
           "cluster.nodes=2", "cluster.cpus_per_task=1", "cluster.wait=true", "train.max_steps=5000", *COMMON]
    waiting = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        until("the job to train", lambda: last_step(run) >= 3, 150)
        job = json.loads(read(run / "slurm.json"))["job_id"]
        subprocess.run(["scancel", job], check=True, timeout=30)
        out, err = waiting.communicate(timeout=120)
    finally:
        waiting.kill()
    assert waiting.returncode == 1, out + err
    assert f"job {job} cancelled" in err, err
    assert report(str(run))[0]["status"] == "cancelled"


def _pids_on_node(node: str, job: str) -> list[int]:
    """Processes of `job` running on local-cluster node `node` (its tasks, then their slurmstepd)."""
    tasks = []
    for env_file in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(env_file, "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"SLURMD_NODENAME") == node.encode() and env.get(b"SLURM_JOB_ID") == job.encode():
            tasks.append(int(env_file.split("/")[2]))
    parents = set()
    for pid in tasks:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            parents.add(int(f.read().rsplit(")", 1)[1].split()[1]))
    stepds = [p for p in parents if p not in tasks and "slurmstepd" in read(f"/proc/{p}/cmdline")]
    return tasks + stepds


@pytest.mark.timeout(420)
def test_node_failure_requeues_and_resumes(slurm, data_env, make_cfg, tmp_path, slurm_jobs):
    """A node of a running 2-node job stops answering (its slurmd and the job's processes there frozen, as in
    a hung or crashed node): Slurm marks it DOWN, requeues the job onto the spare node, and the job resumes
    from its last checkpoint and finishes with the loss of an uninterrupted run."""
    def idle() -> bool:  # (a node of the previous test's job may still be completing)
        out = subprocess.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], capture_output=True, text=True).stdout
        return len(set(out.split())) >= 3

    try:
        until("3 idle nodes", idle, 60, every=0.5)
    except AssertionError:
        pytest.skip("needs 3 idle nodes (make slurm-up starts n1..n3)")
    steps, run = 150, tmp_path / "run"
    # The survivor's collective waits for the frozen rank: its own hang detection (90 % of cluster.pg_timeout_s) must
    # not end the job before Slurm marks the node DOWN (up to 90 s after the reference run below, on a loaded machine:
    # at 120 s it once failed the job first, and there was no requeue)
    job = _job_id(_submit(tmp_path, run, f"train.max_steps={steps}", "train.ckpt_every=10",
                          "monitor.rules.node_failure_rate.for_s=0", "cluster.pg_timeout_s=600"))
    slurm_jobs.append(job)
    until("the checkpoint at step 10", lambda: last_step(run) >= 12, 150, every=0.2)
    victim = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True)
    victim = subprocess.run(["scontrol", "show", "hostnames", victim.stdout.strip()], capture_output=True,
                            text=True).stdout.split()[-1]
    slurmd = int(read(f"/var/lib/hpctrain-slurm/run/slurmd-{victim}.pid"))
    frozen = [slurmd, *_pids_on_node(victim, job)]
    assert len(frozen) >= 3, frozen  # slurmd, the rank, its slurmstepd
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        ref = _reference(make_cfg, tmp_path, steps)  # while Slurm finds the node dead; the job is frozen
        until(f"{victim} DOWN", lambda: "down" in subprocess.run(
            ["sinfo", "-h", "-n", victim, "-o", "%t"], capture_output=True, text=True).stdout, 90, every=1)
        for pid in frozen[1:]:  # the node "reboots": its old processes are gone
            os.kill(pid, signal.SIGKILL)
        until("the requeued job to finish", lambda: job_gone(job) and (run / "result.json").exists()
               and json.loads(read(run / "result.json"))["status"] != "preempted", 240, every=1)
    finally:
        os.kill(slurmd, signal.SIGCONT)
        for _ in range(60):  # the node answers again and returns to service
            subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], capture_output=True)
            if "idle" in subprocess.run(["sinfo", "-h", "-n", victim, "-o", "%t"], capture_output=True,
                                        text=True).stdout:
                break
            time.sleep(1)
    attempt = json.loads(read(run / "slurm.json"))
    assert attempt["restart_count"] >= 1 and victim not in attempt["nodelist"], attempt
    assert "resumed from" in read(run / "train.log")
    _assert_same_run(run, ref, steps)
    # The restart the run did not ask for is a node failure: 1 of the job's 2 nodes within the hour.
    assert len(attempt["node_failures"]) == 1 and attempt["nodes"] == 2, attempt
    alerts = [json.loads(line) for line in read(run / "alerts.jsonl").splitlines()]
    fired = [e for e in alerts if e["rule"] == "node_failure_rate" and e["event"] == "firing"]
    assert fired and fired[0]["value"] == 50.0, alerts


def _resumes(run) -> list[int]:
    """The steps the run resumed from, in order (its train.log, every attempt's)."""
    log = run / "train.log"
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+) \(sample", read(log))] if log.exists() else []


def _resumed_at(run) -> int | None:
    """The step the run first resumed from, once it has logged a step after it (a checkpoint's step: never 0)."""
    found = _resumes(run)
    return found[0] if found and last_step(run) > found[0] else None


def _job_processes(job: str, rank: int | None = None) -> list[tuple[int, str]]:
    """(pid, node) of the job's Python ranks (rank `rank` only, when given): the nodes are slurmds on this machine."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError, StopIteration):
            env = read(f"/proc/{pid}/environ").split("\0")
            if read(f"/proc/{pid}/cmdline").split("\0")[0] == sys.executable and f"SLURM_JOB_ID={job}" in env \
                    and "SLURM_PROCID" in {e.split("=")[0] for e in env} and "SLURM_STEP_ID=" in "\0".join(env) \
                    and (rank is None or f"SLURM_PROCID={rank}" in env):
                found.append((int(pid), next(e for e in env if e.startswith("SLURMD_NODENAME=")).split("=")[1]))
    return found


@pytest.mark.timeout(400)
def test_a_lost_node_restarts_the_run_on_the_spare_inside_the_job(slurm, data_env, make_cfg, tmp_path, slurm_jobs):
    """cluster.spare_nodes=1: a two-node run gets three nodes; SIGKILL the rank on one of them mid-run and the job
    restarts the training on the other two (the spare) from the latest checkpoint, in the same job id (no requeue),
    the losses of every step equal to an uninterrupted run's; restarts.jsonl names the node, which is on the
    bad-node list. The time from the kill to the next finished step is printed (-s)."""
    steps, run = 300, tmp_path / "run"
    job = _job_id(_submit(tmp_path, run, f"train.max_steps={steps}", "train.ckpt_every=20", "cluster.spare_nodes=1",
                          "train.log_every=1"))
    slurm_jobs.append(job)
    until("step 30 of the job", lambda: last_step(run) >= 30, 150, every=0.1)
    pid, node = until("rank 1's process", lambda: (_job_processes(job, 1) or [None])[0], 30)
    os.kill(pid, signal.SIGKILL)
    killed = time.time()

    until("a step after the restart", lambda: _resumed_at(run), 240, every=0.1)  # (new interpreters on a busy machine)
    print(f"kill -> next finished step: {time.time() - killed:.1f} s")
    ref = _reference(make_cfg, tmp_path, steps)
    until("the job to end", lambda: job_gone(job), 200, every=1)
    restarts = [json.loads(line) for line in read(run / "restarts.jsonl").splitlines()]
    assert [(r["job"], r["failed_nodes"]) for r in restarts] == [(job, [node])], restarts
    assert f"srun: error: {node}: task 1: Killed" in restarts[0]["cause"], restarts  # srun's word for how it ended
    assert json.loads(read(run / "slurm.json"))["restart_count"] == 0  # never requeued
    _assert_same_run(run, ref, steps)
    assert losses(run) == ref  # bit for bit
    assert set(bad_nodes.excluded(os.environ["HPCTRAIN_BAD_NODES"], 72)) == {node}


@pytest.mark.timeout(400)
def test_with_no_spare_left_the_job_is_requeued_without_the_failed_nodes(slurm, data_env, tmp_path, slurm_jobs):
    """cluster.spare_nodes=1 and a rank lost twice: the first loss restarts the run on the spare inside the job; after
    the second, one healthy node is left of the three and the run needs two, so the supervisor falls back to a
    requeue that leaves out both failed nodes (ExcNodeList), and both are on the bad-node list. On this three-node
    cluster the requeued job then waits for nodes it may not use: the test reads it pending, and cancels it."""
    run = tmp_path / "run"
    job = _job_id(_submit(tmp_path, run, "train.max_steps=100000", "train.ckpt_every=5", "cluster.spare_nodes=1"))
    slurm_jobs.append(job)

    def trained(resumes: int, step: int) -> bool:  # `step` logged after `resumes` restarts
        return len(_resumes(run)) == resumes and last_step(run) >= step

    lost = []
    for resumes in (0, 1):
        until(f"step 12 after {resumes} restart(s)", lambda r=resumes: trained(r, 12), 240, every=0.1)
        pid, node = until("rank 1's process", lambda: (_job_processes(job, 1) or [None])[0], 30)
        os.kill(pid, signal.SIGKILL)
        lost.append(node)
    shown = until("the job requeued", lambda: (f := _scontrol_job(job)).get("JobState") == "PENDING"
                  and f.get("Restarts") == "1" and f, 120, every=0.5)
    assert set(hostnames(shown["ExcNodeList"])) == set(lost), (shown, lost)
    restarts = [json.loads(line) for line in read(run / "restarts.jsonl").splitlines()]
    assert [(r["job"], r["failed_nodes"], r["nodes"]) for r in restarts] == [(job, [n], 2) for n in lost], restarts
    supervisor = "".join(read(f) for f in glob.glob(str(run / ".submitit" / "*" / "*_log.out")))
    assert f"requeueing job {job} (1 healthy node(s) left of 3, 2 needed), leaving out {','.join(sorted(lost))}" \
        in supervisor, supervisor[-3000:]
    assert set(bad_nodes.excluded(os.environ["HPCTRAIN_BAD_NODES"], 72)) == set(lost)


@pytest.mark.timeout(400)
def test_without_a_spare_the_run_goes_on_on_fewer_nodes(slurm, data_env, make_cfg, tmp_path, slurm_jobs):
    """cluster.min_nodes=1 with parallel.dp=auto and no spare: SIGKILL the rank on one of the two nodes and the job
    goes on on the other alone, in the same job id (no requeue): dp 2 -> 1, the same global batch in two
    micro-batches, the checkpoint resharded. Every loss up to the checkpoint it resumed from is the uninterrupted
    two-rank run's bit for bit; the ten after it are within 1e-5 (one process sums in another order than two)."""
    steps, run = 120, tmp_path / "run"
    job = _job_id(_submit(tmp_path, run, f"train.max_steps={steps}", "train.ckpt_every=10", "cluster.min_nodes=1"))
    slurm_jobs.append(job)
    until("step 15 of the job", lambda: last_step(run) >= 15, 150, every=0.1)
    pid, node = until("rank 1's process", lambda: (_job_processes(job, 1) or [None])[0], 30)
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    found = until("a step after the restart", lambda: _resumed_at(run), 240, every=0.1)
    print(f"kill -> next finished step on one node: {time.time() - killed:.1f} s")
    ref = _reference(make_cfg, tmp_path, steps)
    until("the job to end", lambda: job_gone(job), 200, every=1)
    restarts = [json.loads(line) for line in read(run / "restarts.jsonl").splitlines()]
    assert [(r["job"], r["failed_nodes"], r["nodes"]) for r in restarts] == [(job, [node], 2)], restarts
    supervisor = "".join(read(f) for f in glob.glob(str(run / ".submitit" / "*" / "*_log.out")))
    assert "going on on 1 of the run's 2 nodes (cluster.min_nodes=1): dp 2 -> 1, gradient accumulation 1 -> 2" in \
        supervisor, supervisor[-3000:]
    step_nodes = subprocess.run(["sacct", "-j", job, "-n", "-P", "-o", "JobID,NNodes"], capture_output=True, text=True,
                                timeout=60).stdout.split()
    assert [s for s in step_nodes if re.fullmatch(r"\d+\.\d+\|\d+", s)] == [f"{job}.0|2", f"{job}.1|1"], step_nodes
    assert json.loads(read(run / "slurm.json"))["restart_count"] == 0  # never requeued
    result = json.loads(read(run / "result.json"))
    assert result["status"] == "completed" and result["steps"] == steps, result
    got = losses(run)
    assert sorted(got) == sorted(ref)
    assert {s: got[s] for s in got if s <= found} == {s: ref[s] for s in ref if s <= found}  # bit for bit
    # the same data and state after the shrink, summed in another order: 1e-7 at first (then, at lr 1e-2, the drift
    # grows as any two float orders' do: 1e-5 by ~25 steps later, 1e-3 by ~40)
    after = max(abs(got[s] - ref[s]) for s in range(found + 1, found + 11))
    assert after <= 1e-5, (after, found)
    assert bad_nodes.excluded(os.environ["HPCTRAIN_BAD_NODES"], 72) == {node: ANY}


def test_spare_nodes_in_a_sweep_is_one_line_before_anything_is_submitted(slurm, data_env, tmp_path):
    p = subprocess.run([sys.executable, "-m", "hpctrain", "-m", "hydra/launcher=slurm", "cluster.spare_nodes=1",
                        f"data.path={os.environ['HPCTRAIN_TEST_DATA']}", "data.prepare_demo=false", *SMALL_MODEL,
                        f"hydra.sweep.dir={tmp_path / 'run'}", "optim.lr=1e-3,1e-2"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "hpctrain: error: cluster.spare_nodes restarts one run inside its allocation: submit runs one at a time (no "
        "-m), or drop it for a sweep"], p.stderr
    assert not (tmp_path / "run" / ".submitit").exists()  # nothing submitted


@pytest.mark.timeout(300)
@pytest.mark.parametrize("packed", [False, True], ids=["array", "packed"])
def test_multirun_sweep_is_one_job_array_with_report(slurm, demo_data, tmp_path, packed):
    """`python -m hpctrain -m optim.lr=… train.global_batch=… hydra/launcher=slurm`: one job array; the
    report lists every point with its final losses and writes the plot. `packed` (cluster.pack=4, nodes of two
    ranks): the four points are four srun steps of one job (two nodes), each in its own run directory, and the
    report is the same."""
    from hpctrain.launch.sweep import report

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "hpctrain", "-m", "optim.lr=1e-2,3e-3", "train.global_batch=8,16",
           "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}", f"data.path={demo_data}", "data.prepare_demo=false",
           *SMALL_MODEL, "train.micro_batch=4", "train.max_steps=8", "train.eval_every=8", "train.eval_batches=2",
           "train.ckpt_every=0", "optim.warmup_steps=2", "cluster.cpus_per_task=1", "cluster.wait=true",
           *(["cluster.pack=4", "cluster.tasks_per_node=2"] if packed else [])]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    turnaround = time.time() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    if packed:
        job = re.search(r"submitted 1 job\(s\) (\d+) \(4 points each", p.stdout).group(1)
        steps = subprocess.run(["sacct", "-j", job, "-n", "-P", "-o", "JobID,NodeList,State"], capture_output=True,
                               text=True, timeout=60).stdout.split()
        assert sorted(s.split("|")[0] for s in steps if re.fullmatch(r"\d+\.\d+", s.split("|")[0])) == [
            f"{job}.{i}" for i in range(4)], steps
        print(f"2x2 sweep packed in one job: submit -> all 4 points done in {turnaround:.1f}s (job {job}: {steps})")
    else:
        array = p.stdout.split("array ")[1].split()[0]
        print(f"2x2 sweep on the local cluster: submit -> all 4 points done in {turnaround:.1f}s (array {array})")
        # the array's script: after its srun, each task's srun exits go to its own point's result (task_exits)
        script = read(glob.glob(str(sweep / ".submitit" / "**" / "*_submission.sh"), recursive=True)[0])
        table = next(ln for ln in script.splitlines() if ln.startswith("hpctrain_run_dirs=("))
        dirs = subprocess.run(["bash", "-c", table + '\nprintf "%s\\n" "${hpctrain_run_dirs[@]}"'], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()
        assert dirs == [str(sweep / str(i)) for i in range(4)] and "hpctrain.runtime.task_exits" in script, script
    rows = report(str(sweep))
    assert [r["status"] for r in rows] == ["completed"] * 4, rows
    assert {(r["params"]["optim.lr"], r["params"]["train.global_batch"]) for r in rows} == {
        (lr, b) for lr in (1e-2, 3e-3) for b in (8, 16)}
    for r in rows:
        result = json.loads(read(os.path.join(r["dir"], "result.json")))
        assert r["final_val_loss"] == result["final_val_loss"] and result["steps"] == 8
        slurm_doc = json.loads(read(os.path.join(r["dir"], "slurm.json")))
        assert slurm_doc["job_id"] == job if packed else slurm_doc["array_job_id"] == array
        # No cluster.num_threads: torch threads per rank = the task's CPUs (OMP_NUM_THREADS from the job).
        assert "1 CPU threads/rank" in read(os.path.join(r["dir"], "train.log"))
    out = subprocess.run([sys.executable, "-m", "hpctrain.launch.sweep", "report", str(sweep)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "4 completed" in out.stdout, out.stdout + out.stderr
    assert (sweep / "sweep_report.png").stat().st_size > 10_000


def _scontrol_job(job: str) -> dict[str, str]:
    """`scontrol show job`'s Key=Value fields."""
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def _seconds(slurm_time: str) -> int:
    """Slurm's [D-]HH:MM:SS (or MM:SS) in seconds."""
    days, _, clock = slurm_time.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    return int(days or 0) * 86400 + sum(v * 60**k for k, v in enumerate(reversed(parts)))


def _nice(pid: int) -> None:
    """Nice 19 for a job's process, as the scheduler applies it. Each job runs in a session of its own, and with
    kernel.sched_autogroup_enabled (Debian's default) a session is a scheduling group that gets as much CPU as the
    whole pytest session: a nice value inside it yields only to its own session's threads; the group's nice
    (/proc/PID/autogroup) yields to the rest. Without autogroups, every thread's own (on Linux a priority is a
    thread's: the OpenMP pool's too)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as f:
        f.write("19")
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), 19)


@pytest.mark.timeout(300)
def test_time_limit_requeues_as_timeout_and_resumes(slurm, data_env, tmp_path, slurm_jobs):
    """A run reaching its time limit: USR2 arrives `signal_lead_s` before the limit, the job checkpoints, submitit
    requeues it as a timeout (counted against cluster.max_timeouts) and the rerun resumes from that checkpoint.
    The job asks for 10 minutes; once it trains, the test lowers its limit (`scontrol update TimeLimit`, whole
    minutes) to 1-2 minutes from then, so that the signal (55 s before the limit, and Slurm may send it up to 60 s
    early, `man sbatch`) comes while it trains. With a fixed 2-minute limit it came 5-65 s after the start: on a
    loaded machine (the full suite) that was before the rank had imported torch, three attempts in a row, and before
    any handler existed the default action of USR2 killed the job. Once requeued the limit is raised again, so the
    rerun trains on. The run is endless; the test cancels it once the rerun has trained on (that a resumed run ends
    with an uninterrupted run's loss is what the preemption tests check)."""
    run = tmp_path / "run"
    job = _job_id(_submit(tmp_path, run, "parallel=single", "cluster.nodes=1", "cluster.time_min=10",
                          "cluster.signal_lead_s=55", "train.max_steps=100000000", "train.ckpt_every=0",
                          "train.log_every=50"))
    slurm_jobs.append(job)
    until("a logged step", lambda: (run / "metrics.jsonl").exists() and last_step(run) > 0, 180)
    # Niced once it trains, its endless steps leave the CPU to the rest of the suite (it otherwise burns one core
    # until the signal); not before: at nice 19 beside a busy suite, its import of torch could take minutes.
    for pid, _ in _job_processes(job):
        _nice(pid)
    limit = _seconds(_scontrol_job(job)["RunTime"]) // 60 + 2  # (minutes: 60-120 s left)
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit}"], check=True, timeout=30)
    until("the requeue", lambda: int(_scontrol_job(job).get("Restarts", 0)) >= 1, 180, every=0.5)
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], check=True, timeout=30)
    step = until("steps after the resume", lambda: _resumed_at(run), 180, every=1)
    subprocess.run(["scancel", job], check=True, timeout=30)
    until("the cancelled job to end", lambda: job_gone(job), 60)
    # USR2 `signal_lead_s` early is the rule; on a loaded machine slurmctld's 30 s limit check once sent the limit's
    # SIGTERM first (the run checkpointed on it and was requeued all the same).
    stopped = re.search(rf"stopped by (SIGUSR2|SIGTERM) after step {step}; checkpoint written", read(run / "train.log"))
    assert stopped, read(run / "train.log")
    if stopped.group(1) == "SIGUSR2":
        assert "this job is timed-out" in _job_logs(run)  # submitit's verdict: a timeout, not a preemption
    assert json.loads(read(run / "slurm.json"))["restart_count"] >= 1
    logged = [r["step"] for r in records(run) if "loss" in r]
    assert logged == sorted(set(logged)) and logged[-1] > step, "metrics.jsonl continues past the resume step"


@pytest.mark.timeout(300)
def test_plain_python_in_a_batch_script_is_not_a_rank(slurm, demo_data, tmp_path):
    """`python -m hpctrain` in an sbatch script without srun (SLURM_PROCID/NTASKS set, no step): one
    process trains alone instead of waiting for ranks that will never come."""
    run = tmp_path / "run"
    cmd = " ".join([sys.executable, "-m", "hpctrain", f"run_dir={run}", f"data.path={demo_data}",
                    "data.prepare_demo=false", *SMALL_MODEL, "train.max_steps=2", "train.eval_every=0",
                    "train.global_batch=8", "train.micro_batch=4", "cluster.pg_timeout_s=30",
                    # one thread, as the suite's other runs: two on cores the other test workers keep busy wait on
                    # each other (8 s alone, 100-170 s beside the suite, steps of 20 s instead of 0.1)
                    "cluster.num_threads=1"])
    # (the job took 8 s alone and 58-122 s beside the suite, 91 s of it before the first step: a fresh interpreter on
    # a core the suite keeps busy. Broken, it would not hang: it would wait pg_timeout_s=30 for rank 1 and fail.)
    _, state = sbatch_run(["-N1", "--ntasks=2", "--cpus-per-task=1", "-o", str(tmp_path / "out-%j.txt"), "--wrap",
                           cmd], cwd=ROOT, timeout=240)
    assert state == "completed", read(glob.glob(str(tmp_path / "out-*.txt"))[0])
    result = json.loads(read(run / "result.json"))
    assert result["status"] == "completed" and result["world"] == 1, result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_sbatch_refusing_the_job_is_one_line(slurm, demo_data, tmp_path, sweep):
    """A partition that does not exist: sbatch's refusal becomes one line naming the settings to check, exit 2, and
    a single run leaves no run directory."""
    where = ["-m", f"hydra.sweep.dir={tmp_path / 's'}", "optim.lr=1e-2,3e-3"] if sweep else [f"run_dir={tmp_path / 'r'}"]
    p = run_forked(cli.main, [*where, "hydra/launcher=slurm", f"data.path={demo_data}", "data.prepare_demo=false",
                              *SMALL_MODEL, "cluster.partition=no_such_partition"], cwd=ROOT, timeout=100)
    assert p.code == 2, p.out + p.err
    assert len(p.err.strip().splitlines()) == 1 and "Traceback" not in p.err, p.err
    assert "sbatch refused the job (sbatch: error: invalid partition" in p.err and "cluster.partition" in p.err
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(240)
def test_a_job_its_partition_would_never_start_is_refused_before_sbatch(slurm, make_cfg, demo_data, tmp_path,
                                                                         slurm_jobs, monkeypatch):
    """Under Slurm's default EnforcePartLimits=NO sbatch takes a job longer than its partition's time limit, or
    wider than its node limit or narrower than its MinNodes, and it waits in the queue for good (PartitionTimeLimit,
    PartitionNodeLimit): refused in one line before submitting, a single run, a packed sweep's job and a run's eval
    jobs alike; within the limits, in a list of partitions one of which can start it, or beyond the limits a QOS
    (cluster.qos or $SBATCH_QOS) lifts, it is not."""
    from hpctrain.core.config import ConfigError
    from hpctrain.core.slurm import check_partition, partition_limits
    from hpctrain.training import eval_jobs

    part = f"short{os.getpid()}"
    made = subprocess.run(["scontrol", "create", f"PartitionName={part}", "Nodes=n[1-3]", "MaxTime=10", "MaxNodes=1",
                           "State=UP"], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"no partition can be made here ({made.stderr.strip()})")
    lift = f"lift{os.getpid()}"  # a QOS whose jobs may exceed a partition's time limit (not its node limits)
    made_qos = subprocess.run(["sacctmgr", "-i", "add", "qos", lift, "Flags=PartitionTimeLimit"], capture_output=True,
                              text=True, timeout=30).returncode == 0  # (without an accounting database: not checked)
    try:
        base = ["hydra/launcher=slurm", f"data.path={demo_data}", "data.prepare_demo=false", *SMALL_MODEL,
                f"cluster.partition={part}", "train.max_steps=1", "train.eval_every=0"]
        for more, says in ((["cluster.time_min=11"], [f"cluster.time_min=11 is longer than partition {part} allows a "
                                                      "job (10 min)", "PartitionTimeLimit", "cluster.time_min=10"]),
                           (["cluster.time_min=10", "parallel=ddp", "cluster.nodes=2"],
                            [f"asks for 2 nodes, more than partition {part} gives one job (1)", "PartitionNodeLimit"]),
                           (["-m", f"hydra.sweep.dir={tmp_path / 's'}", "cluster.time_min=10", "cluster.pack=2",
                             "optim.lr=1e-2,3e-3"], ["asks for 2 nodes", "PartitionNodeLimit"])):
            argv = [*more[:2], *base, *more[2:]] if more[0] == "-m" else [f"run_dir={tmp_path / 'r'}", *base, *more]
            p = run_forked(cli.main, argv, cwd=ROOT, timeout=100)
            assert p.code == 2 and len(p.err_lines) == 1 and all(w in p.err for w in says), (more, p.err)
            assert not (tmp_path / "r").exists() and not (tmp_path / "s" / "0").exists()  # (no point's directory)
        queued = subprocess.run(["squeue", "-h", "-p", part], capture_output=True, text=True, timeout=30).stdout
        assert not queued, queued
        # eval jobs keep the run's time_min unless eval.cluster changes it
        cfg = make_cfg("eval.tasks=[hpc_mc]", "eval.mode=job", "train.ckpt_every=3", f"+eval.cluster.partition={part}")
        with pytest.raises(ConfigError, match=rf"eval.cluster.time_min=60 is longer than partition {part} allows a "
                                              r"job \(10 min\): .*; use \+eval.cluster.time_min=10 or less"):
            eval_jobs.check(cfg.eval, cfg.train, True, cfg.cluster, cfg.parallel)
        wide = make_cfg("eval.tasks=[hpc_mc]", "eval.mode=job", "train.ckpt_every=3", f"+eval.cluster.partition={part}",
                        "+eval.cluster.time_min=10", "parallel=ddp", "cluster.nodes=2")  # (the run's layout)
        with pytest.raises(ConfigError, match=rf"asks for 2 nodes, more than partition {part} gives one job \(1\)"):
            eval_jobs.check(wide.eval, wide.train, True, wide.cluster, wide.parallel)
        check_partition(f"{part},debug", 60, 2)  # debug can start it
        if made_qos:  # Under a QOS, the limits its flags lift are not checked, the others are
            check_partition(part, 60, 1, qos=lift)
            with pytest.raises(ConfigError, match=rf"gives one job \(1\): .*\(PartitionNodeLimit; QOS {lift} does not "):
                check_partition(part, 10, 2, qos=lift)
        check_partition(part, 60, 2, qos="long")  # (a QOS sacctmgr does not know: sbatch refuses it itself)
        monkeypatch.setenv("SBATCH_PARTITION", part)  # sbatch takes it over the script's #SBATCH --partition
        for partition in (None, "debug"):
            with pytest.raises(ConfigError, match="PartitionTimeLimit"):
                check_partition(partition, 60, 1)
        if made_qos:
            monkeypatch.setenv("SBATCH_QOS", lift)  # and $SBATCH_QOS over the script's QOS
            check_partition(None, 60, 1)
            monkeypatch.delenv("SBATCH_QOS")
        p = run_forked(cli.main, [f"run_dir={tmp_path / 'r'}", *base, "cluster.time_min=10"], cwd=ROOT, timeout=100)
        assert p.code == 0 and "submitted job" in p.out, p.err
        slurm_jobs.append(job := p.out.split("submitted job ")[1].split()[0])
        subprocess.run(["scancel", job], check=True, timeout=30)
        until("the job to end", lambda: job_gone(job), 60)
        # A QOS that lifts nothing (Slurm's default one) is no way around the check (without an accounting database
        # sacctmgr cannot tell, and nothing is checked under a QOS)
        p = run_forked(cli.main, [f"run_dir={tmp_path / 'q'}", *base, "cluster.qos=normal"], cwd=ROOT, timeout=100)
        if made_qos:
            assert p.code == 2 and len(p.err_lines) == 1 and "(PartitionTimeLimit; QOS normal does not lift it)" in \
                p.err, p.err
        elif p.code == 0:
            slurm_jobs.append(p.out.split("submitted job ")[1].split()[0])
        # A job that waits (here held): the report the submission points to says why, before the job has written
        # anything
        p = run_forked(cli.main, [f"run_dir={tmp_path / 'h'}", *base, "cluster.time_min=10",
                                  "+cluster.sbatch_extra.hold=true"], cwd=ROOT, timeout=100)
        assert p.code == 0 and f"progress: python -m hpctrain report {tmp_path / 'h'}" in p.out, p.err
        slurm_jobs.append(job := p.out.split("submitted job ")[1].split()[0])
        from hpctrain.launch.sweep import report

        (row,) = until("pending (JobHeldUser)", lambda: [r for r in report(str(tmp_path / "h"))
                                                         if r["status"] == "pending (JobHeldUser)"], 30)
        assert row["slurm_job_id"] == job, row
        # A partition's MinNodes: a job under it waits for good too (PartitionNodeLimit)
        subprocess.run(["scontrol", "update", f"PartitionName={part}", "MinNodes=2", "MaxNodes=3"], check=True,
                       timeout=30)
        partition_limits.cache_clear()
        with pytest.raises(ConfigError, match=rf"the job asks for 1 node\(s\), fewer than partition {part} gives a job "
                                              r"\(2 at least\): .*PartitionNodeLimit"):
            check_partition(part, 10, 1)
        check_partition(part, 10, 2)
        # A packed sweep: its jobs' node counts, not a point's (2 one-node points per 2-node job); a short last job too
        sweep = ["-m", f"hydra.sweep.dir={tmp_path / 'p'}", *base, "cluster.time_min=10", "cluster.pack=2",
                 "+cluster.sbatch_extra.hold=true"]
        p = run_forked(cli.main, [*sweep, "optim.lr=1e-2,3e-3,1e-3"], cwd=ROOT, timeout=100)
        assert p.code == 2 and f"asks for 1 node(s), fewer than partition {part} gives a job (2 at least)" in p.err, p.err
        p = run_forked(cli.main, [*sweep, "optim.lr=1e-2,3e-3"], cwd=ROOT, timeout=100)
        assert p.code == 0 and "submitted 1 job(s)" in p.out, p.err
        slurm_jobs.extend(p.out.split("submitted 1 job(s) ")[1].split()[:1])
    finally:  # (a partition still holding a job cannot be deleted)
        subprocess.run(["scancel", "-p", part], timeout=30)
        until("the partition's jobs to end", lambda: not subprocess.run(
            ["squeue", "-h", "-p", part], capture_output=True, text=True, timeout=30).stdout, 60)
        subprocess.run(["scontrol", "delete", f"PartitionName={part}"], check=True, timeout=30)
        if made_qos:
            subprocess.run(["sacctmgr", "-i", "delete", "qos", lift], capture_output=True, timeout=30)
