"""Launch glue without a Slurm cluster: job shapes from layouts, checks before submitting, the local
launcher, preemption of a local run, and the cap on restart loops."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import SMALL_MODEL
from helpers import Forked, last_step, losses, run_forked, until

from hpctrain import cli
from hpctrain.core.config import ConfigError

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


@pytest.mark.parametrize("overrides, want", [
    (["parallel=single"], (1, 1, None)),
    (["parallel=ddp", "cluster.nodes=2"], (2, 1, None)),
    (["parallel=dp2_tp2_pp2", "cluster.tasks_per_node=4"], (2, 4, None)),
    (["parallel=dp2_tp2_pp2", "cluster.gpus_per_node=4"], (2, 4, 4)),
    (["parallel=tp2", "cluster.gpus_per_node=8"], (1, 2, 2)),
    (["parallel=fsdp", "cluster.nodes=4", "cluster.gpus_per_node=8"], (4, 8, 8)),
])
def test_job_shape_from_layout(make_cfg, overrides, want):
    from hpctrain.parallel.layout import job_shape

    cfg = make_cfg(*overrides)
    got = job_shape(cfg.parallel, cfg.cluster)
    assert (got["nodes"], got["tasks_per_node"], got["gpus_per_node"]) == want


@pytest.mark.parametrize("overrides, words", [
    (["parallel.dp=3", "cluster.tasks_per_node=2"], "do not fill whole nodes"),
    (["parallel=ddp"], "needs cluster.nodes"),
    (["parallel.dp=2", "cluster.nodes=3"], "needs 1 node"),
])
def test_impossible_job_shape_is_one_line(make_cfg, overrides, words):
    from hpctrain.parallel.layout import job_shape

    with pytest.raises(ConfigError, match=words):
        cfg = make_cfg(*overrides, "cluster.tasks_per_node=2")
        job_shape(cfg.parallel, cfg.cluster)


@pytest.mark.parametrize("overrides, words", [
    (["parallel.dp=2", "cluster.tasks_per_node=1", "cluster.min_nodes=1"],
     "cluster.min_nodes=1 goes on on fewer nodes by shrinking dp: set parallel.dp=auto (with cluster.nodes), or drop "
     "cluster.min_nodes"),
    (["parallel=ddp", "cluster.nodes=2", "cluster.min_nodes=3"],
     "cluster.min_nodes=3 is more than the run's 2 node(s): make it at most 2, or drop it"),
    (["parallel=ddp", "cluster.nodes=2", "cluster.min_nodes=0"], "cluster.min_nodes=0 must be"),
])
def test_a_run_that_cannot_shrink_is_one_line_before_submitting(make_cfg, overrides, words):
    """cluster.min_nodes (go on on fewer nodes when nodes fail) is checked with the rest, on the login node."""
    from hpctrain.launch.submit import check

    with pytest.raises(ConfigError) as e:
        check(make_cfg(*overrides))
    assert words in str(e.value) and "\n" not in str(e.value), e.value


def test_the_nodes_a_run_may_shrink_to(make_cfg):
    from hpctrain.parallel.layout import min_nodes

    for overrides, want in ((["cluster.min_nodes=1"], 1), (["cluster.min_nodes=2"], None), ([], None)):
        cfg = make_cfg("parallel=ddp", "cluster.nodes=2", *overrides)
        assert min_nodes(cfg.parallel, cfg.cluster) == want, overrides


def test_the_supervisor_shrinks_to_the_most_nodes_that_keep_the_batch(make_cfg, tmp_path):
    """Four nodes, one lost, no spare, cluster.min_nodes=1: three would split the global batch of 8 in micro-batches
    of 2 over dp=3 (no), two keep it (dp 4 -> 2, accumulation 1 -> 2); the steps then train from the config on two
    nodes. With min_nodes=3 nothing fits: requeue ([])."""
    import logging

    from omegaconf import OmegaConf

    from hpctrain.core.files import read_json
    from hpctrain.launch.supervise import STEP_FILE, SupervisedRun

    cfg = make_cfg("parallel=ddp", "cluster.nodes=4", "train.global_batch=8", "train.micro_batch=2")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    said, logger = [], logging.getLogger("hpctrain")
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logger.addHandler(handler)
    # (an earlier test's logging config in this worker may have disabled the logger, or logging below WARNING)
    saved = logger.level, logger.disabled, logging.root.manager.disable
    logger.setLevel(logging.INFO)
    logger.disabled = False
    logging.disable(logging.NOTSET)
    try:
        assert SupervisedRun(resolved, str(tmp_path), None, 4, 1, 3, 1)._shrink(["n1", "n3", "n4"]) == ["n1", "n3"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.disabled = saved[1]
        logging.disable(saved[2])
    assert read_json(str(tmp_path / STEP_FILE))["cfg"]["cluster"]["nodes"] == 2
    assert any("not on 3 node(s): train.global_batch=8 is not divisible by micro_batch×dp=2×3" in s for s in said), said
    assert "going on on 2 of the run's 4 nodes (cluster.min_nodes=1): dp 4 -> 2, gradient accumulation 1 -> 2" in said
    assert SupervisedRun(resolved, str(tmp_path / "x"), None, 4, 1, 3, 3)._shrink(["n1", "n3", "n4"]) == []


@pytest.mark.timeout(200)
@pytest.mark.parametrize("bad, words", [
    (["parallel.dp=3", "cluster.tasks_per_node=2"], "do not fill whole nodes"),
    (["data.path=/nonexistent/shards", "data.prepare_demo=false"], "does not exist"),
])
def test_bad_submission_is_refused_before_sbatch(demo_data, tmp_path, bad, words):
    """Checked on the login node: no job, no sbatch call, one line."""
    p = run_forked(cli.main, ["hydra/launcher=slurm", f"run_dir={tmp_path / 'r'}", f"data.path={demo_data}",
                              *SMALL_MODEL, *bad],
                   cwd=ROOT, env={"PATH": "/usr/bin/nonexistent"}, timeout=180)  # an sbatch call would fail otherwise
    assert p.code == 2, p.err
    assert p.err.strip().splitlines() == [p.err.strip()] and words in p.err, p.err
    assert not (tmp_path / "r" / ".submitit").exists()


@pytest.mark.timeout(200)
def test_bad_sweep_point_is_refused_before_submitting(demo_data, tmp_path):
    p = run_forked(cli.main, ["-m", "train.global_batch=8,7", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path / 's'}",
                              f"data.path={demo_data}", *SMALL_MODEL, "train.micro_batch=4"], cwd=ROOT, timeout=180)
    assert p.code == 2, p.out + p.err
    assert "sweep point #1 (train.global_batch=7)" in p.err and "not divisible" in p.err
    assert not (tmp_path / "s" / ".submitit").exists()


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_local_launcher_runs_a_sweep(demo_data, tmp_path):
    """hydra/launcher=local (submitit_local): the same sweep command, on this machine."""
    from hpctrain.launch.sweep import report

    sweep = tmp_path / "s"
    p = run_forked(cli.main, ["-m", "optim.lr=1e-2,3e-3", "hydra/launcher=local", f"hydra.sweep.dir={sweep}",
                              f"data.path={demo_data}", "data.prepare_demo=false", *SMALL_MODEL, "train.global_batch=8",
                              "train.micro_batch=4", "train.max_steps=4", "train.eval_every=0", "cluster.num_threads=1",
                              "cluster.wait=true"], ROOT, timeout=200)
    assert p.code == 0, p.out + p.err
    rows = report(str(sweep))
    assert [r["status"] for r in rows] == ["completed", "completed"], rows
    assert rows[0]["final_loss"] != rows[1]["final_loss"]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_local_run_stops_on_usr2_and_resumes_exactly(make_cfg, demo_data, tmp_path):
    """USR2 to a local 2-rank run: both ranks stop after the same step, checkpoint, exit 75 (EX_TEMPFAIL);
    the same command resumes and ends where an uninterrupted run ends."""
    from hpctrain.training.run import train

    steps = 60  # the signal comes at step 5 or later: dozens of steps to spare
    common = ["parallel=ddp", "parallel.dp=2", "data.lanes=2", "cluster.num_threads=1", f"train.max_steps={steps}",
              "train.ckpt_every=0", "train.eval_every=0", "train.log_every=1"]
    train(make_cfg(*common), str(tmp_path / "ref"))
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"data.path={demo_data}", "data.prepare_demo=false", *SMALL_MODEL,
            "train.global_batch=8", "train.micro_batch=4", "optim.lr=1e-2", "optim.warmup_steps=2", *common]
    with Forked(cli.main, args, ROOT) as proc:  # the command, forked from this process
        until("step 5 of the run", lambda: last_step(run) >= 5, 240, every=0.2)  # (on a busy machine)
        proc.send_signal(signal.SIGUSR2)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "preempted" and 5 <= result["steps"] < steps, (result, err)
    assert "stopped by SIGUSR2" in err and "checkpoint written" in err
    p = run_forked(cli.main, args, cwd=ROOT, timeout=200)  # the same command again
    assert p.code == 0, p.err
    got, ref = losses(run), losses(tmp_path / "ref")
    assert sorted(got) == sorted(ref)
    assert max(abs(got[s] - ref[s]) for s in ref) <= 1e-5


def test_only_the_main_rank_reports_a_deliberate_stop_in_its_exit_code():
    """srun --kill-on-bad-exit=1 would kill rank 0 while it requeues if another rank ended non-zero first."""
    from hpctrain.runtime.job import EXIT_PREEMPTED, EXIT_TERMINATED, Stop, Stopped
    from hpctrain.runtime.task_exits import SRUN_ARGS

    assert "--kill-on-bad-exit=1" in SRUN_ARGS
    for kind, code in ((Stop.PREEMPT, EXIT_PREEMPTED), (Stop.TERMINATE, EXIT_TERMINATED), (Stop.ALERT, EXIT_TERMINATED)):
        assert Stopped(kind, 3, "SIGUSR2").exit_code == code
        assert Stopped(kind, 3, "SIGUSR2", main=False).exit_code == 0


def test_slurm_times_read_as_minutes():
    """sinfo's partition time limits (`%l`) and Slurm's other time forms, in minutes; infinite or unreadable: None."""
    from hpctrain.core.slurm import minutes

    forms = {"infinite": None, "UNLIMITED": None, "n/a": None, "": None, "30": 30, "10:00": 10, "10:30": 10.5,
             "2:00:00": 120, "1-12": 2160, "1-2:30": 1590, "1-00:00:00": 1440, "2-01:00:30": 2940.5,
             "1:2:3:4": None}
    assert {text: minutes(text) for text in forms} == forms


def test_a_slurm_time_limit_must_leave_a_minute_before_its_warning():
    """Slurm may send the time limit's warning up to 60 s before cluster.signal_lead_s: a limit that leaves less
    would have the job get it as it starts."""
    from types import SimpleNamespace

    from hpctrain.core.config import ConfigError
    from hpctrain.launch.submit import _check_lead

    _check_lead(SimpleNamespace(time_min=3, signal_lead_s=120))
    with pytest.raises(ConfigError, match=r"cluster.time_min=3 \(180 s\) leaves 59 s before the time limit's warning"):
        _check_lead(SimpleNamespace(time_min=3, signal_lead_s=121))


def test_a_node_s_ranks_are_the_launchers(monkeypatch):
    """The memory check counts every rank the launcher starts on the node (they share its memory): torchrun's
    LOCAL_WORLD_SIZE, or an srun step's tasks on this node, which _slurm_env also exports as LOCAL_WORLD_SIZE. The
    variables are the ones srun set on the local cluster for `srun -N2 -n3` on n2,n3 (within a job of n1-n3 too,
    the step's own node numbers): SLURM_STEP_TASKS_PER_NODE=2,1 and SLURM_NODEID 0 on n2, 1 on n3."""
    from hpctrain.core.slurm import tasks_on_node
    from hpctrain.parallel.process_group import _slurm_env, launched_local_world

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_STEP_ID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # (recorded, so that what _slurm_env sets is undone too)
        monkeypatch.delenv(name)
    assert launched_local_world() is None  # started alone
    assert [tasks_on_node("2(x3),1", n) for n in range(5)] == [2, 2, 2, 1, None]
    assert [tasks_on_node(bad, 0) for bad in ("", "2(x", "2(x)", "x", "(x3),2")] == [None] * 5
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # (no scontrol call for the master's name)
    monkeypatch.setenv("MASTER_PORT", "29500")
    for var, value in {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_STEP_ID": "0",
                       "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_NODEID": "1"}.items():
        monkeypatch.setenv(var, value)
    assert launched_local_world() == 1
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2,3")
    assert launched_local_world() == 3
    monkeypatch.setenv("SLURM_HET_SIZE", "2")  # a heterogeneous job's lists are per component: not read
    assert launched_local_world() == 1
    monkeypatch.delenv("SLURM_HET_SIZE")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2,1")
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert launched_local_world() == 2
    _slurm_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"]) == ("2", "3", "2")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "garbled")  # what torchrun says wins; a list not understood: 1
    assert launched_local_world() == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert launched_local_world() == 1


def test_job_ports_stay_below_the_ephemeral_range_and_differ_per_step():
    """A supervised restart's rendezvous port was once taken by some process's outgoing connection (EADDRINUSE):
    derived ports stay below Linux's ephemeral range; each step of a job, and each packed point, gets its own."""
    from hpctrain.core.slurm import job_port

    lo, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [job_port(job, slot) for job in (1, 2023, 999_999) for slot in range(64)]
    assert all(1024 < p < min(lo, 32768) for p in ports)
    assert len({job_port(2023, slot) for slot in range(64)}) == 64
    # Jobs sharing a node: first steps meet only 8000 ids apart (they were 375 apart), a later step or packed point
    # never takes a first step's port, any two of two jobs' later slots (restarts, packed points 1-63: a sweep's
    # packed jobs have consecutive ids) meet only 63 ids apart or more, slots 1-8 127 or more, one slot 4000.
    jobs = range(50_000, 58_000)
    assert len({job_port(job) for job in jobs}) == len(jobs)
    assert not {job_port(job) for job in jobs} & {job_port(job, slot) for job in jobs for slot in range(1, 64)}

    def others(slots, within):
        return {job_port(job, s) for job in range(50_000 - within, 50_000 + within + 1) if job != 50_000 for s in slots}

    assert not {job_port(50_000, s) for s in range(1, 64)} & others(range(1, 64), 62)
    assert not {job_port(50_000, s) for s in range(1, 9)} & others(range(1, 9), 126)
    assert len({job_port(job, 5) for job in range(50_000, 54_000)}) == 4000


def test_a_local_worlds_port_is_below_the_ephemeral_range_apart_from_job_ports_and_not_held(monkeypatch):
    """A local world's rendezvous port from bind(0) could be taken by any outgoing connection before rank 0 bound
    it: it comes from below the ephemeral range, apart from Slurm jobs' ports, and a port something holds is passed
    over (a listener here)."""
    import random
    import socket

    from hpctrain.core.slurm import job_port
    from hpctrain.runtime.spawn import LOCAL_PORTS, free_port

    lo, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert LOCAL_PORTS[0] > 1024 and LOCAL_PORTS[-1] < min(lo, 32768)
    assert LOCAL_PORTS[-1] <= 17000  # the local test cluster's slurmd ports start at 17001 (sbatch/local_cluster.sh)
    assert not {job_port(job, slot) for job in range(0, 12000, 7) for slot in range(64)} & set(LOCAL_PORTS)
    held = socket.socket()
    try:
        port = next(p for p in LOCAL_PORTS if _bound(held, p))  # a free one of the range, held by a listener
        held.listen()
        picks = iter([port, port, *LOCAL_PORTS])  # the held port twice, then the range in order
        monkeypatch.setattr(random.SystemRandom, "choice", lambda self, seq: next(picks))
        got = free_port()
        assert got != port and got in LOCAL_PORTS
    finally:
        held.close()


def _bound(sock, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def test_restarts_without_progress_are_capped(tmp_path, monkeypatch):
    """A job requeued again and again without reaching a new checkpoint gives up after max_stalled_restarts."""
    from hpctrain.runtime.job import record_attempt

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    for restart, step, want_error in [(0, 0, False), (1, 30, False), (2, 30, False), (3, 30, False),
                                      (4, 40, False), (5, 40, False), (6, 40, False), (7, 40, False),
                                      (8, 40, True)]:
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        error = record_attempt(str(tmp_path), step, max_stalled=3)
        assert bool(error) == want_error, (restart, error)
    assert "restarted 4 times in a row without reaching a new checkpoint (still at step 40)" in error
    doc = json.loads((tmp_path / "slurm.json").read_text())
    assert doc["job_id"] == "42" and doc["restart_count"] == 8 and doc["stalled_restarts"] == 4


def test_no_record_outside_slurm(tmp_path, monkeypatch):
    from hpctrain.runtime.job import record_attempt

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert record_attempt(str(tmp_path), 0, 3) is None and not (tmp_path / "slurm.json").exists()


def test_srun_task_environment_becomes_torch_rank(monkeypatch):
    """An srun task: rank, world and local rank from SLURM_*, master = the allocation's first node, port from
    the job id (the same on every node, different per job)."""
    import shutil

    from hpctrain.core.slurm import job_port
    from hpctrain.parallel.process_group import _slurm_env, launched_world

    monkeypatch.setattr(os, "environ", {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5",
                                        "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-10]"})
    assert launched_world() == 8
    _slurm_env()
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_PORT": "21234"}
    assert job_port(1234) == 20000 + 1234 == 21234
    if shutil.which("scontrol"):  # Slurm's own hostlist expansion
        assert os.environ["MASTER_ADDR"] == "gpu07"
    # Two jobs sharing a node derive the same port only when their ids are 8000 apart: the job's own MASTER_PORT
    # wins (docs/troubleshooting.md).
    assert job_port(1234 + 8000) == job_port(1234)
    monkeypatch.setattr(os, "environ", {"SLURM_JOB_ID": "1609", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456"})
    _slurm_env()
    assert os.environ["MASTER_PORT"] == "23456"


def test_plain_batch_script_is_not_a_rank(monkeypatch):
    """The batch shell of an allocation with --ntasks=4 (no srun step): not a rank; the layout forks its own."""
    from hpctrain.parallel.process_group import _slurm_env, launched_world

    monkeypatch.setattr(os, "environ", {"SLURM_JOB_ID": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert launched_world() is None
    _slurm_env()
    assert "RANK" not in os.environ


def test_nccl_settings_exported_unless_the_job_sets_them(monkeypatch):
    from hpctrain.parallel.process_group import apply_env

    monkeypatch.setattr(os, "environ", {"NCCL_IB_HCA": "mlx5_0"})  # e.g. from a site module
    got = apply_env({"NCCL_IB_TIMEOUT": "22", "NCCL_IB_HCA": "mlx5_1", "NCCL_DEBUG": None})
    assert os.environ == {"NCCL_IB_HCA": "mlx5_0", "NCCL_IB_TIMEOUT": "22"}  # None: left unset
    assert got == {"NCCL_IB_TIMEOUT": "22 (cluster.nccl)", "NCCL_IB_HCA": "mlx5_0 (environment)"}


def test_a_damaged_attempt_record_starts_the_counts_afresh(tmp_path, monkeypatch):
    """slurm.json damaged, or holding values no attempt wrote: the counts restart (a warning says so), the job runs."""
    from hpctrain.runtime.job import node_failures, record_attempt

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    for text in ("{not json", '{"stalled_restarts": "x", "job_id": "42", "restart_count": 1}', '["a list"]'):
        (tmp_path / "slurm.json").write_text(text)
        assert record_attempt(str(tmp_path), 10, max_stalled=3) is None
        doc = json.loads((tmp_path / "slurm.json").read_text())
        assert doc["stalled_restarts"] == 0 and doc["node_failures"] == []
    (tmp_path / "slurm.json").write_text('{"node_failures": ["soon"], "nodes": 2}')
    assert node_failures(str(tmp_path)) is None


def test_a_grid_is_numbered_as_the_sbatch_template_numbers_it():
    """`python -m hpctrain check`'s grid: an axis is an override with a comma before `--`, the last axis fastest;
    the rest (everything after `--`, commas included) on every point."""
    from hpctrain.launch.submit import grid

    assert grid(["a=1,2", "b=x,y", "c=3", "--", "d=[1,2]"]) == [
        ["a=1", "b=x", "c=3", "d=[1,2]"], ["a=1", "b=y", "c=3", "d=[1,2]"],
        ["a=2", "b=x", "c=3", "d=[1,2]"], ["a=2", "b=y", "c=3", "d=[1,2]"]]
    assert grid(["c=3"]) == [["c=3"]]


@pytest.mark.timeout(120)
def test_a_sweep_beyond_the_clusters_array_size_is_refused_before_anything(slurm, demo_data, tmp_path):
    """More points than the cluster's MaxArraySize: one line, before any point is composed or anything written."""
    from hpctrain.launch.submit import max_array_size

    n = (max_array_size() or 1001) + 1
    p = run_forked(cli.main, ["-m", "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}/s", f"data.path={demo_data}",
                              "optim.lr=" + ",".join(f"{i + 1}e-6" for i in range(n))], cwd=ROOT, timeout=100)
    err = p.err_lines
    assert p.code == 2 and len(err) == 1 and f"has {n} points" in err[0] and "MaxArraySize" in err[0], p.err
    assert not (tmp_path / "s" / "0").exists() and not (tmp_path / "s" / ".submitit").exists()


def _write_threads(out: str) -> None:
    import torch

    Path(out).write_text(str(torch.get_num_threads()))


def test_local_ranks_take_their_threads_from_the_cpus_this_process_may_use(tmp_path):
    """A local launch inside a Slurm allocation's cpuset (or under taskset): os.cpu_count() is the node's, so 4 ranks
    of an 8-CPU allocation on a 128-core node each started 32 threads. Here one CPU allowed: one thread."""
    from hpctrain.runtime.spawn import spawn

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")

    def main(argv):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        spawn(1, _write_threads, (str(tmp_path / "threads"),))

    ran = run_forked(main, [], cwd=tmp_path)
    assert ran.code == 0, ran.err
    assert (tmp_path / "threads").read_text() == "1"
