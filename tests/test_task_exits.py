"""srun's word on how a step's tasks ended, into the run's failed result (hpctrain.runtime.task_exits); the real
job path (a rank SIGKILLed on the local cluster) is in test_slurm's killed-rank test."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from hpctrain.core.files import FileCheckError, read_tail
from hpctrain.runtime.job import EXIT_PREEMPTED
from hpctrain.runtime.task_exits import PREEMPTED, annotate, exit_trap, parse

KILLED_LOG = ["step 12 | loss 4.1", "srun: error: n2: task 1: Killed", "srun: Terminating StepId=42.0",
              "srun: error: n1: tasks 0,2-3: Exited with exit code 1"]
LOST = {"status": "failed", "error": "a collective in step 12 lost its peer on rank 0 (node n1): rank 1 (node n2, "
        "last heartbeat 4 s ago)", "lost": [{"rank": 1, "node": "n2", "reason": "died"}]}


def test_srun_lines_name_each_task_in_order_and_an_oom_kill():
    assert parse(KILLED_LOG) == [{"rank": 1, "node": "n2", "how": "Killed"},
                                 *({"rank": r, "node": "n1", "how": "Exited with exit code 1"} for r in (0, 2, 3))]
    oom = parse(["slurmstepd: error: Detected 1 oom_kill event in StepId=42.0. Some of the step tasks have been OOM "
                 "Killed.", "srun: error: n3: task 5: Out Of Memory", "srun: error: n3: task 4: Killed"])
    assert [e["how"] for e in oom] == ["Out Of Memory",
                                       "Killed (out of memory: the step's cgroup saw the OOM killer)"]
    # an earlier attempt's preempted ranks (the log of a requeued job holds every attempt) are no failure
    assert f"Exited with exit code {EXIT_PREEMPTED}" == PREEMPTED
    assert parse([f"srun: error: n1: task 0: {PREEMPTED}", "srun: error: n2: task 1: Segmentation fault"]) == \
        [{"rank": 1, "node": "n2", "how": "Segmentation fault"}]
    assert parse(["srun: error: Unable to create step", "loss went up"]) == []


def test_a_failed_result_gets_the_cause_once_and_others_are_left_alone(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "result.json").write_text(json.dumps(LOST))
    exits = parse(KILLED_LOG)
    got = annotate(str(run), exits, "42")
    assert got == json.loads((run / "result.json").read_text())
    assert got["lost"] == [{"rank": 1, "node": "n2", "reason": "died", "cause": "Killed"}]
    assert got["error"] == LOST["error"] + "; srun: rank 1 on n2 ended first: Killed (job 42)"
    assert got["task_exits"] == exits
    assert annotate(str(run), exits, "42")["error"] == got["error"]  # (the supervisor, then the trap: once)
    for status in ("completed", "preempted"):  # only a failure is explained; nothing is made where none was written
        (run / "result.json").write_text(json.dumps({"status": status}))
        assert annotate(str(run), exits) is None and json.loads((run / "result.json").read_text()) == {"status": status}
    (run / "result.json").unlink()
    assert annotate(str(run), exits) is None and not (run / "result.json").exists()
    (run / "result.json").write_text(json.dumps(LOST))
    assert annotate(str(run), []) is None and json.loads((run / "result.json").read_text()) == LOST
    # a result older than this attempt (an earlier run's, or a file this job's ranks never wrote) is left alone
    os.utime(run / "result.json", (1e9, 1e9))
    assert annotate(str(run), exits, "42", since=1e9 + 1) is None and json.loads((run / "result.json").read_text()) == LOST


def test_the_exit_trap_reads_this_attempt_keeps_the_status_and_quotes_the_run_dir(tmp_path):
    """As a batch script runs it, its stderr the job's log (appended to by every attempt): only the lines written
    after the trap was set count (an earlier attempt's `task 0: Killed` on n3 is not this one's), only a result
    written after it is touched, a run directory no shell may read as code, the script's own exit status kept."""
    run = tmp_path / "it's $(touch pwned) `touch pwned2`"
    run.mkdir()
    log = tmp_path / "job.log"
    log.write_text("x" * 3_000_000 + "\nsrun: error: n3: task 0: Killed\n")  # an earlier attempt's
    (run / "result.json").write_text(json.dumps(LOST))
    os.utime(run / "result.json", (1e9, 1e9))  # (the earlier attempt's result)
    fresh = tmp_path / "fresh.json"
    fresh.write_text(json.dumps(LOST))

    def batch(write_result: bool) -> subprocess.CompletedProcess:
        lines = "".join(f"echo {shlex.quote(line)} >&2\n" for line in KILLED_LOG)
        script = (f"exec 2>>{shlex.quote(str(log))}\n{exit_trap(sys.executable, shlex.quote(str(run)))}\n"
                  + (f"cp {shlex.quote(str(fresh))} {shlex.quote(str(run / 'result.json'))}\n" if write_result else "")
                  + f"{lines}exit 7\n")
        return subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "SLURM_JOB_ID": "42"})

    p = batch(write_result=False)
    assert p.returncode == 7 and json.loads((run / "result.json").read_text()) == LOST, read_log(log)
    p = batch(write_result=True)
    assert p.returncode == 7, read_log(log)
    result = json.loads((run / "result.json").read_text())
    assert result["error"].endswith("; srun: rank 1 on n2 ended first: Killed (job 42)"), read_log(log)
    assert [e["node"] for e in result["task_exits"]] == ["n2", "n1", "n1", "n1"]
    assert not list(tmp_path.glob("pwned*")) and not list(run.glob("pwned*"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FileCheckError, match="is a FIFO, not a regular file"):
        read_tail(str(fifo), 0, 100)


def read_log(path) -> str:
    return path.read_text()[-2000:]
