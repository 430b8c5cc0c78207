"""The bad-node list (cluster.bad_nodes): what is recorded, when a node is left out, the file's safety, and
`hpctrain nodes`. (On the Slurm cluster: test_slurm's killed rank puts its node on the list, and the next
submission carries --exclude for it.)"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from helpers import one_line, run_forked

from hpctrain import cli
from hpctrain.core.config import ConfigError
from hpctrain.launch import preflight
from hpctrain.monitoring.comm_sample import STRAGGLED_SAMPLES, CommSampler
from hpctrain.runtime import bad_nodes


def test_a_dead_node_is_left_out_at_once_a_straggler_after_two_runs_and_records_expire(tmp_path):
    path = str(tmp_path / "list.json")
    assert bad_nodes.excluded(path, 72) == {}  # no file: no list
    for rank in range(3):  # every surviving rank reports the same loss: one record
        bad_nodes.record(path, ["n2"], "died", f"lost its peer (seen by rank {rank})", "runs/a")
    assert len(bad_nodes.read(path)) == 1
    bad_nodes.record(path, ["n3"], "straggler", "straggled", "runs/a")
    assert set(bad_nodes.excluded(path, 72)) == {"n2"}
    bad_nodes.record(path, ["n3"], "straggler", "straggled again", "runs/b")
    assert bad_nodes.excluded(path, 72) == {"n2": "died: lost its peer (seen by rank 0)",
                                             "n3": "straggler: straggled again (2 times)"}
    assert bad_nodes.excluded(path, 72, now=time.time() + 73 * 3600) == {}  # expired
    assert bad_nodes.excluded(None, 72) == {}
    assert bad_nodes.clear(path, ["n3"]) == 2 and set(bad_nodes.excluded(path, 72)) == {"n2"}
    assert bad_nodes.clear(path) == 1 and bad_nodes.read(path) == []


def test_a_file_hpctrain_did_not_write_is_never_overwritten(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text(json.dumps({"mine": [1, 2]}))
    with pytest.raises(ConfigError) as e:
        bad_nodes.excluded(str(path), 72)
    assert "is not a bad-node list written by hpctrain" in one_line(e.value, "cluster.bad_nodes")
    bad_nodes.record(str(path), ["n1"], "died", "lost")  # said in the log, never raised, file kept
    assert json.loads(path.read_text()) == {"mine": [1, 2]}
    with pytest.raises(ConfigError):
        bad_nodes.clear(str(path))
    assert json.loads(path.read_text()) == {"mine": [1, 2]}
    # A node name that would open a new line in a job script (#SBATCH --exclude=...) is no node of a list.
    crafted = tmp_path / "crafted.json"
    crafted.write_text(json.dumps({"format": bad_nodes.FORMAT, "records": [
        {"node": "n1\necho injected", "reason": "died", "detail": "x", "at": time.time()}]}))
    with pytest.raises(ConfigError):
        bad_nodes.excluded(str(crafted), 72)
    bad_nodes.record(str(tmp_path / "list.json"), ["n1\necho injected", "n2"], "died", "lost")
    assert [r.node for r in bad_nodes.read(str(tmp_path / "list.json"))] == ["n2"]


def test_a_node_straggling_in_enough_samples_is_recorded_at_the_end_of_the_run(tmp_path):
    path = str(tmp_path / "list.json")
    for run in ("runs/a", "runs/b"):
        sampler = CommSampler(0, 0.3, 1, torch.device("cpu"), None, path, run)
        sampler._straggled_nodes = {"n5": STRAGGLED_SAMPLES, "n6": STRAGGLED_SAMPLES - 1}  # as after_step counts
        sampler.close()
    assert [(r.node, r.reason, r.run) for r in bad_nodes.read(path)] == [("n5", "straggler", "runs/a"),
                                                                        ("n5", "straggler", "runs/b")]
    assert set(bad_nodes.excluded(path, 72)) == {"n5"}


def test_preflight_records_the_nodes_it_names(tmp_path):
    results = [{"rank": r, "node": f"n{r}", "gemm_tflops": 1.0 if r != 2 else 0.2, "p2p_next_gbps": None,
                "problem": None} for r in range(4)]
    status, message, named = preflight.findings(results, 0.7)
    assert (status, named) == ("slow", ["n2"]) and "SLOW: n2" in message
    assert preflight.verdict(results, 0.7) == (status, message)
    code = preflight.main(["--ranks", "1", "--gemm", "64", "--size-mb", "0.01", "--iters", "1",
                           "--bad-nodes", str(tmp_path / "list.json")])
    assert code == 0 and not os.path.exists(tmp_path / "list.json")  # healthy: nothing recorded


def test_hpctrain_nodes_lists_and_clears(tmp_path):
    path = tmp_path / "list.json"
    bad_nodes.record(str(path), ["n2"], "died", "a collective in step 7 lost its peer", "runs/a")
    bad_nodes.record(str(path), ["n3"], "straggler", "straggled", "runs/a")
    p = run_forked(cli.main, ["nodes", f"cluster.bad_nodes={path}"], cwd=tmp_path)
    assert p.code == 0, p.err
    rows = {line.split()[0]: line.split() for line in p.out.splitlines()[2:]}
    assert rows["n2"][1:3] == ["died", "1"] and "yes" in rows["n2"] and "lost its peer" in p.out
    assert rows["n3"][1:3] == ["straggler", "1"] and "no" in rows["n3"]  # one run: not yet left out
    p = run_forked(cli.main, ["nodes", "--sbatch", f"cluster.bad_nodes={path}"], cwd=tmp_path)
    assert p.code == 0 and p.out.split() == ["--exclude=n2"], p.out + p.err  # (n3: not yet)
    p = run_forked(cli.main, ["nodes", "clear", "n2", f"cluster.bad_nodes={path}"], cwd=tmp_path)
    assert p.code == 0 and "cleared 1 record" in p.out, p.err
    assert [r.node for r in bad_nodes.read(str(path))] == ["n3"]
    p = run_forked(cli.main, ["nodes", "--sbatch", f"cluster.bad_nodes={path}"], cwd=tmp_path)
    assert p.code == 0 and p.out.strip() == "", p.out  # nothing to leave out: no option at all
    p = run_forked(cli.main, ["nodes", "drop", f"cluster.bad_nodes={path}"], cwd=tmp_path)
    assert p.code == 2 and p.err_lines == ["hpctrain: error: nodes 'drop' is not an action: use `nodes` to list or "
                                           "`nodes clear [NODE ...]`"], p.err
    # The default list comes from the environment (here the test's own, see conftest).
    bad_nodes.record(os.environ["HPCTRAIN_BAD_NODES"], ["n1"], "hung", "stopped responding")
    p = run_forked(cli.main, ["nodes"], cwd=tmp_path)
    assert p.code == 0 and "n1" in p.out and "hung" in p.out, p.out


def test_an_exclude_in_sbatch_extra_adds_to_the_bad_node_list(make_cfg, tmp_path):
    """`+cluster.sbatch_extra.exclude=nX` (docs/troubleshooting.md) joins the list's nodes in the job's one --exclude
    instead of replacing it (submitit writes the extra options over its own)."""
    from omegaconf import open_dict

    path = tmp_path / "list.json"
    bad_nodes.record(str(path), ["n2"], "died", "a collective in step 7 lost its peer", "runs/a")
    cfg = make_cfg(f"cluster.bad_nodes={path}", "+cluster.sbatch_extra.exclude='n[7-8]'",
                   "+cluster.sbatch_extra.exclusive=true")
    with open_dict(cfg):
        cfg.job = {"exclude": "${hpctrain_slurm:exclude}", "extra": "${hpctrain_slurm:sbatch_extra}"}
    assert cfg.job.exclude == "n2,n[7-8]"
    assert dict(cfg.job.extra) == {"requeue": True, "exclusive": True}
