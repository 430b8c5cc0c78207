"""How the tasks of a job step ended, as only srun knows it, in the run's result.json.

A rank killed by SIGKILL (the kernel's OOM killer, `kill -9`, a lost node) cannot say why it died, and the ranks
that outlive it only see a peer go away (they name its rank and node: result.json's `lost`). srun sees every task
end and says how in the job's log: `srun: error: n2: task 1: Killed`, `... task 3: Out Of Memory`,
`... tasks 0-1: Exited with exit code 1`. Once the step is over this module adds those lines to the run's failed
result: `task_exits` (srun's order: the first is the task that ended the step under --kill-on-bad-exit), a `cause`
on the matching `lost` entry, and the first one in `error`. Runs with spare nodes get this from their supervisor;
other Slurm runs from an EXIT trap of the batch script (`exit_trap`), which runs once srun has returned and reads the
script's own stderr (the job's log) from where it stood when the script started:
`python -m hpctrain.runtime.task_exits RUN_DIR --since EPOCH_S --from BYTES`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys

from hpctrain.core.files import RESULT_FILE, read_result, read_tail, write_json

# Every srun that starts ranks: a task that dies (crash, OOM kill, lost node) ends the whole step at once —
# the others get SIGTERM, then SIGKILL after Slurm's KillWait — instead of waiting in a collective until
# cluster.pg_timeout_s (NCCL). On gloo the survivors still name the dead rank first: their collective fails
# within ~3 s, and a deliberate stop ends the non-main ranks with 0 (runtime.job's Stopped.exit_code).
SRUN_ARGS = ("--kill-on-bad-exit=1",)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on purpose, run the same command again to resume
EXIT_TERMINATED = 128 + signal.SIGTERM  # stopped on purpose by SIGTERM, after a checkpoint

# srun's line for a task that did not exit 0 (slurm/src/srun: "%s: task %s: %s" / "tasks %s: %s")
SRUN_LINE = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+?)\s*$")
# slurmstepd's, when the step's cgroup saw the OOM killer (the task's own line may then only say "Killed")
OOM_LINE = re.compile(r"Detected (\d+) oom[_-]kill event", re.IGNORECASE)
PREEMPTED = f"Exited with exit code {EXIT_PREEMPTED}"  # a stop on purpose, no failure
TAIL_BYTES = 1 << 20  # srun's lines are the log's last ones: at most this much of it is read
MAX_EXITS = 64


def said_by_srun(line: str) -> bool:
    """A line of srun's (or slurmstepd's) on how a task ended."""
    return bool(SRUN_LINE.match(line.strip()) or OOM_LINE.search(line))


def _tasks(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out += range(int(lo), int(hi or lo) + 1)
    return out


def parse(lines) -> list[dict]:
    """Every task srun says ended badly, in its order: {"rank", "node", "how"}; an OOM kill slurmstepd detected
    is named on the tasks whose own line says only "Killed"."""
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
    return exits[:MAX_EXITS]


def annotate(run_dir: str, exits: list[dict], job: str | None = None, since: float = 0.0) -> dict | None:
    """Add srun's `exits` to the run's failed result, when one was written at or after `since` (this attempt's
    start: never an earlier run's, nor a file hpctrain did not write for this job): what it now holds, or None.
    Nothing is made where no rank wrote a result (every rank killed): srun's lines in the job's log remain."""
    path = os.path.join(run_dir, RESULT_FILE)
    try:
        fresh = bool(exits) and os.path.getmtime(path) >= since
    except OSError:
        return None
    result = read_result(run_dir) if fresh else None
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


def exit_trap(python: str, run_dir_word: str) -> str:
    """The batch-script line that notes where the script's stderr (the job's log) and the clock stand, and sets an
    EXIT trap running this module once srun has returned (bash and sh run it whatever the exit status, and keep
    that status). `run_dir_word`: the run directory as the shell reads it (`shlex.quote`d, or a variable's
    expansion in double quotes)."""
    cmd = (f"{shlex.quote(python)} -m hpctrain.runtime.task_exits {run_dir_word} --since \"$hpctrain_since\" "
           "--from \"$hpctrain_log_from\" || true")
    return ("hpctrain_since=$(date +%s); hpctrain_log_from=$(stat -L -c %s /proc/$$/fd/2 2>/dev/null || echo 0); "
            f"trap {shlex.quote(cmd)} EXIT")


def main(argv: list[str]) -> int:
    """The trap's command: srun's lines in this process's stderr (the batch script's: the job's log) since --from."""
    try:
        run_dir, since, start = argv[0], float(argv[argv.index("--since") + 1]), int(argv[argv.index("--from") + 1])
    except (IndexError, ValueError):
        print("usage: python -m hpctrain.runtime.task_exits RUN_DIR --since EPOCH_S --from BYTES", file=sys.stderr)
        return 2
    try:
        log = read_tail("/proc/self/fd/2", start, TAIL_BYTES).decode("utf-8", "replace").splitlines()
        result = annotate(run_dir, parse(log), os.environ.get("SLURM_JOB_ID"), since)
    except (OSError, ValueError) as e:  # never the job's failure: only a lost note
        print(f"hpctrain: srun's task exits not added to {run_dir}/{RESULT_FILE}: {e}", file=sys.stderr)
        return 0
    if result:
        print(f"hpctrain: {run_dir}/{RESULT_FILE}: {result['error'][-300:]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
