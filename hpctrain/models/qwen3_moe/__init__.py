"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder (q/k norms) with experts in the layers its
decoder_sparse_step and mlp_only_layers say, softmax top-k routing, renormalised or not (norm_topk_prob)."""

import dataclasses

from hpctrain.models.mixtral import check_moe
from hpctrain.models.qwen3 import SPEC as QWEN3

SPEC = dataclasses.replace(QWEN3, family="qwen3_moe", hf_adapter="hpctrain.models.qwen3_moe.hf",
                           hf_model_types=("qwen3_moe",), options=("moe",), check_layout=check_moe)
