"""The step-time model (training/step_time.py), `plan --search` and the validation table against published runs."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpctrain import cli
from hpctrain.core.config import ConfigError, ModelConfig
from hpctrain.models import get_spec
from hpctrain.parallel.layout import Layout
from hpctrain.runs.compose import compose
from hpctrain.training import published, step_time
from hpctrain.training.step_time import HARDWARE, StepInputs, all_reduce_s, gather_s, predict

ROOT = Path(__file__).resolve().parents[1]
A100, H100 = HARDWARE["A100"], HARDWARE["H100"]
SPEC = get_spec("llama")
ARGS_7B = SPEC.args(ModelConfig(dim=4096, n_layers=32, n_heads=32, ffn_hidden=11008, vocab_size=32000,
                                max_seq_len=4096))


def _inputs(layout: Layout | None = None, **kw) -> StepInputs:
    return StepInputs(ARGS_7B, SPEC, layout or Layout(), kw.pop("micro_batch", 1), kw.pop("grad_accum", 1), 4096, c=2, **kw)


def test_collectives_follow_the_link_they_cross():
    """All-reduce inside a node: 2(n−1)/n·S over NVLink; one rank per node: the same over the NIC; an all-gather
    moves half an all-reduce's bytes, one latency step per rank of its ring."""
    S = 1e9
    lat = A100.latency_us * 1e-6
    assert all_reduce_s(S, 8, 1, A100) == pytest.approx(2 * S * 7 / 8 / 230e9 + 2 * 7 * lat)
    assert all_reduce_s(S, 1, 16, A100) == pytest.approx(2 * S * 15 / 16 / 23e9 + 2 * 4 * lat)
    assert gather_s(S, 8, 4, A100) == pytest.approx(S * 7 / 8 / 230e9 + S * 3 / 4 / (8 * 23e9) + 31 * lat)
    assert all_reduce_s(S, 1, 1, A100) == gather_s(S, 1, 1, A100) == 0.0


def test_one_gpu_is_its_flops_at_the_gemm_rate_plus_memory_bound_work():
    """No communication on one GPU: the matmuls' 6·N FLOPs per token at the shape-scaled GEMM rate, flash
    attention's half of 12·L·H·Q·T at attn_frac of it, the elementwise bytes and the optimizer's pass."""
    x = _inputs(micro_batch=2, grad_accum=3)
    got = predict(x, A100)
    tokens = 2 * 3 * 4096
    rate = 228e12 * 4096 / (4096 + 128)
    attn = 12 * 32 * 4096 * 4096
    assert got.parts["compute"] == pytest.approx((SPEC.flops_per_token(ARGS_7B, 4096) - attn) * tokens / rate)
    assert got.parts["attention"] == pytest.approx(attn / 2 * tokens / (rate * 0.75))
    assert {k for k, v in got.parts.items() if v} == {"compute", "attention", "elementwise", "optimizer"}
    assert got.step_s == pytest.approx(sum(got.parts.values()))
    assert got.tokens_per_s_per_gpu == pytest.approx(tokens / got.step_s)
    assert got.mfu == pytest.approx(SPEC.flops_per_token(ARGS_7B, 4096) * tokens / got.step_s / 312e12)
    # fused kernels (parallel.compile) read and write 20 values where eager kernels (as measured) move 133
    assert predict(replace(x, compiled=True), A100).parts["elementwise"] == pytest.approx(
        got.parts["elementwise"] * 20 / 133)


def test_an_explicit_mask_costs_what_the_gpus_measured():
    """An explicit mask (document masking; hpctrain's context-parallel chunks; a window shorter than the sequence)
    keeps SDPA off the causal kernels: every score the mask spans is computed, at MASKED_ATTN_FRAC of their rate.
    llama_1b bf16 compiled, fused loss, measured: on one H200 at micro-batch 16 × 4, 67,832 tokens/s without a mask
    (the logits-loss row: the same matmuls) and 59,143 with document masking (the row the share was fitted to); on
    one H100 at 8 × 4, 54,106 with it (not fitted)."""
    cfg = compose(["model=llama_1b", "precision=bf16", "parallel.compile=true"])

    def inputs(micro_batch, accum, document_mask=False, **layout):
        shape = SimpleNamespace(layout=Layout(**layout), micro_batch=micro_batch, grad_accum=accum)
        return StepInputs.of(cfg.model, cfg.parallel, cfg.precision, shape, 2048, document_mask=document_mask)

    h200 = HARDWARE["H200"]
    plain, masked = predict(inputs(16, 4), h200), predict(inputs(16, 4, True), h200)
    assert masked.parts["attention"] == pytest.approx(plain.parts["attention"] * 2 / step_time.MASKED_ATTN_FRAC)
    assert plain.tokens_per_s_per_gpu == pytest.approx(67_832, rel=0.03)
    assert masked.tokens_per_s_per_gpu == pytest.approx(59_143, rel=0.03)
    assert predict(inputs(8, 4, True), HARDWARE["H100"]).tokens_per_s_per_gpu == pytest.approx(54_106, rel=0.10)
    # a window shorter than the sequence is a mask over every pair too
    unmasked = inputs(16, 4)
    windowed = predict(replace(unmasked, args=replace(unmasked.args, sliding_window=1024)), h200)
    assert windowed.parts["attention"] == pytest.approx(masked.parts["attention"])
    # cp=2: a rank's chunks i and 3−i of c = seq/4 tokens see their prefixes, c²·5 of its 8·c² pairs
    cp2 = predict(inputs(16, 4, cp=2), h200)
    assert cp2.parts["attention"] == pytest.approx(plain.parts["attention"] * (5 / 8) / step_time.MASKED_ATTN_FRAC)
    # Llama 3's context parallelism (a causal kernel): the published rows keep the causal count
    causal = predict(inputs(16, 4, cp=2), h200, step_time.Software(cp_prefix_mask=False))
    assert causal.parts["attention"] == pytest.approx(plain.parts["attention"] / 2)


def test_each_layout_pays_its_own_communication():
    one = predict(_inputs(grad_accum=8), H100)
    tp = predict(_inputs(Layout(tp=8), grad_accum=8), H100)
    # an 8th of the matmuls each, on matrices 8 times narrower (a lower rate)
    shape = (4096 / (4096 + 128)) / (512 / (512 + 128))
    assert tp.parts["tp"] > 0 and tp.parts["compute"] == pytest.approx(one.parts["compute"] / 8 * shape)
    pp = predict(_inputs(Layout(pp=4), grad_accum=8), H100)
    assert pp.parts["bubble"] == pytest.approx((pp.step_s - pp.parts["bubble"] - pp.parts["optimizer"])
                                               * Layout(pp=4).bubble(8) / (1 - Layout(pp=4).bubble(8)), rel=1e-6)
    ddp = predict(_inputs(Layout(dp=64), grad_accum=8), H100)  # 8 nodes: the reduction crosses the network
    z3 = predict(_inputs(Layout(dp=64), grad_accum=8, zero_stage=3), H100)
    assert ddp.parts["dp"] > 0 and z3.parts["fsdp"] > 0 and not z3.parts["dp"]
    # ZeRO-3 gathers again for every micro-batch: more micro-batches, more exposed traffic
    assert predict(_inputs(Layout(dp=64), grad_accum=32, zero_stage=3), H100).parts["fsdp"] > z3.parts["fsdp"]
    # recomputation costs one more forward of the blocks
    full = predict(_inputs(grad_accum=8, ac="full"), H100)
    assert full.parts["compute"] > one.parts["compute"] * 1.2


def test_the_validation_table_is_within_20_percent_of_every_published_figure():
    """Megatron-LM's Table 1, Llama 3's Table 4 and torchtitan's bf16 rows: one set of hardware numbers per GPU
    type, every row within ±20 % of what was published."""
    rows = published.rows()
    assert len(rows) >= 18 and {r.source for r in rows} == {published.MEGATRON, published.LLAMA3, published.TITAN}
    errors = {}
    for row in rows:
        value, _ = published.predicted(row)
        errors[row.name] = value / row.published - 1
    assert max(abs(e) for e in errors.values()) <= 0.20, errors
    assert {r.gpu for r in rows} <= set(HARDWARE)


def test_the_docs_show_the_table_the_model_computes():
    page = (ROOT / "docs" / "choosing-a-layout.md").read_text()
    assert published.table() in page, "docs/choosing-a-layout.md: paste `python -m hpctrain plan --validate` again"


@pytest.mark.parametrize("name", ["GPT 1.7B", "GPT 1008B", "Llama 3 405B, 8,192 GPUs, seq 8,192"])
def test_search_beats_the_published_layout_or_says_why(name):
    """For the published model, GPU count and batch, --search's best is predicted at least as fast as the published
    layout run by hpctrain, or hpctrain cannot run the published one and says why."""
    row = next(r for r in published.rows() if r.name == name)
    best, theirs, why = published.search_row(row)
    assert best is not None
    assert best.prediction.tokens_per_s_per_gpu >= theirs.tokens_per_s_per_gpu or why, (best, theirs)


def test_search_prints_the_fastest_that_fit_and_writes_a_parallel_file(tmp_path, capsys):
    overrides = ["model=llama_7b", "train.global_batch=256", "train.seq_len=4096", "precision=bf16",
                 "cluster.gpu_type=A100", "cluster.gpu_mem_gb=80", "parallel.grad_reduce_dtype=bf16"]
    out = tmp_path / "fast.yaml"
    assert cli.plan(["--search", "--gpus", "64", "--top", "3", "--write", str(out), *overrides]) == 0
    text = capsys.readouterr().out
    timed = int(re.search(r"search: (\d+) layouts of 64 GPUs timed", text).group(1))
    assert timed >= 1000
    shown = re.findall(r"^\d\. .*: ([\d.]+) s/step, .* ([\d.]+) GiB per GPU$", text, re.M)
    assert len(shown) == 3 and [float(s) for s, _ in shown] == sorted(float(s) for s, _ in shown)
    assert all(float(g) <= 80 * 0.9 * 1e9 / 2**30 / (1e9 / 2**30) for _, g in shown)
    # the file is a parallel= group whose run the planner predicts as the search did
    keys = dict(line.split(": ", 1) for line in out.read_text().splitlines() if not line.startswith("#"))
    assert keys["grad_reduce_dtype"] == "bf16" and keys["name"] == "fast"  # the whole group: the run's other keys
    mb = re.search(r"train.micro_batch=(\d+)", out.read_text()).group(1)
    cfg = compose([*overrides, *(f"parallel.{k}={v}" for k, v in keys.items() if k != "name"),
                   f"train.micro_batch={mb}"])
    from hpctrain.runs.resolve import resolve

    plan = resolve(cfg, 64)
    printed = re.findall(r"^  overrides: (.*)$", text, re.M)  # what a user copies: whatever the base's accumulation
    assert printed and all(line.endswith("train.grad_accum=null") for line in printed), printed
    resolve(compose([*overrides, "train.micro_batch=null", "train.grad_accum=2", *printed[0].split()]), 64)
    again = predict(StepInputs.of(cfg.model, cfg.parallel, cfg.precision, plan, 4096, document_mask=False),
                    step_time.hardware_of(cfg.cluster, "bf16"))
    assert f"{again.step_s:.3g} s/step" in text.splitlines()[1]
    with pytest.raises(SystemExit):  # never overwritten
        cli.plan(["--search", "--gpus", "64", "--write", str(out), *overrides])
    assert "exists: --write makes a new file" in capsys.readouterr().err


def test_plan_with_dp_auto_plans_the_job_cluster_nodes_make(capsys):
    """parallel.dp=auto with cluster.nodes and cluster.gpus_per_node: planned for the world the job would have (it
    planned for this machine's one device, beside a note naming the 16-rank job)."""
    assert cli.plan(["model=llama_7b", "parallel=fsdp", "cluster.nodes=2", "cluster.gpus_per_node=8",
                     "train.global_batch=64", "train.micro_batch=1", "train.seq_len=4096"]) == 0
    out = capsys.readouterr().out
    assert "layout pp×dp×tp = 1×16×1 = 16 devices" in out and "a Slurm job of 2 node(s) × 8 rank(s)" in out, out
    assert "planned for dp=1" not in out


def test_plan_without_train_seq_len_plans_the_shards_and_checks_cp_on_them(demo_data, capsys):
    """The run's seq_len comes from the shards when train.seq_len is unset: so does the plan's, checked as the run
    checks it (cp=3 of 64-token blocks: the run refused what the plan, on model.max_seq_len, printed)."""
    from conftest import SMALL_MODEL

    base = [*SMALL_MODEL, f"data.path={demo_data}", "data.prepare_demo=false"]
    assert cli.plan([*base, "parallel.cp=2"]) == 0
    assert f"planned for seq_len 64 (the shards in {demo_data})" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.plan([*base, "parallel.cp=3"])
    assert e.value.code == 2 and f"seq_len (the shards in {demo_data})=64 is not divisible by 6" in \
        capsys.readouterr().err


def test_plan_prints_the_predicted_line(capsys):
    assert cli.plan(["model=llama_7b", "parallel.dp=8", "parallel.tp=8", "train.global_batch=64",
                     "train.micro_batch=1", "train.seq_len=4096", "precision=bf16", "cluster.gpu_type=H100"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("predicted:"))
    assert re.match(r"predicted: [\d.]+ s per step, [\d,]+ tokens/s per GPU, MFU [\d.]+% \(\d+ TFLOP/s per GPU\)",
                    line), line
    assert re.search(r"^  compute .* tp .*$", out, re.M)
    # the whole run at that step time, and the Slurm jobs it takes (a job trains until the time limit's warning)
    step_s = float(re.match(r"predicted: ([\d.]+) s", line).group(1))
    hours = re.search(rf"whole run: train.max_steps=200 \(5.24e\+07 tokens\) × {step_s:.3g} s = ([\d.]+) h of "
                      "training", out).group(1)
    assert float(hours) == pytest.approx(200 * step_s / 3600, rel=0.01)
    found = re.search(r"cluster.time_min=60 holds about ([\d,]+) steps a job \(less its start-up\): 1 job\(s\) of "
                      r"the 11 that cluster.max_timeouts=10 allows", out)
    per_job = int(found.group(1).replace(",", ""))
    assert per_job == pytest.approx((60 * 60 - 120) / step_s, rel=0.01)  # (the step time shown is rounded)
    many = ["model=llama_7b", "parallel.dp=8", "parallel.tp=8", "train.global_batch=64", "train.micro_batch=1",
            "train.seq_len=4096", "precision=bf16", "cluster.gpu_type=H100", f"train.max_steps={11 * per_job + 1}"]
    assert cli.plan(many) == 0
    assert (f"12 jobs, more than the 11 that cluster.max_timeouts=10 allows: under hydra/launcher=slurm the run stops "
            f"after about {11 * per_job:,} steps" in capsys.readouterr().out)
    assert cli.plan([*many, "cluster.max_timeouts=11"]) == 0  # every job allowed: nothing left for start-ups
    assert ("12 jobs, all 12 that cluster.max_timeouts=11 allows, with nothing left for start-ups and saves"
            in capsys.readouterr().out)
    assert cli.plan([*many, "cluster.max_timeouts=12"]) == 0
    assert "12 job(s) of the 13 that cluster.max_timeouts=12 allows" in capsys.readouterr().out
    # a stop 15 minutes before a 60-minute limit: a preemption to submitit (after less than 48 minutes of the job)
    assert cli.plan([*many, "cluster.signal_lead_s=900"]) == 0
    assert ("job(s), requeued without limit: submitit counts a stop cluster.signal_lead_s=900 before the limit as a "
            "preemption") in capsys.readouterr().out
    assert cli.plan([*many, "cluster.time_min=2"]) == 0
    assert ("cluster.time_min=2 leaves no step before the time limit's warning (cluster.signal_lead_s=120): raise "
            "cluster.time_min") in capsys.readouterr().out
    assert cli.plan(["model=llama_7b"]) == 0
    assert "predicted: no step time without a GPU type: set cluster.gpu_type" in capsys.readouterr().out


def test_a_submission_that_needs_more_jobs_than_max_timeouts_allows_is_warned(make_cfg, tmp_path):
    """What a Slurm submission warns (cluster.gpu_type) where the run at the predicted step time needs every requeue
    submitit's max_num_timeout gives or more; not where the run requeues itself without limit (spare nodes, packed
    points), nor where the requeues suffice, counting from the run directory's latest checkpoint."""
    from hpctrain.launch import submit
    from hpctrain.training.run import train

    big = ["model=llama_7b", "precision=bf16", "parallel=fsdp", "parallel.dp=8", "cluster.gpus_per_node=8",
           "cluster.gpu_type=H100", "train.global_batch=64", "train.micro_batch=8", "train.checkpointing=false",
           "cluster.time_min=2", "cluster.signal_lead_s=30", "train.max_steps=100000"]
    cfg = make_cfg(*big, small_model=False)
    prepared = submit.check(cfg)
    said = submit.timeouts_warning(cfg, prepared)
    found = re.fullmatch(r"at the predicted [\d.]+ s per step, cluster.time_min=2 holds about ([\d,]+) steps a job "
                         r"\(less its start-up\): [\d,]+ jobs, more than the 11 that cluster.max_timeouts=10 allows: "
                         r"under hydra/launcher=slurm the run stops after about [\d,]+ steps; raise cluster.time_min or "
                         r"cluster.max_timeouts, or submit it again to go on", said)
    assert found, said
    for own in (["cluster.max_timeouts=100000"], ["cluster.spare_nodes=1"], ["cluster.pack=2"]):
        assert submit.timeouts_warning(make_cfg(*big, *own, small_model=False), prepared) is None, own
    # 11 jobs' steps and 2: all 12 jobs max_timeouts=11 allows from the start, 11 of them from a checkpoint of step 2
    per_job = int(found.group(1).replace(",", ""))
    run = tmp_path / "run"
    train(make_cfg("train.max_steps=2", "train.ckpt_every=2", "train.eval_every=0"), str(run))
    cfg = make_cfg(*big, f"train.max_steps={11 * per_job + 2}", "cluster.max_timeouts=11", small_model=False)
    assert "12 jobs, all 12 that cluster.max_timeouts=11 allows" in submit.timeouts_warning(cfg, prepared)
    assert submit.timeouts_warning(cfg, prepared, str(run)) is None
    more = make_cfg(*big, f"train.max_steps={11 * per_job + 3}", "cluster.max_timeouts=11", small_model=False)
    said = submit.timeouts_warning(more, prepared, str(run))  # (from step 2: one step more than 11 jobs hold)
    assert ", from step 2, " in said and "12 jobs, all 12 that cluster.max_timeouts=11 allows" in said, said
    over = make_cfg(*big, f"train.max_steps={13 * per_job}", "cluster.max_timeouts=11", small_model=False)
    assert f"the run stops after about {2 + 12 * per_job:,} steps" in submit.timeouts_warning(over, prepared, str(run))


_SEARCH = ["--search", "--gpus", "12", "--top", "2", "model=llama_7b", "train.global_batch=48", "train.seq_len=4096",
           "precision=bf16", "cluster.gpu_type=H100", "cluster.gpu_mem_gb=80"]


@pytest.mark.parametrize("argv, says", [
    (["--search"], "--search needs --gpus N"),
    (["--gpus", "8"], "--gpus and --write go with --search"),
    # wrong whatever the layout: said once, before a search that would refuse every layout for it
    ([*_SEARCH, "train.max_steps=0"], "train.max_steps=0 must be >= 1"),
    ([*_SEARCH, "cluster.gpu_mem_gb=-5"], "cluster.gpu_mem_gb=-5.0 must be a finite number > 0"),
    # what a Slurm job of those GPUs cannot be
    ([*_SEARCH, "cluster.gpus_per_node=8"], "--gpus 12 does not fill whole nodes of 8"),
    ([*_SEARCH, "cluster.gpus_per_node=4", "cluster.nodes=2"], "--gpus 12 is 3 node(s) of 4, cluster.nodes=2"),
    ([*_SEARCH, "cluster.gpu_mem_gb=1", "--write", "/nonexistent/x.yaml"], "no layout fits, nothing written"),
])
def test_bad_plan_usage_is_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.plan(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_search_without_a_gpu_type_or_a_known_one_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.plan(["--search", "--gpus", "8", "model=llama_7b", "train.global_batch=64", "train.seq_len=2048"])
    assert e.value.code == 2 and "needs cluster.gpu_type" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cluster.gpu_type=Z9 has no default rates"):
        step_time.hardware_of(compose(["cluster.gpu_type=Z9"]).cluster, "bf16")


def test_search_keeps_a_base_configs_offload(capsys):
    """The base config is checked as one rank before the search, without the layout's own keys: parallel.cpu_offload
    (which one rank cannot have) is the search's to place, not a refusal."""
    assert cli.plan([*_SEARCH, "parallel=fsdp", "parallel.cpu_offload=true"]) == 0
    assert "1. " in capsys.readouterr().out


def test_every_gpu_type_has_its_peak_by_precision_and_tp_stays_in_a_node():
    """The 500 W H100 takes the NVL's fp32/tf32/bf16 peaks (its bf16 peak was taken for every precision); over
    several nodes a tensor-parallel group is a divisor of a node's GPUs (tp=3 of 24 GPUs would straddle two)."""
    from hpctrain.training.layout_search import candidates

    for name in step_time.HARDWARE:
        cluster = compose([f"cluster.gpu_type={name}"]).cluster
        fp32, bf16 = step_time.hardware_of(cluster, "fp32"), step_time.hardware_of(cluster, "bf16")
        assert fp32.peak_tflops < bf16.peak_tflops / 4 and fp32.gemm_tflops < bf16.gemm_tflops / 4, name
    args = compose(["model=llama_7b", "model.n_heads=48", "model.n_kv_heads=48", "model.head_dim=128"]).model
    from hpctrain.models import model_args

    tps = {c.layout.tp for c in candidates(model_args(args), 24, 96, 4608, 8)}
    assert tps == {1, 2, 4, 8}, tps
    assert {c.layout.tp for c in candidates(model_args(args), 6, 96, 4608, 8)} == {1, 2, 3, 6}


def test_preflight_measurements_replace_the_defaults():
    cluster = compose(["cluster.gpu_type=h100", "cluster.gemm_tflops=500", "cluster.inter_node_gbps=20",
                       "cluster.gpus_per_node=4"]).cluster
    hw = step_time.hardware_of(cluster, "bf16")
    assert (hw.gemm_tflops, hw.inter_gbps, hw.gpus_per_node, hw.intra_gbps) == (500, 20, 4, H100.intra_gbps)
    assert math.isclose(step_time.hardware_of(compose(["cluster.gpu_type=A100"]).cluster, "fp32").gemm_tflops,
                        228 * 19.5 / 312)
