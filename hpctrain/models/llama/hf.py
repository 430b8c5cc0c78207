"""Convert between hpctrain's ``Llama`` and transformers' ``LlamaForCausalLM``.

Both use the same RoPE layout (rotate the two halves of head_dim), so conversion is a plain
one-to-one weight copy: no q/k permutation. Nothing is ever downloaded: configs are built locally.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpctrain.models.llama.model import Llama, ModelArgs

# Per-layer names: ours -> transformers (under "model.layers.{i}.").
_LAYER_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def key_map(n_layers: int) -> dict[str, str]:
    """Our state_dict key -> transformers' LlamaForCausalLM state_dict key."""
    names = dict(_TOP_KEYS)
    for i in range(n_layers):
        names.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in _LAYER_KEYS.items()})
    return names


def to_hf_config(args: ModelArgs, **overrides) -> LlamaConfig:
    """A LlamaConfig describing the same network. ``overrides`` sets non-architectural fields
    (e.g. ``bos_token_id``, ``eos_token_id``) that ModelArgs does not know about."""
    kwargs = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=float(args.rope_theta),  # transformers 5 moves it into rope_parameters itself
        tie_word_embeddings=args.tie_embeddings,
        initializer_range=args.init_std,
        attention_bias=False,
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],  # what hub tools and AutoModel read first
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def from_hf_config(config) -> ModelArgs:
    """ModelArgs for a transformers Llama config; ValueError (one line) if Llama cannot represent it."""
    # transformers 5 keeps theta and scaling in rope_parameters (rope_scaling is an alias);
    # 4.x has rope_theta plus an optional rope_scaling dict.
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    problems = []
    if getattr(config, "model_type", "llama") != "llama":
        problems.append(f"model_type={config.model_type!r} (only 'llama')")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias=True")
    if getattr(config, "mlp_bias", False):
        problems.append("mlp_bias=True")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (only 'silu')")
    if rope_type != "default" or theta is None:
        problems.append(f"rope scaling {rope} (only plain RoPE)")
    if partial not in (None, 1.0):
        problems.append(f"partial_rotary_factor={partial}")
    if head_dim * config.num_attention_heads != config.hidden_size:
        problems.append(
            f"head_dim={head_dim} != hidden_size/num_attention_heads="
            f"{config.hidden_size}/{config.num_attention_heads}"
        )
    if problems:
        raise ValueError("cannot represent this transformers config as hpctrain Llama: " + "; ".join(problems))
    return ModelArgs(
        vocab_size=config.vocab_size,
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        ffn_hidden=config.intermediate_size,
        max_seq_len=config.max_position_embeddings,
        rope_theta=float(theta),
        norm_eps=config.rms_norm_eps,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        init_std=getattr(config, "initializer_range", 0.02),
    )


def to_hf(model: Llama, **config_overrides) -> LlamaForCausalLM:
    """An fp32 LlamaForCausalLM in eval mode with ``model``'s weights (copied, not shared).

    ``model`` must be whole (not a pipeline stage). Tensor-parallel/FSDP DTensor weights are
    gathered with ``full_tensor()``, a collective: call it on every rank then.
    """
    if model.tok_embeddings is None or model.norm is None or model.output is None or (
        len(model.layers) != model.args.n_layers
    ):
        raise ValueError("to_hf needs a whole model, not a pipeline stage")
    names = key_map(model.args.n_layers)
    state = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        state[names[k]] = v.detach().to(device="cpu", dtype=torch.float32)
    hf = LlamaForCausalLM(to_hf_config(model.args, **config_overrides)).float()
    hf.load_state_dict(state, strict=True)
    return hf.eval()


def from_hf(hf_model: LlamaForCausalLM) -> Llama:
    """An fp32 CPU Llama with the weights of a transformers LlamaForCausalLM (copied)."""
    args = from_hf_config(hf_model.config)
    theirs = hf_model.state_dict()
    if args.tie_embeddings:  # a tied checkpoint may list lm_head.weight or not
        theirs.setdefault("lm_head.weight", theirs["model.embed_tokens.weight"])
    missing = [v for v in key_map(args.n_layers).values() if v not in theirs]
    if missing:
        raise ValueError(f"not a LlamaForCausalLM state_dict: missing {missing[:3]}")
    with torch.device("meta"):  # skip a random init of weights about to be overwritten
        model = Llama(args)
    model.to_empty(device="cpu")
    model.reset_rope_cache()
    model.tie_weights()  # to_empty() unties them
    state = {k: theirs[v].detach().to(device="cpu", dtype=torch.float32) for k, v in key_map(args.n_layers).items()}
    model.load_state_dict(state, strict=True)
    return model


def save_hf(model: Llama, out_dir: str | Path, **config_overrides) -> Path:
    """Write ``model`` as a transformers directory (config.json + model.safetensors) loadable with
    ``LlamaForCausalLM.from_pretrained(out_dir)``."""
    out = Path(out_dir)
    to_hf(model, **config_overrides).save_pretrained(out)  # safetensors is the default format
    return out


# config.json's name for each model.* key. All but max_seq_len (how far the RoPE tables reach) and init_std (the
# scale of a random draw the weights replace) must agree with the checkpoint's.
HF_FIELDS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size",
             "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
             "max_seq_len": "max_position_embeddings", "init_std": "initializer_range"}
FREE = ("max_seq_len", "init_std")


def read_args(path: str | Path) -> ModelArgs:
    """The ModelArgs a local transformers directory's config.json describes; ValueError (one line) when it has none,
    is not a file of sane size, or describes a network Llama cannot represent. Reads config.json only."""
    from hpctrain.core.files import MAX_JSON_BYTES, FileCheckError, check_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: point it at a transformers model directory")
    try:
        check_file(str(path / "config.json"), MAX_JSON_BYTES)
    except FileCheckError as e:
        raise ValueError(str(e)) from None
    return from_hf_config(LlamaConfig.from_pretrained(str(path), local_files_only=True))


def _field(args: ModelArgs, key: str):
    return args.kv_heads if key == "n_kv_heads" else getattr(args, key)  # (None: as many as n_heads)


def check_hf_dir(path: str | Path, args: ModelArgs) -> None:
    """A local transformers Llama directory whose config.json describes `args`' network, with safetensors weights
    holding exactly that network's tensors in floating point; ValueError (one line naming the first mismatch)
    otherwise. Reads config.json and the safetensors headers, no weights."""
    from hpctrain.models import float32_equal
    from hpctrain.models.safetensors_dir import check_tensors

    path = Path(path)
    theirs = read_args(path)
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors weights (only safetensors are read, never pickles)")
    bad = [f"{hf}={_field(theirs, ours)} vs model.{ours}={_field(args, ours)}" for ours, hf in HF_FIELDS.items()
           if ours not in FREE and not float32_equal(_field(theirs, ours), _field(args, ours))]
    if bad:
        raise ValueError(f"{path}/config.json does not describe this model: {'; '.join(bad)}")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Llama(args).state_dict().items()}
    names = key_map(args.n_layers)
    check_tensors(str(path), {names[k]: shape for k, shape in shapes.items()},
                  optional=("lm_head.weight",) if args.tie_embeddings else (),  # a tied head may be listed or not
                  ignored=("rotary_emb.inv_freq",))  # a buffer older transformers versions saved


def load_hf_weights(model, path: str | Path, args: ModelArgs) -> None:
    """Copy a transformers Llama directory's weights (one or many safetensors files) into `model` in place, in any
    layout: DCP's safetensors reader gives each rank only the slices its shards hold. Collective when distributed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    names = key_map(args.n_layers)
    # A tied checkpoint may lack lm_head.weight: the embedding, loaded, is the head too.
    ours = model.state_dict()
    state = {names[k]: v for k, v in ours.items() if k in names and not (args.tie_embeddings and k == "output.weight")}
    if args.tie_embeddings and "output.weight" in ours and "tok_embeddings.weight" not in ours:
        state[names["tok_embeddings.weight"]] = ours["output.weight"]  # a last pipeline stage's copy of the table
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=not dist.is_initialized())
