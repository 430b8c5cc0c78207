"""Alert rules (the `monitor` config group) in real runs: firing after their duration, clearing, inactive metrics
reported, every event in alerts.jsonl and through a real notify command; bad rules refused in one line."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import records

from hpctrain.config import ConfigError
from hpctrain.training.run import prepare, train

RUN = ("train.max_steps=30", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0")


def _alerts(run_dir) -> list[dict]:
    with open(run_dir / "alerts.jsonl") as f:
        return [json.loads(line) for line in f]


def test_a_rule_fires_and_clears_with_the_metric(make_cfg, tmp_path):
    """loss above 5.5 (for 0 s): an event at exactly the logged steps where the loss crosses 5.5, both ways."""
    train(make_cfg(*RUN, "monitor.rules.loss.threshold=5.5", "monitor.rules.loss.for_s=0"), str(tmp_path))
    losses = [(r["step"], r["loss"]) for r in records(tmp_path) if "loss" in r]
    want, firing = [], False
    for step, loss in losses:
        if (loss > 5.5) != firing:
            firing = not firing
            want.append(("firing" if firing else "cleared", step))
    got = [(e["event"], e["step"]) for e in _alerts(tmp_path) if e["rule"] == "loss"]
    assert got == want and len(want) >= 2, (got, losses)


def test_a_rule_fires_only_after_its_duration(make_cfg, tmp_path):
    """Past the threshold from step 1: fires at the first logged step 0.05 s of wall time later (60 steps take
    longer than that even on a fast machine: 30 took under 0.3 s here); a 1e6 s rule never fires; the metrics
    this CPU run cannot measure are reported once as inactive."""
    train(make_cfg(*RUN, "train.max_steps=60", "+monitor.rules.slow={metric:loss,threshold:0.0,when:above,for_s:0.05}",
                   "+monitor.rules.never={metric:loss,threshold:0.0,when:above,for_s:1e6}"), str(tmp_path))
    events = _alerts(tmp_path)
    (slow,) = [e for e in events if e["rule"] == "slow"]
    assert slow["event"] == "firing" and slow["for_s"] >= 0.05 and slow["step"] > 1, slow
    assert not [e for e in events if e["rule"] == "never"]
    inactive = {e["rule"] for e in events if e["event"] == "inactive"}
    assert inactive == {"gpu_utilization", "communication_overhead", "synchronization_time", "node_failure_rate"}


def test_notify_cmd_gets_each_event_as_json_on_stdin(make_cfg, tmp_path):
    """A real command (an argument list, no shell: the quote in its argument reaches it untouched)."""
    out = tmp_path / "notified it's.jsonl"
    cfg = make_cfg(*RUN, "monitor.rules.loss.threshold=5.5", "monitor.rules.loss.for_s=0")
    cfg.monitor.notify_cmd = [sys.executable, "-c",
                              "import sys; open(sys.argv[1], 'a').write(sys.stdin.read() + '\\n')", str(out)]
    train(cfg, str(tmp_path / "run"))
    sent = [json.loads(line) for line in out.read_text().splitlines()]
    assert sent == _alerts(tmp_path / "run") and any(e["event"] == "firing" for e in sent)


@pytest.mark.parametrize("override, words", [
    ("+monitor.rules.x={metric:gpu_temp,threshold:1,when:above,for_s:1}", ["monitor.rules.x.metric='gpu_temp'",
                                                                           "gradient_norm"]),
    ("+monitor.rules.x={metric:loss,threshold:1,when:over,for_s:1}", ["monitor.rules.x", "above or below"]),
    ("+monitor.rules.x={metric:loss,limit:1}", ["monitor.rules.x must be a mapping of", "for_s"]),
    ("monitor.notify_cmd=[]", ["monitor.notify_cmd=[]", "non-empty list"]),
])
def test_bad_rules_are_one_line(make_cfg, override, words):
    with pytest.raises(ConfigError) as e:
        prepare(make_cfg(override))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
