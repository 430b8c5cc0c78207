"""`python -m hpctrain.launch.sweep report`: on a real 2x2 local multirun of tiny training runs."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import warnings

import pytest
from conftest import SMALL_MODEL
from helpers import run_forked

from hpctrain import cli
from hpctrain.launch.sweep import main, report

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
COMBOS = ["optim.lr=0.01 train.global_batch=8", "optim.lr=0.01 train.global_batch=16",
          "optim.lr=0.003 train.global_batch=8", "optim.lr=0.003 train.global_batch=16"]
# One worker runs the module (make test's xdist workers): its real sweep is built once, not once per worker.
pytestmark = pytest.mark.xdist_group("sweep")


@pytest.fixture(scope="module")
def sweep(demo_data, tmp_path_factory) -> str:
    """One real multirun, shared: tests that change it work on a copy."""
    out = str(tmp_path_factory.mktemp("sweep") / "multirun")
    # Outside Slurm on purpose: a SLURM_JOB_ID inherited from a batch job would make runs look like Slurm jobs.
    env = {k: None for k in os.environ if k.startswith("SLURM_")}
    argv = ["-m", "optim.lr=1e-2,3e-3", "train.global_batch=8,16", f"hydra.sweep.dir={out}", f"data.path={demo_data}",
            "data.prepare_demo=false", "train.micro_batch=4", "train.max_steps=4", "train.log_every=1",
            "train.eval_every=4", "train.eval_batches=2", "train.ckpt_every=0", "optim.warmup_steps=2",
            "cluster.num_threads=1", *SMALL_MODEL]
    ran = run_forked(cli.main, argv, ROOT, env=env, timeout=240)
    assert ran.code == 0, ran.err[-3000:]
    return out


@pytest.fixture
def sweep_copy(sweep, tmp_path) -> str:
    dst = str(tmp_path / "multirun")
    shutil.copytree(sweep, dst, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    return dst


@pytest.mark.timeout(300)
def test_report_of_real_sweep(sweep, tmp_path, capsys):
    rows = report(sweep)
    assert [r["job"] for r in rows] == [0, 1, 2, 3]
    # Job numbers follow the cartesian product in command-line order; values as Hydra typed them.
    assert [" ".join(r["overrides"]) for r in rows] == COMBOS
    for r in rows:
        with open(os.path.join(sweep, str(r["job"]), "result.json")) as f:
            result = json.load(f)
        assert r["status"] == "completed"
        assert r["final_loss"] == result["final_loss"] and r["final_val_loss"] == result["final_val_loss"]
        assert r["steps"] == 4 and r["wall_time_s"] == result["wall_time_s"]
        assert r["tokens_per_s"] > 0 and [s for s, _ in r["curve"]] == [1, 2, 3, 4]
    assert {(r["params"]["optim.lr"], r["params"]["train.global_batch"]) for r in rows} == \
        {(0.01, 8), (0.01, 16), (0.003, 8), (0.003, 16)}

    png = str(tmp_path / "report.png")
    assert main(["report", sweep, "--plot", png, "--sort", "loss"]) == 0
    out = capsys.readouterr().out
    for combo in COMBOS:
        assert combo in out
    best = min(rows, key=lambda r: r["final_val_loss"])
    assert "4 points: 4 completed" in out and f"best: job {best['job']} " in out
    assert out.splitlines()[1].split()[0] == str(best["job"])  # --sort loss: best row first
    assert f"plot: {png}" in out
    with open(png, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.timeout(300)
def test_missing_point_dir_is_not_started(sweep_copy, capsys):
    shutil.rmtree(os.path.join(sweep_copy, "2"))
    rows = report(sweep_copy)
    assert len(rows) == 4  # the grid in multirun.yaml still lists it
    assert rows[2]["status"] == "not started" and rows[2]["dir"] is None
    assert " ".join(rows[2]["overrides"]) == COMBOS[2] and rows[2]["final_loss"] is None
    assert main(["report", sweep_copy]) == 0
    out = capsys.readouterr().out
    assert "3 completed, 1 not started" in out
    assert os.path.getsize(os.path.join(sweep_copy, "sweep_report.png")) > 0  # default plot path


@pytest.mark.timeout(300)
def test_point_without_result_is_not_completed(sweep_copy):
    os.remove(os.path.join(sweep_copy, "3", "result.json"))
    row = report(sweep_copy)[3]
    # No result.json and no Slurm job: a run that has logged metrics but not finished.
    assert row["status"] == "running"
    # Losses, steps and wall time then come from metrics.jsonl.
    with open(os.path.join(sweep_copy, "3", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert row["final_loss"] == [r for r in records if "loss" in r][-1]["loss"]
    assert row["final_val_loss"] == records[-1]["val_loss"]
    assert row["steps"] == 4 and row["wall_time_s"] > 0


@pytest.mark.timeout(300)
def test_report_reads_no_device_or_fifo_as_a_config(sweep_copy, capsys):
    """A point's saved config, overrides and the sweep's multirun.yaml are files of a bounded size: a FIFO (which
    would block the read forever) or /dev/zero (which would fill memory) in their place costs the report only that
    point's parameters, not a hang."""
    os.remove(os.path.join(sweep_copy, "1", ".hydra", "config.yaml"))
    os.mkfifo(os.path.join(sweep_copy, "1", ".hydra", "config.yaml"))
    os.remove(os.path.join(sweep_copy, "2", ".hydra", "overrides.yaml"))
    os.symlink("/dev/zero", os.path.join(sweep_copy, "2", ".hydra", "overrides.yaml"))
    rows = report(sweep_copy)
    assert [r["status"] for r in rows] == ["completed"] * 4
    from hpctrain.launch.sweep import _run_row

    point = [_run_row(os.path.join(sweep_copy, str(n))) for n in range(3)]
    assert point[1]["config"] is None and point[2]["all_overrides"] == [] and point[0]["config"] is not None
    os.remove(os.path.join(sweep_copy, "multirun.yaml"))
    os.symlink("/dev/zero", os.path.join(sweep_copy, "multirun.yaml"))
    # Every override of a point is then a sweep key: the plot shortens its legend and the list of keys (matplotlib
    # warned "layout not applied" over a legend wider than the figure).
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert main(["report", sweep_copy, "--plot", os.path.join(sweep_copy, "r.png")]) == 0
    assert "4 points: 4 completed" in capsys.readouterr().out


def test_report_shows_energy_per_token_and_the_bad_nodes_where_there_are_some(sweep_copy, capsys):
    """A run that measured its energy (result.json's energy, as NVML or RAPL give it) gets a J/token column; the
    sweep's bad-node list (its runs' cluster.bad_nodes) is printed under the table. Neither appears without them."""
    from hpctrain.runtime import bad_nodes

    assert main(["report", sweep_copy, "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "J/token" not in out and "bad nodes" not in out
    path = os.path.join(sweep_copy, "1", "result.json")
    with open(path) as f:
        result = json.load(f)
    with open(path, "w") as f:
        json.dump(result | {"energy": {"source": "nvml", "joules": 20.0, "kwh": 20 / 3.6e6, "joules_per_token": 0.25}},
                  f)
    bad_nodes.record(os.environ["HPCTRAIN_BAD_NODES"], ["n7"], "died", "lost its peer")
    assert main(["report", sweep_copy, "--no-plot"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "J/token" and lines[2].split()[-1] == "0.25" and lines[1].split()[-1] == "-"
    assert lines[-1].startswith("bad nodes, left out of submissions (") and lines[-1].endswith("n7 (died: lost its peer)")


@pytest.mark.timeout(300)
def test_slurm_state_from_sacct(sweep_copy, tmp_path, monkeypatch):
    # A stand-in sacct: job 100 was requeued after preemption, the never-started array task 200_2 is pending.
    fake = tmp_path / "bin" / "sacct"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncase "$*" in *"-j 100 "*) echo REQUEUED;; *"-j 200_2 "*) echo PENDING;; '
                    '*) exit 1;; esac\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    with open(os.path.join(sweep_copy, "1", "result.json")) as f:
        result = json.load(f)
    with open(os.path.join(sweep_copy, "1", "result.json"), "w") as f:
        json.dump(result | {"status": "preempted"}, f)
    with open(os.path.join(sweep_copy, "1", "slurm.json"), "w") as f:
        json.dump({"job_id": "100", "array_job_id": None, "array_task_id": None, "nodelist": "n1",
                   "restart_count": 1}, f)
    shutil.rmtree(os.path.join(sweep_copy, "2"))
    os.makedirs(os.path.join(sweep_copy, ".submitit", "200_2"))
    os.remove(os.path.join(sweep_copy, "3", "result.json"))
    with open(os.path.join(sweep_copy, "3", "slurm.json"), "w") as f:
        json.dump({"job_id": "300"}, f)  # sacct fails for it: fall back on metrics.jsonl
    rows = report(sweep_copy)
    assert [r["status"] for r in rows] == ["completed", "requeued", "pending", "running"]
    assert rows[2]["slurm_job_id"] == "200_2"


@pytest.mark.timeout(60)
def test_bad_path_is_one_line_exit_2(tmp_path):
    for path in (str(tmp_path / "missing"), str(tmp_path)):
        proc = subprocess.run([sys.executable, "-m", "hpctrain.launch.sweep", "report", path], cwd=ROOT,
                              capture_output=True, text=True, timeout=50)
        assert proc.returncode == 2
        assert proc.stderr.startswith("hpctrain report: error: ") and len(proc.stderr.strip().splitlines()) == 1
