"""Mistral (v0.1-v0.3, Nemo): the Llama decoder with an optional sliding attention window."""

import dataclasses

from hpctrain.models.llama import SPEC as LLAMA

SPEC = dataclasses.replace(LLAMA, family="mistral", hf_adapter="hpctrain.models.mistral.hf", hf_model_types=("mistral",),
                           options=("sliding_window",))
