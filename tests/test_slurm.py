"""Jobs on a real Slurm cluster (`make slurm-up` starts a local one: several slurmd nodes on this machine).

Skipped when no cluster answers; with HPCTRAIN_REQUIRE_SLURM=1 (CI, after `make slurm-up`) a missing
cluster is a failure instead.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import SMALL_MODEL

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def _cluster_up() -> str | None:
    if not shutil.which("sbatch"):
        return "no Slurm client (sbatch) on PATH"
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if p.returncode != 0 or "idle" not in p.stdout:
        return f"no idle Slurm nodes ({(p.stderr or p.stdout).strip()[:100]}): run `make slurm-up`"
    return None


@pytest.fixture(scope="module")
def slurm():
    why = _cluster_up()
    if why:
        if os.environ.get("HPCTRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(f"HPCTRAIN_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)


def _sbatch_wait(args: list[str], cwd: str, timeout: int = 240) -> None:
    p = subprocess.run(["sbatch", "--wait", "--parsable", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"sbatch failed: {p.stdout}{p.stderr}"


def _read(path) -> str:
    with open(path) as f:
        return f.read()


def _losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.timeout(300)
def test_two_node_job_equals_one_process(slurm, make_cfg, demo_data, tmp_path):
    from hpctrain.train import train

    common = ["train.max_steps=3", "train.eval_every=0", "data.lanes=2", "cluster.num_threads=1",
              "optim.lr=1e-2", "optim.warmup_steps=2"]
    train(make_cfg(*common), str(tmp_path / "ref"))
    run = tmp_path / "job"
    cmd = " ".join([sys.executable, "-m", "hpctrain", f"run_dir={run}", f"data.path={demo_data}",
                    "data.prepare_demo=false", *SMALL_MODEL, "train.global_batch=8", "train.micro_batch=4",
                    "train.log_every=1", "parallel=ddp", "cluster.pg_timeout_s=60", *common])
    _sbatch_wait(["-N2", "--ntasks-per-node=1", "--cpus-per-task=1", "-o", str(tmp_path / "slurm-%j.out"),
                  "--wrap", f"srun {cmd}"], cwd=ROOT)
    ref, got = _losses(tmp_path / "ref"), _losses(run)
    assert sorted(got) == [1, 2, 3], _read(glob.glob(str(tmp_path / "slurm-*.out"))[0])
    assert json.loads(_read(run / "result.json"))["world"] == 2
    for s in ref:
        assert abs(ref[s] - got[s]) <= 1e-5, (s, ref[s], got[s])


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
    # Wait for the merge job (it starts only after every array task succeeded).
    subprocess.run(["bash", "-c", f"while squeue -h -j {merge_id} 2>/dev/null | grep -q .; do sleep 0.5; done"],
                   timeout=240, check=True)
    state = subprocess.run(["sacct", "-n", "-X", "-j", merge_id, "-o", "state"], capture_output=True,
                           text=True).stdout.split()
    logs = "".join(_read(f) for f in glob.glob(str(tmp_path / "prep-*.out")))
    assert state and state[0] == "COMPLETED", (state, logs)
    assert _tree_digest(out) == _tree_digest(tmp_path / "local"), logs
