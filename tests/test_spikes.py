"""Loss spikes (monitor.loss_spike) in real runs on a poisoned shard: warn, skip_batch and rollback, the rollback
proved equal to a resume from the same checkpoint at the data position past the skipped window."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import edit_tokens, losses, records

from hpctrain.core.config import ConfigError
from hpctrain.core.errors import TrainingError
from hpctrain.training.run import prepare, train

# One lane, no shuffling: shard k holds samples 48k..48k+47 in order, so shard 4's first 8 samples are exactly the
# global batch of step 25 (samples 192..199), whose loss jumps from ~5.3 to ~8.1 (measured).
RUN = ("data.lanes=1", "data.shuffle=false", "train.max_steps=40", "train.eval_every=0", "train.ckpt_every=10",
       "train.ckpt_keep=10", "train.log_every=1", "cluster.num_threads=1", "logging.trackers=[]",
       "optim.decay_steps=42", "monitor.loss_spike.factor=1.4", "monitor.loss_spike.window=10")
SPIKE_STEP = 25


def _poisoned(demo_data, tmp_path, n_samples: int) -> str:
    """The demo shards with the first `n_samples` samples of shard 4 made of random rare token ids."""
    out = str(tmp_path / "poisoned")
    shutil.copytree(demo_data, out)
    rng = np.random.default_rng(0)
    edit_tokens(out, 4, lambda i, t: rng.integers(400, 512, size=t.shape) if i < n_samples else t, fix_sha256=True)
    return out


def _events(run_dir, kind: str) -> list[dict]:
    with open(run_dir / "alerts.jsonl") as f:
        return [e for e in map(json.loads, f) if e["event"] == kind]


def test_rollback_skips_the_window_and_equals_a_resume_past_it(make_cfg, demo_data, tmp_path):
    """The spike at step 25 rolls back to step 20 and skips samples 160..199; the run goes on from sample 200 to
    its end, every step logged once; a later resume keeps the record. Reference: the step-20 checkpoint resumed at
    data position 200 gives the same losses (the rollback is exactly that, in the same process)."""
    data = _poisoned(demo_data, tmp_path, 8)
    run = tmp_path / "run"
    result = train(make_cfg(*RUN, f"data.path={data}", "train.max_steps=30", "monitor.loss_spike.action=rollback"),
                   str(run))
    window = {"spike_step": SPIKE_STEP, "back_to_step": 20, "from_sample": 160, "to_sample": 200}
    assert result["status"] == "completed" and result["steps"] == 30 and result["skipped_spike"] == 1
    (got,) = result["skipped_data"]
    assert {k: got[k] for k in window} == window and got["loss"] > 7.0, got
    assert result["samples"] == 200 + 10 * 8
    assert [r["step"] for r in records(run)] == list(range(1, 31))  # the rolled-back records dropped
    assert [e["step"] for e in _events(run, "spike")] == [SPIKE_STEP] and _events(run, "rollback")

    # Resumed to 40 steps: the record stays (it is in the checkpoints' run state).
    result = train(make_cfg(*RUN, f"data.path={data}", "monitor.loss_spike.action=rollback"), str(run))
    assert result["steps"] == 40 and [w["spike_step"] for w in result["skipped_data"]] == [SPIKE_STEP]

    ref, ck = tmp_path / "ref", tmp_path / "copy" / "step-0000020"
    shutil.copytree(run / "checkpoints" / "step-0000020", ck)
    state_file = ck / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["run"]["samples"] == 160
    state["run"]["samples"] = 200
    state_file.write_text(json.dumps(state))
    result = train(make_cfg(*RUN, f"data.path={data}", "monitor.loss_spike.action=rollback", f"train.resume={ck}"),
                   str(ref))
    assert result["skipped_spike"] == 0 and result["samples"] == 200 + 20 * 8
    got, want = losses(run), losses(ref)
    assert [got[s] for s in range(21, 41)] == pytest.approx([want[s] for s in range(21, 41)], rel=1e-6, abs=0)


def test_skip_batch_drops_every_spiking_update(make_cfg, demo_data, tmp_path):
    """All of shard 4 poisoned (steps 25-30): with skip_batch each of those updates is dropped, so the model never
    learns the poison and the loss right after is where it was; without, the poison is learnt and steps 31+ pay."""
    data = _poisoned(demo_data, tmp_path, 48)
    skip = train(make_cfg(*RUN, f"data.path={data}", "monitor.loss_spike.action=skip_batch"), str(tmp_path / "s"))
    plain = train(make_cfg(*RUN, f"data.path={data}", "monitor.loss_spike.action=none"), str(tmp_path / "p"))
    assert skip["status"] == "completed" and skip["skipped_spike"] == 6 and skip["skipped_data"] == []
    assert plain["skipped_spike"] == 0 and not _events(tmp_path / "p", "spike")
    assert [e["step"] for e in _events(tmp_path / "s", "spike")] == list(range(25, 31))
    s, p = losses(tmp_path / "s"), losses(tmp_path / "p")
    assert s[24] == p[24]  # the same run up to the poison
    # Measured: skipped, the poison's loss stays ~7.9 (nothing learnt) and steps 31-35 average 5.23; applied, it
    # falls to 6.2 by step 30 and steps 31-35 average 5.77.
    assert all(s[i] > p[i] for i in range(26, 31)), (s, p)
    assert sum(s[i] for i in range(31, 36)) / 5 < sum(p[i] for i in range(31, 36)) / 5 - 0.2, (s, p)
    assert records(tmp_path / "s")[-1]["skipped_spike"] == 6


def test_warn_applies_the_update_and_records_the_spike(make_cfg, demo_data, tmp_path):
    data = _poisoned(demo_data, tmp_path, 8)
    result = train(make_cfg(*RUN, f"data.path={data}", "train.max_steps=26"), str(tmp_path))  # default: warn
    assert result["skipped_spike"] == 0 and result["status"] == "completed"
    (spike,) = _events(tmp_path, "spike")
    assert spike["step"] == SPIKE_STEP and spike["action"] == "warn" and spike["value"] > spike["threshold"]


def test_rollback_before_any_checkpoint_skips_the_step_and_a_limit_stops_the_run(make_cfg, demo_data, tmp_path):
    data = _poisoned(demo_data, tmp_path, 8)
    result = train(make_cfg(*RUN, f"data.path={data}", "train.max_steps=26", "train.ckpt_every=100",
                            "monitor.loss_spike.action=rollback"), str(tmp_path / "a"))
    assert result["skipped_spike"] == 1 and result["skipped_data"] == [] and result["status"] == "completed"
    with pytest.raises(TrainingError, match="after 0 rollbacks .*max_rollbacks=0.*lower optim.lr"):
        train(make_cfg(*RUN, f"data.path={data}", "train.max_steps=26", "monitor.loss_spike.action=rollback",
                       "monitor.loss_spike.max_rollbacks=0"), str(tmp_path / "b"))


def test_a_dropped_update_leaves_weights_and_optimizer_untouched():
    """TrainStep with a loss check that refuses: the loss is reported, nothing is applied."""
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import TrainStep

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cfg = type("P", (), {"name": "fp32", "loss_scale_init": 1.0, "loss_scale_growth_interval": 1})()
    step = TrainStep(model, opt, setup_precision(cfg, torch.device("cpu")), 1.0, torch.device("cpu"))
    batch = torch.randint(0, 32, (2, 9))
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    step.loss_check = lambda loss: seen.append(loss) or True
    result = step([batch])
    assert result.status == "spike" and seen == [result.loss] and not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    step.loss_check = lambda loss: False
    assert step([batch]).status == "ok" and opt.state
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("overrides, words", [
    (("monitor.loss_spike.action=rollback", "train.checkpointing=false"),
     ["monitor.loss_spike.action=rollback", "train.checkpointing=true", "skip_batch"]),
    (("monitor.loss_spike.factor=0.5",), ["monitor.loss_spike.factor=0.5", "> 1"]),
    (("monitor.loss_spike.window=0",), ["monitor.loss_spike.window=0", ">= 1"]),
])
def test_bad_spike_settings_are_one_line(make_cfg, overrides, words):
    with pytest.raises(ConfigError) as e:
        prepare(make_cfg(*overrides))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
