"""The GPU paths, on a real CUDA device (`make gpu-check`): each test is skipped, with its reason, without one.

bf16 and fp16 steps against fp32, compile, the SDPA kernel actually run, pinned-memory loading, no host sync inside
a step's micro-batches, an NCCL process group with FSDP2 and a DCP round trip, preflight's GEMM and all-reduce, and
the planner against `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import deltas, records, run_layout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run make gpu-check there)")]

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def _on_cuda(run_dir) -> None:
    """The run trained on the GPU: its memory figures are the CUDA allocator's (a CPU run reports none there)."""
    mem = json.loads((run_dir / "result.json").read_text())["memory"]
    assert mem["step_gib"][0] is not None and mem["step_gib"][0] > 0, mem
    assert all(r["mem_gb"] > 0 for r in records(run_dir) if "loss" in r)


@pytest.mark.parametrize("precision,tol", [("bf16", 0.05), ("fp16", 0.05), ("tf32", 0.01)])
def test_low_precision_steps_track_fp32_on_cuda(make_cfg, tmp_path, precision, tol):
    ref = run_layout(make_cfg, tmp_path / "fp32")
    got = run_layout(make_cfg, tmp_path / precision, f"precision={precision}")
    _on_cuda(tmp_path / precision)
    dl, _ = deltas(ref, got)
    assert dl < tol, (precision, ref, got)
    if precision == "fp16":  # the scaler ran on the GPU, with its initial scale (no overflow at this size)
        assert [r["loss_scale"] for r in records(tmp_path / precision) if "loss" in r] == [65536.0] * 3


@pytest.mark.parametrize("precision,fused,tol", [("fp32", False, 1e-4), ("bf16", False, 2e-2), ("bf16", True, 2e-2)])
def test_compiled_blocks_match_eager_on_cuda(make_cfg, tmp_path, precision, fused, tol):
    """parallel.compile: the blocks (and with train.fused_loss the loss's chunk kernels) through inductor."""
    torch._dynamo.reset()
    run = (f"precision={precision}", f"train.fused_loss={str(fused).lower()}")
    ref = run_layout(make_cfg, tmp_path / "eager", *run)
    got = run_layout(make_cfg, tmp_path / "compiled", *run, "parallel.compile=true")
    dl, dg = deltas(ref, got)
    assert dl < tol and dg < 10 * tol, (dl, dg)


def test_energy_per_token_from_the_gpus_counter(make_cfg, tmp_path):
    """NVML's energy counter, summed over the ranks at each logged step and for the run, with its cost."""
    pytest.importorskip("pynvml", reason="NVML's Python binding is not installed (pip install nvidia-ml-py)")
    run_layout(make_cfg, tmp_path / "run", "monitor.energy_price_per_kwh=0.2")
    energy = json.loads((tmp_path / "run" / "result.json").read_text())["energy"]
    assert energy["source"] == "nvml" and energy["joules"] > 0 and energy["joules_per_token"] > 0, energy
    assert energy["cost"] == pytest.approx(energy["kwh"] * 0.2)
    logged = [r["energy_j"] for r in records(tmp_path / "run") if "energy_j" in r]
    assert logged == sorted(logged) and logged[-1] == pytest.approx(energy["joules"]), logged


def test_fused_loss_on_cuda_equals_the_logits_path(make_cfg, tmp_path):
    ref = run_layout(make_cfg, tmp_path / "plain", "precision=bf16")
    got = run_layout(make_cfg, tmp_path / "fused", "precision=bf16", "train.fused_loss=true")
    dl, dg = deltas(ref, got)
    assert dl < 1e-2 and dg < 5e-2, (dl, dg)


def test_sdpa_runs_a_fused_attention_kernel():
    """llama_1b's attention (head_dim 64, GQA 32/8) in bf16 at 2048 tokens: flash, cuDNN or memory-efficient
    attention, not SDPA's math fallback (which has no kernel of its own: bmm and softmax)."""
    from hpctrain.models import model_args
    from hpctrain.runs.compose import compose
    from hpctrain.tools.bench_gpu import attention_kernels

    kernels = attention_kernels(model_args(compose(["model=llama_1b"]).model), 2048, "bf16")
    print("attention kernels:", kernels)
    assert any(w in k.lower() for k in kernels for w in ("flash", "cudnn", "fmha", "efficient")), kernels


def test_batches_arrive_pinned_and_on_the_gpu(make_cfg, demo_data):
    """On CUDA the feed pins its batches (data.pin_memory unset), so the copy to the GPU is asynchronous."""
    from hpctrain.parallel import process_group
    from hpctrain.runs.resolve import resolve
    from hpctrain.training.feed import TrainFeed
    from hpctrain.training.state import RunState

    cfg = make_cfg()
    shape = resolve(cfg)
    env = process_group.init()
    try:
        mesh = shape.layout.build_mesh(env.device.type)
        feed = TrainFeed(cfg.data, cfg.train.seed, demo_data, shape, RunState(), env.device, shape.layout.batch_mesh(mesh))
        batches = list(feed.next_step())
        assert env.device.type == "cuda" and len(batches) == shape.grad_accum
        assert all(b.is_pinned() for b in batches)
    finally:
        process_group.shutdown()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_no_host_sync_inside_a_step_s_micro_batches(make_cfg, precision, fused):
    """Forward and backward of four micro-batches queue on the GPU without waiting for it once
    (torch.cuda.set_sync_debug_mode raises on any synchronising call); the step syncs only for its loss and norm."""
    from hpctrain.models import build_model
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import TrainStep

    cfg = make_cfg(f"precision={precision}")
    device = torch.device("cuda")
    torch.manual_seed(0)
    with device:
        model = build_model(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = TrainStep(model, optimizer, setup_precision(cfg.precision, device), 1.0, device, fused_loss=fused)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, 65)).pin_memory() for _ in range(4)]
    step(batches)  # warm-up: lazy initialisation (cuBLAS handles, the scaler's tensors) may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        total = step._forward_backward(iter(batches), 4 * 2 * 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(total).item()


def test_nccl_fsdp2_step_and_dcp_round_trip(make_cfg, tmp_path):
    """An NCCL process group (world 1) with FSDP2 over a one-device mesh: a training step, hpctrain's DCP save, and
    a load into a fresh model and optimizer that gives the same next step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from hpctrain.models import build_model
    from hpctrain.parallel import process_group
    from hpctrain.storage import checkpoint
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import TrainStep

    cfg = make_cfg("precision=bf16")
    env = process_group.init()
    try:
        assert dist.get_backend() == "nccl" or "nccl" in str(dist.get_backend_config()), dist.get_backend_config()
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))

        def built():
            torch.manual_seed(0)
            with env.device:
                model = build_model(cfg.model)
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            return model, optimizer, TrainStep(model, optimizer, setup_precision(cfg.precision, env.device), 1.0,
                                               env.device)

        g = torch.Generator().manual_seed(1)
        batches = [[torch.randint(0, cfg.model.vocab_size, (2, 65), generator=g) for _ in range(2)] for _ in range(2)]
        model, optimizer, step = built()
        first = step(batches[0])
        checkpoint.save(str(tmp_path), 1, model, optimizer, {"step": 1}, keep=1)
        want = step(batches[1])
        model2, optimizer2, step2 = built()
        checkpoint.load(checkpoint.latest(str(tmp_path)), model2, optimizer2)
        assert all(isinstance(p, DTensor) and p.device.type == "cuda" for p in model2.parameters())
        got = step2(batches[1])  # from the loaded state: the step the saved model took next
        assert first.status == want.status == got.status == "ok"
        assert abs(got.loss - want.loss) < 1e-6 and abs(got.grad_norm - want.grad_norm) < 1e-5 * want.grad_norm
    finally:
        process_group.shutdown()


def test_preflight_gemm_and_allreduce_on_the_gpu(tmp_path):
    out = tmp_path / "pf.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    p = subprocess.run([sys.executable, "-m", "hpctrain.launch.preflight", "--gemm", "8192", "--size-mb", "256",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    rank = data["ranks"][0]
    print(f"preflight: {rank['device']}: GEMM {rank['gemm_tflops']:.0f} TFLOP/s (bf16, n=8192, rel err "
          f"{rank['gemm_rel_err']:.1e}); all-reduce of 256 MiB {data['allreduce']['algbw_gbps']:.0f} GB/s")
    assert data["status"] == "ok" and "cuda" in rank["device"] and rank["problem"] is None
    assert rank["gemm_tflops"] > 0 and rank["gemm_rel_err"] < 3e-2


PLANNER_CASES = {
    "125m-fp32": ["model=llama_125m", "precision=fp32", "train.micro_batch=4"],
    "125m-bf16-fused": ["model=llama_125m", "precision=bf16", "train.micro_batch=8", "train.fused_loss=true"],
    "350m-bf16-ac": ["model=llama_350m", "precision=bf16", "train.micro_batch=8",
                     "parallel.activation_checkpointing=full"],
    "350m-bf16-compile": ["model=llama_350m", "precision=bf16", "train.micro_batch=8", "parallel.compile=true",
                          "train.fused_loss=true"],
}


@pytest.fixture(scope="module")
def shards_32k_1024(tmp_path_factory):
    from data_prep.synthetic import build_synthetic

    out = str(tmp_path_factory.mktemp("shards-32k"))
    build_synthetic(out, 32000, 1024, samples=64)
    return out


@pytest.mark.parametrize("case", PLANNER_CASES)
def test_planner_within_15_percent_of_cuda_peak(make_cfg, tmp_path, shards_32k_1024, case):
    """The planner's per-device estimate against the CUDA allocator's peak over two steps (torch.cuda's
    max_memory_allocated over what was allocated before the model: the run's own memory report)."""
    from hpctrain.training.run import train

    cfg = make_cfg(*PLANNER_CASES[case], f"data.path={shards_32k_1024}", "train.seq_len=1024", "train.grad_accum=2",
                   "train.global_batch=null", "train.max_steps=2", "train.eval_every=0", "train.checkpointing=false",
                   "logging.trackers=[]", small_model=False)
    result = train(cfg, str(tmp_path))
    planned, measured = result["memory"]["planned_gib"][0], result["memory"]["step_gib"][0]
    print(f"planner {case}: planned {planned:.2f} GiB, measured {measured:.2f} GiB ({planned / measured - 1:+.1%})")
    assert abs(planned / measured - 1) <= 0.15, (case, planned, measured)


def test_memory_snapshot_at_the_end_and_on_out_of_memory(make_cfg, tmp_path, shards_32k_1024):
    """train.memory_snapshot=true: the allocator's history is dumped at the end of a run, and when a step runs out
    of memory (forced here by capping this process's share of the GPU just above what it holds)."""
    from hpctrain.training.run import train

    ok = train(make_cfg("train.max_steps=2", "train.eval_every=0", "train.memory_snapshot=true"), str(tmp_path / "ok"))
    assert ok["status"] == "completed" and (tmp_path / "ok" / "memory" / "rank-0-end.pickle").stat().st_size > 0
    cfg = make_cfg("model=llama_125m", "precision=bf16", f"data.path={shards_32k_1024}", "train.seq_len=1024",
                   "train.micro_batch=8", "train.grad_accum=1", "train.global_batch=null", "train.max_steps=2",
                   "train.eval_every=0", "train.checkpointing=false", "train.memory_snapshot=true", small_model=False)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 2 * 2**30) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            train(cfg, str(tmp_path / "oom"))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert json.loads((tmp_path / "oom" / "result.json").read_text())["status"] == "failed"
    assert (tmp_path / "oom" / "memory" / "rank-0-oom.pickle").stat().st_size > 0


def test_gpu_utilization_rule_reads_nvml_on_cuda(make_cfg, tmp_path):
    """On a GPU the utilisation rule is active (NVML through pynvml) or says once why not; a rule below 101 %
    fires at the first logged step (utilisation is at most 100)."""
    from hpctrain.training.run import train

    train(make_cfg("train.max_steps=3", "train.eval_every=0", "logging.trackers=[]",
                   "monitor.rules.gpu_utilization.threshold=101", "monitor.rules.gpu_utilization.for_s=0"),
          str(tmp_path))
    with open(tmp_path / "alerts.jsonl") as f:
        events = [json.loads(line) for line in f if '"gpu_utilization"' in line]
    assert events and events[0]["event"] in ("firing", "inactive"), events
    if events[0]["event"] == "inactive":
        assert "pynvml" in events[0]["reason"], events
    else:
        assert 0 <= events[0]["value"] <= 100 and events[0]["step"] == 1
