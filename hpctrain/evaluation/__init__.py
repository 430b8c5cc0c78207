"""Downstream evaluation: lm-evaluation-harness's tasks scored by hpctrain's model (harness.py)."""
