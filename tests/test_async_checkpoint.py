"""train.ckpt_async: checkpoints written in the background hold the step they were taken at, become complete
(and `latest`) only once written, one at a time; a failed write stops the run with one line; SIGKILL mid-write
resumes from the previous checkpoint exactly."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time

import pytest
from helpers import Forked, last_step, losses, run_forked, run_layout, until
from test_train import _args, read_json, read_text

from hpctrain import cli
from hpctrain.core.errors import TrainingError
from hpctrain.storage import checkpoint
from hpctrain.training.run import train

ASYNC = "train.ckpt_async=true"


@pytest.mark.multiproc
def test_async_checkpoints_hold_their_step_and_resume_as_uninterrupted(make_cfg, tmp_path):
    """fsdp dp=2, a background write every step: training is unchanged, every checkpoint is published, and resuming
    from one written while the next step trained (step 2) gives steps 3-6 of an uninterrupted run."""
    six = ("train.max_steps=6", "train.ckpt_every=0")
    ref = run_layout(make_cfg, tmp_path / "ref", *six)
    fsdp = ("parallel=fsdp", "parallel.dp=2", ASYNC)
    saved = run_layout(make_cfg, tmp_path / "saved", *fsdp, "train.ckpt_every=1", "train.ckpt_keep=3")
    for s in (1, 2, 3):
        assert abs(saved[s][0] - ref[s][0]) <= 1e-5, (s, saved[s], ref[s])
    ck = tmp_path / "saved" / "checkpoints"
    assert sorted(os.listdir(ck)) == ["latest", "step-0000001", "step-0000002", "step-0000003"]
    assert checkpoint.latest(str(tmp_path / "saved")).endswith("step-0000003")
    summary = read_json(tmp_path / "saved" / "result.json")["checkpoints"]
    assert summary["async"] and len(summary["stall_s"]) == len(summary["write_s"]) == 3
    assert read_json(ck / "step-0000002" / checkpoint.STATE_FILE)["run"]["step"] == 2
    got = run_layout(make_cfg, tmp_path / "resumed", *six, *fsdp, f"train.resume={ck}/step-0000002")
    assert sorted(got) == [3, 4, 5, 6]
    for s in got:
        assert abs(got[s][0] - ref[s][0]) <= 1e-5, (s, got[s], ref[s])
        assert got[s][1] == pytest.approx(ref[s][1], rel=1e-5), s


def _failing_write(fail_rank: int, step: int):
    """FileSystemWriter.write_data that fails like a full disk on `fail_rank` when writing checkpoint `step`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if str(self.path).endswith(f"step-{step:07d}") and dist.get_rank() == fail_rank:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, plan, planner)

    return write_data


@pytest.mark.multiproc
def test_a_failed_background_write_stops_every_rank_with_one_line(make_cfg, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    monkeypatch.setattr(FileSystemWriter, "write_data", _failing_write(fail_rank=1, step=4))  # inherited by forks
    run = tmp_path / "run"
    with pytest.raises(TrainingError) as e:
        train(make_cfg("parallel=fsdp", "parallel.dp=2", ASYNC, "train.max_steps=12", "train.ckpt_every=2",
                       "train.eval_every=0"), str(run))
    text = str(e.value)
    assert "checkpoint step 4 could not be written (no space left on device in" in text, text
    assert "step-0000002" in text and "train.resume=auto" in text and "\n" not in text.strip()
    doc = read_json(run / "result.json")
    assert doc["status"] == "failed" and doc["steps"] <= 6  # stopped within two steps of the failure, not at 12
    assert checkpoint.latest(str(run)).endswith("step-0000002")
    assert not (run / "checkpoints" / "step-0000004").exists()
    assert not (run / "checkpoints" / ".tmp-step-0000004").exists()  # the partial directory is removed


def test_a_full_disk_in_a_synchronous_save_keeps_the_previous_checkpoint(make_cfg, tmp_path, monkeypatch):
    """The same full disk with train.ckpt_async=false: one line naming the cause and the path, the partial directory
    removed, `latest` still the previous complete checkpoint (no root needed, unlike test_safety's real tmpfs)."""
    from torch.distributed.checkpoint import FileSystemWriter

    monkeypatch.setattr(FileSystemWriter, "write_data", _failing_write(fail_rank=0, step=4))
    with pytest.raises(TrainingError) as e:
        train(make_cfg("train.ckpt_async=false", "train.max_steps=6", "train.ckpt_every=2", "train.eval_every=0"),
              str(tmp_path))
    assert "checkpoint step 4 could not be written (no space left on device in" in str(e.value), e.value
    assert "\n" not in str(e.value).strip()
    assert read_json(tmp_path / "result.json")["status"] == "failed"
    assert checkpoint.latest(str(tmp_path)).endswith("step-0000002")
    assert not (tmp_path / "checkpoints" / "step-0000004").exists()
    assert not (tmp_path / "checkpoints" / ".tmp-step-0000004").exists()


def test_a_failed_final_write_fails_the_run(make_cfg, tmp_path, monkeypatch):
    """The last checkpoint is waited for before the run is called completed."""
    from torch.distributed.checkpoint import FileSystemWriter

    monkeypatch.setattr(FileSystemWriter, "write_data", _failing_write(fail_rank=0, step=3))
    with pytest.raises(TrainingError, match="checkpoint step 3 could not be written"):
        train(make_cfg(ASYNC, "train.max_steps=3", "train.ckpt_every=0", "train.eval_every=0"), str(tmp_path))
    assert read_json(tmp_path / "result.json")["status"] == "failed"
    assert checkpoint.latest(str(tmp_path)) is None


# Runs hpctrain with checkpoint 4's write held for a minute once it has started (a slow filesystem).
def _slow_write_main(argv: list[str]) -> int:
    """The CLI with checkpoint 4's write held back a minute (in the forked run only)."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if str(self.path).endswith("step-0000004"):
            print("writing step 4", flush=True)
            time.sleep(60)
        return real(self, plan, planner)

    FileSystemWriter.write_data = write_data
    return cli.main(argv)


@pytest.mark.slow
def test_sigkill_during_a_background_write_resumes_from_the_previous_checkpoint(demo_data, tmp_path):
    """While checkpoint 4 is being written training goes on, and waits at step 6 (one write in flight at most);
    SIGKILL then leaves step 2 as `latest`, and rerunning continues exactly as an uninterrupted run."""
    steps = ("train.max_steps=10", ASYNC)
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert run_forked(cli.main, _args(ref, demo_data, *steps), cwd=tmp_path, timeout=300).code == 0
    proc = Forked(_slow_write_main, _args(run, demo_data, *steps), tmp_path)
    try:
        until("checkpoint 4's write", lambda: "writing step 4" in proc.out or proc.poll() is not None, 240)
        assert "writing step 4" in proc.out, f"checkpoint 4 was never written (exit {proc.wait()}): {proc.err[-3000:]}"
        deadline = time.time() + 60
        while last_step(run) < 6 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(2)  # time for steps 7 and on, were the save at step 6 not waiting for step 4's write
        assert last_step(run) == 6 and proc.poll() is None
        ck = run / "checkpoints"
        assert not (ck / ".tmp-step-0000006").exists() and (ck / ".tmp-step-0000004").is_dir()
        assert checkpoint.latest(str(run)).endswith("step-0000002")
    finally:
        proc.close()  # SIGKILL, reaped
    assert checkpoint.latest(str(run)).endswith("step-0000002") and not (run / "checkpoints" / "step-0000004").exists()
    p = run_forked(cli.main, _args(run, demo_data, *steps), cwd=tmp_path, timeout=300)
    assert p.code == 0, p.err
    assert "resumed from" in read_text(run / "train.log")
    lr, lrun = losses(ref), losses(run)
    for s in range(3, 11):
        assert lrun[s] == pytest.approx(lr[s], abs=1e-6), s
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step-0000008", "step-0000010"]


def test_async_with_checkpointing_off_writes_nothing(make_cfg, tmp_path):
    result = train(make_cfg(ASYNC, "train.checkpointing=false", "train.max_steps=3", "train.eval_every=0"),
                   str(tmp_path))
    assert result["status"] == "completed" and not (tmp_path / "checkpoints").exists()


@contextlib.contextmanager
def _preempted_after_step_3(run_dir):
    """SIGUSR2 to this process once the in-process run in `run_dir` has logged step 3. The run outlasts any starved
    thread (a SIGUSR2 after train() put the default action back would kill this pytest worker), and the thread ends
    with the block whatever happened."""
    ended = threading.Event()

    def preempt():
        while last_step(run_dir) < 3:
            if ended.wait(0.005):
                return
        os.kill(os.getpid(), signal.SIGUSR2)

    threading.Thread(target=preempt, daemon=True).start()
    try:
        yield
    finally:
        ended.set()


def test_a_stop_signal_publishes_the_background_write_before_the_run_stops(make_cfg, tmp_path):
    """Preempted while training (one process): the stop's checkpoint is written in the background, then waited for,
    so `latest` names the step the run stopped at when it exits (and requeues)."""
    from hpctrain.runtime import job

    with _preempted_after_step_3(tmp_path), pytest.raises(job.Stopped):
        train(make_cfg(ASYNC, "train.max_steps=100000", "train.ckpt_every=2", "train.eval_every=0"), str(tmp_path))
    result = read_json(tmp_path / "result.json")
    assert result["status"] == "preempted" and 3 <= result["steps"] < 100000
    assert checkpoint.latest(str(tmp_path)).endswith(f"step-{result['steps']:07d}")
    assert not [name for name in os.listdir(tmp_path / "checkpoints") if name.startswith(".tmp")]


def test_a_late_copy_of_the_stop_signal_is_only_noted_until_the_run_has_requeued(make_cfg, tmp_path, monkeypatch):
    """Ranks stop on the first rank's signal; a rank's own copy can come later, after the checkpoint (seen in a Slurm
    job under load). The previous handler (submitit's in a job: it requeues and exits, without the bad-node list's
    ExcNodeList) is put back only after the run's own requeue: the late copy, here sent while result.json is
    written, is only noted, and the previous handler is in place again once train() has raised."""
    from hpctrain.runtime import job
    from hpctrain.training import trainer

    called = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: called.append(signum))
    real_write = trainer.write_json

    def write_after_a_late_signal(path, doc):
        if doc.get("status") == "preempted":
            os.kill(os.getpid(), signal.SIGUSR2)  # (handled at once: the main thread, this one)
        return real_write(path, doc)

    monkeypatch.setattr(trainer, "write_json", write_after_a_late_signal)
    try:
        with _preempted_after_step_3(tmp_path), pytest.raises(job.Stopped):
            train(make_cfg("train.max_steps=100000", "train.eval_every=0"), str(tmp_path))
        handler = signal.getsignal(signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert read_json(tmp_path / "result.json")["status"] == "preempted"
    assert called == [] and handler is not previous and handler.__name__ == "<lambda>", (called, handler)


def test_a_run_stopped_at_an_evaluation_step_evaluates_it_when_it_resumes(make_cfg, tmp_path):
    """A step's checkpoint is written before its evaluation, which a stop skips: the resumed run evaluates that step
    first (once), then goes on, so no score is lost to a preemption."""
    from hpctrain.core.files import read_metrics
    from hpctrain.runtime import job

    def evaluated() -> list[int]:
        return [r["step"] for r in read_metrics(str(tmp_path)) if "val_loss" in r]

    with _preempted_after_step_3(tmp_path), pytest.raises(job.Stopped):
        train(make_cfg("train.max_steps=100000", "train.ckpt_every=1000", "train.eval_every=1", "train.eval_batches=1"),
              str(tmp_path))
    stopped = read_json(tmp_path / "result.json")["steps"]
    assert evaluated() == list(range(1, stopped))
    cfg = make_cfg(f"train.max_steps={stopped + 1}", "train.ckpt_every=1000", "train.eval_every=1",
                   "train.eval_batches=1")
    assert train(cfg, str(tmp_path))["status"] == "completed"
    assert evaluated() == list(range(1, stopped + 2))
