"""A wheel built from the repository works on its own: installed into a fresh virtualenv, `python -m hpctrain`
and the `hpctrain` console script run from an empty directory with the configs the wheel carries."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

# One worker runs the module (make test's xdist workers): its wheel and virtualenv are built once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packaging")]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
SOURCES = ("pyproject.toml", "README.md", "hpctrain", "conf", "data_prep", "hydra_plugins")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A new virtualenv with only the built wheel installed; its dependencies (torch, Hydra, ...) are borrowed
    from this environment by a path entry, so nothing is downloaded. That entry's own .pth files (the editable
    install of this checkout) are not processed: `import hpctrain` can only find the wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:  # built from a copy: the build writes build/ and *.egg-info next to the sources
        if os.path.isdir(os.path.join(ROOT, name)):
            shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(tmp / "dist")], check=True, capture_output=True, timeout=240)
    (wheel,) = (tmp / "dist").iterdir()
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "borrowed_dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=120)
    empty = tmp / "empty"
    empty.mkdir()
    return venv, empty


def _run(cmd, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(600)
def test_wheel_carries_the_configs(fresh):
    venv, empty = fresh
    p = _run([venv / "bin" / "python", "-c", "import hpctrain.runs.compose as c; print(c.__file__); print(c.conf_dir())"],
             empty)
    module, conf = p.stdout.split()
    assert module.startswith(str(venv)) and conf.startswith(str(venv)), p.stdout  # the wheel, not the checkout
    p = _run([venv / "bin" / "python", "-m", "hpctrain", "--cfg", "job"], empty)
    assert p.returncode == 0, p.stderr
    assert "name: tiny" in p.stdout and "zero_stage: 0" in p.stdout
    assert not os.listdir(empty)  # --cfg makes no run directory


# `hpctrain COMMAND --help` for each command: a forked child of one interpreter per command (an interpreter each
# cost ~2 s), its exit code, stdout and stderr.
_HELPS = r"""
import json, os, sys, tempfile
from hpctrain.cli import console
results = []
for command in sys.argv[1:]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
            code = 1
            try:
                code = console([command, "--help"]) or 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            finally:
                sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0); err.seek(0)
        results.append((os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()))
print(json.dumps(results))
"""


@pytest.mark.timeout(600)
def test_console_script_has_every_command(fresh):
    venv, empty = fresh
    script = venv / "bin" / "hpctrain"
    p = _run([script, "--help"], empty)
    assert p.returncode == 0, p.stderr
    commands = ("train", "plan", "report", "preflight", "generate", "export-hf", "summary", "eval", "bench", "prep",
                "gpu-check")
    # Each command's --help through the script's own function, in one interpreter of the fresh environment.
    helps = _run([venv / "bin" / "python", "-c", _HELPS, *commands], empty)
    assert helps.returncode == 0, helps.stderr
    for command, (code, out, err) in zip(commands, json.loads(helps.stdout)):
        assert f"  {command} " in p.stdout, command
        assert code == 0 and "usage" in out.lower(), (command, out, err)
    p = _run([script, "plan", "model=llama_7b", "parallel.dp=8", "train.global_batch=64", "cluster.gpu_mem_gb=80"],
             empty)
    assert p.returncode == 0 and "6.738B parameters" in p.stdout, p.stdout + p.stderr
    p = _run([script, "trian"], empty)
    assert p.returncode == 2 and p.stderr.strip() == (
        "hpctrain: error: unknown command 'trian': use one of train, plan, preflight, check, generate, export-hf, summary, "
        "eval, report, nodes, bench, prep, gpu-check (hpctrain --help)")

