"""Reading a run directory while a job writes it, and waiting on Slurm: shared by the tests of real jobs."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from hpctrain.core.files import read_metrics, read_records
from hpctrain.launch.sweep import sacct_state


def model_on(cfg, layout, mesh, device):
    """The run's model built on `layout` as the Trainer builds it."""
    from hpctrain.training.model_init import build_model
    from hpctrain.training.precision import compute_dtype

    return build_model(cfg.model, cfg.parallel, layout, mesh, device, compute_dtype(cfg.precision), cfg.train.seed)


def read(path) -> str:
    with open(path) as f:
        return f.read()


def records(run_dir, lenient: bool = False) -> list[dict]:
    return read_metrics(str(run_dir), lenient)


def losses(run_dir, lenient: bool = False) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, lenient) if "loss" in r}


def written(path) -> list[dict]:
    """The records of a JSON-lines file that a live process may be appending to (none yet: []). A write can become
    visible in parts: a line cut short is no JSON object, and is passed over."""
    return read_records(str(path), lenient=True) if os.path.exists(path) else []


def last_step(run_dir) -> int:
    """The last logged training step, 0 before the first (a line being written is passed over)."""
    try:
        return max(losses(run_dir, lenient=True), default=0)
    except OSError:
        return 0


def until(what: str, check, timeout: float, every: float = 0.5):
    """Poll `check()` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def job_gone(job: str) -> bool:
    """squeue no longer lists the job. An error other than its "Invalid job id" (slurmctld busy on a loaded machine:
    a socket time-out) is no answer, not an end."""
    try:
        p = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return not p.stdout.strip() if p.returncode == 0 else "Invalid job id" in p.stderr


def ranks_of(pid: int) -> list[int]:
    """The rank processes a local launcher (`pid`) forked, in rank order: the order it forked them in."""
    with open(f"/proc/{pid}/task/{pid}/children") as f, open("/proc/sys/kernel/pid_max") as m:
        return fork_order([int(c) for c in f.read().split()], int(m.read()))


def fork_order(pids: list[int], pid_max: int) -> list[int]:
    """PIDs forked one after another, in that order. They rise from one fork to the next but wrap at pid_max (32768
    here, passed several times by a suite's processes and threads): the first is the one after the widest gap."""
    pids = sorted(pids)
    gaps = [(pids[(i + 1) % len(pids)] - p) % pid_max for i, p in enumerate(pids)]
    first = (gaps.index(max(gaps)) + 1) % len(pids) if pids else 0
    return pids[first:] + pids[:first]


def wait_job(job: str, timeout: float = 240) -> str:
    """Wait for a Slurm job to end; return its final state, lowercased ("completed", "failed", ...). Polls:
    `sbatch --wait` sleeps 2, 8, then 32 s between its checks."""
    until(f"job {job} to end", lambda: job_gone(job), timeout, every=0.3)
    active = (None, "pending", "running", "requeued", "completing")  # sacct can lag squeue by a moment
    return until(f"sacct to record the end of job {job}", lambda: (s := sacct_state(job)) not in active and s, 30)


def list_unused_node(job: str, bad_node_list: str) -> str:
    """Put a node of the local cluster that `job` does not run on on the bad-node list; return its name."""
    from hpctrain.runtime import bad_nodes

    def hostnames(nodelist: str) -> set[str]:
        return set(subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                  text=True).stdout.split())

    used = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    every = ",".join(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split())
    free = sorted(hostnames(every) - hostnames(used))[0]
    bad_nodes.record(bad_node_list, [free], "died", "(recorded by the test)")
    return free


def sbatch_run(args: list[str], cwd, env=None, timeout: float = 240) -> tuple[str, str]:
    """Submit a batch job and wait for it to end: (job id, final state as `wait_job` returns it)."""
    p = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"sbatch failed: {p.stdout}{p.stderr}"
    job = p.stdout.strip().split(";")[0]
    return job, wait_job(job, timeout)


@dataclass
class Ran:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


class Forked:
    """A command's `main(argv)` running in a forked child of this process (torch already imported: milliseconds
    instead of a new interpreter's seconds), with its own stdout/stderr files, cwd and environment; what a test
    needs of a Popen: `pid`, `poll`, `wait`, `communicate`, `send_signal`. The exit code is main's return value, a
    SystemExit's code, or 1 with the traceback on stderr, as `python -m` would give."""

    def __init__(self, main, argv: list[str], cwd, env: dict[str, str | None] | None = None):
        self.argv, self.returncode = argv, None
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - close()
        gc.collect()  # as hpctrain.runtime.spawn does: garbage process groups destroyed here, never in the child
        gc.freeze()  # and what lives on is not walked again by the next collect (~0.25 s each in this process)
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            self._child(main, argv, cwd, env)

    def _child(self, main, argv, cwd, env) -> None:
        gc.freeze()
        code = 1
        try:
            # One thread: this process's OpenMP pool (torch ran here, 2 threads) does not survive fork, and a
            # child asking it for 2 threads waits forever in libgomp (hpctrain's launcher forks with
            # cpus // world threads from a parent that computes nothing; runtime/spawn.py).
            torch.set_num_threads(1)
            os.dup2(self._out.fileno(), 1)
            os.dup2(self._err.fileno(), 2)
            # pytest's capture replaced sys.stdout/err with its own files: write to the fds instead.
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            faulthandler.register(signal.SIGQUIT, file=sys.stderr, all_threads=True)  # a hang explains itself
            # Ctrl-C as in a new interpreter, whatever an earlier test left in this process (a handler, a
            # blocked mask, an event loop's wakeup fd).
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            signal.set_wakeup_fd(-1)
            os.chdir(cwd)
            for key, value in (env or {}).items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            sys.argv = ["python", *argv]
            code = main(argv) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported like the interpreter would
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (`_hung`): it was killed
                self.returncode = -signal.SIGKILL
            else:
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(self.argv, timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once the child has ended."""
        self.wait(timeout)
        return self.out, self.err

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap it, if it still runs (never a reaped PID: it may be another process's by now)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait()

    def close(self) -> None:
        """Kill it if it still runs, and close its output files."""
        self.kill()
        self._out.close()
        self._err.close()

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc) -> None:  # a test that fails leaves no run behind (nor a zombie)
        self.close()

    @property
    def out(self) -> str:
        self._out.seek(0)
        return self._out.read().decode(errors="replace")

    @property
    def err(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")


def run_forked(main, argv: list[str], cwd, env: dict[str, str | None] | None = None, timeout: float = 120,
               interrupt_when=None) -> Ran:
    """A command's `main(argv)` in a forked child (`Forked`), to its end. `interrupt_when()`: polled while the
    child runs; once true, the child gets SIGINT (a Ctrl-C)."""
    with Forked(main, argv, cwd, env) as child:  # (interrupt_when raising, or the test interrupted: killed)
        deadline = time.time() + timeout
        while child.poll() is None:
            if interrupt_when is not None and interrupt_when():
                child.send_signal(signal.SIGINT)
                interrupt_when = None
            if time.time() > deadline:
                raise AssertionError(_hung(child.pid, argv, timeout, child._err))  # (it kills and reaps the child)
            time.sleep(0.02)
        return Ran(child.returncode, child.out, child.err)


def _hung(pid: int, argv: list[str], timeout: float, err) -> str:
    """Kill a forked child that did not finish; what it and this process were doing then (its threads' Python
    stacks, dumped on SIGQUIT; this process's threads: a fork copies their locks, not them)."""
    def signals(p) -> str:
        with open(f"/proc/{p}/status") as f:
            return " ".join(line.replace(":\t", " ").strip() for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt")))

    mine, theirs = signals(os.getpid()), signals(pid)
    err.seek(0, os.SEEK_END)
    before = err.tell()
    os.kill(pid, signal.SIGQUIT)
    time.sleep(2)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    err.seek(0)
    text = err.read().decode(errors="replace")
    threads = ", ".join(t.name for t in threading.enumerate())
    return (f"{argv} did not finish in {timeout:.0f}s; the child's signals: {theirs}; this process's: {mine}, "
            f"SIGINT handler {signal.getsignal(signal.SIGINT)}, threads: {threads}; the child's stacks:\n"
            f"{text[before:before + 5000]}\nthe end of its stderr before:\n{text[max(0, before - 2000):before]}")


_CONTENT: dict[tuple, bytes] = {}  # a file's (path, inode, size, ctime) -> the sha256 of its bytes


def _content(path: str) -> bytes:
    """sha256 of a file's bytes, hashed again only when its inode, size or change time moved (any write moves the
    change time): the tables of bad inputs compare large trees before and after every case."""
    st = os.stat(path)
    key = (path, st.st_ino, st.st_size, st.st_ctime_ns, st.st_mtime_ns)
    if key not in _CONTENT:
        with open(path, "rb") as f:
            _CONTENT[key] = hashlib.sha256(f.read()).digest()
    return _CONTENT[key]


def tree_digest(path) -> str:
    """A hash of every file's relative path and bytes (and every directory's name) under `path`."""
    h = hashlib.sha256()
    if not os.path.exists(path):
        return "absent"
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        h.update(os.path.relpath(root, path).encode() + b"/\0")
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(name.encode() + b"\0")
            if os.path.islink(full):
                h.update(os.readlink(full).encode())
            else:
                h.update(_content(full))
    return h.hexdigest()


def edit_tokens(data_dir: str, index: int, edit, fix_sha256: bool = False) -> str:
    """Rewrite the token data of train shard `index` in place, member by member (same size, tar headers
    untouched); `edit(sample, tokens)` returns the new tokens. fix_sha256: record the new sha256 in the
    manifest too, so that only checks on the tokens themselves can notice. Returns the shard's path."""
    import tarfile

    import numpy as np

    from hpctrain.core.shard_format import (
        MANIFEST_NAME,
        decode_tokens,
        encode_tokens,
        read_manifest,
        sha256_file,
    )

    m = read_manifest(data_dir)
    path = os.path.join(data_dir, m.splits["train"][index].name)
    with tarfile.open(path) as tf:
        members = [(t.offset_data, t.size) for t in tf]
    with open(path, "r+b") as f:
        for i, (offset, size) in enumerate(members):
            f.seek(offset)
            tokens = edit(i, decode_tokens(f.read(size), m.dtype).astype(np.int64))
            f.seek(offset)
            f.write(encode_tokens(tokens, m.dtype))
    if fix_sha256:
        with open(os.path.join(data_dir, MANIFEST_NAME)) as f:
            raw = json.load(f)
        raw["splits"]["train"][index]["sha256"] = sha256_file(path)
        with open(os.path.join(data_dir, MANIFEST_NAME), "w") as f:
            json.dump(raw, f)
    return path


class WarningLines(logging.Handler):
    """A logging handler that keeps the messages of `level` (WARNING) and above (attach it to the logger under
    test; for INFO lines, lower the logger's level too)."""

    def __init__(self, level: int = logging.WARNING):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def one_line(error, *words: str) -> str:
    """The message of an exception (raised, or a pytest.ExceptionInfo) or a text: one line without surrounding
    space, holding every word. Returns it."""
    msg = str(getattr(error, "value", error))
    assert "\n" not in msg and msg.strip() == msg, msg
    for word in words:
        assert word in msg, (word, msg)
    return msg


# --- one layout against another: the same small run, compared step by step ---------------------------------------

# 8 samples per step, micro-batches of 2: accumulation 4 in one process, 2 per rank with dp=2.
LAYOUT_RUN = ("train.global_batch=8", "train.micro_batch=2", "train.max_steps=3", "train.eval_every=0",
              "train.ckpt_every=0", "logging.trackers=[]", "cluster.num_threads=1", "optim.decay_steps=12")


def step_metrics(run_dir) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad_norm)} of a run's logged training steps."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir) if "loss" in r}


def run_layout(make_cfg, run_dir, *overrides) -> dict[int, tuple[float, float]]:
    from hpctrain.training.run import train

    result = train(make_cfg(*LAYOUT_RUN, *overrides), str(run_dir))
    assert result["status"] == "completed"
    return step_metrics(run_dir)


def deltas(ref, got) -> tuple[float, float]:
    """The largest loss difference and relative grad-norm difference over steps 1-3."""
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    return (max(abs(ref[s][0] - got[s][0]) for s in ref),
            max(abs(ref[s][1] - got[s][1]) / ref[s][1] for s in ref))


def cli_args(run_dir, demo_data, *extra) -> list[str]:
    """`python -m hpctrain` arguments of the same small run."""
    from conftest import SMALL_MODEL

    return [f"run_dir={run_dir}", f"data.path={demo_data}", "data.prepare_demo=false", *SMALL_MODEL,
            "train.global_batch=8", "train.micro_batch=2", "train.log_every=1", "train.eval_every=0",
            "logging.trackers=[]", "cluster.num_threads=1", "optim.decay_steps=12", "optim.warmup_steps=2",
            "optim.lr=1e-2", *extra]


def _fsdp_params(model):
    """FSDP2's per-parameter records (FSDPParam) of every FSDP unit in `model` (internals: for tests only)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        yield from group.fsdp_params if group else ()


def held_grad_bytes(model) -> int:
    """Bytes of gradients this rank holds now: the (local shards of the) parameters' .grad, plus what FSDP2 keeps
    unsharded between micro-batches when it does not reduce each one (FSDP internals: for tests only)."""
    from torch.distributed.tensor import DTensor

    def nbytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    for fp in _fsdp_params(model):
        held = [getattr(fp, "unsharded_accumulated_grad", None)]
        if hasattr(fp, "_unsharded_param"):
            held.append(fp._unsharded_param.grad)
        total += sum(nbytes(g) for g in held if g is not None)
    return total


def fsdp_unsharded_bytes(model) -> int:
    """Bytes of the unsharded parameters FSDP2 holds right now (a resharded unit holds none; FSDP internals)."""
    return sum(fp._unsharded_param.untyped_storage().nbytes() for fp in _fsdp_params(model)
               if hasattr(fp, "_unsharded_param"))
