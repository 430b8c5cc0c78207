"""Mixtral: the Llama decoder with a mixture of experts in every layer (hpctrain.models.moe), softmax top-k routing,
and Mistral's optional sliding window. Its MoE rules (`check_moe`) hold for every family with experts."""

import dataclasses

from hpctrain.core.config import ConfigError
from hpctrain.models.llama import SPEC as LLAMA
from hpctrain.models.moe import is_sparse


def check_moe(args, layout, sequence_parallel: bool) -> None:
    """The MoE dims and the layouts MoE layers run in; then the decoder's own rules."""
    moe = args.moe
    if moe.num_experts and not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts="
                          f"{moe.num_experts}")
    if moe.num_experts:
        outside = [i for i in moe.dense_layers if not 0 <= i < args.n_layers]
        if outside:
            raise ConfigError(f"model.moe.dense_layers={list(moe.dense_layers)}: {outside[0]} is not a layer of the "
                              f"{args.n_layers} (0 … {args.n_layers - 1})")
        if not any(is_sparse(moe, i) for i in range(args.n_layers)):
            raise ConfigError(f"model.moe.num_experts={moe.num_experts}, but no layer of the {args.n_layers} has "
                              f"experts (model.moe.every={moe.every}, dense_layers={list(moe.dense_layers)}): lower "
                              "every or list fewer dense layers, or model.moe.num_experts=0 for a dense model")
    if moe.num_experts % layout.ep:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={layout.ep}: "
                          "choose an ep that divides the experts")
    LLAMA.check_layout(args, layout, sequence_parallel)


SPEC = dataclasses.replace(LLAMA, family="mixtral", hf_adapter="hpctrain.models.mixtral.hf",
                           hf_model_types=("mixtral",), options=("sliding_window", "moe"), check_layout=check_moe)
