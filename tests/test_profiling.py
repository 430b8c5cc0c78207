"""train.profile_steps and train.memory_snapshot on real runs (CPU here; tests/test_gpu.py has the CUDA side)."""

import json
import re

import pytest
from helpers import WarningLines, one_line

from hpctrain.core.config import ConfigError
from hpctrain.training.run import train

RUN = ("train.max_steps=4", "train.eval_every=0", "train.ckpt_every=0", "logging.trackers=[]")


def _trace_steps(path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the step's operators were recorded
    return events


def test_profile_steps_writes_a_trace_and_a_table_per_rank(make_cfg, tmp_path):
    result = train(make_cfg(*RUN, "train.profile_steps=[2,3]"), str(tmp_path / "one"))
    assert result["status"] == "completed"
    prof = tmp_path / "one" / "profile"
    assert sorted(p.name for p in prof.iterdir()) == ["rank-0.json", "rank-0.txt"]
    _trace_steps(prof / "rank-0.json")
    table = (prof / "rank-0.txt").read_text()
    assert table.startswith("steps 2-3, rank 0, sorted by self_cpu_time_total") and "aten::mm" in table, table[:500]
    by_shape = table.split("by input shape, sorted by self_cpu_time_total\n")[1]
    assert re.search(r"aten::mm .*\[\[\d+, \d+\], \[\d+, \d+\]\]", by_shape), by_shape[:1500]  # a matmul's operands


@pytest.mark.multiproc
def test_profile_steps_on_every_rank(make_cfg, tmp_path):
    train(make_cfg(*RUN, "train.profile_steps=[3,3]", "parallel=fsdp", "parallel.dp=2"), str(tmp_path))
    names = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert names == ["rank-0.json", "rank-0.txt", "rank-1.json", "rank-1.txt"]
    for rank in (0, 1):
        _trace_steps(tmp_path / "profile" / f"rank-{rank}.json")


def test_a_resumed_run_keeps_the_earlier_profile(make_cfg, tmp_path):
    """A run resumed inside or before its window profiles again, beside the first attempt's files."""
    train(make_cfg(*RUN, "train.profile_steps=[3,4]", "train.ckpt_every=2", "train.max_steps=4"), str(tmp_path))
    (tmp_path / "checkpoints" / "step-0000004").rename(tmp_path / "checkpoints" / "aside")  # resume from step 2
    (tmp_path / "checkpoints" / "latest").unlink()
    (tmp_path / "checkpoints" / "latest").symlink_to("step-0000002")
    train(make_cfg(*RUN, "train.profile_steps=[3,4]", "train.ckpt_every=2", "train.max_steps=4"), str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank-0-2.json", "rank-0-2.txt",
                                                                        "rank-0.json", "rank-0.txt"]


@pytest.mark.parametrize("steps", ["[3,2]", "[0,1]", "[2]", "[1,9]"])
def test_bad_profile_window_is_one_line(make_cfg, steps):
    from hpctrain.runs.resolve import resolve

    with pytest.raises(ConfigError) as e:
        resolve(make_cfg(*RUN, f"train.profile_steps={steps}"))
    one_line(e, "train.profile_steps=", "1 <= first <= last <= train.max_steps=4", "train.profile_steps=[10,12]")


def test_memory_snapshot_without_cuda_says_so_and_records_nothing(make_cfg, tmp_path):
    import logging

    logger, lines = logging.getLogger("hpctrain"), WarningLines()
    logger.addHandler(lines)
    try:
        assert train(make_cfg(*RUN, "train.memory_snapshot=true"), str(tmp_path))["status"] == "completed"
    finally:
        logger.removeHandler(lines)
    assert "train.memory_snapshot=true: no CUDA device on this rank, no allocator history is recorded" in lines.messages
    assert not (tmp_path / "memory").exists()
