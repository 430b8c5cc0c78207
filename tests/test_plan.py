"""The layout planner: stage map, memory estimates against measured tensor bytes, CLI and errors."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import pytest
import torch

from hpctrain.models import model_args
from hpctrain.models.llama.model import Llama, num_params
from hpctrain.resolve import resolve
from hpctrain.tools.planner import estimate, layer_map, report, stage_params
from hpctrain.training.optim import build_optimizer

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
LLAMA_70B = ["model=llama_70b", "parallel.dp=8", "parallel.tp=8", "parallel.pp=4", "parallel.sequence_parallel=true",
             "cluster.gpu_mem_gb=80", "train.global_batch=512", "train.micro_batch=1", "train.seq_len=4096"]
# ~34M parameters: parameter, gradient and optimizer bytes dwarf everything else on a 64-token step.
MEDIUM = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=1376",
          "model.vocab_size=8192", "model.max_seq_len=64", "model.tie_embeddings=false", "train.seq_len=64",
          "train.global_batch=1", "train.micro_batch=1", "train.grad_accum=1"]


def _plan(cmd: list[str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpctrain", "plan", *cmd], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.path.abspath(ROOT)))


def test_llama_70b_cli(tmp_path):
    t0 = time.monotonic()
    p = _plan(LLAMA_70B, tmp_path)
    assert p.returncode == 0, p.stderr
    assert time.monotonic() - t0 < 20
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
    args, tp = model_args(cfg), 8
    stages = stage_params(args, 4)
    assert [len(s.layers[0]) for s in stages] == [20] * 4
    # Summed over stages and the tp ranks of a stage (norms are replicated, counted once): the whole model.
    assert sum((s.per_device(tp) - s.replicated) * tp + s.replicated for s in stages) == num_params(args)
    layer = (num_params(args) - 2 * args.vocab_size * args.dim - args.dim) // args.n_layers
    assert stages[1].per_device(tp) == 20 * ((layer - 2 * args.dim) // tp + 2 * args.dim)


def test_layer_map_interleaved():
    assert layer_map(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert layer_map(4, 1) == [[range(0, 4)]]


def _measure(cfg) -> dict[str, int]:
    """Tensor storage bytes of parameters, gradients and optimizer state in one real CPU step."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    model = Llama(model_args(cfg))
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
    """tp2: matrices halve, norms stay; dp2 zero3: everything halves; zero2: grads and optimizer only."""
    base = make_cfg(*MEDIUM, small_model=False)
    model = Llama(model_args(base))
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
    assert (z2["params"], z2["grads"], z2["optim"]) == (4 * full, 2 * full, 4 * full)
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
    cfg = make_cfg(*LLAMA_70B[:-4], "cluster.gpu_mem_gb=null", "train.seq_len=4096", "train.global_batch=512",
                   "train.micro_batch=4", small_model=False)
    text, fits = report(cfg, resolve(cfg, 256), 4096, [])
    assert fits is None and "set cluster.gpu_mem_gb to check fit" in text


@pytest.mark.parametrize("overrides, words", [
    (["model=llama_70b", "parallel.tp=3"], ["n_heads=64", "tp=3"]),
    (LLAMA_70B[:-3] + ["train.global_batch=16", "train.micro_batch=1", "train.seq_len=4096"],
     ["train.grad_accum=2", "parallel.pp=4"]),
    (["train.bogus=1"], ["bogus"]),
])
def test_errors_are_one_line(tmp_path, overrides, words):
    p = _plan(overrides, tmp_path)
    assert p.returncode == 2
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("hpctrain: error:"), p.stderr
    assert all(w in err[0] for w in words), err[0]
