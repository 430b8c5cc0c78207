"""optim=lamb and optim=sophia against their papers' algorithms written out plainly, and across layouts (one process,
fsdp dp=2, tp2: LAMB's trust ratio needs each parameter's global norm, not its shard's; Sophia's sampled labels must
not depend on how the batch is split), through a resume across layouts; and parallel.grad_reduce_dtype: bf16/fp16
gradient sums differ from fp32's by no more than their rounding."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import deltas, one_line, run_layout

from hpctrain.core.config import ConfigError
from hpctrain.runs.resolve import resolve
from hpctrain.training.lamb_sophia import Lamb, SophiaG, sampled_labels
from hpctrain.training.optimizer import param_groups


def _reference_lamb(params, grads, state, step, lr, betas, eps, wds, max_trust):
    """You et al. 2020, Algorithm 2, one parameter at a time, in float64."""
    for i, (p, g, wd) in enumerate(zip(params, grads, wds)):
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        state[i] = (m, v)
        m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
        r = m_hat / (v_hat.sqrt() + eps) + wd * p
        w_norm, r_norm = p.norm(), r.norm()
        trust = min(float(w_norm / r_norm), max_trust) if w_norm > 0 and r_norm > 0 else 1.0
        p -= lr * trust * r


def test_lamb_is_the_papers_algorithm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50))
    with torch.no_grad():
        model[1].weight.zero_()  # a zero parameter: its trust ratio is 1
    ref = [p.detach().double().clone() for p in model.parameters()]
    wds = [0.01 if p.dim() >= 2 else 0.0 for p in model.parameters()]
    opt = Lamb(param_groups(model, 0.01), lr=0.05, betas=(0.9, 0.99), eps=1e-6, max_trust=3.0)
    state = {}
    for step in range(1, 6):
        x = torch.randint(0, 50, (4, 7))
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        grads = [p.grad.double() for p in model.parameters()]
        opt.step()
        _reference_lamb(ref, grads, state, step, 0.05, (0.9, 0.99), 1e-6, wds, 3.0)
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)


def test_lamb_refuses_bad_settings():
    with pytest.raises(ValueError, match="out of range"):
        Lamb([torch.zeros(2, requires_grad=True)], lr=0.0)


def _unequal_halves() -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and its gradient whose row halves differ in scale by 100: a trust ratio from either half's norms
    is far from the whole tensor's."""
    w = torch.linspace(-1, 1, 32).reshape(8, 4)
    w[4:] *= 100
    g = torch.cos(torch.arange(32.0)).reshape(8, 4)
    return w, g


def _lamb_steps(weight: torch.Tensor, grad: torch.Tensor) -> None:
    opt = Lamb([{"params": [weight], "weight_decay": 0.01}], lr=0.1, max_trust=1e6)
    for _ in range(3):
        weight.grad = grad.clone()
        opt.step()


def _lamb_on_row_shards(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    w, g = _unequal_halves()
    weight = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    _lamb_steps(weight, distribute_tensor(g, mesh, [Shard(0)]))
    full = weight.detach().full_tensor()
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(out, "sharded.pt"))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_lamb_trust_ratio_uses_the_whole_parameter(tmp_path):
    """Row-sharded over two gloo ranks (as FSDP2 shards), halves 100× apart: the same weights as one process.
    A trust ratio from each shard's own norms moves the halves by other amounts (checked: the assert fails)."""
    from hpctrain.runtime.spawn import spawn

    spawn(2, _lamb_on_row_shards, (str(tmp_path),), threads=1)
    w, g = _unequal_halves()
    weight = torch.nn.Parameter(w.clone())
    _lamb_steps(weight, g)
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)
    assert not torch.equal(weight.detach(), w)
    torch.testing.assert_close(sharded, weight.detach(), rtol=1e-6, atol=1e-6)


def _reference_sophia(params, grads, curv_grads, state, lr, betas, rho, eps, wds, tokens):
    """Liu et al. 2023, Algorithm 3 (SophiaG's scaling), one parameter at a time, in float64."""
    for i, (p, g, wd) in enumerate(zip(params, grads, wds)):
        m, h = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        if curv_grads is not None:
            h = betas[1] * h + (1 - betas[1]) * tokens * curv_grads[i] ** 2
        m = betas[0] * m + (1 - betas[0]) * g
        state[i] = (m, h)
        p *= 1 - lr * wd
        p -= lr * m.sign() * torch.clamp(m.abs() / (rho * h + eps), max=1.0)


def test_sophia_is_the_papers_algorithm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50))
    ref = [p.detach().double().clone() for p in model.parameters()]
    wds = [0.1 if p.dim() >= 2 else 0.0 for p in model.parameters()]
    opt = SophiaG(param_groups(model, 0.1), lr=0.05, betas=(0.9, 0.95), rho=0.04, eps=1e-12, update_every=2)
    state, estimated = {}, []
    for step in range(5):
        curv = None
        if opt.wants_curvature():
            curv = [torch.randn_like(p) * 0.1 for p in model.parameters()]
            for p, c in zip(model.parameters(), curv):
                p.grad = c.clone()
            opt.update_curvature(tokens=7)
            estimated.append(step)
            curv = [c.double() for c in curv]
        grads = [torch.randn_like(p) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        _reference_sophia(ref, [g.double() for g in grads], curv, state, 0.05, (0.9, 0.95), 0.04, 1e-12, wds, 7)
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
    assert estimated == [0, 2, 4]


def test_sampled_labels_depend_on_the_row_alone_and_follow_the_model():
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (4, 9))
    logits = torch.randn(4, 8, 6)
    labels = sampled_labels(logits, tokens, salt=3)
    flipped = sampled_labels(logits.flip(0), tokens.flip(0), salt=3)  # the rows in another order (another layout)
    assert torch.equal(flipped.flip(0), labels)
    assert not torch.equal(sampled_labels(logits, tokens, salt=4), labels)
    peaked = torch.full((4, 8, 6), -30.0).scatter(2, torch.full((4, 8, 1), 5), 30.0)
    assert torch.all(sampled_labels(peaked, tokens, salt=0) == 5)
    uniform = sampled_labels(torch.zeros(2, 4000, 4), torch.randint(0, 100, (2, 4001)), salt=0)
    shares = torch.bincount(uniform.flatten(), minlength=4) / uniform.numel()
    assert torch.allclose(shares, torch.full((4,), 0.25), atol=0.02), shares
    # Non-finite logits (a diverging model) still give labels on every rank (the step then drops the estimate).
    assert sampled_labels(torch.full((1, 3, 4), float("nan")), tokens[:1, :4], salt=0).shape == (1, 3)


@pytest.mark.parametrize("overrides,world,words", [
    (["optim=sophia", "train.fused_loss=true"], 1, ["optim=sophia", "train.fused_loss"]),
    (["optim=sophia", "parallel=pp2"], 2, ["optim=sophia", "parallel.pp=2"]),
    (["optim=sophia", "precision=fp16"], 1, ["optim=sophia", "precision=bf16"]),
    (["optim=sophia", "parallel=ddp", "parallel.grad_compression=topk"], 2,
     ["optim=sophia", "grad_compression=topk"]),
    (["optim=sophia", "optim.implementation=fused"], 1, ["sophia has no fused kernel"]),
    (["optim=sophia", "optim.rho=0"], 1, ["optim.rho=0"]),
    (["optim=sophia", "optim.update_every=0"], 1, ["optim.update_every=0"]),
])
def test_sophia_settings_that_cannot_work_are_one_line(make_cfg, overrides, world, words):
    with pytest.raises(ConfigError) as e:
        resolve(make_cfg(*overrides), world)
    one_line(e, *words)


LAMB = ("optim=lamb", "optim.lr=1e-2")
SOPHIA = ("optim=sophia", "optim.lr=1e-2", "optim.update_every=2")  # curvature passes at steps 1, 3, 5
OPTIMIZERS = {"lamb": LAMB, "sophia": SOPHIA}
LAYOUTS = {"fsdp": ("parallel=fsdp", "parallel.dp=2"), "tp2": ("parallel=tp2",), "tp2_sp": ("parallel=tp2_sp",)}


@pytest.mark.multiproc
@pytest.mark.parametrize("optim, layout", [(o, layout) for o in sorted(OPTIMIZERS) for layout in ("fsdp", "tp2")]
                         + [("sophia", "tp2_sp")])
def test_layouts_equal_one_process(make_cfg, tmp_path, layout, optim):
    """Through the whole trainer (FSDP2 row shards, tp's column/row shards, replicated norms; with sequence
    parallelism the norms' gradients arrive as pending sums over tp)."""
    ref = run_layout(make_cfg, tmp_path / "one", *OPTIMIZERS[optim])
    dloss, dnorm = deltas(ref, run_layout(make_cfg, tmp_path / "got", *OPTIMIZERS[optim], *LAYOUTS[layout]))
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)


@pytest.mark.multiproc
@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_state_resumes_across_layouts(make_cfg, tmp_path, optim):
    """Saved under fsdp dp=2 after 3 steps, resumed with tp2 and with one process: steps 4-6 as uninterrupted."""
    six = (*OPTIMIZERS[optim], "train.max_steps=6", "train.ckpt_every=3")
    ref = run_layout(make_cfg, tmp_path / "ref", *six)
    run_layout(make_cfg, tmp_path / "saved", *OPTIMIZERS[optim], "parallel=fsdp", "parallel.dp=2",
               "train.ckpt_every=3")
    for name, layout in (("tp2", ["parallel=tp2"]), ("single", [])):
        shutil.copytree(tmp_path / "saved", tmp_path / name, symlinks=True)
        got = run_layout(make_cfg, tmp_path / name, *six, *layout)
        for s in (4, 5, 6):
            assert abs(got[s][0] - ref[s][0]) <= 1e-5, (name, s, got[s], ref[s])
            assert got[s][1] == pytest.approx(ref[s][1], rel=1e-5), (name, s)


@pytest.mark.multiproc
@pytest.mark.parametrize("stage, dtype, mantissa", [("ddp", "bf16", 8), ("fsdp", "fp16", 11)])
def test_half_precision_gradient_reduction_is_within_its_rounding(make_cfg, tmp_path, dtype, mantissa, stage):
    """dp=2: each rank's gradient rounded to `dtype`, summed, rounded again, cast back: every element within about
    3 units of its last place of fp32 reduction's, so the global grad norm too; and it does differ (the setting
    is applied)."""
    base = (f"parallel={stage}", "parallel.dp=2")
    ref = run_layout(make_cfg, tmp_path / "fp32", *base)
    got = run_layout(make_cfg, tmp_path / dtype, *base, f"parallel.grad_reduce_dtype={dtype}")
    dloss, dnorm = deltas(ref, got)
    ulp = 2.0 ** -mantissa
    assert 0 < dnorm <= 3 * ulp, (dnorm, 3 * ulp)
    assert dloss <= 1e-3, dloss


def test_the_curvature_pass_runs_at_its_steps_only():
    """optimizer.step_passes(Sophia) is the train step's pass before steps 1, 3, 5, ... (update_every=2): h moves
    at those steps and stays put between them; an AdamW step has no pass."""
    from hpctrain.training.optimizer import step_passes
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import TrainStep

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))
    opt = SophiaG(model.parameters(), lr=0.01, update_every=2)
    cfg = type("P", (), {"name": "fp32", "loss_scale_init": 1.0, "loss_scale_growth_interval": 1})()
    step = TrainStep(model, opt, setup_precision(cfg, torch.device("cpu")), 1.0, torch.device("cpu"))
    step.passes = step_passes(opt)
    batch = torch.randint(0, 32, (2, 9))
    h = lambda: sum(float(opt.state[p]["hessian"].abs().sum()) for p in model.parameters())  # noqa: E731
    moved = []
    for _ in range(4):
        before = h() if opt.state else 0.0
        assert step([batch]).status == "ok"
        moved.append(h() != before)
    assert moved == [True, False, True, False]
    assert step_passes(torch.optim.AdamW(model.parameters())) == []
