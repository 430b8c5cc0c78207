"""train.fused_loss: the cross entropy computed with the output projection, chunk by chunk, against the plain
logits path (values and gradients), what it keeps for backward, and whole runs against the plain loss."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import deltas, run_layout

from hpctrain.core.config import ConfigError
from hpctrain.models.cross_entropy import IGNORE_INDEX, chunk_tokens, linear_cross_entropy
from hpctrain.models.llama.model import Llama, ModelArgs


def _inputs(n_batch=3, n_tok=37, dim=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n_batch, n_tok, dim, generator=g, requires_grad=True)
    w = torch.randn(vocab, dim, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, (n_batch, n_tok), generator=g)
    t[0, :5] = IGNORE_INDEX  # padding counts nothing
    return h, w, t


def _plain(h, w, t):
    return F.cross_entropy(F.linear(h, w).flatten(0, 1), t.flatten(), reduction="sum")


@pytest.mark.parametrize("chunk", [1, 10, 37 * 3, 1000])
def test_equals_the_logits_path_in_value_and_gradients(chunk):
    h, w, t = _inputs()
    ref = _plain(h, w, t)
    ref_h, ref_w = torch.autograd.grad(ref * 0.5, [h, w])  # a scaled loss: the upstream gradient is applied
    got = linear_cross_entropy(h, w, t, chunk=chunk)
    got_h, got_w = torch.autograd.grad(got * 0.5, [h, w])
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-5)
    assert got_h[0, :5].abs().max() == 0  # ignored targets: no gradient


def test_under_autocast_matches_the_autocast_logits_path():
    h, w, t = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _plain(h, w, t)
        got = linear_cross_entropy(h, w, t, chunk=16)
    ref_h, ref_w = torch.autograd.grad(ref, [h, w])
    got_h, got_w = torch.autograd.grad(got, [h, w])
    assert got.dtype == torch.float32 and got_h.dtype == h.dtype and got_w.dtype == w.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3)  # the same bf16 logits, the same fp32 softmax
    # The weight's gradient is summed over chunks in fp32 here, in one bf16 matmul there: bf16 rounding apart.
    torch.testing.assert_close(got_h, ref_h, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-2, atol=2e-2)


def _compiled_equals_eager(argv):
    h, w, t = _inputs()
    ref = linear_cross_entropy(h, w, t, chunk=32)
    ref_h, ref_w = torch.autograd.grad(ref, [h, w])
    got = linear_cross_entropy(h, w, t, chunk=32, compiled=True)
    got_h, got_w = torch.autograd.grad(got, [h, w])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-5)


def test_compiled_chunks_equal_eager():
    """parallel.compile's path (the chunk kernels through torch.compile), with a short last chunk. In a new
    interpreter: inductor's compile workers in this process would make later forks of it (the local ranks) abort,
    and a forked child of a busy test process once hung compiling."""
    p = subprocess.run([sys.executable, "-c", "import test_fused_loss as t; t._compiled_equals_eager([])"],
                       cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]


def test_without_gradients_only_the_loss_is_computed():
    h, w, t = _inputs()
    with torch.no_grad():
        got = linear_cross_entropy(h, w, t, chunk=7)
    assert got.grad_fn is None
    torch.testing.assert_close(got, _plain(h, w, t).detach(), rtol=1e-6, atol=1e-4)


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward while `fn` runs."""
    saved = {}

    def pack(t):
        saved[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


def test_keeps_no_logits_for_backward():
    """The plain path keeps [tokens, vocab] fp32 log-probabilities; the fused one only the two gradients."""
    tokens, dim, vocab = 512, 32, 4096
    h = torch.randn(tokens, dim, requires_grad=True)
    w = torch.randn(vocab, dim, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,))
    plain = _saved_bytes(lambda: F.cross_entropy(F.linear(h, w), t, reduction="sum"))
    fused = _saved_bytes(lambda: linear_cross_entropy(h, w, t, chunk=64))
    assert plain >= tokens * vocab * 4
    assert fused == (tokens + vocab) * dim * 4  # grad of the hidden states and of the weight, fp32
    # At most 1 GiB of fp32 logits per chunk, in whole 128-token tiles where they fit.
    assert (chunk_tokens(128256), chunk_tokens(4096), chunk_tokens(2**22), chunk_tokens(2**30)) == (2048, 65536, 64, 1)


@pytest.mark.parametrize("tied", [False, True])
def test_model_forward_with_targets_equals_the_loss_of_its_logits(tied):
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=24,
                     tie_embeddings=tied)
    model = Llama(args)
    x = torch.randint(0, args.vocab_size, (2, 25))
    ref = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    got = model(x[:, :-1], x[:, 1:])
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-4)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_run_with_the_fused_loss_equals_the_plain_loss(make_cfg, tmp_path):
    ref = run_layout(make_cfg, tmp_path / "plain")
    got = run_layout(make_cfg, tmp_path / "fused", "train.fused_loss=true", "train.eval_every=2")
    dl, dg = deltas(ref, got)
    assert dl < 1e-5 and dg < 1e-4, (dl, dg)


@pytest.mark.multiproc
def test_fused_loss_under_fsdp_equals_one_process(make_cfg, tmp_path):
    ref = run_layout(make_cfg, tmp_path / "one", "train.fused_loss=true")
    got = run_layout(make_cfg, tmp_path / "fsdp", "train.fused_loss=true", "parallel=fsdp", "parallel.dp=2")
    dl, dg = deltas(ref, got)
    assert dl < 1e-5 and dg < 1e-4, (dl, dg)


@pytest.mark.parametrize("layout", [["parallel=tp2"], ["parallel=pp2"]])
def test_refused_with_tensor_or_pipeline_parallelism(make_cfg, layout):
    from hpctrain.runs.resolve import resolve

    with pytest.raises(ConfigError, match="train.fused_loss=true needs parallel.tp=1 and parallel.pp=1"):
        resolve(make_cfg("train.fused_loss=true", *layout), world=2)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_step_sums_each_groups_loss_from_its_own_forward(fused):
    """A step given each sample's group (a mixture's source) returns each group's summed loss and target tokens —
    what every sample of the group scores alone — and the same loss and gradients as without groups."""
    from hpctrain.core.config import PrecisionConfig
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import Groups, TrainStep

    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=50, max_seq_len=16)
    batches = [torch.randint(0, 50, (3, 9)) for _ in range(2)]
    groups = Groups(torch.tensor([2, 0, 2, 1, 2, 0]), 4)  # group 3 has no sample in this step
    results, grads = [], []
    for given in (None, groups):
        torch.manual_seed(1)
        model = Llama(args)
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), setup_precision(PrecisionConfig(),
                         torch.device("cpu")), 0.0, torch.device("cpu"), fused_loss=fused)
        results.append(step(batches, groups=given))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    plain, grouped = results
    assert plain.groups is None and abs(grouped.loss - plain.loss) < 1e-6 and torch.allclose(grads[0], grads[1])
    with torch.no_grad():
        alone = torch.stack([F.cross_entropy(model(s[None, :-1])[0], s[1:], reduction="sum")
                             for b in batches for s in b])
    want = torch.zeros(4).index_add_(0, groups.ids, alone).tolist() + [16.0, 8.0, 24.0, 0.0]
    assert grouped.groups == pytest.approx(want, rel=1e-5), (grouped.groups, want)
    assert sum(grouped.groups[:4]) / 48 == pytest.approx(grouped.loss, rel=1e-6)
