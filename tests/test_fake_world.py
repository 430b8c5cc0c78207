"""One rank of an 8- to 8,192-rank job under PyTorch's fake process group (hpctrain.tools.fake_world): start-up,
a step's host-side control flow and the checkpoint's save planning run at every size, and what grows with the
world grows no faster than the world."""

from __future__ import annotations

import pytest

from hpctrain.tools import fake_world

# One worker runs the module: the worlds fixture (~25 core-s) once, not on every worker that runs one of these.
pytestmark = pytest.mark.xdist_group("fake_world")


@pytest.fixture(scope="module")
def worlds():
    # 8 and 1,024 ranks with every rank's save plan and DCP's global plan; 8,192 with rank 0's own (deriving
    # 8,192 plans takes the harness a minute: `make bench-world` does it)
    return {**{r["world"]: r for r in fake_world.measure((8, 1024))},
            **{r["world"]: r for r in fake_world.measure((8192,), global_plan=False)}}


def test_a_rank_of_8192_starts_steps_votes_gathers_and_plans_its_save_in_this_machines_memory(worlds):
    big = worlds[8192]
    assert (big["dp"], big["tp"], big["pp"]) == (128, 8, 8)
    assert big["local_items"] > 0 and big["rss_mb"] < 4096, big
    assert big["vote_ms_per_step"] >= 0 and big["peaks_gather_s"] >= 0
    # a training step of dp×tp = 1,024×8 with ZeRO-3 ran to its end (the fake group moves no data: whatever the loss)
    assert big["step_layout"] == "1024×8×1" and big["step_status"] in ("ok", "nonfinite") and big["step_s"] > 0


def test_checkpoint_metadata_grows_with_the_shards_not_faster(worlds):
    """DCP's metadata holds a chunk per shard of each tensor: 128 times the ranks, 8 times the pipeline stages: the
    shards per stage grow 128/8 = 16 times (dp×tp 4 → 128 per tensor, 75 tensors), and so may the bytes, no more."""
    small, large = worlds[8], worlds[1024]
    assert large["plans"] == 1024 and small["plans"] == 8
    assert large["chunks"] <= small["chunks"] * 1024 / 8
    assert large["metadata_bytes"] / large["chunks"] <= 1.2 * small["metadata_bytes"] / small["chunks"]


def test_bad_worlds_are_one_line(capsys):
    for bad in ("8,x", "12"):
        with pytest.raises(SystemExit) as e:
            fake_world.main(["--worlds", bad])
        assert e.value.code == 2 and "--worlds" in capsys.readouterr().err


def test_the_memory_line_names_the_largest_peaks_not_every_rank():
    """Every rank's peaks go to result.json; the log line names the 16 largest step peaks of a large world."""
    import subprocess
    import sys

    code = ("import logging, torch.distributed as dist\n"
            "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=64)\n"
            "from hpctrain.monitoring.memory import Peaks\n"
            "p = Peaks(0, 2**30, 2)\np.report(3 * 2**30, 64)\nprint(len(p.gathered['step_gib']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stderr.splitlines() if ln.startswith("memory per rank"))
    assert line.count("/3.00/1.00") == 16 and "(the 16 largest step peaks of 64 ranks; all in result.json)" in line
    assert p.stdout.split() == ["64"]
