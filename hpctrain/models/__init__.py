"""Model families, found by `model.family`: each is a `ModelSpec` that keeps together what generic code needs
of a model (its class and arguments, tensor-parallel plan, pipeline split rule, layout rules, FLOPs formula
and transformers adapter).

Generic code (parallelization, training, planning, generation) builds and inspects models only through a
spec. A family is a package `hpctrain.models.<family>` whose `SPEC` is its ModelSpec, listed in FAMILIES. Llama,
Mistral, Qwen2 and Qwen3 share one decoder (hpctrain.models.llama); each of them is its traits (Qwen2's q/k/v
biases, Qwen3's q/k norms), its options (Mistral's sliding window), its tensor-parallel plan and its transformers
adapter.

The module contract every family's model follows: blocks in `model.layers`, an `nn.ModuleDict` keyed by the
global layer index (names stay stable when a pipeline stage drops layers); the modules named in
`first_stage` / `last_stage` may be None on the stages that do not hold them; `forward(tokens)` returns
logits (a middle stage takes and returns hidden states), `forward(tokens, targets)` of a whole model the summed
next-token cross entropy without materialising the logits (train.fused_loss), with its kernels compiled when
parallel.compile sets `compile_loss`; `init_weights()` draws every parameter and
`init_buffers()` fills the non-persistent buffers (after `to_empty()`); `tie_weights()` re-ties shared ones
(a Parameter shared by modules of different pipeline stages becomes one copy per stage, kept equal).
"""

from __future__ import annotations

import importlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from hpctrain.core.config import ConfigError, ModelConfig, TransformerDims

FAMILIES = {"llama": "hpctrain.models.llama", "mistral": "hpctrain.models.mistral", "qwen2": "hpctrain.models.qwen2",
            "qwen3": "hpctrain.models.qwen3", "mixtral": "hpctrain.models.mixtral",
            "qwen3_moe": "hpctrain.models.qwen3_moe"}
# `model` keys only some families have: (the key whose value says it is on, that value is on)
OPTIONS = {"sliding_window": ("sliding_window", lambda v: v is not None),
           "moe": ("moe.num_experts", lambda v: bool(v))}


@dataclass(frozen=True)
class ModelSpec:
    family: str
    args_type: type  # the model's own arguments (a dataclass); filled from the same-named model.* keys
    model_type: type  # nn.Module subclass, built from args_type
    first_stage: tuple[str, ...]  # modules only the first pipeline stage holds (the embedding)
    last_stage: tuple[str, ...]  # modules only the last stage holds (final norm, output head)
    tp_plan: Callable[[bool], tuple[dict, dict]]  # sequence_parallel -> (root plan, per-block plan)
    check_layout: Callable[[Any, Any, bool], None]  # (args, Layout, sequence_parallel): ConfigError if it cannot
    flops_per_token: Callable[[Any, int], float]  # (args, seq_len): training FLOPs per token
    # (args, tokens, saved kind, tp, sp, seq_len, a mask built per forward, cp, compiled) -> (bytes a block saves for
    # backward, its input: what a checkpointed one keeps)
    block_activations: Callable[[Any, int, str, int, int, int, bool, int, bool], tuple[float, float]]
    num_params: Callable[[Any], int]  # parameter count (a module or args)
    init_rule: Callable[[Any], Callable[[str], tuple[str, float]]]  # args -> (name -> ("normal", std) | ("ones", 0))
    hf_adapter: str  # module whose ADAPTER converts to and from transformers (hpctrain.models.llama.hf.HFAdapter)
    hf_model_types: tuple[str, ...] = ()  # config.json `model_type`s this family reads
    traits: tuple[tuple[str, Any], ...] = ()  # model arguments the family fixes (Qwen2: ("qkv_bias", True))
    options: tuple[str, ...] = ()  # the OPTIONS the family has (Mistral: sliding_window)

    def args(self, model_cfg: ModelConfig) -> Any:
        """The model's arguments from the `model` config group (its keys of TransformerDims) and the family's traits;
        ConfigError when the group sets an option this family does not have."""
        for key, (shown, on) in OPTIONS.items():
            value = model_cfg
            for part in shown.split("."):
                value = getattr(value, part, None)
            if key not in self.options and on(value):
                has = [f for f in FAMILIES if key in get_spec(f).options]
                raise ConfigError(f"model.{shown}={value} is not an option of model.family={self.family} (it is "
                                  f"{' and '.join(has)}'s): drop it or choose that family")
        given = {f.name: getattr(model_cfg, f.name) for f in fields(TransformerDims) if hasattr(model_cfg, f.name)}
        return self.args_type(**given, **dict(self.traits))

    def build(self, args) -> Any:
        return self.model_type(args)

    def meta(self, args) -> Any:
        """The model on the meta device: its shapes, no memory."""
        import torch

        with torch.device("meta"):
            return self.build(args)

    def weights(self, args) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Every weight of the whole model, {state_dict key: (shape, dtype)}, from a meta-device build."""
        return {key: (tuple(t.shape), t.dtype) for key, t in self.meta(args).state_dict().items()}

    def hf(self):
        """The family's transformers adapter (imports transformers)."""
        return importlib.import_module(self.hf_adapter).ADAPTER


def get_spec(family: str) -> ModelSpec:
    if family not in FAMILIES:
        raise ConfigError(f"model.family={family!r} is not a known model family: use one of {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[family]).SPEC


def spec_for_hf(path: str) -> ModelSpec:
    """The family that reads the transformers directory `path`, by its config.json's `model_type` (read as JSON:
    transformers is not imported); ConfigError naming the families when none does."""
    import json

    from hpctrain.core.files import read_json

    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(f"{path} has no config.json: point it at a transformers model directory")
    try:
        model_type = read_json(config).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"cannot read {config} ({' '.join(str(e).split())}): point it at a transformers model "
                          "directory (config.json + *.safetensors)") from None
    specs = [get_spec(family) for family in FAMILIES]
    for spec in specs:
        if model_type in spec.hf_model_types:
            return spec
    known = ", ".join(t for spec in specs for t in spec.hf_model_types)
    raise ConfigError(f"{config} has model_type={json.dumps(model_type)}, which no hpctrain model family reads (it "
                      f"reads {known})")


HF_PREFIX = "hf:"  # model.init_from=hf:DIR: a transformers directory (else an hpctrain checkpoint)


def init_source(model: ModelConfig) -> tuple[bool, str] | None:
    """model.init_from as (a transformers directory?, its path), or None when unset."""
    source = model.init_from
    if source is None:
        return None
    hf = str(source).startswith(HF_PREFIX)
    return hf, os.path.expanduser(str(source)[len(HF_PREFIX):] if hf else str(source))


def float32_equal(a, b) -> bool:
    """Equal, floats once rounded to float32 (a config.json may hold 1e-5 as 9.999999747378752e-06)."""
    if isinstance(a, float) or isinstance(b, float):
        try:
            return struct.pack("f", float(a)) == struct.pack("f", float(b))
        except (TypeError, ValueError, OverflowError):
            return False
    return a == b


def flat(value, prefix: str = ""):
    """(dotted key, leaf) pairs of a dataclass: model arguments with rope_scaling's fields as rope_scaling.factor, ...
    (enums as their values)."""
    for f in fields(value):
        leaf = getattr(value, f.name)
        if is_dataclass(leaf):
            yield from flat(leaf, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", getattr(leaf, "value", leaf)


def spec_of(model: ModelConfig) -> ModelSpec:
    """The spec of the family the `model` group names."""
    return get_spec(getattr(model, "family", None) or "llama")  # (a run saved before families existed: llama)


def model_args(model: ModelConfig) -> Any:
    """The arguments of the model the `model` group describes."""
    return spec_of(model).args(model)


def build_model(model: ModelConfig) -> Any:
    """The model the `model` group describes (on the current default device: `with torch.device("meta")` for none)."""
    spec = spec_of(model)
    return spec.build(spec.args(model))


def resident_bytes(model: ModelConfig) -> tuple[int, int]:
    """(parameter bytes, buffer bytes) of the model the `model` group describes, from a meta-device build: what one
    process holds to run it, before any activation. The buffers are the RoPE tables (max_seq_len × head_dim)."""
    import torch

    with torch.device("meta"):
        built = build_model(model)
    return (sum(t.numel() * t.element_size() for t in built.parameters()),
            sum(t.numel() * t.element_size() for t in built.buffers()))
