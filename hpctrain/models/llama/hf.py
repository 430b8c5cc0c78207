"""Convert between hpctrain's decoder and transformers' classes of the families that share it.

`HFAdapter` holds what the families have in common: the weight names (the same in LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM), the config.json fields of the shape and RoPE, the
checks of a directory and the sharded loading. A family's adapter (`ADAPTER` in its `hf` module) names its
transformers classes and reads and writes its own fields (`_read_traits`, `_write_traits`). All of them use the
same RoPE layout (rotate the two halves of head_dim), so conversion is a plain one-to-one weight copy: no q/k
permutation. Nothing is ever downloaded: configs are built locally.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from hpctrain.core.config import RopeScaling, RopeType
from hpctrain.models import flat, float32_equal
from hpctrain.models.llama.model import Llama, ModelArgs

# Per-layer names: ours -> transformers (under "model.layers.{i}."). A family's model has a subset (biases: Qwen2;
# q/k norms: Qwen3).
_LAYER_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
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
    """Our state_dict key -> transformers' state_dict key (every key any family has)."""
    names = dict(_TOP_KEYS)
    for i in range(n_layers):
        names.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in _LAYER_KEYS.items()})
    return names


def _rope_parameters(args: ModelArgs) -> dict:
    """transformers' rope_parameters for the model's RoPE."""
    s = args.rope_scaling
    out = {"rope_type": s.type.value, "rope_theta": float(args.rope_theta)}
    if s.type != RopeType.default:
        out["factor"] = float(s.factor)
    if s.type == RopeType.llama3:
        out.update(low_freq_factor=float(s.low_freq_factor), high_freq_factor=float(s.high_freq_factor),
                   original_max_position_embeddings=s.original_max_seq_len)
    return out


def _rope_scaling(config) -> tuple[float | None, RopeScaling | None, str | None]:
    """(theta, scaling, problem) of a transformers config: transformers 5 keeps theta and scaling in rope_parameters
    (rope_scaling is an alias); 4.x has rope_theta plus an optional rope_scaling dict."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if kind not in {t.value for t in RopeType}:
        return theta, None, f"rope type {kind!r} (hpctrain reads {', '.join(t.value for t in RopeType)})"
    try:
        if kind == "default":
            return theta, RopeScaling(), None
        if kind == "linear":
            return theta, RopeScaling(RopeType.linear, float(rope["factor"])), None
        if kind == "dynamic":  # transformers' dynamic NTK grows from max_position_embeddings
            return theta, RopeScaling(RopeType.dynamic, float(rope["factor"]),
                                      int(config.max_position_embeddings)), None
        return theta, RopeScaling(RopeType.llama3, float(rope["factor"]), int(rope["original_max_position_embeddings"]),
                                  float(rope["low_freq_factor"]), float(rope["high_freq_factor"])), None
    except (KeyError, TypeError, ValueError) as e:
        return theta, None, f"rope scaling {rope} lacks or garbles {e}"


class HFAdapter:
    """One family's transformers classes and config.json fields; the conversions every family shares."""

    family = "llama"
    config_class = "LlamaConfig"
    model_class = "LlamaForCausalLM"
    model_type = "llama"
    # config.json's name for each model.* key. All but max_seq_len (how far the RoPE tables reach) and init_std (the
    # scale of a random draw the weights replace) must agree with the checkpoint's.
    HF_FIELDS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
                 "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
                 "ffn_hidden": "intermediate_size", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
                 "tie_embeddings": "tie_word_embeddings", "max_seq_len": "max_position_embeddings",
                 "init_std": "initializer_range", "head_dim": "head_dim", "rope_scaling": "rope_scaling",
                 "sliding_window": "sliding_window"}
    FREE = ("max_seq_len", "init_std")
    # config.json's training-time settings hpctrain does not apply (published models set them to 0), and what that means
    UNAPPLIED = {"attention_dropout": "hpctrain's attention has no dropout: training goes on without it, and an "
                                      "export writes 0.0"}

    # --- what differs by family ---------------------------------------------------------------------------------
    def _read_traits(self, config) -> tuple[dict, list[str]]:
        """(ModelArgs fields this family's config sets beyond the shared ones, what it cannot represent)."""
        problems = [f"{flag}=True" for flag in ("attention_bias", "mlp_bias") if getattr(config, flag, False)]
        return {}, problems

    def _write_traits(self, args: ModelArgs) -> dict:
        """This family's config fields for `args`, beyond the shared ones."""
        return dict(attention_bias=False, mlp_bias=False)

    # --- shared -------------------------------------------------------------------------------------------------
    def hf_classes(self):
        return getattr(transformers, self.config_class), getattr(transformers, self.model_class)

    def key_map(self, n_layers: int) -> dict[str, str]:
        return key_map(n_layers)

    def disk_names(self, args: ModelArgs) -> dict[str, tuple[str, ...]]:
        """Our state_dict key -> the tensors it is in a transformers directory: one name (the whole tensor), or one
        per row of its first dimension (an MoE layer's experts, saved one by one)."""
        return {k: (v,) for k, v in self.key_map(args.n_layers).items()}

    def to_memory(self, ours: dict[str, torch.Tensor], args: ModelArgs, theirs: set[str]) -> dict[str, torch.Tensor]:
        """Our tensors as the state_dict of the family's transformers module, whose keys are `theirs`."""
        names = self.key_map(args.n_layers)
        return {names[k]: v for k, v in ours.items()}

    def from_memory(self, theirs: dict[str, torch.Tensor], args: ModelArgs, keys) -> dict[str, torch.Tensor]:
        """Our state_dict `keys` from a transformers module's state_dict; KeyError naming a missing one."""
        names = self.key_map(args.n_layers)
        return {k: theirs[names[k]] for k in keys}

    def to_hf_config(self, args: ModelArgs, **overrides):
        """A transformers config of the family describing the same network. ``overrides`` sets non-architectural
        fields (e.g. ``bos_token_id``, ``eos_token_id``) that ModelArgs does not know about."""
        scaling = args.rope_scaling
        kwargs = dict(
            vocab_size=args.vocab_size,
            hidden_size=args.dim,
            intermediate_size=args.ffn_hidden,
            num_hidden_layers=args.n_layers,
            num_attention_heads=args.n_heads,
            num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim,
            hidden_act="silu",
            # dynamic NTK RoPE grows from max_position_embeddings: the context it was trained at
            max_position_embeddings=(scaling.original_max_seq_len if scaling.type == RopeType.dynamic
                                     else args.max_seq_len),
            rms_norm_eps=args.norm_eps,
            rope_parameters=_rope_parameters(args),
            tie_word_embeddings=args.tie_embeddings,
            initializer_range=args.init_std,
            architectures=[self.model_class],  # what hub tools and AutoModel read first
            **self._write_traits(args),
        )
        kwargs.update(overrides)
        return self.hf_classes()[0](**kwargs)

    def from_hf_config(self, config) -> ModelArgs:
        """ModelArgs for a transformers config of this family; ValueError (one line) if hpctrain cannot represent
        it."""
        theta, scaling, rope_problem = _rope_scaling(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = dict(getattr(config, "rope_parameters", None) or {})
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        problems = []
        if getattr(config, "model_type", self.model_type) != self.model_type:
            problems.append(f"model_type={config.model_type!r} (this adapter reads {self.model_type!r})")
        if getattr(config, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={config.hidden_act!r} (only 'silu')")
        if rope_problem or theta is None:
            problems.append(rope_problem or "no rope_theta")
        if partial not in (None, 1.0):
            problems.append(f"partial_rotary_factor={partial}")
        traits, more = self._read_traits(config)
        problems += more
        if problems:
            raise ValueError(f"cannot represent this transformers config as hpctrain {self.family}: "
                             + "; ".join(problems))
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
            head_dim=head_dim,
            rope_scaling=scaling,
            **traits,
        )

    def to_hf(self, model: Llama, **config_overrides):
        """An fp32 transformers model of the family in eval mode with ``model``'s weights (copied, not shared).

        ``model`` must be whole (not a pipeline stage). Tensor-parallel/FSDP DTensor weights are
        gathered with ``full_tensor()``, a collective: call it on every rank then.
        """
        if model.tok_embeddings is None or model.norm is None or model.output is None or (
            len(model.layers) != model.args.n_layers
        ):
            raise ValueError("to_hf needs a whole model, not a pipeline stage")
        ours = {}
        for k, v in model.state_dict().items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            ours[k] = v.detach().to(device="cpu", dtype=torch.float32)
        hf = self.hf_classes()[1](self.to_hf_config(model.args, **config_overrides)).float()
        hf.load_state_dict(self.to_memory(ours, model.args, set(hf.state_dict())), strict=True)
        return hf.eval()

    def from_hf(self, hf_model) -> Llama:
        """An fp32 CPU model with the weights of a transformers model of the family (copied)."""
        args = self.from_hf_config(hf_model.config)
        theirs = hf_model.state_dict()
        if args.tie_embeddings:  # a tied checkpoint may list lm_head.weight or not
            theirs.setdefault("lm_head.weight", theirs["model.embed_tokens.weight"])
        with torch.device("meta"):  # skip a random init of weights about to be overwritten
            model = Llama(args)
        try:
            state = self.from_memory(theirs, args, list(model.state_dict()))
        except KeyError as e:
            raise ValueError(f"not a {self.model_class} state_dict: missing {e}") from None
        model.to_empty(device="cpu")
        model.init_buffers()
        model.tie_weights()  # to_empty() unties them
        model.load_state_dict({k: v.detach().to(device="cpu", dtype=torch.float32) for k, v in state.items()},
                              strict=True)
        return model

    def save_hf(self, model: Llama, out_dir: str | Path, **config_overrides) -> Path:
        """Write ``model`` as a transformers directory (config.json + model.safetensors) that the family's class and
        AutoModelForCausalLM load."""
        out = Path(out_dir)
        self.to_hf(model, **config_overrides).save_pretrained(out)  # safetensors is the default format
        return out

    def read_args(self, path: str | Path) -> ModelArgs:
        """The ModelArgs a local transformers directory's config.json describes; ValueError (one line) when it has
        none, is not a file of sane size, or describes a network hpctrain cannot represent. Reads config.json only."""
        from hpctrain.core.files import MAX_JSON_BYTES, FileCheckError, check_file

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: point it at a transformers model directory")
        try:
            check_file(str(path / "config.json"), MAX_JSON_BYTES)
        except FileCheckError as e:
            raise ValueError(str(e)) from None
        try:
            config = self.hf_classes()[0].from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers' checks raise KeyError, TypeError, its own dataclass errors
            raise ValueError(f"{path}/config.json: transformers cannot read it ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:300]}): fix that field or download config.json again"
                             ) from None
        return self.from_hf_config(config)

    def unapplied(self, path: str | Path) -> list[str]:
        """`KEY=VALUE: why` for each UNAPPLIED setting config.json (read_args checked it) sets to other than 0."""
        from hpctrain.core.files import read_json

        config = read_json(str(Path(path) / "config.json"))
        return [f"{key}={config[key]}: {why}" for key, why in self.UNAPPLIED.items() if config.get(key)]

    def field_name(self, key: str) -> str:
        """config.json's name of the dotted model key (rope_scaling.factor -> rope_scaling.factor, dim -> hidden_size)."""
        top = key.split(".")[0]
        return self.HF_FIELDS.get(top, top) + key[len(top):]

    def mismatches(self, theirs: ModelArgs, ours: ModelArgs) -> list[tuple[str, object, object]]:
        """(dotted model key, theirs, ours) for each field that differs beyond float32 rounding (FREE ones aside)."""
        mine = dict(flat(ours))
        return [(key, value, mine[key]) for key, value in flat(theirs)
                if key not in self.FREE and key.split(".")[0] not in self.FREE and key != "n_kv_heads"
                and not float32_equal(value, mine[key])
                ] + ([("n_kv_heads", theirs.kv_heads, ours.kv_heads)] if theirs.kv_heads != ours.kv_heads else [])

    def check_hf_dir(self, path: str | Path, args: ModelArgs) -> None:
        """A local transformers directory whose config.json describes `args`' network, with safetensors weights
        holding exactly that network's tensors in floating point; ValueError (one line naming the first mismatch)
        otherwise. Reads config.json and the safetensors headers, no weights."""
        from hpctrain.models.safetensors_dir import check_tensors

        path = Path(path)
        theirs = self.read_args(path)
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"{path} has no *.safetensors weights (only safetensors are read, never pickles): "
                             "download the model's *.safetensors files, or convert its .bin weights (transformers' "
                             "save_pretrained writes safetensors)")
        bad = [f"{self.field_name(key)}={a} vs model.{key}={b}" for key, a, b in self.mismatches(theirs, args)]
        if bad:
            raise ValueError(f"{path}/config.json does not describe this model: {'; '.join(bad)}")
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in Llama(args).state_dict().items()}
        names = self.disk_names(args)
        expected = {}
        for k, shape in shapes.items():
            if k not in names:  # a buffer of ours a transformers directory has no place for (MoE's routing bias)
                continue
            expected.update({names[k][0]: shape} if len(names[k]) == 1 else dict.fromkeys(names[k], shape[1:]))
        check_tensors(str(path), expected,
                      optional=("lm_head.weight",) if args.tie_embeddings else (),  # a tied head may be listed or not
                      ignored=("rotary_emb.inv_freq",))  # a buffer older transformers versions saved

    def load_hf_weights(self, model, path: str | Path, args: ModelArgs) -> None:
        """Copy a transformers directory's weights (one or many safetensors files) into `model` in place, in any
        layout: DCP's safetensors reader gives each rank only the slices its shards hold. Collective when
        distributed."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        names = self.disk_names(args)
        # A tied checkpoint may lack lm_head.weight: the embedding, loaded, is the head too.
        ours = model.state_dict()
        state = {}
        for k, v in ours.items():
            if k in names and not (args.tie_embeddings and k == "output.weight"):
                state.update(_disk_views(names[k], v))
        if args.tie_embeddings and "output.weight" in ours and "tok_embeddings.weight" not in ours:
            state[names["tok_embeddings.weight"][0]] = ours["output.weight"]  # a last pipeline stage's copy of the table
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=not dist.is_initialized())


def _disk_views(names: tuple[str, ...], tensor) -> dict:
    """{disk name: what DCP loads it into}: the tensor itself (one name), or the rows of its first dimension that
    this rank holds, as plain views (a tensor saved row by row; a DTensor sharded on that dimension only)."""
    if len(names) == 1:
        return {names[0]: tensor}
    if hasattr(tensor, "to_local"):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        from torch.distributed.tensor.placement_types import _StridedShard

        # (expert parallel shards dim 0, FSDP shards its piece again: a _StridedShard, still a range of rows, as DCP
        # itself saves it)
        if any(not (p.is_replicate() or (isinstance(p, (Shard, _StridedShard)) and p.dim == 0))
               for p in tensor.placements):
            raise ValueError(f"{names[0]}...: loading rows of a tensor sharded as {tensor.placements} is not "
                             "supported")
        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local, start = tensor.to_local(), offset[0]
    else:
        local, start = tensor, 0
    return {names[start + i]: local[i] for i in range(local.shape[0])}


ADAPTER = HFAdapter()  # Llama 1-3.x and anything saved as LlamaForCausalLM (TinyLlama, SmolLM, OpenLLaMA, ...)
# The Llama adapter's conversions by name (tests and tools that speak Llama).
to_hf_config, from_hf_config, to_hf, from_hf, save_hf = (ADAPTER.to_hf_config, ADAPTER.from_hf_config, ADAPTER.to_hf,
                                                         ADAPTER.from_hf, ADAPTER.save_hf)
load_hf_weights = ADAPTER.load_hf_weights
