"""The layout planner: stage map, memory estimates against measured tensor bytes, CLI and errors."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys

import pytest
import torch

from hpctrain.models import model_args
from hpctrain.models.llama.model import Llama, num_params
from hpctrain.runs.resolve import resolve
from hpctrain.training.optimizer import build_optimizer
from hpctrain.training.planner import estimate, layer_map, report, stage_params

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
LLAMA_70B = ["model=llama_70b", "parallel.dp=8", "parallel.tp=8", "parallel.pp=4", "parallel.sequence_parallel=true",
             "cluster.gpu_mem_gb=80", "precision=bf16", "train.global_batch=512", "train.micro_batch=1",
             "train.seq_len=4096"]
# ~34M parameters: parameter, gradient and optimizer bytes dwarf everything else on a 64-token step.
MEDIUM = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=1376",
          "model.vocab_size=8192", "model.max_seq_len=64", "model.tie_embeddings=false", "train.seq_len=64",
          "train.global_batch=1", "train.micro_batch=1", "train.grad_accum=1"]


# `python -m hpctrain`, reporting the process's peak resident memory on its last stderr line.
_PEAK_RSS = ("import resource, runpy, sys\ntry:\n    runpy.run_module('hpctrain', run_name='__main__', alter_sys=True)\n"
             "finally:\n    print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")


def test_llama_70b_cli(tmp_path):
    p = subprocess.run([sys.executable, "-c", _PEAK_RSS, "plan", *LLAMA_70B], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.path.abspath(ROOT)))
    assert p.returncode == 0, p.stderr
    # Planned from shapes alone, nothing materialised: one 70B block is 3.4 GB in fp32, its embedding 4.2 GB.
    rss_gib = int(p.stderr.split()[-1]) / 2**20
    assert rss_gib < 2, rss_gib
    out = p.stdout
    for s, desc in enumerate(["embed + layers 0-19", "layers 20-39", "layers 40-59", "layers 60-79 + norm + output"]):
        assert f"stage {s}: {desc}" in out
    assert "stage 4:" not in out
    # One schedule per step over its 64 micro-batches (512 / (1 × dp 8)): 3/67 = 4.5 %.
    assert "pipeline bubble: (pp−1)/(m·v + pp−1) = (4−1)/(64·1 + 4−1) = 4.5%" in out and "FLOPs per step" in out
    assert "FITS" in out and "ckpt=full" in out
    assert os.listdir(tmp_path) == []  # no run directory, no logs


def test_llama_70b_stage_counts_are_exact(make_cfg):
    cfg = make_cfg(*LLAMA_70B, small_model=False)
    args, tp = model_args(cfg.model), 8
    stages = stage_params(args, 4)
    assert [len(s.layers[0]) for s in stages] == [20] * 4
    # Summed over stages and the tp ranks of a stage (norms are replicated, counted once): the whole model.
    assert sum((s.per_device(tp) - s.replicated) * tp + s.replicated for s in stages) == num_params(args)
    layer = (num_params(args) - 2 * args.vocab_size * args.dim - args.dim) // args.n_layers
    assert stages[1].per_device(tp) == 20 * ((layer - 2 * args.dim) // tp + 2 * args.dim)


def test_layer_map_interleaved():
    assert layer_map(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert layer_map(4, 1) == [[range(0, 4)]]


def test_the_peak_is_the_worst_moment_of_the_features_terms(make_cfg):
    """The planner adds the features' terms moment by moment: the loss's buffers and a recomputed block never meet,
    gradients being reduced and the optimizer's temporary neither; a device's total is one of those moments."""
    from hpctrain.core.memory import MOMENTS, Term, merge, peak
    from hpctrain.training.planner import total

    loss, recompute = Term(backward=5), Term(recompute=3)
    assert peak([Term.held(10), loss, recompute]) == 15 and merge({"a": loss}, {"a": recompute})["a"].size == 5
    assert Term.gradients(4, accumulating=False) == Term(0, 0, 4, 4)
    cfg = make_cfg(*MEDIUM, "parallel=fsdp", "train.global_batch=2", "parallel.activation_checkpointing=full",
                   small_model=False)
    row = estimate(cfg, resolve(cfg, 2), 64)["rows"][0]
    summed = sum(row["terms"].values(), row["activations"]["full"])
    assert total(row, "full") == max(getattr(summed, m) for m in MOMENTS)
    assert total(row, "full") < sum(t.size for t in row["terms"].values()) + row["activations"]["full"].size


def _measure(cfg) -> dict[str, int]:
    """Tensor storage bytes of parameters, gradients and optimizer state in one real CPU step."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    model = Llama(model_args(cfg.model))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 65))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grads = sum(p.grad.nbytes for p in model.parameters())
    opt = build_optimizer(model, cfg.optim, 1e-3)
    opt.step()
    state = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    return {"params": params, "grads": grads, "optim": state, "rss": rss}


@pytest.mark.parametrize("optim", ["adamw", "sgd", "adafactor"])
def test_estimates_match_measured_bytes(make_cfg, optim):
    cfg = make_cfg(*MEDIUM, f"optim={optim}", small_model=False)
    row = estimate(cfg, resolve(cfg, 1), 64)["rows"][0]
    got = _measure(cfg)
    for part in ("params", "grads", "optim"):
        assert abs(row[part] - got[part]) <= 0.25 * got[part], (part, row[part], got[part])
        assert abs(row[part] - got[part]) <= 0.01 * got[part]  # in fact exact up to the step counters
    # Cross-check: the process grew by at least the tensors we measured (peak RSS is monotone, so lower bound
    # only when this is the first big allocation in the process; keep it loose).
    assert got["rss"] <= 3 * (got["params"] + got["grads"] + got["optim"]) + 2**30


def test_sharded_shares(make_cfg):
    """tp2: matrices halve, norms stay; dp2 zero3 and zero2: parameters, gradients and optimizer state halve (FSDP2
    shards them in both; ZeRO-2 keeps the gathered compute copy from forward to backward instead)."""
    base = make_cfg(*MEDIUM, small_model=False)
    model = Llama(model_args(base.model))
    full = sum(p.numel() for p in model.parameters())
    tp_share = sum(p.numel() // 2 if p.dim() > 1 else p.numel() for p in model.parameters())

    def row(*ov):
        cfg = make_cfg(*MEDIUM, *ov, small_model=False)
        return estimate(cfg, resolve(cfg, 2), 64)["rows"][0]

    tp2 = row("parallel=tp2")
    assert (tp2["params"], tp2["grads"], tp2["optim"]) == (4 * tp_share, 4 * tp_share, 8 * tp_share)
    z3 = row("parallel=fsdp", "parallel.dp=2", "train.global_batch=2")
    assert (z3["params"], z3["grads"], z3["optim"]) == (2 * full, 2 * full, 4 * full)
    z2 = row("parallel=zero2", "parallel.dp=2", "train.global_batch=2")
    assert (z2["params"], z2["grads"], z2["optim"], z2["copies"]) == (2 * full, 2 * full, 4 * full, 4 * full)
    # Accumulating: the share stays the share, unless full-size accumulation is chosen (then both are held).
    assert row("parallel=zero2", "parallel.dp=2", "train.global_batch=4", "train.micro_batch=1", "train.grad_accum=null")["grads"] == 2 * full
    unsharded = row("parallel=zero2", "parallel.dp=2", "train.global_batch=4", "train.micro_batch=1", "train.grad_accum=null",
                    "parallel.sharded_accumulation=false")
    assert unsharded["grads"] == 4 * full + 2 * full


def test_does_not_fit_suggests(make_cfg):
    cfg = make_cfg("model=llama_70b", "cluster.gpu_mem_gb=80", "train.seq_len=4096", "train.global_batch=8",
                   "train.micro_batch=1", small_model=False)
    text, fits = report(cfg, resolve(cfg, 1), 4096, [])
    assert fits is False and "DOES NOT FIT" in text and "suggestion:" in text
    # each change tried as a run takes it, with the worst stage it gives; one a run refuses is not offered
    odd = make_cfg("model=llama_7b", "model.vocab_size=50257", "parallel.dp=1", "cluster.gpu_mem_gb=40",
                   "train.seq_len=4096", "train.global_batch=8", "train.micro_batch=1", small_model=False)
    even = make_cfg("model=llama_7b", "parallel.dp=1", "cluster.gpu_mem_gb=40", "train.seq_len=4096",
                    "train.global_batch=8", "train.micro_batch=1", small_model=False)
    said = {name: next(x for x in report(c, resolve(c, 1), 4096, [])[0].splitlines() if x.startswith("suggestion:"))
            for name, c in (("odd", odd), ("even", even))}
    assert re.search(r"parallel.tp=2 \(\d+\.\d\d GiB\)", said["even"]) and "parallel.tp" not in said["odd"], said
    assert re.search(r"parallel.activation_checkpointing=full \(\d+\.\d\d GiB\)", said["odd"]), said
    cfg = make_cfg(*LLAMA_70B[:-4], "cluster.gpu_mem_gb=null", "train.seq_len=4096", "train.global_batch=512",
                   "train.micro_batch=4", small_model=False)
    text, fits = report(cfg, resolve(cfg, 256), 4096, [])
    assert fits is None and "set cluster.gpu_mem_gb to check fit" in text


def test_the_plans_node_line_is_what_a_submission_checks(make_cfg):
    """With cluster.mem_gb (--mem, per node) the plan shows a node's ranks' host memory against it (on GPUs the
    asynchronous checkpoint's copies: 4 tp ranks × 18.8 GiB of a 7B model), and says DOES NOT FIT exactly where a
    submission is refused before sbatch."""
    from hpctrain.core.errors import TrainingError
    from hpctrain.launch.submit import check
    from hpctrain.runs.resolve import resolve
    from hpctrain.training.planner import report

    base = ("model=llama_7b", "precision=bf16", "parallel=tp2", "parallel.tp=4", "cluster.gpus_per_node=4",
            "train.ckpt_async=true", "train.global_batch=8", "train.micro_batch=1")
    for gib, verdict in ((32, "DOES NOT FIT"), (500, "FITS")):
        cfg = make_cfg(*base, f"cluster.mem_gb={gib}", small_model=False)
        text, _ = report(cfg, resolve(cfg, 4), 64, [])
        assert "\ncheckpoints on disk: 75.31 GiB each (fp32 weights and optimizer state); train.ckpt_keep=2 and the " \
            "one being written: 225.92 GiB\n" in text, text
        line = next(ln for ln in text.splitlines() if ln.startswith("host memory per node: "))
        assert line.startswith("host memory per node: 4 rank(s) × 18.83 GiB (train.ckpt_async's copy) = 75.32 GiB; "
                               f"cluster.mem_gb={gib}: {verdict} "), line
        if verdict == "FITS":
            check(cfg)
        else:
            with pytest.raises(TrainingError, match=r"75\.3 GiB \(4 ranks × 18\.8 GiB\) of host memory"):
                check(cfg)


def test_a_nodes_ranks_are_summed_by_their_pipeline_stages():
    """Pipeline stages are the mesh's outermost dimension: on nodes of consecutive ranks a node holds the stages of
    its own ranks, not the worst stage's bytes on every rank (two stages of 3 and 1 GiB on 4 ranks: nodes of 2 hold
    6 and 2, one node of 4 holds 8, not 12)."""
    from hpctrain.training.planner import node_bytes

    gpu_stages = [(10.0, 3.0), (20.0, 1.0)]  # (device, host) per stage: on GPUs the host bytes count
    assert node_bytes(gpu_stages, True, 4, 2) == (6.0, 2, True)
    assert node_bytes(gpu_stages, True, 4, 4) == (8.0, 4, True) == node_bytes(gpu_stages, True, 4, 8)
    assert node_bytes(gpu_stages, True, 4, 1) == (3.0, 1, True)
    assert node_bytes([(0.0, h) for h in (1.0, 2.0, 5.0, 1.0)], True, 8, 4) == (2 * 5.0 + 2 * 1.0, 4, True)
    # on CPUs the device is the host: both count (stages of 13 and 21)
    assert node_bytes(gpu_stages, False, 4, 2) == (42.0, 2, True)
    assert node_bytes([(2.0, 1.0)], False, 4, 4) == (12.0, 4, False)


@pytest.mark.parametrize("overrides, words", [
    (["model=llama_70b", "parallel.tp=3"], ["n_heads=64", "tp=3"]),
    (LLAMA_70B[:-3] + ["train.global_batch=16", "train.micro_batch=1", "train.seq_len=4096"],
     ["train.grad_accum=2", "parallel.pp=4"]),
    (["train.bogus=1"], ["bogus"]),
    (["cluster.gpu_type=B200", "cluster.gpu_mem_gb=80"], ["cluster.gpu_type=B200 has no default rates"]),
    # placed as a submission places it: whole nodes
    (["parallel.dp=12", "train.global_batch=12", "train.micro_batch=1", "cluster.gpus_per_node=8"], ["12 ranks do not fill whole nodes of 8"]),
    (["parallel.dp=16", "train.global_batch=16", "train.micro_batch=1", "cluster.gpus_per_node=8", "cluster.nodes=1"],
     ["cluster.nodes=1 but the layout", "needs 2 node(s)"]),
])
def test_errors_are_one_line(tmp_path, overrides, words):
    from helpers import run_forked

    from hpctrain import cli

    p = run_forked(cli.main, ["plan", *overrides], cwd=tmp_path)
    assert p.code == 2
    err = p.err_lines
    assert len(err) == 1 and err[0].startswith("hpctrain: error:"), p.err
    assert all(w in err[0] for w in words), err[0]


# The planner against what a real run allocates. A model whose parameters, activations and logits all count
# (7.1 M parameters, 4 blocks, 8192-token vocabulary, 4 × 256 tokens per micro-batch, two micro-batches a step),
# two steps per run, on a synthetic shard set made for that vocabulary. `fsdp_tied64k`: a 64k-token tied
# embedding and 16-token samples, so that the peak is the end of backward, the embedding's gradients being reduced.
# In bf16 the blocks are 128 wide (and fused64k's vocabulary 16k on 64-token samples): on a CPU without AVX512-BF16
# PyTorch's bf16 matmul takes a reference path ~15x slower than fp32 (pytorch#146508; g @ w of the 64k head, 1024
# tokens: 75 s against 0.4 s), which made this test 17 minutes of the suite. Every term the planner has for bf16
# (compute copies, autocast's casts, the loss's bf16 buffers) is still measured, within 8 % at this size.
PEAK_MODEL = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=688",
              "model.vocab_size=8192", "model.max_seq_len=256", "model.tie_embeddings=false"]
PEAK_RUN = ["train.max_steps=2", "train.eval_every=0", "train.checkpointing=false", "logging.trackers=[]",
            "cluster.num_threads=1", "train.global_batch=8", "train.micro_batch=4", "train.grad_accum=null"]
PEAK_CASES = {"single": [], "ddp": ["parallel=ddp", "parallel.dp=2"], "fsdp": ["parallel=fsdp", "parallel.dp=2"],
              "tp2": ["parallel=tp2"], "pp2": ["parallel=pp2"],
              # ZeRO under a pipeline schedule: torch keeps the weights gathered and the gradients unreduced from one
              # micro-batch to the next (the reduction runs after the last)
              "pp2_dp2_zero2": ["parallel=pp2", "parallel.dp=2", "parallel.zero_stage=2", "train.micro_batch=2"],
              "pp2_dp2_zero3": ["parallel=pp2", "parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch=2"],
              "fsdp_tied64k": ["parallel=fsdp", "parallel.dp=2", "model.vocab_size=65536", "model.max_seq_len=16",
                               "model.tie_embeddings=true", "model.n_layers=2"],
              # train.fused_loss on a 64k vocabulary, the loss's buffers a large part of the peak.
              "fused64k": ["train.fused_loss=true", "model.vocab_size=65536", "model.n_layers=2"],
              # Gradient compression (top-k) from step 1: the residual kept between steps. (PowerSGD: one rank in
              # some runs holds ~30 MiB more than the plan, unexplained: −10 … −18 %, docs/planner.md.)
              "ddp_topk": ["parallel=ddp", "parallel.dp=2", "parallel.grad_compression=topk",
                           "parallel.compression_start_step=1", "train.max_steps=3"],
              # Context parallel: half of each sequence's activations per rank, the gathered keys and values, the
              # chunks' document masks.
              "cp2_docs": ["parallel.cp=2", "train.document_mask=true"]}
# The precisions each case is measured in (both, unless named here).
PEAK_PRECISIONS = {"ddp_topk": ("fp32",), "cp2_docs": ("fp32",)}
# Tighter than the 15 % promise where a term would hide inside it: top-k's residual is 11 % of its peak (measured
# within 1.2 % of the plan; −11.6 % with the residual left out of backward's start).
PEAK_TOLERANCE = {"ddp_topk": 0.05,
                  # the last stage under ZeRO-3 measured 0.099 and 0.107 GiB (ckpt=full) in runs of one config, the
                  # plan 0.116: +9 … +18 % (an over-estimate, the safe side)
                  "pp2_dp2_zero3": 0.2}
PEAK_BF16 = ["model.dim=128", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=344"]
PEAK_BF16_CASES = {"fused64k": ["model.vocab_size=16384", "model.max_seq_len=64"]}
# bf16 runs take ~4x fp32's here (the bf16 matmuls above): activation checkpointing is measured in bf16 where it meets
# a bf16 term of its own (one process; the pipeline's micro-batches in flight), in fp32 everywhere but where the
# case's own term does not depend on it (replicate's peak is one process's; the compressor's residual, the loss's
# buffers and a tied embedding's gradients are the same with it).
PEAK_BF16_AC = ("single", "pp2")
PEAK_NO_AC = ("ddp", "ddp_topk", "fused64k", "fsdp_tied64k")


@pytest.fixture(scope="module")
def synthetic_shards(tmp_path_factory):
    """Synthetic shard sets by (vocabulary, seq_len), each built once for the module."""
    from data_prep.synthetic import build_synthetic

    built = {}

    def get(vocab: int, seq_len: int) -> str:
        if (vocab, seq_len) not in built:
            out = str(tmp_path_factory.mktemp(f"shards-{vocab}-{seq_len}"))
            build_synthetic(out, vocab, seq_len, samples=64, shards=8)
            built[vocab, seq_len] = out
        return built[vocab, seq_len]

    return get


def _tensor_peak(prof) -> int:
    """The most bytes of tensors allocated at once while profiling (the CPU counterpart of
    torch.cuda.max_memory_allocated), from the allocations and frees the profiler records, less gloo's copies of
    reduce-scatter inputs: ProcessGroupGloo clones the input of `_reduce_scatter_base_` (NCCL reduces in place) and
    its worker thread frees the clone after the collective has returned, late on an oversubscribed CPU — up to five
    blocks' gradients were seen alive at backward's end (0 … 11 MiB on a 126 MiB fp32 FSDP rank), which made FSDP
    peaks vary by ±10 % from run to run; without them the peak is the same in every run. The profiler records only
    the frees of the threads it profiles: a tensor whose last reference gloo's worker thread drops (a functional
    collective's output, such as sequence parallelism's gathered activations) looked alive until the end, and was
    9-15 MiB of a 0.13 GiB tp2_sp rank's peak. The address being handed out again says it was freed by then."""
    from torch._C._profiler import _ExtraFields_Allocation

    events, stack = [], [(e, False) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, in_gloo_copy = stack.pop()
        in_gloo_copy = in_gloo_copy or event.name == "c10d::_reduce_scatter_base_"
        stack.extend((child, in_gloo_copy) for child in event.children)
        if isinstance(event.extra_fields, _ExtraFields_Allocation):
            f = event.extra_fields
            events.append((event.start_time_ns, f.ptr, f.alloc_size, in_gloo_copy))
    live, total, peak = {}, 0, 0
    for _, ptr, size, gloo_copy in sorted(events, key=lambda e: (e[0], e[2] > 0)):  # a free first at a tie
        if size > 0:
            total -= live.pop(ptr, 0)  # an address handed out again was freed before: its free went unrecorded
            live[ptr] = 0 if gloo_copy else size
            total += live[ptr]
        else:
            total -= live.pop(ptr, 0)  # (a tensor allocated before profiling began: not counted in, nor out)
        peak = max(peak, total)
    return peak


def _profiled_rank(cfg, run_dir: str, prepared) -> None:
    """One rank of a real run (model built, two steps), every allocation recorded from before the model exists."""
    from torch.profiler import ProfilerActivity, profile

    from hpctrain.training.run import _rank_main

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _rank_main(cfg, run_dir, prepared)
    with open(os.path.join(run_dir, f"peak.{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(_tensor_peak(prof)))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("case", PEAK_CASES)
def test_planner_within_15_percent_of_measured_peak(make_cfg, synthetic_shards, tmp_path, case):
    """Per device, fp32 and bf16, both activation-checkpointing modes (in bf16 for PEAK_BF16_AC): the planner's
    estimate (the run reports it per rank in result.json) against the tensor bytes the rank's allocator held at its
    peak."""
    from hpctrain.runtime.spawn import spawn
    from hpctrain.training.run import prepare

    # fsdp_tied64k: the peak is at the tied embedding's gradient (+8 % fp32, +13 % bf16, every run).
    # ddp_topk in fp32 only: the residual it adds is fp32 whatever the precision.
    for precision in PEAK_PRECISIONS.get(case, ("fp32", "bf16")):
        overrides = [*PEAK_MODEL, *PEAK_RUN, *PEAK_CASES[case]]
        if precision == "bf16":
            overrides += [*PEAK_BF16, *PEAK_BF16_CASES.get(case, [])]
        model = make_cfg(*overrides, small_model=False).model
        data = synthetic_shards(model.vocab_size, model.max_seq_len)
        both = (precision == "fp32" and case not in PEAK_NO_AC) or case in PEAK_BF16_AC
        for ac in ("none", "full") if both else ("none",):
            cfg = make_cfg(*overrides, f"data.path={data}", f"precision={precision}",
                           f"parallel.activation_checkpointing={ac}", small_model=False)
            prepared, run_dir = prepare(cfg), tmp_path / f"{precision}-{ac}"
            run_dir.mkdir()
            spawn(prepared.shape.world, _profiled_rank, (cfg, str(run_dir), prepared))
            memory = json.loads((run_dir / "result.json").read_text())["memory"]
            measured = [int((run_dir / f"peak.{r}").read_text()) / 2**30 for r in range(prepared.shape.world)]
            planned = memory["planned_gib"]
            errors = [(p - m) / m for p, m in zip(planned, measured)]
            print(f"{case} {precision} ac={ac}: planned {planned} measured {[round(m, 4) for m in measured]} "
                  f"({', '.join(f'{100 * e:+.1f} %' for e in errors)})")
            assert all(abs(e) <= PEAK_TOLERANCE.get(case, 0.15) for e in errors), (precision, ac, planned, measured)
            # The run's own report: every rank's resident peaks, above the tensors it held (runtime, allocator).
            assert all(s >= 0.9 * m for s, m in zip(memory["step_gib"], measured)), (memory, measured)
            assert all(s > 0 for s in memory["startup_gib"]), memory


def _shape(dim, layers, heads, kv, ffn, vocab, seq, tie=False, **kw) -> list[str]:
    return [f"model.dim={dim}", f"model.n_layers={layers}", f"model.n_heads={heads}", f"model.n_kv_heads={kv}",
            f"model.ffn_hidden={ffn}", f"model.vocab_size={vocab}", f"model.max_seq_len={seq}",
            f"model.tie_embeddings={tie}", *[f"model.{k}={v}" for k, v in kw.items()]]


# Shapes no shipped config has, across the families: odd head counts and GQA ratios (6/2, 9/3, 12/4, MQA 8/1, MHA),
# head_dim apart from dim/n_heads, a sliding window shorter than the sequence, large tied vocabularies, a deep narrow
# model; fsdp, tp (with sequence parallelism), pp and one process, bf16 and fp32. Small enough for ~1 s a run.
_FSDP, _TP2 = ["parallel=fsdp", "parallel.dp=2"], ["parallel=tp2"]
_MASKED = ["train.document_mask=true", "train.restart_positions=true"]
_LLAMA3 = {"rope_scaling.type": "llama3", "rope_scaling.factor": 8.0, "rope_scaling.original_max_seq_len": 64}
SWEEP = {
    "llama-6h2kv-fsdp-bf16": (_shape(192, 6, 6, 2, 512, 2048, 128) + _FSDP, "bf16"),
    "llama3-hd48-single-bf16": (_shape(128, 3, 4, 2, 384, 4096, 128, head_dim=48, **_LLAMA3), "bf16"),
    "llama-12h4kv-tp2-bf16": (_shape(192, 3, 12, 4, 512, 4096, 128) + _TP2, "bf16"),
    "llama-mha-bigffn-single-fp32": (_shape(128, 3, 8, 8, 1024, 4096, 128), "fp32"),
    # replicate in fp32 peaking at backward's end (its parameters are not gathered: +16.6 % when they were counted)
    "llama-bigffn-ddp2-fp32": (_shape(256, 3, 4, 2, 2048, 4096, 128) + ["parallel=ddp", "parallel.dp=2"], "fp32"),
    "llama-mqa-fsdp-bf16": (_shape(128, 4, 8, 1, 384, 2048, 128) + _FSDP, "bf16"),
    "llama-9h3kv-tied8k-fsdp-bf16": (_shape(144, 8, 9, 3, 384, 8192, 128, tie=True) + _FSDP, "bf16"),
    "llama-deep-narrow-fsdp-fp32": (_shape(64, 16, 4, 1, 192, 2048, 128) + _FSDP, "fp32"),
    "mistral-window32-tp2-fp32": (_shape(128, 3, 4, 2, 384, 4096, 128, family="mistral", sliding_window=32) + _TP2,
                                  "fp32"),
    "mistral-hd40-fsdp-bf16": (_shape(128, 4, 4, 4, 384, 2048, 128, family="mistral", head_dim=40,
                                      sliding_window=48) + _FSDP, "bf16"),
    "qwen2-tied16k-fsdp-fp32": (_shape(256, 6, 8, 2, 704, 16384, 64, tie=True, family="qwen2") + _FSDP, "fp32"),
    "qwen2-pp2-fp32": (_shape(128, 4, 4, 2, 384, 4096, 128, family="qwen2") + ["parallel=pp2"], "fp32"),
    "qwen3-hd64-tp2-sp-bf16": (_shape(128, 3, 4, 2, 384, 4096, 128, family="qwen3", head_dim=64) + _TP2
                               + ["parallel.sequence_parallel=true"], "bf16"),
    "qwen3-tied-hd48-fsdp-fp32": (_shape(128, 4, 4, 2, 384, 8192, 128, tie=True, family="qwen3", head_dim=48)
                                  + _FSDP, "fp32"),
    # train.document_mask on long samples, the masks ([B, 1, T, T] per micro-batch in flight) a large part of the peak
    "llama-docmask-seq1024-single-fp32": (_shape(64, 2, 4, 2, 192, 512, 1024) + _MASKED, "fp32"),
    "mistral-docmask-window-pp2-fp32": (_shape(64, 4, 4, 2, 192, 512, 1024, family="mistral", sliding_window=256)
                                        + _MASKED + ["parallel=pp2"], "fp32"),
    # MoE: the experts' parameters and optimizer state (all of them), their routed activations (k of them)
    "mixtral-e8k2-single-fp32": (_shape(128, 3, 4, 2, 384, 4096, 128, family="mixtral", **{
        "moe.num_experts": 8, "moe.top_k": 2, "moe.aux_loss_coef": 0.01}), "fp32"),
    "qwen3moe-e16k4-fsdp-bf16": (_shape(128, 4, 4, 2, 384, 4096, 128, family="qwen3_moe", head_dim=32, **{
        "moe.num_experts": 16, "moe.top_k": 4, "moe.expert_hidden": 128}) + _FSDP, "bf16"),
    "mixtral-e8k2-ep2-fp32": (_shape(128, 3, 4, 2, 384, 4096, 128, family="mixtral", **{
        "moe.num_experts": 8, "moe.top_k": 2}) + _FSDP + ["parallel.ep=2"], "fp32"),
    # ZeRO-2 gathers each rank's share of the experts only (measured +29.6 % / +15.3 % when all were counted)
    "mixtral-e8k2-ep2-zero2-fp32": (_shape(128, 3, 4, 2, 384, 4096, 128, family="mixtral", **{
        "moe.num_experts": 8, "moe.top_k": 2}) + _FSDP + ["parallel.ep=2", "parallel.zero_stage=2"], "fp32"),
}
# Expert parallelism: the planner counts an even share of the routed tokens per rank, and in these two steps the router
# sends rank 1's experts twice rank 0's (12 against 6 MiB of expert activations, every run): rank 0 measures 0.0498 GiB
# (plan 0.0574: +15.3 %), rank 1 0.0601 (−4.5 %).
SWEEP_TOLERANCE = {"mixtral-e8k2-ep2-fp32": 0.2, "mixtral-e8k2-ep2-zero2-fp32": 0.2}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("case", SWEEP)
def test_planner_sweep_within_15_percent_across_families(make_cfg, synthetic_shards, tmp_path, case):
    """The planner against each rank's measured tensor peak (two steps, two micro-batches of 2) on shapes outside
    the shipped configs, every family: within ±15 %."""
    from hpctrain.runtime.spawn import spawn
    from hpctrain.training.run import prepare

    overrides, precision = SWEEP[case]
    run = [*overrides, *PEAK_RUN, "train.global_batch=4", "train.micro_batch=2", f"precision={precision}"]
    model = make_cfg(*run, small_model=False).model
    cfg = make_cfg(*run, f"data.path={synthetic_shards(model.vocab_size, model.max_seq_len)}", small_model=False)
    prepared = prepare(cfg)
    spawn(prepared.shape.world, _profiled_rank, (cfg, str(tmp_path), prepared))
    planned = json.loads((tmp_path / "result.json").read_text())["memory"]["planned_gib"]
    measured = [int((tmp_path / f"peak.{r}").read_text()) / 2**30 for r in range(prepared.shape.world)]
    errors = [(p - m) / m for p, m in zip(planned, measured)]
    print(f"{case}: planned {planned} measured {[round(m, 4) for m in measured]} "
          f"({', '.join(f'{100 * e:+.1f} %' for e in errors)})")
    assert all(abs(e) <= SWEEP_TOLERANCE.get(case, 0.15) for e in errors), (planned, measured)


@pytest.mark.multiproc
def test_bench_scale_smoke(tmp_path, capsys, monkeypatch):
    """`make bench-scale`'s code path on a shrunken llama_1b (its 128k vocabulary kept): the synthetic data is made
    once and reused, and every rank's peaks are printed against the planner."""
    from hpctrain.tools import bench_scale

    # malloc's mmap threshold, once fixed, would stay fixed for the rest of this test process.
    monkeypatch.setattr(bench_scale, "_fix_mmap_threshold", lambda: False)

    # fp32: bf16 matmuls on a CPU without AVX512-BF16 are ~15x slower (see PEAK_BF16), and the path is the same.
    small = ["model.dim=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
             "precision=fp32"]
    result = bench_scale.main(["--out", str(tmp_path), *small])
    out = capsys.readouterr().out
    assert result["status"] == "completed" and result["steps"] == 2, out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0] in ("0", "1")]
    assert [r[0] for r in rows] == ["0", "1"] and all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows), out
    ckpts = tmp_path / "run" / "checkpoints"
    assert not ckpts.exists() or not os.listdir(ckpts)  # train.checkpointing=false
    manifest = (tmp_path / "data" / "manifest.json").stat().st_mtime_ns
    bench_scale.main(["--out", str(tmp_path), *small])  # the data is reused, the first run moved aside
    assert (tmp_path / "data" / "manifest.json").stat().st_mtime_ns == manifest
    assert (tmp_path / "run" / "previous").is_dir()


@pytest.mark.parametrize("layout", [[], ["parallel=fsdp", "parallel.dp=2"]])
def test_async_host_copy_is_the_checkpoints_share(make_cfg, synthetic_shards, tmp_path, layout):
    """train.ckpt_async keeps a host copy of each rank's share of a checkpoint: the planner's line against the
    bytes of a real checkpoint (every rank's shards, with DCP's per-tensor headers)."""
    from hpctrain.training.run import train

    run = (*MEDIUM, *layout, f"data.path={synthetic_shards(8192, 32)}", "train.seq_len=32", "train.global_batch=2",
           "train.grad_accum=null")
    cfg = make_cfg(*run, "train.ckpt_async=true", "train.max_steps=1", "train.ckpt_every=1", "train.eval_every=0",
                   small_model=False)
    train(cfg, str(tmp_path))
    ck = tmp_path / "checkpoints" / "step-0000001"
    on_disk = sum(f.stat().st_size for f in ck.iterdir() if f.name.endswith(".distcp"))
    shape = resolve(cfg, 2 if layout else 1)
    planned = estimate(cfg, shape, 32)["rows"][0]["async_copy"] * shape.dp
    assert abs(planned - on_disk) <= 0.02 * on_disk, (planned, on_disk)
    off = make_cfg(*run, small_model=False)
    assert estimate(off, resolve(off, 2 if layout else 1), 32)["rows"][0]["async_copy"] == 0


def test_bench_ckpt_smoke(tmp_path, capsys):
    """`make bench-ckpt`'s code path on a small model: both runs, the disk's speed, every figure printed; the runs'
    directory removed afterwards, the synthetic data kept."""
    from hpctrain.tools import bench_ckpt

    figures = bench_ckpt.main(["--out", str(tmp_path), "--model", "tiny", "--steps", "4", "--every", "2",
                               "model.dim=64", "model.n_layers=2"])
    out = capsys.readouterr().out
    assert len(figures["sync_stalls_s"]) == len(figures["async_stalls_s"]) == len(figures["async_write_s"]) == 2
    assert all(s > 0 for s in figures["sync_stalls_s"] + figures["async_stalls_s"]) and figures["checkpoint_gb"] > 0
    assert len(figures["raw_write_gb_s"]) == 3 and min(figures["raw_write_gb_s"]) > 0
    assert "sync:  stall per save" in out and "async: stall per save" in out and "% of raw" in out, out
    assert sorted(os.listdir(tmp_path)) == ["data"]


@pytest.mark.parametrize("kind", ["fp32", "autocast", "lowp"])
def test_a_compiled_block_saves_what_the_planner_counts(kind):
    """parallel.compile: what torch.compile keeps for backward (saved-tensor hooks on the compiled block) is the
    planner's per-token figure exactly; eager keeps a third more. The backend is Inductor's own decompositions and
    min-cut partitioner without its code generation (which does not change what is saved: Inductor itself gave the
    same bytes, 3 s here against 17 s cold); an H100 confirmed the figure against the CUDA allocator's peak
    (docs/planner.md). The shape keeps dim, q, kv and ffn apart, so each coefficient shows."""
    from hpctrain.models.llama.model import ModelArgs
    from hpctrain.models.llama.parallel import block_activations

    args = ModelArgs(dim=192, n_layers=1, n_heads=4, n_kv_heads=1, head_dim=64, ffn_hidden=640, vocab_size=64,
                     max_seq_len=64)
    torch.manual_seed(0)
    model = Llama(args).to(torch.bfloat16 if kind == "lowp" else torch.float32)
    block = model.layers["0"]
    block.compile(fullgraph=True, backend="aot_eager_decomp_partition")

    def saved(batch: int) -> int:
        storages = {}

        def pack(t):
            if not (t.is_leaf and t.requires_grad):  # parameters and the input's leaf are not activations
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x0 = torch.randn(batch, 32, args.dim, dtype=torch.bfloat16 if kind == "lowp" else None, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = x0 * 1.0  # the block's input is a previous block's output, not a leaf
            torch._dynamo.mark_dynamic(x, 0)  # one compiled graph for both batch sizes
            with torch.autocast("cpu", torch.bfloat16, enabled=kind == "autocast"):
                y = block(x, model.rope_cos, model.rope_sin)
        y.float().sum().backward()
        return sum(storages.values())

    per_token = (saved(4) - saved(2)) / (2 * 32)  # the weights' casts and RoPE's slices do not grow with the batch
    assert per_token == block_activations(args, 1, kind, 1, 1, 32, compiled=True)[0]
    assert per_token < 0.8 * block_activations(args, 1, kind, 1, 1, 32)[0]


def test_the_plan_counts_a_tied_model_once_names_cp_and_caps_the_longest_sequence(make_cfg):
    """The headline: a tied embedding counted once however many stages hold a copy, the layout's product with cp in
    it; the longest sequence that fits, never past model.max_seq_len (the memory's figure beside it)."""
    from hpctrain.parallel.layout import world_of
    from hpctrain.runs.resolve import resolve
    from hpctrain.training import planner

    texts = {}
    for name, extra in (("one", []), ("pp2", ["parallel.pp=2"]),
                        ("cp4", ["parallel.cp=4", "parallel.tp=2", "train.seq_len=1024"])):
        cfg = make_cfg("model=llama_1b", "parallel.dp=1", "train.global_batch=8", "train.micro_batch=1",
                       "cluster.gpu_mem_gb=80", *extra, small_model=False)
        plan = resolve(cfg, world_of(cfg.parallel, 8))
        texts[name] = planner.report(cfg, plan, cfg.train.seq_len or cfg.model.max_seq_len, [])[0]
    heads = {name: text.splitlines()[0].split("; ") for name, text in texts.items()}
    assert heads["one"][0] == heads["pp2"][0] == "model llama_1b: 1.236B parameters (counted on the meta device)"
    assert heads["cp4"][1].startswith("layout pp×dp×cp×tp = 1×1×4×2 = 8 devices"), heads["cp4"]
    longest = next(line for line in texts["one"].splitlines() if line.startswith("longest train.seq_len"))
    assert longest.endswith("8192 tokens (model.max_seq_len; the memory would hold 12105: raise model.max_seq_len "
                            "to train longer)"), longest


def test_cpu_offload_counts_its_host_memory_and_a_node_it_does_not_fit_is_said(make_cfg):
    """parallel.cpu_offload: the device holds no fp32 weights, gradients or optimizer state; the host holds them
    (sharded) per rank, which the node line — the submission's check — counts against cluster.mem_gb."""
    from hpctrain.parallel.layout import world_of
    from hpctrain.runs.resolve import resolve
    from hpctrain.training import planner

    base = ["model=llama_7b", "parallel=fsdp", "parallel.dp=8", "train.global_batch=8", "train.micro_batch=1",
            "train.seq_len=4096", "cluster.gpus_per_node=8", "cluster.mem_gb=64", "cluster.gpu_mem_gb=80"]
    cfg = make_cfg(*base, "parallel.cpu_offload=true", small_model=False)
    plan = resolve(cfg, world_of(cfg.parallel, 8))
    (row,) = planner.estimate(cfg, plan, 4096)["rows"]
    assert row["params"] == row["grads"] == row["optim"] == 0
    assert row["offload"] == 16 * row["params_per_device"] / 8  # fp32 weights, gradients, AdamW's two moments
    assert planner.stage_bytes(cfg, plan, 4096)[0][1] == row["offload"]
    text, _ = planner.report(cfg, plan, 4096, [])
    line = next(x for x in text.splitlines() if x.startswith("host memory per node"))
    assert f"8 rank(s) × {row['offload'] / planner.GiB:.2f} GiB (parallel.cpu_offload's weights and optimizer " \
           "state)" in line and "cluster.mem_gb=64: DOES NOT FIT" in line, line
    on_device = make_cfg(*base, small_model=False)
    (row,) = planner.estimate(on_device, resolve(on_device, 8), 4096)["rows"]
    assert row["offload"] == 0 and row["params"] > 0
