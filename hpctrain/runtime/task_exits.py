"""How the tasks of a job step ended, as only srun knows it, in the run's result.json.

A rank killed by SIGKILL (the kernel's OOM killer, `kill -9`, a lost node) cannot say why it died, and the ranks
that outlive it only see a peer go away (they name its rank and node: result.json's `lost`). srun sees every task
end and says how in the job's log: `srun: error: n2: task 1: Killed`, `... task 3: Out Of Memory`,
`... tasks 0-1: Exited with exit code 1`. Once the step is over this module reads those lines and adds them to the
run's failed result: `task_exits` (srun's order: the first is the task that ended the step under
--kill-on-bad-exit), a `cause` on the matching `lost` entry, and the first one in `error`. Runs with spare nodes get this from their supervisor; other Slurm runs from an EXIT trap of the
batch script (`exit_trap`), which runs after srun returns: `python -m hpctrain.runtime.task_exits RUN_DIR [LOG]`
(LOG: the batch script's stderr, by default the one `scontrol show job` names).
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys

from hpctrain.core.files import RESULT_FILE, read_result, write_json

# srun's line for a task that did not exit 0 (slurm/src/srun: "%s: task %s: %s" / "tasks %s: %s")
SRUN_LINE = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+?)\s*$")
# slurmstepd's, when the step's cgroup saw the OOM killer (the task's own line may then only say "Killed")
OOM_LINE = re.compile(r"Detected (\d+) oom[_-]kill event", re.IGNORECASE)
TAIL_BYTES = 1 << 20
PREEMPTED = "Exited with exit code 75"  # runtime.job.EXIT_PREEMPTED: an earlier attempt's stop on purpose
  # srun's lines are the log's last ones: the tail of a log of any size is read


def _tasks(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out += range(int(lo), int(hi or lo) + 1)
    return out


def parse(lines) -> list[dict]:
    """Every task srun says ended badly, in its order: {"rank", "node", "how"}; an OOM kill slurmstepd detected
    is named on the tasks whose own line says only "Killed". (A requeued job's log holds its earlier attempts too:
    their preempted ranks' exit 75 is left out.)"""
    exits, oom = [], False
    for line in lines:
        m = SRUN_LINE.match(line.strip())
        if m and m["how"] != PREEMPTED:
            exits += [{"rank": t, "node": m["node"], "how": m["how"]} for t in _tasks(m["tasks"])]
        oom = oom or bool(OOM_LINE.search(line))
    if oom:
        for e in exits:
            if e["how"] == "Killed":
                e["how"] = "Killed (out of memory: the step's cgroup saw the OOM killer)"
    return exits


def tail_lines(path: str, limit: int = TAIL_BYTES) -> list[str]:
    """The last `limit` bytes of a regular file, as lines (never a FIFO or device: it could block or never end)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (opening a FIFO must not wait for its writer)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        f.seek(max(0, os.fstat(fd).st_size - limit))
        return f.read(limit).decode("utf-8", "replace").splitlines()


def annotate(run_dir: str, exits: list[dict], job: str | None = None) -> dict | None:
    """Add srun's `exits` to the run's failed result: what it now holds, or None when srun said nothing or there is
    no failed result (a preempted run has none until it ends; where every rank was killed, srun's lines in the
    job's log are what remains)."""
    path = os.path.join(run_dir, RESULT_FILE)
    result = read_result(run_dir) if exits and os.path.exists(path) else None
    if not result or result.get("status") != "failed":
        return None
    first = exits[0]
    said = f"srun: rank {first['rank']} on {first['node']} ended first: {first['how']}"
    if job:
        said += f" (job {job})"
    result["task_exits"] = exits
    for lost in result.get("lost") or []:
        how = next((e["how"] for e in exits if e["rank"] == lost.get("rank")), None)
        if how:
            lost["cause"] = how
    error = result.get("error") or ""
    if said not in error:
        result["error"] = f"{error}; {said}" if error else said
    write_json(path, result)
    return result


def exit_trap(python: str, run_dir_word: str, log_word: str = "") -> str:
    """The batch-script line that runs this module once the script's srun has returned (bash runs an EXIT trap
    whatever the exit status, and keeps that status). The words are as the shell reads them (`shlex.quote`d, or a
    variable's expansion in double quotes); without `log_word` the job's stderr file is read."""
    cmd = f"{shlex.quote(python)} -m hpctrain.runtime.task_exits {run_dir_word} {log_word}".rstrip()
    return "trap " + shlex.quote(cmd + " || true") + " EXIT"


def _job_stderr(job: str) -> str | None:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"\bStdErr=(\S+)", out)
    return m.group(1) if m else None


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: python -m hpctrain.runtime.task_exits RUN_DIR [LOG]", file=sys.stderr)
        return 2
    run_dir, job = argv[0], os.environ.get("SLURM_JOB_ID")
    try:
        log = argv[1] if len(argv) > 1 else (_job_stderr(job) if job else None)
        if not log or not os.path.isdir(run_dir):
            return 0
        result = annotate(run_dir, parse(tail_lines(log)), job)
    except (OSError, ValueError, subprocess.SubprocessError) as e:  # never the job's failure: only a lost note
        print(f"hpctrain: could not add srun's task exits to {run_dir}/{RESULT_FILE}: {e}", file=sys.stderr)
        return 0
    if result:
        print(f"hpctrain: {run_dir}/{RESULT_FILE}: {result['error'][-300:]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
