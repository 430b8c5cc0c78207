"""MLflow and W&B trackers (`logging.trackers`) in real runs: a local MLflow SQLite store and a real `mlflow server`
read back with MlflowClient, W&B offline files read back with wandb's own reader (`wandb leet inspect --json`);
the same loss curve as metrics.jsonl, the config as params, one tracker run across a resume, alerts, a sweep's
points grouped, and bad settings refused in one line before anything is written."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from conftest import CONF_DIR, SMALL_MODEL
from helpers import one_line, records, run_forked, until

from hpctrain import cli
from hpctrain.core.config import ConfigError
from hpctrain.core.files import read_json
from hpctrain.runtime.spawn import free_port
from hpctrain.training.run import prepare, train

ALERT = "+monitor.rules.low={metric:loss,threshold:1000,when:below,for_s:0}"  # fires at the first logged step
LONG = "x" * 7000  # over MLflow's 6000-character limit on a param's value
BASE = [*SMALL_MODEL, "data.prepare_demo=false", "train.global_batch=8", "train.micro_batch=4", "train.log_every=1",
        "train.eval_every=3", "train.eval_batches=2", "train.ckpt_every=3", "optim.warmup_steps=2", "optim.lr=1e-2",
        "cluster.num_threads=1", "logging.trackers=[mlflow,wandb]"]
# One worker runs the module (make test's xdist workers): its tracked and resumed run is built once, not once per worker.
pytestmark = pytest.mark.xdist_group("trackers")


def _cfg(demo_data, *overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=[*BASE, f"data.path={demo_data}", *overrides])


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _history(client, run_id: str, key: str) -> dict[int, float]:
    """{step: value} of an MLflow metric; a step logged twice would fail here."""
    points = client.get_metric_history(run_id, key)
    steps = [p.step for p in points]
    assert len(steps) == len(set(steps)), (key, steps)
    return {p.step: p.value for p in points}


def _jsonl(run_dir, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(run_dir) if r.get(key) is not None}


def _wandb_log(path: str) -> list[dict]:
    """The records of one offline run's .wandb file, as wandb's own reader prints them."""
    p = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path], capture_output=True,
                       text=True, timeout=60, check=True)
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def _wandb(run_dir) -> dict:
    """Every offline attempt of a run dir, merged in order: run ids, history by step, config, summary, group."""
    out = {"ids": [], "history": {}, "config": {}, "summary": {}, "groups": set()}
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        for rec in _wandb_log(path):
            kind, body = rec["type"], rec.get(rec["type"], {})
            if kind == "run":
                out["ids"].append(body["run_id"])
                out["groups"].add(body.get("run_group"))
                out["config"].update(body.get("config", {}).get("update", {}))
            elif kind == "config":
                out["config"].update(body.get("update", {}))
            elif kind == "summary":
                out["summary"].update(body.get("update", {}))
            elif kind == "history":
                out["history"].setdefault(body["step"]["num"], {}).update(body["item"])
    return out


def _curve(history: dict, key: str) -> dict[int, float]:
    return {step: row[key] for step, row in history.items() if key in row}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, demo_data):
    """A run of 3 steps with both trackers and an alert rule, then the same run dir resumed to 6 steps."""
    cwd = tmp_path_factory.mktemp("trackers")
    run = cwd / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default store: <run_dir>/mlflow
        mp.chdir(cwd)  # nothing may land in the working directory (MLflow's own default store is ./mlflow.db)
        assert train(_cfg(demo_data, "train.max_steps=3", ALERT, f"+cluster.sbatch_extra.comment={LONG}"),
                     str(run))["status"] == "completed"
        first = read_json(run / "trackers.json")
        assert train(_cfg(demo_data, "train.max_steps=6", ALERT, f"+cluster.sbatch_extra.comment={LONG}"),
                     str(run))["status"] == "completed"
        assert os.listdir(cwd) == ["run"]
    client = _client(f"sqlite:///{run}/mlflow/mlflow.db")
    return run, first, client, client.get_run(first["mlflow"]["run_id"]), _wandb(run)


@pytest.mark.slow
def test_both_trackers_hold_the_loss_curve_of_metrics_jsonl(resumed):
    run, ids, client, _, wb = resumed
    for key, name in (("loss", "train/loss"), ("grad_norm", "train/grad_norm"), ("val_loss", "val/loss")):
        want = _jsonl(run, key)
        assert sorted(want) == ([1, 2, 3, 4, 5, 6] if key != "val_loss" else [3, 6])
        mlflow_curve = _history(client, ids["mlflow"]["run_id"], name)
        wandb_curve = _curve(wb["history"], name)
        assert sorted(mlflow_curve) == sorted(wandb_curve) == sorted(want), name
        for step, value in want.items():
            assert mlflow_curve[step] == pytest.approx(value, rel=1e-6) == wandb_curve[step], (name, step)


@pytest.mark.slow
def test_the_resolved_config_is_logged(resumed):
    """MLflow: flattened params, a value over MLflow's limit cut to it; a key changed on resume (max_steps) is a
    `resumed.` tag, since MLflow refuses to change a param. W&B: the nested config, its latest values."""
    run, _, _, mlrun, wb = resumed
    params, tags = mlrun.data.params, mlrun.data.tags
    assert params["model.dim"] == "64" and params["optim.lr"] == "0.01" and params["run_dir"] == str(run)
    assert params["logging.trackers"] == '["mlflow", "wandb"]' and params["train.max_steps"] == "3"
    assert tags["resumed.train.max_steps"] == "6"
    comment = params["cluster.sbatch_extra.comment"]
    assert len(comment) == 6000 and comment.endswith("...") and LONG.startswith(comment[:-3])
    assert wb["config"]["model"]["dim"] == 64 and wb["config"]["train"]["max_steps"] == 6
    assert wb["config"]["cluster"]["sbatch_extra"]["comment"] == LONG


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_tracker_runs(resumed):
    run, first, client, mlrun, wb = resumed
    assert read_json(run / "trackers.json") == first  # the ids of the first attempt, kept
    exp = client.get_experiment_by_name("hpctrain")  # a single run: the default experiment
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [first["mlflow"]["run_id"]]
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags["hpctrain.run_dir"] == str(run)
    assert wb["ids"] == [first["wandb"]["id"]] * 2  # two offline attempts of one W&B run
    assert wb["groups"] <= {"", None}  # not a sweep: no group


@pytest.mark.slow
def test_alerts_reach_every_tracker(resumed):
    """`low` fires at the first logged step, once: the resumed attempt finds it firing at its checkpoint (in
    alerts.jsonl) and does not fire it, or page, again; the rules this CPU run cannot measure are reported as
    inactive."""
    run, ids, client, mlrun, wb = resumed
    events = [json.loads(line) for line in (run / "alerts.jsonl").read_text().splitlines()]
    fired = [(e["event"], e["step"]) for e in events if e["rule"] == "low"]
    assert fired == [("firing", 1)]
    assert _history(client, ids["mlflow"]["run_id"], "alert/low") == {1: 1.0}
    assert mlrun.data.tags["alert_state/low"].startswith("firing at step 1: loss")
    assert mlrun.data.tags["alert_state/gpu_utilization"].startswith("inactive: gpu_utilization")
    assert _curve(wb["history"], "alert/low") == {1: 1}
    assert wb["summary"]["alert_state/low"].startswith("firing at step 1")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_mlflow_server_gets_the_run(demo_data, tmp_path):
    """A real `mlflow server` on a free localhost port; the run logs to it over HTTP."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
             "--default-artifact-root", str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            # no server-side job runner: MLflow 3 starts seven huey consumers for it, each importing mlflow
            # whole (this test took 26.4 core-s with them, ~15 without, measured), and a run logging over HTTP
            # needs none
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        until("the MLflow server to answer", lambda: _answers(f"{url}/health") or server.poll() is not None, 120)
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        run = tmp_path / "run"
        train(_cfg(demo_data, "train.max_steps=3", "logging.trackers=[mlflow]",
                   f"logging.mlflow_tracking_uri={url}"), str(run))
        ids = read_json(run / "trackers.json")
        assert ids["mlflow"]["tracking_uri"] == url and not (run / "mlflow").exists()
        client = _client(url)
        assert _history(client, ids["mlflow"]["run_id"], "train/loss") == pytest.approx(_jsonl(run, "loss"))
        assert client.get_run(ids["mlflow"]["run_id"]).data.params["train.max_steps"] == "3"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server's own group: its workers too
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.slow
def test_sweep_points_share_an_experiment_and_a_group(demo_data, tmp_path):
    """A real multirun (`-m`, two points): one MLflow store and experiment in the sweep dir, one W&B group."""
    sweep = tmp_path / "sweep"
    ran = run_forked(cli.main, ["-m", f"hydra.sweep.dir={sweep}", f"data.path={demo_data}", *BASE,
                                "train.max_steps=2", "train.eval_every=0", "optim.lr=1e-2,2e-2"], tmp_path,
                     env={"MLFLOW_TRACKING_URI": None}, timeout=240)
    assert ran.code == 0, ran.err[-3000:]
    client = _client(f"sqlite:///{sweep}/mlflow/mlflow.db")
    exp = client.get_experiment_by_name(str(sweep))
    runs = {r.data.tags["hpctrain.run_dir"]: r for r in client.search_runs([exp.experiment_id])}
    assert sorted(runs) == [str(sweep / "0"), str(sweep / "1")]
    assert {r.data.params["optim.lr"] for r in runs.values()} == {"0.01", "0.02"}
    for point in ("0", "1"):
        assert runs[str(sweep / point)].data.tags["hpctrain.sweep"] == str(sweep)
        assert _history(client, read_json(sweep / point / "trackers.json")["mlflow"]["run_id"], "train/loss") == \
            pytest.approx(_jsonl(sweep / point, "loss"))
        assert _wandb(sweep / point)["groups"] == {str(sweep)}


@pytest.mark.parametrize("overrides, blocked, words", [
    (["logging.mlflow_tracking_uri=localhost:5000"], None,
     ["logging.mlflow_tracking_uri='localhost:5000'", "http://HOST:PORT"]),
    (["logging.mlflow_tracking_uri='http://:5000'"], None, ["is not a tracking URI"]),
    (["logging.mlflow_experiment=''"], None, ["logging.mlflow_experiment=''", "experiment name"]),
    (["logging.wandb_project=team/llm"], None, ["logging.wandb_project='team/llm'", "W&B project name"]),
    (["logging.wandb_mode=online"], None, ["logging.wandb_mode=online", "wandb login", "wandb sync"]),
    (["logging.trackers=[mlflow]"], "mlflow", ["mlflow package is not installed", "pip install mlflow-skinny"]),
    (["logging.trackers=[wandb]"], "wandb", ["wandb package is not installed", "pip install wandb"]),
    (["logging.trackers=[mlflow]"], "sqlalchemy", ["SQLite MLflow store", "pip install sqlalchemy alembic"]),
])
def test_bad_tracker_settings_are_one_line(demo_data, tmp_path, monkeypatch, overrides, blocked, words):
    """Checked by prepare(), before anything is spawned or written. No W&B login: no WANDB_API_KEY, an empty
    netrc. A package is made missing the way Python blocks an import (None in sys.modules)."""
    if blocked:
        monkeypatch.setitem(sys.modules, blocked, None)
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ConfigError) as e:
        prepare(_cfg(demo_data, *overrides))
    one_line(e, *words)
    assert os.listdir(tmp_path) == ["netrc"]


@pytest.mark.parametrize("override, words", [
    ("logging.wandb_project='team:llm'", ["logging.wandb_project='team:llm'", "W&B project name"]),
    ("logging.wandb_mode=sometimes", ["logging.wandb_mode", "offline", "online"]),  # Hydra's own check of the enum
])
def test_the_cli_refuses_bad_tracker_settings_before_making_the_run_dir(demo_data, tmp_path, override, words):
    ran = run_forked(cli.main, [f"run_dir={tmp_path}/run", f"data.path={demo_data}", *BASE, override], tmp_path)
    assert ran.code == 2 and len(ran.err_lines) == 1, ran.err
    one_line(ran.err_lines[0].removeprefix("hpctrain: error: "), *words)
    assert not (tmp_path / "run").exists()
