"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections (tied embeddings or not)."""

import dataclasses

from hpctrain.models.llama import SPEC as LLAMA

SPEC = dataclasses.replace(LLAMA, family="qwen2", hf_adapter="hpctrain.models.qwen2.hf", hf_model_types=("qwen2",),
                           traits=(("qkv_bias", True),))
