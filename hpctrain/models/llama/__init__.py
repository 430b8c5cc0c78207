"""Llama-style decoder: the model (`model.py`), its parallel plan and layout rules (`parallel.py`) and its
transformers adapter (`hf.py`), bound together in SPEC."""

from hpctrain.models import ModelSpec
from hpctrain.models.llama.model import Llama, ModelArgs, flops_per_token, init_rule, num_params
from hpctrain.models.llama.parallel import block_activations, check_layout, tp_plan

SPEC = ModelSpec(
    family="llama",
    args_type=ModelArgs,
    model_type=Llama,
    first_stage=("tok_embeddings",),
    last_stage=("norm", "output"),
    tp_plan=tp_plan,
    check_layout=check_layout,
    flops_per_token=flops_per_token,
    block_activations=block_activations,
    num_params=num_params,
    init_rule=init_rule,
    hf_adapter="hpctrain.models.llama.hf",
    hf_model_types=("llama",),  # LlamaForCausalLM: Llama 1-3, TinyLlama, SmolLM, OpenLLaMA, ...
)
