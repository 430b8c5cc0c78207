"""Shared fixtures: one small real shard set per session, a composer for small, fast run configs, and the
gate of the tests that need a Slurm cluster."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
import time

import pytest
import torch
import torch.distributed.pipelining  # noqa: F401  (imported once here: each forked pipeline rank took ~0.5 core-s)

from hpctrain.runs.compose import register

CONF_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "conf")

# A model small enough that a step takes milliseconds on 2 cores, on 64-token blocks.
SMALL_MODEL = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=176",
    "model.vocab_size=512", "model.max_seq_len=64",
]

# The session's shard set (data_prep.demo): 512-token vocabulary, 64-token blocks, many small shards.
DEMO_KW = dict(max_bytes=400_000, vocab_size=512, seq_len=64, shard_mb=0.05)

torch.set_num_threads(min(2, os.cpu_count() or 1))
register()
# Never the user's bad-node list (cluster.bad_nodes): one of the session's for what captures the environment at import
# (a module's sbatch environment), each test's own beside it (below).
_SESSION_BAD_NODES = tempfile.mkdtemp(prefix="hpctrain-bad-nodes-")
os.environ["HPCTRAIN_BAD_NODES"] = os.path.join(_SESSION_BAD_NODES, "bad_nodes.json")

# Removed when this process ends (each session left one folder in /tmp), and by this process only: a forked child
# inherits the handler (the tests' forks end with os._exit, which runs none; the pid check does not rely on that).
@atexit.register
def _remove_session_bad_nodes(pid: int = os.getpid()) -> None:
    if os.getpid() == pid:
        shutil.rmtree(_SESSION_BAD_NODES, ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_bad_node_list(tmp_path_factory, monkeypatch):
    """Each test its own bad-node list (cluster.bad_nodes), never the user's: a node one test records (a killed
    rank's) must not be left out of the next test's jobs. Jobs and ranks inherit it from the environment."""
    monkeypatch.setenv("HPCTRAIN_BAD_NODES", str(tmp_path_factory.mktemp("bad-nodes") / "bad_nodes.json"))


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> str:
    from data_prep.demo import build_demo

    out = str(tmp_path_factory.mktemp("shards"))
    build_demo(out, **DEMO_KW)
    return out


# Each composition of the same overrides, made once per worker: a compose takes ~0.11 core-s, a copy ~0.005 (the
# suite asked for 662, 60 of them again: 85 -> 79 core-s measured).
_COMPOSED: dict = {}


@pytest.fixture
def make_cfg(demo_data):
    """Compose the real Hydra config with the small model and data, plus `overrides` (a config of its own for each
    call: the caller may change it)."""
    import copy

    from hydra import compose, initialize_config_dir

    def make(*overrides: str, small_model: bool = True):
        base = (SMALL_MODEL if small_model else []) + [
            f"data.path={demo_data}", "data.prepare_demo=false", "train.global_batch=8",
            "train.micro_batch=4", "train.max_steps=6", "train.log_every=1", "train.eval_every=3",
            "train.eval_batches=2", "train.ckpt_every=3", "optim.warmup_steps=2", "optim.lr=1e-2",
        ]
        key = (*base, *overrides)
        if key not in _COMPOSED:
            with initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3"):
                _COMPOSED[key] = compose(config_name="config", overrides=list(key))
        return copy.deepcopy(_COMPOSED[key])

    return make


def _slurm_missing() -> str | None:
    """Why no Slurm job can run here, or None when a cluster answers with usable nodes."""
    if not shutil.which("sbatch") or not shutil.which("srun"):
        return "no Slurm client (sbatch/srun) on PATH"
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if p.returncode != 0 or not any(s in p.stdout for s in ("idle", "mix")):
        return f"no available Slurm nodes ({(p.stderr or p.stdout).strip()[:100]}): run `make slurm-up`"
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """A test that needs the cluster (the `slurm` fixture) is a `slurm` test: -m "not slurm" leaves it out. Under
    `make test`'s workers (pytest-xdist, --dist loadgroup) the Slurm tests run one at a time on one worker: they
    share the cluster's three nodes, and one of them takes a node down."""
    for item in items:
        if "slurm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
            item.add_marker(pytest.mark.xdist_group("slurm"))
    # The Slurm tests first: their worker spends most of their ~6 minutes waiting on the cluster, while the others
    # run the rest beside it (sent last, they were the suite's tail).
    items.sort(key=lambda item: "slurm" not in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def slurm():
    """Tests on a real cluster (`make slurm-up`) skip without one; with HPCTRAIN_REQUIRE_SLURM=1 (CI, after
    `make slurm-up`) a missing cluster is a failure instead."""
    why = _slurm_missing()
    if why:
        if os.environ.get("HPCTRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(f"HPCTRAIN_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)


@pytest.fixture
def slurm_jobs():
    """Append the ids of the jobs a test submits: they are cancelled after it, whatever happened."""
    ids: list[str] = []
    yield ids
    for job in ids:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)


class _InCgroup(list):
    """An argv prefix that runs a command inside a cgroup, and that cgroup's directory (`group`)."""

    group: object


@pytest.fixture
def cgroup():
    """cgroup(controller, below="", **files) -> an argv prefix that runs a command inside a new cgroup (v1's
    `controller`) with those files written (e.g. cpu.cfs_quota_us=...); `below`: in a group of that name under the
    limited one (as Slurm puts a task's group under its job's and step's). Root and cgroup v1 only, else the test
    skips. Every group is removed at the end, whatever is left in it killed first."""
    import signal
    from pathlib import Path

    made = []

    def make(controller: str, below: str = "", **files: str) -> list[str]:
        base = Path("/sys/fs/cgroup") / controller
        if os.geteuid() != 0 or not (base / "cgroup.procs").exists() or not os.access(base, os.W_OK):
            pytest.skip(f"needs root and cgroup v1's {controller} controller")
        group = base / f"hpctrain-test-{os.getpid()}-{len(made)}"
        group.mkdir()
        made.append(group)
        for name, value in files.items():
            (group / name).write_text(value)
        if below:
            group = group / below
            group.mkdir()
            made.append(group)
        inside = _InCgroup(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"])
        inside.group = group
        return inside

    yield make
    failed = []
    for group in reversed(made):  # children first
        for _ in range(100):
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:  # (a command the test gave up on: its ranks, its loader's workers)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        try:
            group.rmdir()
        except OSError as e:
            failed.append(f"{group}: {e}")
    assert not failed, failed


@pytest.fixture
def half_a_core(cgroup):
    """The argv prefix of a cgroup with a CPU quota of half a core (a container's --cpus=0.5), on a machine with at
    least 2 CPUs (so that the quota is what lowers the count)."""
    from pathlib import Path

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    return cgroup("cpu", **{"cpu.cfs_quota_us": str(int(period.read_text()) // 2 if period.exists() else 50000)})
