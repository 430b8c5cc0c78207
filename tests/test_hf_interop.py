import dataclasses
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpctrain.models.llama.hf import from_hf, from_hf_config, save_hf, to_hf, to_hf_config
from hpctrain.models.llama.model import Llama, ModelArgs

TOL = 1e-5


def small(tie: bool) -> ModelArgs:
    # Non-default theta and eps so that a dropped field shows up.
    return ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                     max_seq_len=32, rope_theta=500.0, norm_eps=1e-6, tie_embeddings=tie)


def hf_config(tie: bool = False, **kw) -> LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, rope_theta=500.0, rms_norm_eps=1e-6,
                tie_word_embeddings=tie)
    return LlamaConfig(**{**base, **kw})


def ours_random(tie: bool) -> Llama:
    torch.manual_seed(0)
    m = Llama(small(tie))
    with torch.no_grad():  # init leaves norms at 1: perturb them so a swapped norm mapping is caught
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return m.eval()


def hf_random(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config(tie))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf.eval()


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(seed))


def max_diff(ours: Llama, hf: LlamaForCausalLM, x: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(x) - hf(input_ids=x).logits).abs().max().item()


@pytest.mark.parametrize("tie", [False, True])
def test_to_hf_logits_match(tie):
    m = ours_random(tie)
    hf = to_hf(m)
    assert not hf.training and all(p.dtype == torch.float32 for p in hf.parameters())
    c = hf.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 4, 2)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (96, 128, 32)
    assert c.rms_norm_eps == 1e-6 and c.tie_word_embeddings == tie
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tie
    assert max_diff(m, hf, tokens()) < TOL
    # Weights are copied, not shared.
    assert hf.model.embed_tokens.weight.data_ptr() != m.tok_embeddings.weight.data_ptr()


@pytest.mark.parametrize("tie", [False, True])
def test_from_hf_logits_match(tie):
    hf = hf_random(tie)
    m = from_hf(hf)
    assert m.args == small(tie)
    assert (m.output.weight is m.tok_embeddings.weight) == tie
    assert max_diff(m, hf, tokens(1)) < TOL


def test_rope_theta_matters():
    """Guard for the test above: a wrong rope_theta would give clearly different logits."""
    hf = hf_random(False)
    m = from_hf(hf)
    m.args.rope_theta = 10000.0
    m.reset_rope_cache()
    assert max_diff(m, hf, tokens(1)) > 1e-3


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_state_dict_identical(tie):
    m = ours_random(tie)
    back = from_hf(to_hf(m))
    assert back.args == m.args
    a, b = m.state_dict(), back.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    hf = hf_random(tie)
    again = to_hf(from_hf(hf)).state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(again[k], v), k


@pytest.mark.parametrize("tie", [False, True])
def test_save_hf_loads_with_from_pretrained(tie, tmp_path):
    m = ours_random(tie)
    out = save_hf(m, tmp_path / "export", eos_token_id=5)
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 5
    loaded = LlamaForCausalLM.from_pretrained(out).eval()  # a local directory: nothing is downloaded
    assert max_diff(m, loaded, tokens(2)) < TOL


def test_to_hf_config_round_trip():
    for args in (small(False), small(True), ModelArgs()):
        assert from_hf_config(to_hf_config(args)) == dataclasses.replace(args, n_kv_heads=args.kv_heads)


@pytest.mark.parametrize(
    "kw",
    [
        dict(attention_bias=True),
        dict(mlp_bias=True),
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        dict(head_dim=32),
        dict(hidden_act="gelu"),
    ],
)
def test_unsupported_config_raises(kw):
    hf = LlamaForCausalLM(hf_config(**kw))
    with pytest.raises(ValueError, match="cannot represent") as err:
        from_hf(hf)
    assert "\n" not in str(err.value)


def test_to_hf_refuses_pipeline_stage():
    m = ours_random(False)
    m.output = None
    with pytest.raises(ValueError, match="pipeline stage"):
        to_hf(m)
