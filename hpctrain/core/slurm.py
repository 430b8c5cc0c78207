"""Slurm's facts and requests that need no torch: a job's node names, its rendezvous ports, requeueing it.

The ranks (the process group, the preemption handler) and the in-allocation supervisor, which is no rank and so
never loads torch (1.7 core-s and 210 MB less on the batch node, measured), share them.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import subprocess

log = logging.getLogger("hpctrain")


def hostnames(nodelist: str) -> list[str]:
    """Slurm's node list (`n[1-3]`) as names."""
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          timeout=60).stdout.split()


def tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """The tasks Slurm started on the step's `node`-th node, from its tasks-per-node list (`2(x3),1`: three nodes with
    2, then one with 1; SLURM_STEP_TASKS_PER_NODE, indexed by SLURM_NODEID); None for a list not in that form."""
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None or node < 0:
            return None
        node -= int(m[2] or 1)
        if node < 0:
            return int(m[1])
    return None


def job_port(job: int, slot: int = 0) -> int:
    """The rendezvous port of a Slurm job's training (`slot`: a supervised job's step, a packed point): derived, so
    that every node agrees without talking, and below Linux's ephemeral range (32768-60999), where any process's
    outgoing connection may hold it (measured: a supervisor's restart found its port 36185 taken, EADDRINUSE).
    A job's first step has 20000-27999: jobs sharing a node meet only 8000 ids apart (it was 375). Its later steps
    and packed points (slots 1-63) have 28000-31999, never a first step's port: the same slot of two jobs meets 4000
    ids apart, any two slots 63 or more (×63 spreads them; 127 or more for slots 1-8)."""
    if slot == 0:
        return 20000 + job % 8000
    return 28000 + (job * 63 + slot - 1) % 4000


def outlive_the_requeue() -> None:
    """Requeueing cancels the job's steps, this one included: Slurm's SIGTERM can arrive before scontrol returns and
    would cut off the line saying what happened, or kill the scontrol that sets ExcNodeList after the requeue
    (measured: killed, empty stderr). The caller is stopping anyway (it exits right after, well within KillWait), so
    the signal is ignored from here on, by it and by the scontrol processes it starts (an ignored signal stays
    ignored across exec; a Python handler, submitit's, does not)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def requeue_job(job: str, exclude: list[str] = ()) -> bool:
    """`scontrol requeue`, then `exclude` added to the job's ExcNodeList (Slurm takes it only from a pending job).
    The calling process ignores SIGTERM from here on (`outlive_the_requeue`)."""
    outlive_the_requeue()
    p = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        log.error("could not requeue Slurm job %s (%s): resubmit it to resume", job, p.stderr.strip())
        return False
    log.info("requeued Slurm job %s", job)
    if exclude:
        exclude_nodes(job, exclude)
    return True


def exclude_nodes(job: str, nodes: list[str]) -> None:
    """Add `nodes` to the job's ExcNodeList (kept by a requeue), beside what it already leaves out."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60).stdout
    current = next((w.split("=", 1)[1] for w in shown.split() if w.startswith("ExcNodeList=")), "(null)")
    have = set() if current == "(null)" else set(hostnames(current))
    if set(nodes) <= have:
        return
    p = subprocess.run(["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(sorted(have | set(nodes)))}"],
                       capture_output=True, text=True, timeout=60)
    if p.returncode == 0:
        log.info("job %s leaves out %s when it runs again (bad-node list)", job, ",".join(sorted(nodes)))
    else:
        log.error("could not leave out %s in job %s (%s)", ",".join(sorted(nodes)), job, p.stderr.strip())


def missing_commands() -> str | None:
    """Which of the Slurm commands a submission runs are not on PATH ("sbatch is", "srun is", "sbatch and srun
    are"), or None: submitit submits with sbatch and, before that, looks for srun (a traceback where it is missing)."""
    import shutil

    missing = [c for c in ("sbatch", "srun") if not shutil.which(c)]
    return f"{' and '.join(missing)} {'are' if len(missing) > 1 else 'is'}" if missing else None


def minutes(text: str) -> float | None:
    """A Slurm time (`infinite`, `30`, `10:00`, `2:00:00`, `1-12`, `1-00:00:00`: minutes, minutes:seconds,
    hours:minutes:seconds, days-hours[:minutes[:seconds]]) in minutes; None for infinite or unreadable."""
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    try:
        parts, day = [int(p) for p in rest.split(":")], int(days)
    except ValueError:
        return None
    if len(parts) > 3:
        return None
    if "-" in text:  # days-hours[:minutes[:seconds]]
        parts += [0] * (3 - len(parts))
        return day * 1440 + parts[0] * 60 + parts[1] + parts[2] / 60
    if len(parts) == 3:
        return parts[0] * 60 + parts[1] + parts[2] / 60
    return parts[0] + (parts[1] / 60 if len(parts) == 2 else 0)


@functools.cache  # (a sweep's jobs ask for the same partition)
def partition_limits(partition: str | None) -> tuple[tuple[str, float | None, int, int | None], ...]:
    """(name, the longest time limit in minutes, the fewest and the most nodes a job may have) of each partition of
    `partition` (`a,b`: either; None: the cluster's default one), from sinfo (its job sizes read `1-infinite`,
    `16-64`, or `2` where the two are equal); () where sinfo cannot say (a partition it does not know: sbatch names
    it)."""
    cmd = ["sinfo", "-h", "--noconvert", "-o", "%P|%l|%s"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    found = {}
    for line in out.splitlines():
        name, limit, size = (line.split("|") + ["", ""])[:3]
        if partition or name.endswith("*"):  # (sinfo marks the default partition)
            least, most = size.partition("-")[0], size.rpartition("-")[2]
            found[name.rstrip("*")] = (minutes(limit), int(least) if least.isdigit() else 1,
                                       int(most) if most.isdigit() else None)
    return tuple((name, *limits) for name, limits in found.items())


_QOS_FLAGS: dict[str, frozenset[str]] = {}  # (what sacctmgr answered; a time-out is asked again)


def qos_flags(qos: str) -> frozenset[str] | None:
    """The flags of QOS `qos` from sacctmgr (PartitionTimeLimit, PartitionMaxNodes, PartitionMinNodes: the partition
    limits a job under it may exceed); None where sacctmgr cannot say (no accounting database, a QOS it does not
    know: sbatch names it)."""
    if qos not in _QOS_FLAGS:
        cmd = ["sacctmgr", "-n", "-P", "show", "qos", f"name={qos}", "format=Name,Flags"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout  # (an unreachable slurmdbd)
        except (OSError, subprocess.SubprocessError):
            return None
        for line in out.splitlines():
            name, _, flags = line.partition("|")
            if name.casefold() == qos.casefold():  # (sacctmgr may spell it in another case)
                _QOS_FLAGS[qos] = frozenset(flags.split(",")) - {""}
    return _QOS_FLAGS.get(qos)


def _flag_set(value: str) -> bool:
    """sbatch's reading of a flag option's environment variable: set when empty, `yes` in any case, or a whole
    number other than zero."""
    return value == "" or value.lower() == "yes" or bool(re.fullmatch(r"\s*[+-]?[0-9]+", value)) and int(value) != 0


def _exports_all(value: str) -> bool:
    from hpctrain.core.config import exports_all

    return exports_all(value)


# SBATCH_* variables that would override what hpctrain writes into the job script: (the option, what to do instead,
# which values are in the way; None: any).
_ENVIRONMENT = (("SBATCH_SIGNAL", "--signal", "the warning is cluster.signal, cluster.signal_lead_s before the time "
                 "limit", None),
                ("SBATCH_NO_REQUEUE", "--requeue", "a requeued job resumes from its latest checkpoint", _flag_set),
                ("SBATCH_GPUS_PER_NODE", "--gpus-per-node", "set cluster.gpus_per_node", None),
                ("SBATCH_ARRAY_INX", "--array", "a sweep (-m) is the array; cluster.pack packs it", None),
                *((var, f"--{var[7:].lower().replace('_', '-')}", "submitit reads the job's result from its logs in "
                   "<run_dir>/.submitit/", None) for var in ("SBATCH_OUTPUT", "SBATCH_ERROR", "SBATCH_OPEN_MODE")),
                ("SBATCH_EXPORT", "--export=ALL", "the job needs the environment it is submitted from",
                 lambda v: not _exports_all(v)))


def _check_environment(time_min: int | None, key: str, plus: str) -> None:
    """sbatch takes its SBATCH_* environment over the job script's #SBATCH lines, where submitit writes the time
    limit, the warning signal, --requeue, the job's shape and its logs: one of those set there would run the job on
    other terms than the run checks and plans by (the partition's limit, the requeues, the time limit's warning).
    SBATCH_WAIT would hold the submission until the job ends. ConfigError for either."""
    from hpctrain.core.config import ConfigError

    limit = os.environ.get("SBATCH_TIMELIMIT")
    if limit and minutes(limit) != time_min:
        raise ConfigError(f"SBATCH_TIMELIMIT={limit} in the environment would replace {key}.time_min={time_min} as "
                          "the job's time limit (sbatch takes it over the job script's), unseen by the checks and the "
                          f"requeue plan: unset SBATCH_TIMELIMIT and set {plus}{key}.time_min")
    if _flag_set(os.environ.get("SBATCH_WAIT", "0")):  # (measured: sbatch returned when the job ended)
        instead = " (cluster.wait=true waits for the job instead)" if key == "cluster" else ""
        raise ConfigError(f"SBATCH_WAIT={os.environ['SBATCH_WAIT']} in the environment would keep sbatch from returning "
                          f"until the job ends: unset SBATCH_WAIT{instead}")
    for var, option, instead, in_the_way in _ENVIRONMENT:
        if var in os.environ and (in_the_way is None or in_the_way(os.environ[var])):
            raise ConfigError(f"{var}={os.environ[var]} in the environment would override the job script's {option} "
                              f"(sbatch takes it over the script's #SBATCH lines): unset {var} ({instead})")


def check_partition(partition: str | None, time_min: int | None, nodes: int | None, qos: str | None = None,
                    key: str = "cluster") -> None:
    """A job none of its partitions can ever start is not refused by sbatch under Slurm's default
    EnforcePartLimits=NO: it waits in the queue for good (PartitionTimeLimit, PartitionNodeLimit). ConfigError for it,
    before it is submitted (`key`: the config group named). Under a QOS, not the limits its flags lift
    (PartitionTimeLimit, PartitionMaxNodes, PartitionMinNodes), nor any where sacctmgr cannot tell. First, the SBATCH_*
    environment that would replace the script's time limit, signal or --requeue."""
    from hpctrain.core.config import ConfigError

    plus = "" if key == "cluster" else "+"  # (eval.cluster starts empty: Hydra adds keys to it with +)
    _check_environment(time_min, key, plus)
    # (sbatch takes $SBATCH_PARTITION and $SBATCH_QOS over the script's #SBATCH lines, where submitit writes them)
    limits = partition_limits(os.environ.get("SBATCH_PARTITION") or partition or None)
    qos = os.environ.get("SBATCH_QOS") or qos
    lifted = qos_flags(qos) if qos and limits else frozenset()
    if lifted is None:
        return  # (a QOS sacctmgr cannot read may lift any of them)
    kept = f"; QOS {qos}{' ($SBATCH_QOS)' if os.environ.get('SBATCH_QOS') else ''} does not lift it" if qos else ""
    why = []
    for name, most_min, least_nodes, most_nodes in limits:
        if most_min is not None and time_min and time_min > most_min and "PartitionTimeLimit" not in lifted:
            why.append(f"{key}.time_min={time_min} is longer than partition {name} allows a job ({most_min:g} min): "
                       f"the job would wait in the queue for good (PartitionTimeLimit{kept}); use {plus}{key}.time_min="
                       f"{int(most_min)} or less, or another {plus}{key}.partition")
        elif most_nodes is not None and nodes and nodes > most_nodes and "PartitionMaxNodes" not in lifted:
            why.append(f"the job asks for {nodes} nodes, more than partition {name} gives one job ({most_nodes}): it "
                       f"would wait in the queue for good (PartitionNodeLimit{kept}); fewer nodes (the layout, "
                       f"{key}.gpus_per_node or {key}.tasks_per_node, {key}.spare_nodes, {key}.pack) or another "
                       f"{plus}{key}.partition")
        elif nodes and nodes < least_nodes and "PartitionMinNodes" not in lifted:
            why.append(f"the job asks for {nodes} node(s), fewer than partition {name} gives a job ({least_nodes} at "
                       f"least): it would wait in the queue for good (PartitionNodeLimit{kept}); another "
                       f"{plus}{key}.partition, or {least_nodes} nodes or more (the layout, {key}.nodes)")
        else:
            return  # a partition that can start it: Slurm picks it
    if why:
        raise ConfigError("; ".join(why))
