"""Document masking (train.document_mask): documents packed in one block attend only within themselves — against each
document run alone, in every layout against one process, compiled, and in training."""

from __future__ import annotations

import pytest
import torch
from helpers import deltas, run_layout

from hpctrain.models.llama.model import Llama, ModelArgs
from hpctrain.models.packing import DocumentMask, document_ids, document_positions

EOS = 0


def test_documents_and_their_positions_come_from_the_eos_in_the_block():
    inputs = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(inputs, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(document_ids(inputs, EOS)).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1],
                                                                      [0, 0, 1, 2, 3, 4, 5, 6]]
    assert set(DocumentMask(EOS).kwargs(inputs)) == {"docs"}
    assert set(DocumentMask(EOS, restart_positions=True).kwargs(inputs)) == {"docs", "positions"}


def _packed(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A block of documents of these lengths, each but the last ending with EOS: ([1, T] block, the documents)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    for d in docs[:-1]:
        d[-1] = EOS
    return torch.cat(docs)[None], docs


FAMILIES = {"llama-gqa": {}, "mistral-window": {"sliding_window": 6}, "qwen2-bias": {"qkv_bias": True},
            "qwen3-qk-norm": {"qk_norm": True, "head_dim": 16}}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("restart", [True, False], ids=["restart", "continue"])
def test_a_packed_blocks_logits_equal_each_document_run_alone(family, restart):
    """fp32, to 1e-5: each document's logits in the packed block are those of the document alone. RoPE is relative,
    so positions that continue across the block give them too; restarted ones are the document's own."""
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64, **FAMILIES[family])
    model = Llama(args).eval()
    with torch.no_grad():
        for bias in (m.bias for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None):
            bias.normal_()  # (initialised to zero: make them count)
    block, docs = _packed([9, 14, 1, 17, 7], args.vocab_size)
    with torch.no_grad():
        packed = model(block, **DocumentMask(EOS, restart).kwargs(block))[0]
        whole = model(block)[0]
        start = 0
        for doc in docs:
            alone = model(doc[None])[0]
            torch.testing.assert_close(packed[start:start + len(doc)], alone, rtol=0, atol=1e-5)
            start += len(doc)
    assert (whole[9:23] - model(docs[1][None])[0]).abs().max() > 1e-2  # without the mask, documents see each other


@pytest.mark.slow
def test_compiled_blocks_with_the_mask_equal_eager():
    """parallel.compile's blocks (torch.compile, fullgraph) take the mask and the positions: the eager logits and
    gradients."""
    from hpctrain.parallel.parallelize import apply_compile

    torch.manual_seed(0)
    model = Llama(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64))
    block, _ = _packed([9, 14, 1, 17, 7, 16], 64)
    given = DocumentMask(EOS, restart_positions=True).kwargs(block)
    eager = model(block, **given)
    eager.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_compile(model, True)
    try:
        compiled = model(block, **given)
        compiled.square().sum().backward()
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """Shards of 20-word documents: three or four in every 65-token block."""
    from data_prep.synthetic import build_synthetic

    out = str(tmp_path_factory.mktemp("short-docs"))
    build_synthetic(out, 512, 64, samples=64, val_samples=16, shards=8, doc_tokens=20)
    return out


MASKED = ("train.document_mask=true", "train.restart_positions=true", "model.tie_embeddings=false")
_refs: dict = {}


def _one_process(make_cfg, data: str, tmp_path, *overrides):
    if overrides not in _refs:
        _refs[overrides] = run_layout(make_cfg, tmp_path / f"one-{len(_refs)}", f"data.path={data}", *overrides)
    return _refs[overrides]


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [["parallel=fsdp", "parallel.dp=2"], ["parallel=tp2_sp"], ["parallel=pp2"],
                                    ["parallel=dp2_tp2", "parallel.activation_checkpointing=full"]],
                         ids=["fsdp", "tp2_sp", "pp2", "dp2_tp2_sp_ac"])
def test_every_layout_trains_the_masked_losses_of_one_process(make_cfg, short_documents, tmp_path, layout):
    """fp32: the losses and gradient norms of one masked process (pipeline stages get the documents as keyword
    inputs, tensor parallel ranks their heads' share of the mask), which differ from the unmasked ones."""
    ref = _one_process(make_cfg, short_documents, tmp_path, *MASKED)
    got = run_layout(make_cfg, tmp_path / "layout", f"data.path={short_documents}", *MASKED, *layout)
    dloss, dnorm = deltas(ref, got)
    print(f"{layout}: max |Δloss| {dloss:.2e}, max rel Δgrad_norm {dnorm:.2e}")
    assert dloss <= 1e-5 and dnorm <= 1e-5, (dloss, dnorm)
    unmasked = _one_process(make_cfg, short_documents, tmp_path, "model.tie_embeddings=false")
    assert abs(unmasked[1][0] - ref[1][0]) > 1e-4, (unmasked, ref)


def test_training_with_the_mask_lowers_the_loss_like_without(make_cfg, short_documents, tmp_path):
    """Eight steps, with the fused loss too: the masked run's loss falls as the unmasked one's does."""
    from helpers import losses

    from hpctrain.training.run import train

    curves = {}
    for name, extra in (("plain", ["model.tie_embeddings=false"]), ("masked", [*MASKED, "train.fused_loss=true"])):
        cfg = make_cfg(f"data.path={short_documents}", "train.max_steps=8", "train.eval_every=8", "train.ckpt_every=0",
                       "logging.trackers=[]", "cluster.num_threads=1", *extra)
        result = train(cfg, str(tmp_path / name))
        assert result["status"] == "completed" and result["final_val_loss"] is not None
        curves[name] = losses(tmp_path / name)
    first, last = curves["masked"][1], curves["masked"][8]
    print({k: (v[1], v[8]) for k, v in curves.items()})
    assert last < first - 0.5 and abs(last - curves["plain"][8]) < 0.1 * (first - last), curves
