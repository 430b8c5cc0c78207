"""Hang forensics in one process (tests/test_parallel.py stops one of four real ranks)."""

import os
import time

import pytest

from hpctrain.core.errors import TrainingError
from hpctrain.monitoring.hang import (
    HangWatch,
    apply_flight_recorder,
    flight_recorder_env,
    is_peer_lost,
    is_timeout,
)


def _stuck_in_a_step(watch: HangWatch, seconds: float) -> None:
    """At least `seconds`, and until the watchdog has said its line (its diagnosis may be late on a busy machine)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds or (watch.line is None and time.monotonic() - start < 30):
        time.sleep(0.05)


def test_a_step_past_hang_s_writes_the_stacks_once(tmp_path):
    watch = HangWatch(str(tmp_path), rank=0, world=1, hang_s=0.3, beat_s=0.1)
    try:
        watch.begin(7)
        _stuck_in_a_step(watch, 1.0)
        watch.end()
        line = watch.line
        watch.begin(8)  # the slow step finished after all: the next one starts with no diagnosis
        assert watch.line is None and watch.explain(MemoryError("out of memory")) is None
    finally:
        watch.close()
    assert line.startswith("step 7 has run for ") and "(monitor.hang_s=0.3) on rank 0 (node " in line, line
    assert "no heartbeats in a single process" in line and line.endswith(f"are in {tmp_path}/hang/")
    stacks = (tmp_path / "hang" / "rank-0.txt").read_text()
    assert sum(line.startswith("20") for line in stacks.splitlines()) == 1  # once, however long the hang lasts
    assert "Thread MainThread" in stacks and "in _stuck_in_a_step" in stacks, stacks  # where the main thread was
    assert "Thread hpctrain-hangwatch" in stacks


def test_a_diagnosis_of_a_step_that_ended_meanwhile_is_not_kept(tmp_path):
    """The watchdog found step 7 too long, and step 7 ended (step 8 began) while it wrote the stacks: its line would
    stand for step 8 and hide that step's own hang."""
    watch = HangWatch(str(tmp_path), rank=0, world=1, hang_s=3600, beat_s=3600)
    try:
        watch.begin(7)
        since = watch._since
        watch.end()
        watch.begin(8)
        assert watch.diagnose("step 7 has run for 1 s", since=since).startswith("step 7 has run for 1 s")
        assert watch.line is None
        assert watch.diagnose("step 8 has run for 1 s", since=watch._since).startswith("step 8 ") and watch.line
    finally:
        watch.close()


def test_iterations_within_hang_s_write_nothing(tmp_path):
    watch = HangWatch(str(tmp_path), rank=0, world=1, hang_s=0.5, beat_s=0.05)
    try:
        for step in range(1, 6):
            watch.begin(step)
            time.sleep(0.1)
            watch.end()
        time.sleep(0.7)  # between iterations (e.g. finished) nothing is watched
    finally:
        watch.close()
    assert watch.line is None and not (tmp_path / "hang").exists()


@pytest.mark.parametrize("error,timed_out", [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms for recv "
                  "operation to complete"), True),
    (RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE)"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (TrainingError("data.timeout too small"), False),  # hpctrain's own one-line errors are never a hang
    (KeyboardInterrupt(), False),
])
def test_which_failures_are_collective_timeouts(tmp_path, error, timed_out):
    assert is_timeout(error) == timed_out
    watch = HangWatch(str(tmp_path), rank=2, world=1, hang_s=100, beat_s=10)
    try:
        watch.begin(3)
        line = watch.explain(error)
    finally:
        watch.close()
    assert (line is not None) == timed_out
    assert (watch.line is not None) == timed_out  # any other failure is reported as itself
    if timed_out:
        assert line.startswith("a collective timed out in step 3 on rank 2 (node ")
        assert (tmp_path / "hang" / "rank-2.txt").exists()


def test_flight_recorder_dumps_into_the_run(tmp_path, monkeypatch):
    env = flight_recorder_env(str(tmp_path))
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0  # (torch >= 2.8's name)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # deprecated: PyTorch 2.11 warned at every start
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/hang/nccl-trace-rank-"
    for key in (*env, "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")  # the job's own setting wins, under either name
    said = apply_flight_recorder(str(tmp_path / "a"))
    apply_flight_recorder(str(tmp_path / "b"))  # a later run in the same process dumps into its own directory
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500" and "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert said["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500 (environment)", said
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/b/hang/nccl-trace-rank-"


def test_a_lost_peer_is_named_by_its_heartbeat_not_the_transport_error(tmp_path, monkeypatch):
    """Rank 1 went away (killed, its node lost) after its last heartbeat: rank 0's collective fails with gloo's
    'Connection closed by peer [address]', and the run's error names rank 1 and its node within a few beats (a real
    store, as in a job)."""
    import torch.distributed as dist

    from hpctrain.runtime.spawn import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    store.set("hpctrain/heartbeat/1", f"{time.time():.3f} n9")  # rank 1's last beat
    error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                         "[127.0.0.1]:38556")
    assert is_peer_lost(error) and not is_timeout(error)
    watch = HangWatch(str(tmp_path), rank=0, world=2, hang_s=100, beat_s=0.2)
    try:
        watch.begin(5)
        t0 = time.monotonic()
        line = watch.explain(error)
        took = time.monotonic() - t0
    finally:
        watch.close()
    assert line.startswith("a collective in step 5 lost its peer on rank 0 (node "), line
    assert "rank 1 (node n9, last heartbeat " in line and "stopped responding" in line, line
    # A few beats (LOST_BEATS × 0.2 s), not the 100 s hang limit: bounded loosely, the suite's cores being shared.
    assert took < 25, took
    assert (tmp_path / "hang" / "rank-0.txt").exists()
    assert not is_peer_lost(TrainingError("connection closed by peer: a one-line error of ours"))
    alone = HangWatch(str(tmp_path / "alone"), rank=0, world=1, hang_s=100, beat_s=0.2)
    try:
        assert alone.explain(error) is None  # one process has no peer: the error is reported as itself
    finally:
        alone.close()
