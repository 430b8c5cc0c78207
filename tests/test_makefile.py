"""The Makefile passes user strings to the shell literally: real `make` runs on a tiny corpus.

Every user variable reaches the shell as one literal word (list variables: one literal word per item), so a
quote, a space, $( ), backticks, $(shell ...) or a newline in a value is just text. The sbatch scripts that
the targets drive get the same checks without Slurm: a stand-in `sbatch` / `srun` on PATH records its argv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")

# Variables of the Makefile (and of make itself) that must not leak in from the environment of the test run;
# an outer `make test` passes its command-line variables down in MAKEFLAGS.
_MAKE_VARS = {"CORPUS", "OUT", "TOKENIZER", "VOCAB", "SEQ_LEN", "WORKERS", "SHARD_MB", "TEXT_FIELD", "PREP_ARGS",
              "PREP_SBATCH_ARGS", "DEMO_DIR", "DEMO_STEPS", "PYTEST_ARGS", "TEST_WORKERS", "PYTHON", "VENV", "PY", "MFLAGS",
              "GNUMAKEFLAGS"}
FAST = ["SEQ_LEN=32", "SHARD_MB=0.05", "WORKERS=1"]

# {m} is the marker file an injected command would create.
PAYLOADS = {
    "quote": "x'; touch {m}; echo '",
    "dollar-paren": "$(touch {m})",
    "backticks": "`touch {m}`",
    "make-shell": "$(shell touch {m})",
    "newline": "x\ntouch {m} #",
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _MAKE_VARS and not k.startswith(("MAKE", "SLURM_"))}
    return {**env, **extra}


def _make(*args: str, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(REPO), *args], env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def _payload(name: str, marker: Path) -> str:
    return PAYLOADS[name].format(m=marker)


def _recorder(bin_dir: Path, name: str) -> Path:
    """An executable `name` in bin_dir that writes its argv (NUL-separated) to bin_dir/call-<n>, n = 1, 2, ...
    and prints `<n>4242;cluster` (what `sbatch --parsable` prints)."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text('#!/bin/bash\nd=$(dirname "$0")\nn=$(( $(cat "$d/n" 2>/dev/null || echo 0) + 1 ))\n'
                   'echo "$n" > "$d/n"\nprintf \'%s\\0\' "$@" > "$d/call-$n"\necho "${n}4242;cluster"\n')
    exe.chmod(0o755)
    return exe


def _calls(bin_dir: Path) -> list[list[str]]:
    n = int((bin_dir / "n").read_text()) if (bin_dir / "n").exists() else 0
    return [(bin_dir / f"call-{i}").read_text().split("\0")[:-1] for i in range(1, n + 1)]


@pytest.fixture(scope="module", autouse=True)
def _installed():
    """The targets depend on `install`: run them only where it is a no-op (CI: `make test` installed first)."""
    p = _make("--eval", "print-stamp: ; @echo $(STAMP)", "print-stamp")
    stamp = p.stdout.strip()
    if p.returncode or _make("-q", stamp).returncode:
        pytest.skip(f"`make install` is not up to date ({stamp}): run it first")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Four small text files, one in a subdirectory: the glob `**/*.txt` matches all four only when Python
    (recursive glob) expands it; a shell would expand ** like * and find just the nested one."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "sub").mkdir()
    for i, rel in enumerate(["a.txt", "b.txt", "c.txt", "sub/d.txt"]):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}\n" for j in range(150))
        (root / rel).write_text(body)
    return f"{root}/**/*.txt"


@pytest.fixture(scope="module")
def tok(tmp_path_factory, corpus) -> Path:
    """`make tokenizer` into a directory whose name has a space and a quote."""
    out = tmp_path_factory.mktemp("tok") / "tok 'q"
    p = _make("tokenizer", f"CORPUS={corpus}", "VOCAB=300", f"OUT={out}")
    assert p.returncode == 0, p.stdout + p.stderr
    return out


def test_tokenizer_out_with_quote_and_space(tok):
    assert (tok / "tokenizer.json").is_file()
    assert sorted(p.name for p in tok.parent.iterdir()) == ["tok 'q"]


def test_shards_out_with_quote_is_one_literal_path(corpus, tmp_path):
    out = tmp_path / "bob's shards"
    p = _make("shards", f"CORPUS={corpus}", f"OUT={out}", "VOCAB=300", *FAST)
    assert p.returncode == 0, p.stdout + p.stderr
    assert os.listdir(tmp_path) == ["bob's shards"]
    manifest = json.loads((out / "manifest.json").read_text())
    # The glob reached Python unexpanded: it is recorded as given and matched all four files.
    assert [(s["corpus"], s["files"]) for s in manifest["sources"]] == [([corpus], 4)]


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("target", ["shards", "tokenizer"])
def test_injection_in_out_is_a_literal_directory(corpus, tok, tmp_path, target, payload):
    marker = tmp_path / "pwned"
    out = tmp_path / "out" / _payload(payload, marker)
    args = [f"TOKENIZER={tok}", *FAST] if target == "shards" else ["VOCAB=300"]
    p = _make(target, f"CORPUS={corpus}", f"OUT={out}", *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not marker.exists()
    assert (out / ("manifest.json" if target == "shards" else "tokenizer.json")).is_file()


@pytest.mark.parametrize("payload", PAYLOADS)
def test_injection_in_text_field_is_literal(corpus, tok, tmp_path, payload):
    """Text files ignore the jsonl field name, so the build succeeds and records the value as given."""
    marker, out = tmp_path / "pwned", tmp_path / "out"
    p = _make("shards", f"CORPUS={corpus}", f"OUT={out}", f"TOKENIZER={tok}", f"TEXT_FIELD={_payload(payload, marker)}",
              *FAST)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not marker.exists()
    settings = json.loads((out / "manifest.json").read_text())["created_by"]["settings"]
    assert settings["text_field"] == _payload(payload, marker)


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("var", ["TOKENIZER", "CORPUS", "PREP_ARGS", "VOCAB", "SEQ_LEN", "SHARD_MB", "WORKERS"])
def test_injection_elsewhere_fails_cleanly(corpus, tmp_path, var, payload):
    """Nonsense reaches the tool as text and is refused with a one-line error; nothing runs."""
    marker = tmp_path / "pwned"
    value = _payload(payload, marker)
    if var == "CORPUS":
        value = f"{corpus} {value}"
    p = _make("shards", f"CORPUS={corpus}", f"OUT={tmp_path / 'out'}", *FAST, f"{var}={value}")
    assert p.returncode == 2, p.stdout + p.stderr
    assert not marker.exists()
    assert "Traceback" not in p.stderr and "error" in p.stderr


def test_usage_check_does_not_evaluate_values(tmp_path):
    marker = tmp_path / "pwned"
    for corpus in ("", "  "):
        p = _make("shards", f"CORPUS={corpus}", f"OUT={_payload('backticks', marker)}")
        assert p.returncode == 2 and "usage: make shards" in p.stderr, p.stdout + p.stderr
    assert not marker.exists()


def test_shards_slurm_passes_every_word_literally(corpus, tok, tmp_path):
    """Submit mode of sbatch/preprocess.sbatch through make: PREP_SBATCH_ARGS is split into words, never
    glob-expanded (`*` would match files in the repository) nor evaluated."""
    marker = tmp_path / "pwned"
    bin_dir = tmp_path / "bin"
    _recorder(bin_dir, "sbatch")
    out = tmp_path / "bob's shards"
    sbatch_args = f"--array=0-3 --comment=* --comment=$(touch {marker}) --comment=x';touch {marker};'"
    p = _make("shards-slurm", f"CORPUS={corpus} {corpus}", f"OUT={out}", f"TOKENIZER={tok}",
              f"PREP_ARGS=--val-fraction 0.1 `touch {marker}`", f"PREP_SBATCH_ARGS={sbatch_args}",
              env=_env(PATH=f"{bin_dir}:{os.environ['PATH']}"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "array 14242 and merge job 24242" in p.stdout
    assert not marker.exists()
    script_args = ["sbatch/preprocess.sbatch", "--corpus", corpus, corpus, "--out", str(out), "--tokenizer", str(tok),
                   "--seq-len", "2048", "--shard-mb", "64", "--text-field", "text", "--val-fraction", "0.1",
                   "`touch", f"{marker}`"]
    array, merge = _calls(bin_dir)
    assert array == ["--parsable", *sbatch_args.split(), *script_args]
    assert merge[:len(sbatch_args.split()) + 1] == ["--parsable", *sbatch_args.split()]
    assert merge[-len(script_args):] == script_args


def test_pytest_args_reach_pytest_unevaluated(tmp_path):
    """`make test` with PY replaced by a recorder (running the suite from inside it would recurse): PYTEST_ARGS
    arrives whole in PYTEST_ADDOPTS, which pytest splits like a shell (`-m "not slurm"` is two words) but
    never evaluates."""
    import shlex

    marker = tmp_path / "pwned"
    bin_dir = tmp_path / "bin"
    py = _recorder(bin_dir, "python")
    py.write_text(py.read_text().replace("#!/bin/bash\n", '#!/bin/bash\nprintf %s "$PYTEST_ADDOPTS" > "$(dirname "$0")/addopts"\n'))
    args = f"-k resume -m \"not slurm\" * $(touch {marker}) x';touch {marker};'"
    p = _make("test", f"PY={py}", f"PYTEST_ARGS={args}")
    assert p.returncode == 0, p.stdout + p.stderr
    assert not marker.exists()
    assert _calls(bin_dir) == [["-m", "pytest", "-q", "-n", _default_workers(), "--dist", "loadgroup"]]
    assert (bin_dir / "addopts").read_text() == args
    assert shlex.split(args)[:4] == ["-k", "resume", "-m", "not slurm"]


def _default_workers(cores: int | None = None) -> str:
    """What `make test` should pass to -n: a worker per usable core and one more, at most 9."""
    from hpctrain.core.host import usable_cpus

    return str(min((cores or usable_cpus()) + 1, 9))


def _test_workers(bin_dir: Path, *prefix: str, env: dict[str, str] | None = None) -> str:
    """The -n that `make test` passes (PY replaced by a recorder), run under `prefix` (a shell command's words)."""
    py = _recorder(bin_dir, "python")
    p = subprocess.run([*prefix, "make", "-s", "-C", str(REPO), "test", f"PY={py}"], env=env or _env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    (call,) = _calls(bin_dir)
    return call[call.index("-n") + 1]


def test_make_test_runs_a_worker_per_core_and_one_more(tmp_path):
    """Not OMP_NUM_THREADS (which `nproc` would print, and clusters often set to 1); TEST_WORKERS still wins."""
    assert _test_workers(tmp_path / "a", env=_env(OMP_NUM_THREADS="1")) == _default_workers()
    assert _test_workers(tmp_path / "b", env=_env(TEST_WORKERS="5")) == "5"


def test_make_test_counts_the_cores_of_a_cpu_quota(tmp_path, half_a_core):
    """In a cgroup with a CPU quota (a container's --cpus), the cores are the quota's, not the machine's: half a core
    runs 2 workers. A real cgroup (conftest's `half_a_core`)."""
    assert _test_workers(tmp_path, *half_a_core) == _default_workers(1) == "2"


@pytest.mark.parametrize("run_dir, path", [
    ("run_dir=\"bob's $(touch {m}) runs\"", "bob's $(touch {m}) runs"),  # Hydra quoting: the quotes go
    ("run_dir=my runs", "my runs"),
])
def test_train_sbatch_run_dir_with_space_and_quote(tmp_path, run_dir, path):
    """sbatch/train.sbatch outside Slurm (its environment variables set by hand, `srun` recorded): the log
    goes into the run dir Hydra will use, and srun gets the arguments unchanged."""
    marker = tmp_path / "pwned"
    run_dir, path = run_dir.format(m=marker), path.format(m=marker)
    bin_dir = tmp_path / "bin"
    _recorder(bin_dir, "srun")
    submit = tmp_path / "submit"
    submit.mkdir()
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(submit),
               PYTHON=sys.executable)
    p = subprocess.run(["bash", str(REPO / "sbatch" / "train.sbatch"), run_dir, f"x=`touch {marker}`"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not marker.exists()
    assert os.listdir(submit) == [path.split("/")[0]]
    log = submit / path / "slurm-7.out"
    assert f"run_dir={path}" in log.read_text()
    # (one rank that dies ends the step at once: --kill-on-bad-exit)
    assert _calls(bin_dir) == [["--kill-on-bad-exit=1", sys.executable, "-m", "hpctrain", run_dir,
                                f"x=`touch {marker}`"]]


def test_make_tests_workers_keep_a_group_on_one_worker(tmp_path):
    """`make test` runs pytest-xdist with --dist loadgroup, and tests/conftest.py puts every test that needs the Slurm
    cluster in one xdist group, added at collection: the group must run on one worker, one test at a time (they share
    the cluster's nodes, and one takes a node down). pytest 9.2 with pytest-xdist 3.8 silently dropped the grouping
    (pytest-dev/pytest-xdist#1386): two Slurm tests then ran at once and one saw its job requeued by the other's node
    failure."""
    (tmp_path / "conftest.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef shared():\n    return None\n\n"
        "@pytest.hookimpl(tryfirst=True)\ndef pytest_collection_modifyitems(items):\n"
        "    for item in items:\n        if 'shared' in item.fixturenames:\n"
        "            item.add_marker(pytest.mark.xdist_group('shared'))\n")
    tests = "".join(f"def test_{i}(shared):\n    time.sleep(0.2)\n    record()\n\n" for i in range(4))
    (tmp_path / "test_grouped.py").write_text(
        "import os, time\n\ndef record():\n    with open('workers.txt', 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n\n" + tests
        + "".join(f"def test_free_{i}():\n    time.sleep(0.2)\n\n" for i in range(4)))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})
    assert p.returncode == 0, p.stdout + p.stderr
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 4 and len(set(workers)) == 1, workers
