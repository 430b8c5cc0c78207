"""Mixture-of-experts layers (hpctrain.models.moe) and their training: routing, grouped GEMM against the loop, the
auxiliary losses' gradients, the aux-loss-free bias, the figures, and layouts against one process."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import deltas, run_layout

from hpctrain.core.config import MoEDims, RouterKind
from hpctrain.models.moe import MoE, moe_layers

MOE = ("model.family=mixtral", "model.moe.num_experts=4", "model.moe.top_k=2", "model.tie_embeddings=false",
       "model.init_std=0.2")  # (a router far from uniform: choices that differ between experts)


def _layer(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(32, 48, MoEDims(**{"num_experts": 4, "top_k": 2, **kw}))
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    layer.init_buffers()
    return layer


@pytest.mark.parametrize("kw", [{}, {"norm_topk": False}, {"router": RouterKind.sigmoid, "route_scale": 2.5},
                                {"shared_experts": 1}])
def test_every_token_reaches_its_k_experts_weighted_as_the_router_says(kw):
    """Dropless: the layer's output is, token by token, Σ over its k distinct chosen experts of weight · expert(x)
    (+ the shared experts), each expert run alone on that token; the weights sum to route_scale when
    renormalised; every (token, choice) is counted in the load."""
    import torch.nn.functional as F

    layer = _layer(**kw).train()
    x = torch.randn(3, 10, 32)
    out = layer(x).detach()
    flat = x.reshape(-1, 32)
    weights, chosen, _, _ = layer.router(flat)
    assert all(len(set(row.tolist())) == 2 for row in chosen)
    if layer.router.norm_topk:
        torch.testing.assert_close(weights.sum(-1), torch.full((30,), layer.router.scale), rtol=1e-6, atol=1e-6)
    e = layer.experts
    want = torch.stack([sum(w * F.linear(F.silu(F.linear(t, e.w1[k])) * F.linear(t, e.w3[k]), e.w2[k])
                            for w, k in zip(weights[i], chosen[i].tolist())) for i, t in enumerate(flat)])
    if layer.shared is not None:
        want = want + layer.shared(flat)
    torch.testing.assert_close(out.reshape(-1, 32), want.detach(), rtol=1e-5, atol=1e-5)
    assert layer.load.sum().item() == 30 * 2 and layer.stats[-2:].tolist() == [3, 30]  # sequences, tokens


def test_grouped_gemm_equals_the_loop_forward_and_backward():
    """torch._grouped_mm (CPU: any float dtype, 16-byte strides) and the per-expert loop give the same outputs and
    gradients, with an expert that gets no token."""
    layer = _layer(router=RouterKind.sigmoid)
    layer.router.expert_bias[3] = -100.0  # expert 3 chosen by no token
    x = torch.randn(2, 12, 32, requires_grad=True)
    results = []
    for grouped in (True, False):
        layer.zero_grad()
        x.grad = None
        layer.experts.grouped = grouped
        out = layer(x)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out.detach(), x.grad.clone(), layer.experts.w1.grad.clone(), layer.router.gate.weight.grad))
    assert layer.load[3] == 0
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_auxiliary_losses_reach_the_gradients_with_their_weight():
    """The layer's gradient with aux_loss_coef and z_loss_coef equals autograd of output·g + weight·(coef·Σ aux +
    z_coef·Σ z), the terms computed here sequence by sequence from the router's own outputs (weight: one token's)."""
    layer = _layer(aux_loss_coef=0.05, z_loss_coef=0.01).train()
    layer.loss_weight = 0.25
    x = torch.randn(2, 8, 32)
    g = torch.randn(2, 8, 32)
    (layer(x) * g).sum().backward()
    got = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    layer.aux_coef = layer.z_coef = 0.0
    out = layer(x)
    aux = z = 0.0
    for seq in x:  # the load-balancing term per sequence (each of its 8 tokens weighs), the z-loss per token
        _, chosen, probs, logits = layer.router(seq)
        counts = torch.bincount(chosen.flatten(), minlength=4).float()
        aux = aux + 8 * 4 * (counts / (8 * 2) * probs.mean(0)).sum()
        z = z + torch.logsumexp(logits, -1).square().sum()
    ((out * g).sum() + 0.25 * (0.05 * aux + 0.01 * z)).backward()
    torch.testing.assert_close(got, layer.router.gate.weight.grad, rtol=1e-5, atol=1e-5)
    layer.zero_grad()
    (layer(x) * g).sum().backward()  # (without the terms: another gradient)
    assert (got - layer.router.gate.weight.grad).abs().max() > 1e-4


def test_the_bias_chooses_but_does_not_weigh():
    """The aux-loss-free bias changes which experts a token gets, not how its chosen scores weigh."""
    layer = _layer(router=RouterKind.sigmoid)
    x = torch.randn(20, 32)
    w0, c0, _, _ = layer.router(x)
    layer.router.expert_bias[:] = torch.tensor([5.0, 5.0, -5.0, -5.0])
    w1, c1, _, _ = layer.router(x)
    assert set(c1.flatten().tolist()) == {0, 1} and not torch.equal(c0, c1)
    scores = layer.router.gate(x).float().sigmoid()
    torch.testing.assert_close(w1, scores.gather(-1, c1) / scores.gather(-1, c1).sum(-1, keepdim=True))


def test_a_moe_run_logs_its_balance_and_counts_active_flops(make_cfg, tmp_path):
    """A Mixtral-shaped run: the figures in metrics.jsonl (every token counted: load sums to tokens · k per layer),
    an alert rule watching the imbalance, FLOPs from the active parameters (fewer than all of them)."""
    from helpers import records

    from hpctrain.models import model_args, spec_of
    from hpctrain.training.run import train

    cfg = make_cfg(*MOE, "model.moe.aux_loss_coef=0.01", "train.max_steps=2", "train.eval_every=0",
                   "train.ckpt_every=0", "logging.trackers=[]",
                   "+monitor.rules.imbalance={metric:moe/imbalance,threshold:1.0,when:above,for_s:0,action:warn}")
    assert train(cfg, str(tmp_path / "run"))["status"] == "completed"
    events = [json.loads(line) for line in (tmp_path / "run" / "alerts.jsonl").read_text().splitlines()]
    assert any(e.get("rule") == "imbalance" and e.get("event") == "firing" for e in events), events  # a rule on it
    rec = [r for r in records(tmp_path / "run") if r.get("step") == 2][0]
    tokens = 8 * 64  # global batch × seq_len
    for i in range(2):
        assert sum(rec[f"moe/layer{i}/load"]) == tokens * 2 and rec[f"moe/layer{i}/imbalance"] >= 1
    assert rec["moe/imbalance"] >= 1 and rec["moe/aux_loss"] > 0.9 and rec["moe/router_entropy"] > 0
    args = model_args(cfg.model)
    spec = spec_of(cfg.model)
    every = model_args(make_cfg(*MOE, "model.moe.top_k=4").model)  # all 4 experts active
    d, h = args.dim, args.ffn_hidden
    # top-2 of 4: two experts' matmuls fewer per layer than all four (6 FLOPs per weight, 3 matrices each)
    assert spec.flops_per_token(every, 64) - spec.flops_per_token(args, 64) == 6 * 2 * (2 * 3 * d * h)


# (fsdp, tp2 and pp2 alone are in the combinations: each of these runs them together with expert parallelism)
LAYOUTS = {"fsdp_ac": ["parallel=fsdp", "parallel.dp=2", "parallel.activation_checkpointing=full"],
           "ep2": ["parallel=fsdp", "parallel.dp=2", "parallel.ep=2"],
           "ep2_fsdp4": ["parallel=fsdp", "parallel.dp=4", "parallel.ep=2"],
           "ep2_tp2": ["parallel=dp2_tp2", "parallel.sequence_parallel=false", "parallel.ep=2"],
           "ep2_tp2_sp": ["parallel=dp2_tp2", "parallel.ep=2"],
           "ep2_pp2": ["parallel=pp2", "parallel.dp=2", "parallel.zero_stage=3", "parallel.ep=2"],
           # context parallel: each sequence's balance statistics summed over its cp ranks (with activation
           # checkpointing: the sum runs again in the recomputation), and with ep (experts sharded over dp/ep × cp)
           "cp2_ac": ["parallel=fsdp", "parallel.dp=1", "parallel.cp=2", "parallel.activation_checkpointing=full"],
           "ep2_cp2": ["parallel=fsdp", "parallel.dp=2", "parallel.ep=2", "parallel.cp=2"]}
BALANCED = ("model.moe.aux_loss_coef=0.05", "model.moe.z_loss_coef=0.01", "model.moe.router=sigmoid",
            "model.moe.bias_update_rate=0.01")
_refs: dict = {}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_the_moe_losses_of_one_process(make_cfg, tmp_path, layout):
    """fp32, 3 steps with the load-balancing loss, the z-loss and the aux-loss-free bias: fsdp dp=2 with activation
    checkpointing (the recomputation counts nothing twice), expert parallel ep=2 alone, inside fsdp dp=4, with tp2
    and with pp2 equal one process in loss, gradient norm, each layer's load and the aux loss."""
    if "one" not in _refs:
        _refs["one"] = run_layout(make_cfg, tmp_path / "one", *MOE, *BALANCED), _figures(tmp_path / "one")
    ref, ref_figures = _refs["one"]
    got = run_layout(make_cfg, tmp_path / layout, *MOE, *BALANCED, *LAYOUTS[layout])
    dloss, dnorm = deltas(ref, got)
    print(f"moe {layout}: max |Δloss| {dloss:.2e}, max rel Δgrad_norm {dnorm:.2e}")
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)
    figures = _figures(tmp_path / layout)
    assert figures["load"] == ref_figures["load"], (figures, ref_figures)
    assert abs(figures["aux"] - ref_figures["aux"]) <= 1e-6


@pytest.mark.multiproc
def test_bf16_with_experts_outside_fsdp_tracks_one_process(make_cfg, tmp_path):
    """bf16 at ep = dp: FSDP's mixed precision hands the other weights over in bf16 while the experts it does not
    manage stay fp32 (they failed with a dtype error before they were cast to the tokens'). bf16 rounding can move a
    token to another expert, so the runs track one process loosely: measured 3.1e-2 in loss, 9.2e-3 in gradient
    norm over 3 steps (fsdp without ep: 3.2e-2, 9.2e-3)."""
    ref = run_layout(make_cfg, tmp_path / "one", *MOE, "precision=bf16")
    got = run_layout(make_cfg, tmp_path / "ep2", *MOE, "precision=bf16", *LAYOUTS["ep2"])
    dloss, dnorm = deltas(ref, got)
    assert dloss <= 0.1 and dnorm <= 0.05, (dloss, dnorm)


def _figures(run_dir) -> dict:
    from helpers import records

    rows = [r for r in records(run_dir) if "moe/imbalance" in r]
    return {"load": [r["moe/layer0/load"] for r in rows], "aux": rows[-1]["moe/aux_loss"]}


def test_balancing_lowers_the_measured_imbalance(make_cfg, tmp_path):
    """16 steps from a router that favours some experts: the load-balancing loss, and the aux-loss-free bias, each
    end with a lower imbalance than no balancing."""
    from helpers import records

    from hpctrain.training.run import train

    def imbalance(name, *extra):
        cfg = make_cfg(*MOE, "model.moe.num_experts=8", "train.max_steps=16", "train.eval_every=0",
                       "train.ckpt_every=0", "logging.trackers=[]", "optim.lr=3e-3", *extra)
        assert train(cfg, str(tmp_path / name))["status"] == "completed"
        rows = [r["moe/imbalance"] for r in records(tmp_path / name) if "moe/imbalance" in r]
        return sum(rows[-4:]) / 4

    none = imbalance("none")
    aux = imbalance("aux", "model.moe.aux_loss_coef=0.1")
    bias = imbalance("bias", "model.moe.bias_update_rate=0.05")
    print(f"imbalance over the last 4 of 16 steps: none {none:.3f}, aux loss {aux:.3f}, bias {bias:.3f}")
    assert aux < none and bias < none, (none, aux, bias)


def test_sophias_curvature_pass_is_neither_counted_nor_balanced(make_cfg):
    """Sophia's curvature forward and backward (on sampled labels) is not the training objective: a step's routed
    tokens are counted once (they were twice on its steps), and the balancing losses do not reach its curvature
    estimate (the same with aux_loss_coef and z_loss_coef 0 as with 0.5)."""
    from hpctrain.models import build_model
    from hpctrain.training.optimizer import build_optimizer, step_passes
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import TrainStep

    cpu, batch = torch.device("cpu"), torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(0))

    def first_step(coef: float):
        cfg = make_cfg(*MOE, "optim=sophia", f"model.moe.aux_loss_coef={coef}", f"model.moe.z_loss_coef={coef}")
        torch.manual_seed(0)
        model = build_model(cfg.model)
        opt = build_optimizer(model, cfg.optim, cfg.optim.lr)
        step = TrainStep(model, opt, setup_precision(cfg.precision, cpu), 0.0, cpu)
        step.passes = step_passes(opt)
        step([batch])
        routed = [int(layer.summed()[:4].sum()) for _, layer in moe_layers(model)]
        return routed, [opt.state[p]["hessian"] for p in model.parameters()]

    routed, plain = first_step(0.0)
    assert routed == [4 * 64 * 2] * len(routed), routed  # tokens × top_k
    _, balanced = first_step(0.5)
    assert all(torch.equal(a, b) for a, b in zip(plain, balanced))


def test_bad_moe_settings_are_one_line(make_cfg):
    from hpctrain.core.config import ConfigError
    from hpctrain.runs.resolve import resolve

    with pytest.raises(ConfigError, match=r"model.moe.num_experts=4 is not an option of model.family=llama"):
        resolve(make_cfg("model.moe.num_experts=4"), 1)
    with pytest.raises(ConfigError, match=r"model.moe.top_k=5 must be between 1 and model.moe.num_experts=4"):
        resolve(make_cfg(*MOE, "model.moe.top_k=5"), 1)
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=4 is not divisible by parallel.ep=8"):
        resolve(make_cfg(*MOE, "parallel=fsdp", "parallel.dp=8", "parallel.ep=8"), 8)
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide the data-parallel degree dp=2"):
        resolve(make_cfg(*MOE, "parallel=fsdp", "parallel.dp=2", "parallel.ep=4"), 2)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 needs a sharded data parallel"):
        resolve(make_cfg(*MOE, "parallel=ddp", "parallel.dp=2", "parallel.ep=2"), 2)
    with pytest.raises(ConfigError, match=r"parallel.compile=true with MoE layers is not supported"):
        resolve(make_cfg(*MOE, "parallel.compile=true"), 1)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 shares out MoE experts, and this model has none"):
        resolve(make_cfg("parallel=fsdp", "parallel.dp=2", "parallel.ep=2"), 2)
    # no layer with experts (a traceback after step 1), a dense layer that is not one
    with pytest.raises(ConfigError, match=r"but no layer of the 2 has experts \(model.moe.every=4, dense_layers=\[\]\)"):
        resolve(make_cfg(*MOE, "model.moe.every=4"), 1)
    with pytest.raises(ConfigError, match=r"no layer of the 2 has experts"):
        resolve(make_cfg(*MOE, "model.moe.dense_layers=[0,1]"), 1)
    with pytest.raises(ConfigError, match=r"model.moe.dense_layers=\[7\]: 7 is not a layer of the 2"):
        resolve(make_cfg(*MOE, "model.moe.dense_layers=[7]"), 1)
    # torch's Adafactor cannot update a sharded matrix (a RuntimeError at the first step): every ep layout is one
    for layout, world, what in (((*MOE, "parallel=fsdp", "parallel.dp=2", "parallel.ep=2"), 2, "parallel.zero_stage=3"),
                                (("parallel=tp2",), 2, "parallel.tp=2")):
        with pytest.raises(ConfigError, match=rf"optim=adafactor with sharded weights \({what}\)"):
            resolve(make_cfg(*layout, "optim=adafactor"), world)
    resolve(make_cfg("parallel=ddp", "parallel.dp=2", "optim=adafactor"), 2)
    # a routing bias transformers cannot hold: refused at the start, not after training (the run ended failed)
    with pytest.raises(ConfigError, match=r"train.export_hf_at_end=true with model.moe.bias_update_rate"):
        resolve(make_cfg(*MOE, "model.moe.bias_update_rate=0.01", "train.export_hf_at_end=true"), 1)
    # experts outside FSDP (ep = dp) are not offloaded: planned as if they were, 3.3 GiB for Mixtral 8x7B on 8 GPUs
    with pytest.raises(ConfigError, match=r"parallel.cpu_offload with parallel.ep=2 = dp: each rank holds its experts"):
        resolve(make_cfg(*MOE, "parallel=fsdp", "parallel.dp=2", "parallel.ep=2", "parallel.cpu_offload=true"), 2)
    resolve(make_cfg(*MOE, "parallel=fsdp", "parallel.dp=4", "parallel.ep=2", "parallel.cpu_offload=true",
                     "train.micro_batch=2"), 4)



@pytest.mark.multiproc
@pytest.mark.parametrize("written, resumed", [("ep2", "single"), ("ep2", "ep4")])
def test_a_checkpoint_resumes_in_another_layout_as_if_uninterrupted(make_cfg, tmp_path, written, resumed):
    """The experts are whole tensors in a checkpoint and the routing bias is part of it: 3 steps in one layout,
    resumed for 3 more in another (expert parallel over 2 ranks, then 4; or one process), give the losses and bias
    of 6 uninterrupted steps."""
    from helpers import losses

    from hpctrain.training.run import train

    layouts = {"single": [], "ep2": LAYOUTS["ep2"],
               "ep4": ["parallel=fsdp", "parallel.dp=4", "parallel.ep=4"]}

    def run(name, steps, layout):
        cfg = make_cfg(*MOE, *BALANCED, f"train.max_steps={steps}", "train.eval_every=0", "train.ckpt_every=3",
                       "logging.trackers=[]", "optim.decay_steps=12", "train.micro_batch=2", *layouts[layout])
        assert train(cfg, str(tmp_path / name))["status"] == "completed"

    if "whole" not in _refs:
        run("whole", 6, "single")
        _refs["whole"] = losses(tmp_path / "whole"), _bias(tmp_path / "whole")
    whole, whole_bias = _refs["whole"]
    run("resumed", 3, written)
    run("resumed", 6, resumed)
    got = losses(tmp_path / "resumed")
    assert all(abs(whole[s] - got[s]) <= 1e-5 for s in (4, 5, 6)), (whole, got)
    bias = _bias(tmp_path / "resumed")
    assert whole_bias.abs().sum() > 0 and torch.allclose(whole_bias, bias, atol=1e-7), (whole_bias, bias)


def _bias(run_dir) -> torch.Tensor:
    """Layer 1's routing bias in the run's last checkpoint."""
    from hpctrain.storage import checkpoint

    state = {"layers.1.feed_forward.router.expert_bias": torch.zeros(4)}
    checkpoint.read_weights(checkpoint.latest(str(run_dir)), state)
    return state["layers.1.feed_forward.router.expert_bias"]


def test_bench_moe_smoke(capsys):
    """`make bench-moe`, shortened: both implementations measured, the all-to-all against the even-load estimate."""
    from hpctrain.tools import bench_moe

    doc = bench_moe.main(["--dim", "32", "--hidden", "32", "--experts", "4", "--tokens", "256", "--repeats", "1",
                          "--threads", "1"])
    out = capsys.readouterr().out
    assert set(doc["rates"]) == {"grouped GEMM", "loop"} and "vs loop" in out
    assert 0.5 < doc["a2a_bytes"] / doc["a2a_estimate"] < 1.5, doc


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_moe_shape_the_transformers_class_cannot_hold_is_one_line(family):
    from hpctrain.models import get_spec
    from hpctrain.models.llama.model import ModelArgs

    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=48,
                     moe={"num_experts": 4, "shared_experts": 1, "route_scale": 2.0})
    adapter = get_spec(family).hf()
    with pytest.raises(ValueError, match=rf"^{adapter.model_class} cannot hold model.moe.shared_experts=1, "
                                         r"model.moe.route_scale=2.0: use the default or another family$"):
        adapter.to_hf_config(args)
