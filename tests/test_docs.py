"""The commands shown in README.md and docs/*.md, run or checked, so the docs cannot rot.

The convention for doc writers is in docs/README.md ("For doc writers"). In short: every command in a fenced
block is extracted (```bash/sh/shell: every line; ```console: the `$ ` lines, followed by their output; any other
block: lines whose first word is a program) and must be accounted for:

- `make T ...`                        -> `make -n T ...` exits 0 (the target exists, the variables parse)
- `python -m hpctrain [overrides]`   -> `python -m hpctrain plan [overrides]` exits 0 (composes and checks; no run)
  (`hpctrain train ...` alike)
- `plan ...`, `--help`, `--cfg job`  -> run as written, exit 0
- other hpctrain commands / modules  -> `COMMAND --help` / `python -m MODULE --help` exits 0
- a block marked `<!-- docs-test: needs-gpu | needs-slurm | long | illustrative -->` is only checked statically
  (make -n, find_spec, hpctrain commands and sbatch/ scripts exist); `bad-input` must exit 2 with the output shown.
Anything else fails, naming page:line.

The Python commands run in forks of one interpreter (sys.executable, cwd the repository root, HYDRA_FULL_ERROR
unset) that has imported torch, Hydra and hpctrain once: each command is still its own process with its own exit
code, output and timeout, but costs ~0.5 s instead of the ~4 s a fresh `python -m hpctrain plan` takes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# One worker runs the module: the `ran` fixture (every Python job of the docs, ~16 core-s) once, not on every worker.
pytestmark = pytest.mark.xdist_group("docs")
ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKS = {"needs-gpu", "needs-slurm", "long", "illustrative", "bad-input"}
STATIC_ONLY = MARKS - {"bad-input"}  # marks whose commands are not run
SHELL = {"bash", "sh", "shell"}
# First words that make a line of a text block a command all the same (a command cannot hide there).
PROGRAMS = {"make", "python", "python3", "hpctrain", "sbatch", "srun", "torchrun", "bash", "sh", "pip", "pip3",
            "scancel", "scontrol", "squeue", "sacct", "lfs", "tensorboard", "mlflow", "wandb"}
TIMEOUT_S = 60  # per command
MARK_RE = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Command:
    where: str  # page:line, the test id
    text: str  # as shown (continuations joined, without `$ `)
    marks: frozenset[str]
    output: tuple[str, ...] = ()  # a console block's lines shown after the command

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def env(self) -> dict[str, str]:
        """Leading NAME=value words."""
        env = {}
        for w in self.words:
            if not ENV_RE.match(w):
                break
            k, _, v = w.partition("=")
            env[k] = v
        return env

    @property
    def argv(self) -> list[str]:
        return self.words[len(self.env):]


def _is_program(word: str) -> bool:
    return word in PROGRAMS or word.startswith(".venv/bin/")


def _looks_like_command(line: str) -> bool:
    words = line.removeprefix("$ ").split()
    while words and ENV_RE.match(words[0]):
        words = words[1:]
    return line.startswith("$ ") or bool(words) and _is_program(words[0])


def parse(path: Path) -> tuple[list[Command], list[str]]:
    """Every command of a page, and its problems (an unknown mark, a fence never closed)."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").split("\n")
    commands, problems = [], []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, start = lines[i][3:].strip(), i
        m = MARK_RE.match(lines[i - 1]) if i else None
        marks = frozenset(x.strip() for x in m.group(1).split(",")) if m else frozenset()
        problems += [f"{page}:{i + 1}: unknown mark {x!r} (one of {sorted(MARKS)})" for x in marks - MARKS]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            problems.append(f"{page}:{i + 1}: a fence that is never closed")
            break
        body = list(enumerate(lines[start + 1:end], start + 2))  # (line number, text)
        k = 0
        while k < len(body):
            no, text = body[k]
            is_cmd = (lang in SHELL and text.strip() and not text.lstrip().startswith("#")) or (
                lang == "console" and text.startswith("$ ")) or (
                lang not in SHELL | {"console"} and _looks_like_command(text))
            k += 1
            if not is_cmd:
                continue
            while text.rstrip().endswith("\\") and k < len(body):  # continuation lines
                text = text.rstrip()[:-1] + " " + body[k][1].strip()
                k += 1
            output = []
            if lang == "console":
                while k < len(body) and not body[k][1].startswith("$ "):
                    output.append(body[k][1])
                    k += 1
            commands.append(Command(f"{page}:{no}", text.removeprefix("$ ").strip(), marks,
                                    tuple(o for o in output if o.strip())))
        i = end + 1
    return commands, problems


PARSED = [parse(p) for p in PAGES]
COMMANDS = [c for cmds, _ in PARSED for c in cmds]
PROBLEMS = [p for _, probs in PARSED for p in probs]


# --- what a command becomes --------------------------------------------------------------------------------------
def python_call(argv: list[str]) -> tuple[str, list[str]] | None:
    """(module, args) of `python -m MODULE args` / `.venv/bin/python -m ...` / `hpctrain ...`, else None."""
    prog = argv[0]
    if prog in ("python", "python3") or prog.startswith(".venv/bin/python"):
        return (argv[2], argv[3:]) if len(argv) > 2 and argv[1] == "-m" else None
    if prog == "hpctrain" or prog == ".venv/bin/hpctrain":
        args = argv[1:]
        if not args or args[0] in ("-h", "--help"):
            return "hpctrain:console", args
        return "hpctrain", args[1:] if args[0] == "train" else args
    return None


def _command_word(args: list[str]) -> str | None:
    """`plan` in `plan model=...`; None for a training run's overrides and Hydra flags."""
    return args[0] if args and "=" not in args[0] and not args[0].startswith("-") else None


def job_for(cmd: Command) -> tuple[tuple[str, ...], str] | None:
    """What to run for a Python command (module, args...) and how it was derived; None: no check known."""
    call = python_call(cmd.argv)
    if call is None:
        return None
    module, args = call
    helps = {"-h", "--help"}
    if module == "hpctrain":
        word = _command_word(args)
        if word is None:  # a training run (or Hydra's own flags, which do not train)
            if helps & set(args) or any(a.startswith("--cfg") or a in ("-c", "--info") for a in args):
                return (module, *args), "as written"
            if "-m" in args or "--multirun" in args:
                return None  # a sweep has no cheap check: it must be marked
            return (module, "plan", *args), "as plan"
        if word == "plan" or helps & set(args):
            return (module, *args), "as written"
        return (module, word, "--help"), "as --help"
    if module == "hpctrain:console" or set(args) <= helps and args:
        return (module, *args), "as written"
    return (module, "--help"), "as --help"


# --- running Python commands: forks of one warm interpreter ------------------------------------------------------
RUNNER = r"""
import json, os, runpy, signal, sys, tempfile, time, traceback
import torch, hydra, hpctrain.cli, hpctrain.training.planner  # the slow imports, once
jobs, results = json.load(sys.stdin), {}
for job in jobs:
    key = "\0".join(job["argv"])
    out = tempfile.TemporaryFile()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: one command, as `python -m MODULE ARGS` would run it
        os.dup2(out.fileno(), 1); os.dup2(out.fileno(), 2)
        module, args = job["argv"][0], job["argv"][1:]
        code = 0
        try:
            if module == "hpctrain:console":
                sys.argv = ["hpctrain", *args]
                code = hpctrain.cli.console(args)
            else:
                sys.argv = [module, *args]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:  # sys.exit(None | int | message)
            code = e.code
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr); code = 1
        except BaseException:
            traceback.print_exc(); code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code or 0)
    deadline, status = time.monotonic() + job["timeout"], None
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(st)
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0); status = "timeout"
        else:
            time.sleep(0.02)
    out.seek(0)
    results[key] = {"rc": status, "output": out.read().decode(errors="replace")}
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


def _python_jobs() -> list[tuple[str, ...]]:
    jobs = set()
    for cmd in COMMANDS:
        if cmd.marks & STATIC_ONLY:
            for module, args in _calls(cmd.argv):
                if module == "hpctrain" and _command_word(args):
                    jobs.add(("hpctrain", _command_word(args), "--help"))
        elif (job := job_for(cmd)) is not None:
            jobs.add(job[0])
    return sorted(jobs)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[tuple[str, ...], dict]:
    """Every Python job of the docs, run once: {argv: {"rc", "output"}}."""
    jobs = _python_jobs()
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    results = tmp_path_factory.mktemp("docs") / "results.json"
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(results)], cwd=ROOT, env=env, text=True,
                          input=json.dumps([{"argv": list(j), "timeout": TIMEOUT_S} for j in jobs]),
                          capture_output=True, timeout=TIMEOUT_S * (len(jobs) + 1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {tuple(k.split("\0")): v for k, v in json.loads(results.read_text()).items()}


# --- the checks --------------------------------------------------------------------------------------------------
def _calls(argv: list[str]):
    """Every `python -m MODULE ...` / `hpctrain ...` / `torchrun ... -m MODULE` inside a command (srun, sbatch
    and env prefixes included)."""
    for i, w in enumerate(argv):
        if (call := python_call(argv[i:])) is not None:
            yield call
            return
        if w == "torchrun" and "-m" in argv[i:]:
            j = argv.index("-m", i)
            yield argv[j + 1], argv[j + 2:]
            return


def _make_n(cmd: Command) -> None:
    argv = cmd.argv
    proc = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, env={**os.environ, **cmd.env}, text=True,
                          capture_output=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{cmd.where}: `make -n {' '.join(argv[1:])}` failed:\n{proc.stderr[-2000:]}"


def _squash(text: str) -> str:
    return " ".join(text.split())


def _static(cmd: Command, ran_lazy) -> None:
    """A marked command: what can be checked without running it."""
    argv = cmd.argv
    if argv and argv[0] == "make":
        _make_n(cmd)
    for module, args in _calls(argv):
        if module == "hpctrain:console":
            module = "hpctrain"
        assert importlib.util.find_spec(module) is not None, f"{cmd.where}: no module {module}"
        if module == "hpctrain" and (word := _command_word(args)):
            r = ran_lazy()[("hpctrain", word, "--help")]
            assert r["rc"] == 0, f"{cmd.where}: no hpctrain command {word!r}:\n{r['output'][-2000:]}"
    for w in argv:  # the Slurm templates a command names
        if w.startswith("sbatch/"):
            assert (ROOT / w).is_file(), f"{cmd.where}: {w} does not exist"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command(cmd: Command, request):
    ran_lazy = lambda: request.getfixturevalue("ran")  # noqa: E731 (only Python commands start the runner)
    if cmd.marks & STATIC_ONLY:
        _static(cmd, ran_lazy)
        return
    if cmd.argv[0] == "make":
        _make_n(cmd)
        return
    job = job_for(cmd)
    assert job is not None, (
        f"{cmd.where}: no check for `{cmd.text}`: mark its block (<!-- docs-test: needs-gpu | needs-slurm | long | "
        "illustrative -->, see docs/README.md) or teach tests/test_docs.py to check it")
    argv, how = job
    r = ran_lazy()[argv]
    expected = 2 if "bad-input" in cmd.marks else 0
    assert r["rc"] == expected, (f"{cmd.where}: `{cmd.text}` checked {how} (`{' '.join(argv)}`): exit {r['rc']}, "
                                 f"expected {expected}:\n{r['output'][-3000:]}")
    if cmd.output and (how == "as written" or expected):  # shown output: each line must be in the real one
        real = _squash(r["output"])
        for line in cmd.output:
            if line.strip() not in ("...", "…"):
                assert _squash(line) in real, f"{cmd.where}: shown output {line.strip()!r} not in:\n{r['output']}"


# --- the pages themselves ----------------------------------------------------------------------------------------
def test_pages_parse():
    assert COMMANDS, "no command found in README.md and docs/: the extraction is broken"
    assert not PROBLEMS, "\n".join(PROBLEMS)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)  # no code blocks
    seen: dict[str, int] = {}
    anchors = set()
    for h in re.findall(r"^#+ (.+)$", text, flags=re.M):
        s = _slug(h)
        anchors.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return anchors


def test_links_reach_a_page_and_heading():
    """[text](page.md#heading) between the pages: the file exists and, for a .md page, so does the heading."""
    bad = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
        text = re.sub(r"`[^`\n]*`", "", text)  # nor inline code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target}: no such heading in {dest.name}")
    assert not bad, "\n".join(bad)


def test_readme_is_short_and_names_every_command():
    """The README stays a front page, and its command tables stay true to the Makefile and the CLI."""
    from hpctrain.cli import COMMANDS as CLI_COMMANDS

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250, "README.md is a front page: move the detail into docs/"
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1).split()
    missing = [t for t in [*phony, *CLI_COMMANDS] if f"`{t}`" not in readme and f"`{t} " not in readme]
    assert not missing, f"README.md does not name: {missing}"
    assert "make test" in readme  # CI's test command, named on the front page
