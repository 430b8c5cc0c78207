"""What this machine can give a run, inside a cgroup's limits (a Slurm job's --mem and cpuset, a container's --memory
and --cpus): real cgroups (v1, as on this machine; conftest's `cgroup`), made and removed by the tests; root only,
skipped elsewhere."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def test_the_usable_cpus_are_a_cgroup_quotas(half_a_core):
    """Under a CPU quota the CPUs are the quota's, rounded up, not the machine's: half a core is one CPU."""
    code = "from hpctrain.core.host import usable_cpus; print(usable_cpus())"
    p = subprocess.run([*half_a_core, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["1"], p.stdout + p.stderr


def test_a_run_larger_than_its_cgroup_memory_limit_is_refused_before_it_starts(cgroup, demo_data, tmp_path):
    """A job's memory limit (Slurm's --mem) is what the run can have, not the machine's free memory: a llama_350m run
    (~6 GiB planned) under a 2 GiB cgroup on a machine with more free is one line naming the limit, before any rank
    starts. Checked against the machine alone it started, and the kernel killed it at the limit. The limit is on the
    group above the process's own, as Slurm sets it on the job and step and puts each task in a group below."""
    from hpctrain.core.host import memory_headroom

    limit = 2 * 2**30
    if (memory_headroom()[0] or 0) < 8 * 2**30:
        pytest.skip("needs 8 GiB free: the run must fit the machine and not the cgroup")
    inside = cgroup("memory", below="task_0", **{"memory.limit_in_bytes": str(limit)})
    p = subprocess.run([*inside, sys.executable, "-m", "hpctrain", "model=llama_350m", f"run_dir={tmp_path / 'run'}",
                        f"data.path={demo_data}", "data.prepare_demo=false", "train.global_batch=2",
                        "train.micro_batch=1", "train.max_steps=1", "train.eval_every=0", "logging.trackers=[]"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stdout + p.stderr
    assert "the memory left under this job's cgroup limit" in err[0] and "needs about" in err[0], err[0]
    assert float(err[0].split("cgroup limit (")[1].split(" GiB")[0]) <= limit / 2**30


def test_the_ranks_a_launcher_starts_on_a_node_share_its_memory(cgroup, demo_data, tmp_path):
    """Ranks that torchrun or srun start on one node each check, before the process group starts, that all of them
    fit: a rank of a two-rank node (torchrun's variables) whose share alone fits the job's 2 GiB cgroup (1.1 GiB
    planned) is refused for the two together, one line naming both, before it waits for its peer. Each rank
    checked for itself, both started and the kernel would kill them at the limit."""
    from hpctrain.core.host import memory_headroom

    if (memory_headroom()[0] or 0) < 8 * 2**30:
        pytest.skip("needs 8 GiB free: the run must fit the machine and not the cgroup")
    inside = cgroup("memory", below="task_0", **{"memory.limit_in_bytes": str(2 * 2**30)})
    big = ["model.dim=768", "model.n_layers=7", "model.n_heads=12", "model.n_kv_heads=12", "model.ffn_hidden=2048"]
    from hpctrain.runtime.spawn import free_port

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # (no peer: past the check, pg_timeout_s)
    p = subprocess.run([*inside, sys.executable, "-m", "hpctrain", *big, "model.vocab_size=512", "model.max_seq_len=64",
                        f"run_dir={tmp_path / 'run'}", f"data.path={demo_data}", "data.prepare_demo=false",
                        "parallel=ddp", "parallel.dp=2", "train.global_batch=8", "train.micro_batch=4",
                        "train.max_steps=1", "train.eval_every=0", "logging.trackers=[]", "cluster.pg_timeout_s=10"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stdout + p.stderr
    assert "needs about 2.2 GiB (2 ranks × 1.1 GiB), more than the memory left under this job's cgroup limit" \
        in err[0], err[0]
    assert 1.1 < float(err[0].split("cgroup limit (")[1].split(" GiB")[0]) <= 2, err[0]  # one rank alone fits


def test_the_cgroup_limit_is_found_where_the_hierarchy_is_mounted(cgroup, tmp_path):
    """The memory hierarchy is found where /proc/self/mountinfo says it is mounted, not only at
    /sys/fs/cgroup/memory: in a mount namespace with /sys/fs/cgroup hidden, (1) the whole hierarchy mounted elsewhere
    (a site's own mount point), (2) only the job's group bind-mounted (a container's view: /proc/self/cgroup still
    names the group by its path in the whole hierarchy). Both find the job's 2 GiB limit; with the fixed paths
    neither did (this machine's available memory instead). (3) Another group mounted (a sibling with a 1 GiB limit)
    says nothing of this process's: its limit is not taken for the job's."""
    from hpctrain.core.host import _cgroup_mounts

    if not shutil.which("unshare") or subprocess.run(["unshare", "--mount", "true"], timeout=30).returncode != 0:
        pytest.skip("needs unshare (util-linux) and mount namespaces")
    inside = cgroup("memory", below="task_0", **{"memory.limit_in_bytes": str(2 * 2**30)})
    sibling = inside.group.parent / "task_1"
    sibling.mkdir()
    try:
        (sibling / "memory.limit_in_bytes").write_text(str(2**30))
        whole, job = tmp_path / "whole", tmp_path / "job"
        whole.mkdir(), job.mkdir()
        # (where the hierarchy mounted whole holds the test's group: below the group this machine's view is rooted at)
        limited = f"{whole}{_cgroup_mounts().get((1, 'memory'), ('/',))[0].rstrip('/')}/{inside.group.parent.name}"
        show = f"{sys.executable} -c 'from hpctrain.core.host import memory_headroom; print(memory_headroom())'"
        script = " && ".join([
            "mount -t tmpfs none /sys/fs/cgroup", f"mount -t cgroup -o memory none {whole}", show,
            f"mount --bind {limited} {job}", f"umount {whole}", show,
            f"umount {job}", f"mount -t cgroup -o memory none {whole}", f"mount --bind {limited}/task_1 {job}",
            f"umount {whole}", show])
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", *inside, "sh", "-c", script], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    finally:
        sibling.rmdir()
    assert p.returncode == 0, p.stdout + p.stderr
    seen = [ast.literal_eval(line) for line in p.stdout.splitlines()]
    assert [where for _, where in seen] == ["the memory left under this job's cgroup limit"] * 2 + [
        "this machine's available memory"], seen
    assert all(0 < left <= 2 * 2**30 for left, _ in seen[:2]), seen


def test_a_cuda_build_on_a_node_without_a_gpu_is_checked_as_training_on_the_host(monkeypatch, tmp_path):
    """The default pip wheel of torch is a CUDA build, also on CPU nodes, where the ranks train on the host: the
    memory check adds their devices' memory to the host's unless a GPU driver's device file is there (asked without a
    CUDA call: the launcher forks its ranks afterwards)."""
    import torch

    from hpctrain.training import run

    assert not run.NodeMemory.here(2).gpus  # (this machine: a CPU build)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(run, "GPU_DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    assert not run.NodeMemory.here(2).gpus
    (tmp_path / "nvidiactl").touch()
    assert run.NodeMemory.here(2).gpus


def test_the_local_launch_counts_gpus_without_a_cuda_runtime_call(monkeypatch, make_cfg):
    """A run started without torchrun or srun forks its ranks from this process, and a forked child cannot use CUDA
    once its parent made a CUDA runtime call (cudaGetDeviceCount, which torch.cuda.is_available() makes). Here torch
    is a CUDA build whose NVML sees two GPUs, and the runtime call fails the test: parallel.dp=auto still finds them,
    and nothing before the fork asks the runtime."""
    import torch

    from hpctrain.training.run import prepare

    def runtime_call():
        raise AssertionError("a CUDA runtime call before the ranks fork")

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", runtime_call, raising=False)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    with pytest.raises(AssertionError, match="runtime call"):
        torch.cuda.is_available()  # (what the count used to ask)
    assert prepare(make_cfg("parallel=ddp", "parallel.dp=auto")).shape.world == 2
