"""parallel.grad_compression (ZeRO-0): the top-k hook's arithmetic on two gloo ranks, lossless settings equal to one
process, each compressor training (and differing from the plain sum), its error-feedback state through a resume,
and the refusals."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import LAYOUT_RUN, deltas, one_line, run_layout

from hpctrain.core.config import ConfigError, GradCompression
from hpctrain.runs.resolve import resolve

DDP2 = ("parallel=ddp", "parallel.dp=2")


def _grads(rank: int) -> list[torch.Tensor]:
    """Rank-specific gradients of two parameters (8 + 4 entries)."""
    g = torch.arange(12.0) * (1 if rank == 0 else -0.5) + rank
    g[rank * 5] = 40.0 * (rank + 1)  # one large entry on each rank, at different places
    return [g[:8].reshape(2, 4).clone(), g[8:].clone()]


def _topk_steps(grads_of, steps: int = 2, undoable: bool = False):
    """On a gloo rank: a two-parameter model whose gradients a top-k (25 %) exchange sums `steps` times; its rank,
    the exchange, and the summed gradients and compressor state after each step."""
    import torch.distributed as dist

    from hpctrain.parallel.compression import GradExchange

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2, 4)), torch.nn.Parameter(torch.zeros(4))])
    exchange = GradExchange(model, dist.group.WORLD, GradCompression.topk, rank=1, fraction=0.25, start_step=0)
    exchange.undoable = undoable
    exchange._bind(model, ())
    after = []
    for _ in range(steps):
        for p, g in zip(model, grads_of(rank)):
            p.grad = g.clone()
        exchange._exchange()
        after.append(([p.grad.clone() for p in model], {k: v.clone() for k, v in exchange.state_dict(rank).items()}))
    return rank, exchange, after


def _two_rank_exchange(out: str, grads_of) -> None:
    import torch.distributed as dist

    rank, exchange, after = _topk_steps(grads_of)
    torch.save({"grads": [g for g, _ in after], "state": after[-1][1]}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _expected_topk(fraction: float = 0.25, steps: int = 2):
    """The top-k sum with error feedback, computed by hand: each rank sends its k largest |g + e|, keeps the rest."""
    flat = {r: torch.cat([g.reshape(-1) for g in _grads(r)]) for r in (0, 1)}
    errors = {r: torch.zeros(12) for r in (0, 1)}
    k = int(fraction * 12)
    sums = []
    for _ in range(steps):
        total = torch.zeros(12)
        for r in (0, 1):
            acc = flat[r] + errors[r]
            idx = acc.abs().topk(k).indices
            sent = torch.zeros(12)
            sent[idx] = acc[idx]
            errors[r] = acc - sent
            total += sent
        sums.append(total)
    return sums, errors


@pytest.mark.multiproc
def test_topk_sends_each_ranks_largest_entries_and_keeps_the_rest(tmp_path):
    from hpctrain.runtime.spawn import spawn

    spawn(2, _two_rank_exchange, (str(tmp_path), _grads), threads=1)
    sums, errors = _expected_topk()
    for r in (0, 1):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        for step, expected in enumerate(sums):  # every rank holds the same sum
            torch.testing.assert_close(torch.cat([g.reshape(-1) for g in got["grads"][step]]), expected)
        torch.testing.assert_close(got["state"][f"rank{r}.error.0"], errors[r])
        assert int(got["state"]["shared.iter"]) == 2
    assert not torch.equal(sums[0], sum(torch.cat([g.reshape(-1) for g in _grads(r)]) for r in (0, 1)))


def _exchange_then_undo(out: str) -> None:
    import torch.distributed as dist

    rank, exchange, after = _topk_steps(_grads, undoable=True)
    exchange.undo()  # the second step was dropped
    torch.save({"after_one": after[0][1], "undone": exchange.state_dict(rank)}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_a_dropped_step_leaves_the_compressor_as_before_it(tmp_path):
    """monitor.loss_spike.action=skip_batch: the step's exchange already made new residuals; undo puts back the
    previous ones and the step count, so nothing of the dropped batch is sent later."""
    from hpctrain.runtime.spawn import spawn

    spawn(2, _exchange_then_undo, (str(tmp_path),), threads=1)
    for r in (0, 1):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert got["undone"].keys() == got["after_one"].keys()
        for key, value in got["after_one"].items():
            assert torch.equal(got["undone"][key], value), key


def _nonfinite_on_rank_1(rank: int) -> list[torch.Tensor]:
    grads = _grads(rank)
    if rank == 1:
        grads[1][0] = float("inf")
    return grads


@pytest.mark.multiproc
def test_a_nonfinite_gradient_is_summed_plainly_and_leaves_the_residual_alone(tmp_path):
    """An fp16-style overflow on one rank: both ranks get the plain (non-finite) sum, so the step is skipped
    everywhere, and no residual is made from it."""
    from hpctrain.runtime.spawn import spawn

    spawn(2, _two_rank_exchange, (str(tmp_path), _nonfinite_on_rank_1), threads=1)
    for r in (0, 1):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert not torch.isfinite(got["grads"][0][1]).all()
        assert f"rank{r}.error.0" not in got["state"] and int(got["state"]["shared.iter"]) == 0


@pytest.mark.multiproc
@pytest.mark.parametrize("lossless", [("parallel.grad_compression=topk", "parallel.topk_fraction=1.0"),
                                      ("parallel.grad_compression=powersgd", "parallel.powersgd_rank=1000")],
                         ids=["topk-all", "powersgd-full-rank"])
def test_lossless_settings_equal_one_process(make_cfg, tmp_path, lossless):
    """top-k of every entry, PowerSGD at a rank no matrix is worth compressing at: the exchange itself (buckets,
    the hooks' mean turned into hpctrain's sum, gradients written back) equals one process, compressed steps
    included (from step 2)."""
    ref = run_layout(make_cfg, tmp_path / "one")
    got = run_layout(make_cfg, tmp_path / "got", *DDP2, *lossless, "parallel.compression_start_step=2")
    dloss, dnorm = deltas(ref, got)
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)


COMPRESSED = {"powersgd": ("parallel.grad_compression=powersgd", "parallel.powersgd_rank=1"),
              "topk": ("parallel.grad_compression=topk", "parallel.topk_fraction=0.05")}


def _bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory))


@pytest.mark.multiproc
@pytest.mark.parametrize("method", sorted(COMPRESSED))
def test_compression_trains_and_its_residuals_survive_a_resume(make_cfg, tmp_path, method):
    """6 steps, compressed from step 2: they differ from the plain sum from step 3 on (it is applied), the loss
    falls, and a run stopped after step 3 and resumed takes steps 4-6 exactly as the uninterrupted one: the
    checkpoint holds each rank's residuals (and PowerSGD's warm-start matrices)."""
    from hpctrain.storage import checkpoint
    from hpctrain.training.run import prepare

    six = (*DDP2, "train.max_steps=6", "train.ckpt_every=3", "parallel.compression_start_step=2")
    plain = run_layout(make_cfg, tmp_path / "plain", *six)
    ref = run_layout(make_cfg, tmp_path / "ref", *six, *COMPRESSED[method])
    assert all(abs(ref[s][0] - plain[s][0]) <= 1e-6 for s in (1, 2, 3))  # the loss before the update
    assert abs(ref[4][0] - plain[4][0]) > 1e-4, (ref[4], plain[4])
    assert ref[6][0] < ref[1][0]
    run_layout(make_cfg, tmp_path / "saved", *DDP2, "parallel.compression_start_step=2", "train.ckpt_every=3",
               *COMPRESSED[method])
    step3 = os.path.join(tmp_path / "saved", "checkpoints", "step-0000003")
    # On disk the residuals add what the planner counts for them (prepare's checkpoint size, which the disk space
    # check uses): every replica's, within 10 %.
    added = _bytes(step3) - _bytes(tmp_path / "plain" / "checkpoints" / "step-0000003")
    planned = [prepare(make_cfg(*LAYOUT_RUN, *DDP2, *more)).checkpoint for more in ((), COMPRESSED[method])]
    assert added == pytest.approx(planned[1] - planned[0], rel=0.1), (added, planned)
    keys = checkpoint._SafeReader(step3).metadata.state_dict_metadata
    assert "comm.shared.iter" in keys and ("comm.shared.q.0" in keys) == (method == "powersgd")
    for r in (0, 1):
        assert f"comm.rank{r}.error.0" in keys
    shutil.copytree(tmp_path / "saved", tmp_path / "resumed", symlinks=True)
    got = run_layout(make_cfg, tmp_path / "resumed", *six, *COMPRESSED[method])
    for s in (4, 5, 6):
        assert abs(got[s][0] - ref[s][0]) <= 1e-6, (s, got[s], ref[s])
        assert got[s][1] == pytest.approx(ref[s][1], rel=1e-6), s


@pytest.mark.multiproc
def test_a_resume_onto_more_ranks_keeps_them_in_step(make_cfg, tmp_path):
    """Saved at dp=2 after 3 compressed steps, resumed at dp=4: every rank takes the shared step count (the same
    collectives on all), the new ranks start without residuals, and the run finishes."""
    compressed = (*COMPRESSED["powersgd"], "parallel.compression_start_step=2", "train.ckpt_every=3")
    run_layout(make_cfg, tmp_path / "run", *DDP2, *compressed)
    got = run_layout(make_cfg, tmp_path / "run", "parallel=ddp", "parallel.dp=4", *compressed, "train.max_steps=6")
    assert sorted(got) == list(range(1, 7)) and all(got[s][0] == got[s][0] for s in (4, 5, 6))


@pytest.mark.parametrize("overrides,world,words", [
    (["parallel=fsdp", "parallel.grad_compression=topk"], 2, ["grad_compression=topk", "zero_stage=3", "ddp"]),
    (["parallel=tp2", "parallel.zero_stage=0", "parallel.grad_compression=powersgd"], 2, ["tp=1 and pp=1"]),
    (["parallel=ddp", "parallel.grad_compression=powersgd", "parallel.grad_reduce_dtype=bf16"], 2,
     ["grad_reduce_dtype=bf16"]),
    (["parallel=ddp", "parallel.grad_compression=topk", "precision=fp16"], 2, ["precision=fp16", "bf16"]),
    (["parallel=ddp", "parallel.topk_fraction=0"], 2, ["parallel.topk_fraction=0"]),
    (["parallel=ddp", "parallel.grad_compression=powersgd", "parallel.compression_start_step=1"], 2,
     ["parallel.compression_start_step=1", ">= 2"]),
    (["parallel=ddp", "parallel.compression_start_step=-1"], 2, ["parallel.compression_start_step=-1"]),
    (["parallel=ddp", "parallel.powersgd_rank=0"], 2, ["parallel.powersgd_rank=0"]),
])
def test_compression_settings_that_cannot_work_are_one_line(make_cfg, overrides, world, words):
    with pytest.raises(ConfigError) as e:
        resolve(make_cfg(*overrides), world)
    one_line(e, *words)


def _payload(cfg, rank: int | None) -> int:
    """Bytes of one step's gradient reduction: every gradient in fp32 (rank None), or PowerSGD's P and Q of each
    matrix worth compressing at `rank` plus every other gradient (its `_should_compress` rule, min rate 2)."""
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import Llama

    with torch.device("meta"):
        model = Llama(model_args(cfg.model))
    total = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank or 0)
        total += (n + m) * r if rank and (n + m) * r * 2 < n * m else p.numel()
    return 4 * total


@pytest.mark.multiproc
def test_the_bytes_of_each_option_are_counted(make_cfg, tmp_path):
    """The sampled step's collectives, read by the profiler on every thread (PowerSGD's P and Q all-reduces run in
    its futures' callbacks): fp32 sends every gradient, bf16 half of it, PowerSGD rank 2 its factors."""
    from helpers import records

    sampled = ("train.max_steps=4", "monitor.sample_every=3", "parallel.compression_start_step=2", *DDP2)
    counted = {}
    for name, extra in (("fp32", []), ("bf16", ["parallel.grad_reduce_dtype=bf16"]),
                        ("powersgd", ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=2"])):
        run_layout(make_cfg, tmp_path / name, *sampled, *extra)
        (by_op,) = [r["comm_bytes_by_op"] for r in records(tmp_path / name) if "comm_bytes_by_op" in r]
        counted[name] = by_op["gloo:all_reduce"]
    full, low_rank = _payload(make_cfg(), None), _payload(make_cfg(), 2)
    small = 64  # the step's own small all-reduces: the loss, the stop votes
    assert full <= counted["fp32"] <= full + small, (counted, full)
    assert full // 2 <= counted["bf16"] <= full // 2 + small, (counted, full)
    assert low_rank <= counted["powersgd"] <= low_rank + small, (counted, low_rank)
    assert low_rank < full / 10


@pytest.mark.multiproc
def test_bench_comm_prints_bytes_and_loss_per_option(demo_data, tmp_path, capsys):
    """`make bench-comm`, shortened to two options and 20 steps."""
    from conftest import SMALL_MODEL

    from hpctrain.tools.bench_comm import main

    out = main(["--out", str(tmp_path), "--steps", "20", "--tail", "5", "--data", demo_data,
                "--options", "ddp fp32,topk 10%", *SMALL_MODEL, "train.micro_batch=4", "train.global_batch=8"])
    fp32, topk = out["rows"]
    assert fp32["by_op"]["gloo:all_reduce"] >= 4 * 10_000 and "gloo:all_gather" in topk["by_op"]
    assert 0 < topk["sent"] < 0.25 * fp32["sent"]
    assert fp32["val_loss"] == fp32["val_loss"] and topk["train_loss"] != fp32["train_loss"]
    assert "vs first" in capsys.readouterr().out


def test_the_planner_counts_the_residual_and_one_bucket(make_cfg):
    """Compared with ddp's plan: a residual of 4·P (8·P when a skipped batch can be undone), three buckets' worth
    (the whole model here, under 25 MB) instead of replicate's reduce buffers."""
    from hpctrain.training.planner import estimate

    plain, topk, undo = (estimate(cfg, resolve(cfg, 2), 64)["rows"][0] for cfg in (
        make_cfg("parallel=ddp"), make_cfg("parallel=ddp", "parallel.grad_compression=topk"),
        make_cfg("parallel=ddp", "parallel.grad_compression=topk", "monitor.loss_spike.action=skip_batch")))
    P = plain["params_per_device"]
    assert topk["grads"] - plain["grads"] == 4 * P and undo["grads"] - plain["grads"] == 8 * P
    assert topk["reducing"] == 3 * 4 * P
