"""train.ckpt_every=auto: the checkpoint interval from the measured save stall and step time and the job's failure
rate, by Young/Daly's rule, agreed by every rank and re-evaluated at each save."""

from __future__ import annotations

import math
import statistics

import pytest
from helpers import records

from hpctrain.storage import checkpoint
from hpctrain.training.cadence import FIRST_AUTO_STEP, daly_interval
from hpctrain.training.run import train


def _daly(delta: float, m: float) -> float:
    """Daly 2006, eq. (37): the optimum compute time between checkpoints, δ < 2M; M beyond."""
    if delta >= 2 * m:
        return m
    return math.sqrt(2 * delta * m) * (1 + (delta / (2 * m)) ** 0.5 / 3 + delta / (18 * m)) - delta


def test_the_interval_is_youngs_for_cheap_saves_and_daly_s_otherwise():
    assert daly_interval(10.0, 3600 * 1e6) == pytest.approx(math.sqrt(2 * 10 * 3600e6), rel=1e-3)  # Young
    for delta, m in ((30.0, 3600.0), (300.0, 8 * 3600.0), (1.0, 10.0)):
        assert daly_interval(delta, m) == pytest.approx(_daly(delta, m), rel=1e-12)
    assert daly_interval(100.0, 40.0) == 40.0  # a save longer than two MTBFs: once per MTBF
    # A job of 2,048 nodes at Llama 3's per-node MTBF (6,335 h) saving in 30 s: every ~13 minutes.
    assert daly_interval(30.0, 6335 * 3600 / 2048) / 60 == pytest.approx(13.3, abs=0.1)


@pytest.mark.multiproc
def test_auto_saves_at_the_steps_the_rule_gives_for_the_measured_inputs(make_cfg, tmp_path):
    """fsdp dp=2 with a tiny MTBF (so the interval is a few steps): every decision recorded in result.json is the
    rule applied to its own measured inputs, the slowest rank's; the checkpoints are at exactly those steps (a
    disagreement between ranks would deadlock the collective save); the step time is the run's."""
    mtbf_h = 0.0002
    result = train(make_cfg("parallel=fsdp", "parallel.dp=2", "train.ckpt_every=auto", f"cluster.node_mtbf_h={mtbf_h}",
                            "train.max_steps=24", "train.ckpt_keep=100", "train.eval_every=0"), str(tmp_path))
    assert result["status"] == "completed"
    saves = result["checkpoints"]
    decisions = saves["cadence"]
    assert decisions and decisions[0]["step"] == FIRST_AUTO_STEP
    expected = [FIRST_AUTO_STEP]  # then each decision's step + its interval, and the last step (always saved): a decision between shows it re-evaluated
    for i, d in enumerate(decisions):
        assert d["step"] == expected[i] and d["mtbf_s"] == pytest.approx(mtbf_h * 3600)
        assert d["stall_s"] >= saves["stall_s"][i] - 1e-3  # the slowest rank's, rank 0's at most
        assert d["interval_s"] == pytest.approx(_daly(d["stall_s"], d["mtbf_s"]), rel=1e-3, abs=1e-3)
        # (result.json keeps 4 decimals: the rule on the recorded inputs, ± half of the last one, may round either
        # way, as it did once: 0.38399 / 0.0512 = 7.4999 against the run's 8)
        steps = [_daly(d["stall_s"] + e, d["mtbf_s"]) / (d["step_s"] - e) for e in (-5e-5, 5e-5)]
        assert d["every"] in {max(1, round(x)) for x in steps}, (d, steps)
        expected.append(min(d["step"] + d["every"], 24))
    assert expected[-1] == 24 and decisions[-1]["step"] == 24 and len(decisions) >= 3, decisions
    saved_steps = [checkpoint.step_of(p) for p in checkpoint.complete_checkpoints(str(tmp_path))]
    assert sorted(saved_steps) == expected[:-1]
    logged = [r["step_time_s"] for r in records(tmp_path) if "step_time_s" in r and r["step"] > FIRST_AUTO_STEP]
    for d in decisions[1:]:
        assert 0.5 <= d["step_s"] / statistics.median(logged) <= 5


def test_the_mtbf_is_learned_from_the_bad_node_list(make_cfg, tmp_path, monkeypatch):
    """cluster.learn_mtbf: the list's node failures over its runs' node-hours, cluster.node_mtbf_h as one prior
    failure; the run (a Slurm job) adds its own node-hours to the list."""
    from hpctrain.runtime import bad_nodes

    path = str(tmp_path / "list.json")
    assert bad_nodes.node_mtbf_h(path, 5.0)[0] == 5.0  # nothing seen yet: the prior
    bad_nodes.add_node_hours(path, 0.0004)
    bad_nodes.record(path, ["n2"], "died", "lost", "runs/a")
    bad_nodes.record(path, ["n3"], "straggler", "slow", "runs/a")  # not a failure
    learned, how = bad_nodes.node_mtbf_h(path, 0.0002)
    assert learned == pytest.approx((0.0004 + 0.0002) / 2) and "1 node failure(s) in 0.0004 node-hours" in how
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a Slurm run adds its node-hours
    result = train(make_cfg("train.ckpt_every=auto", "cluster.node_mtbf_h=0.0002", f"cluster.bad_nodes={path}",
                            "train.max_steps=6", "train.eval_every=0"), str(tmp_path / "run"))
    assert result["status"] == "completed"
    assert [d["mtbf_s"] for d in result["checkpoints"]["cadence"]] == pytest.approx([learned * 3600] * len(
        result["checkpoints"]["cadence"])) and result["checkpoints"]["cadence"]
    hours = bad_nodes._read(path)[1]
    # The run's node-hours are added after result.json is written (and fsynced): a little more than its wall time,
    # and the list keeps 4 decimals (±0.18 s); 1.8 s of room above for that write on a busy disk.
    assert -1e-4 <= hours - (0.0004 + result["wall_time_s"] / 3600) <= 5e-4, (hours, result["wall_time_s"])
    assert bad_nodes.clear(path) == 2 and bad_nodes._read(path)[1] == pytest.approx(hours)  # clearing keeps them
    off = train(make_cfg("train.ckpt_every=auto", "cluster.node_mtbf_h=0.0002", f"cluster.bad_nodes={path}",
                         "cluster.learn_mtbf=false", "train.max_steps=4", "train.eval_every=0"), str(tmp_path / "off"))
    assert [d["mtbf_s"] for d in off["checkpoints"]["cadence"]] == pytest.approx([0.0002 * 3600] * len(
        off["checkpoints"]["cadence"])) and off["checkpoints"]["cadence"]
