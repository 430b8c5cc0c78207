"""Checkpoint safety: atomic directories, `latest` handling, retention, and no arbitrary unpickling."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

from hpctrain import checkpoint
from hpctrain.train import train


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.fixture
def run_with_ckpts(make_cfg, tmp_path):
    run = tmp_path / "run"
    train(make_cfg("train.max_steps=4", "train.ckpt_every=1", "train.ckpt_keep=3", "train.eval_every=0"),
          str(run))
    return run


def test_retention_and_latest(run_with_ckpts):
    names = sorted(os.listdir(run_with_ckpts / "checkpoints"))
    assert names == ["latest", "step-0000002", "step-0000003", "step-0000004"]
    assert checkpoint.latest(str(run_with_ckpts)).endswith("step-0000004")


def test_incomplete_and_stale_checkpoints_are_ignored(run_with_ckpts):
    ck = run_with_ckpts / "checkpoints"
    # A crash mid-save leaves a hidden temporary directory; a crash before the rename leaves no step dir.
    shutil.copytree(ck / "step-0000004", ck / ".tmp-step-0000005")
    # A step directory without trainer_state.json is not complete.
    shutil.copytree(ck / "step-0000004", ck / "step-0000006")
    os.remove(ck / "step-0000006" / checkpoint.STATE_FILE)
    assert checkpoint.latest(str(run_with_ckpts)).endswith("step-0000004")
    # `latest` pointing at a vanished directory falls back to the newest complete one.
    shutil.rmtree(ck / "step-0000004")
    assert checkpoint.latest(str(run_with_ckpts)).endswith("step-0000003")


def test_resume_from_an_explicit_checkpoint(make_cfg, run_with_ckpts, tmp_path):
    other = tmp_path / "other"
    result = train(make_cfg("train.max_steps=4", "train.eval_every=0",
                            f"train.resume={run_with_ckpts}/checkpoints/step-0000002"), str(other))
    assert result["steps"] == 4
    with open(other / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [3, 4]


def test_loading_refuses_a_malicious_metadata_pickle(run_with_ckpts, make_cfg, tmp_path):
    from hpctrain.config import model_args
    from hpctrain.model import Llama

    ck = run_with_ckpts / "checkpoints" / "step-0000004"
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(_Exploit(), f)
    os.chdir(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="system, which is not allowed"):
        checkpoint.load_model(str(ck), Llama(model_args(make_cfg())))
    assert not (tmp_path / "pwned").exists()


def test_loading_refuses_a_malicious_bytes_entry(tmp_path):
    """Non-tensor entries go through torch.load(weights_only=True): code objects are refused."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(2, 2)

    dcp.save({"model": model.state_dict(), "evil": _Exploit()}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    (tmp_path / "c" / checkpoint.STATE_FILE).write_text("{}")
    os.chdir(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="Weights only load failed"):
        checkpoint._dcp_load({"evil": None}, str(tmp_path / "c"), no_dist=True)
    assert not (tmp_path / "pwned").exists()
