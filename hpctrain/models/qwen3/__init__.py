"""Qwen3 (dense): the Llama decoder with an RMSNorm over each query and key head before RoPE, and its head_dim
given apart from dim / n_heads."""

import dataclasses

from torch.distributed.tensor.parallel import SequenceParallel

from hpctrain.models.llama import SPEC as LLAMA


def tp_plan(sequence_parallel: bool) -> tuple[dict, dict]:
    """Llama's plan, and the q/k norms over the heads a rank holds: their weights replicated DTensors, so that each
    rank's gradient (from its own heads) is summed over tp."""
    root, block = LLAMA.tp_plan(sequence_parallel)
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)  # [B, T, heads, head_dim]: sharded over heads
    return root, {**block, "attention.q_norm": heads, "attention.k_norm": heads}


SPEC = dataclasses.replace(LLAMA, family="qwen3", hf_adapter="hpctrain.models.qwen3.hf", hf_model_types=("qwen3",),
                           traits=(("qk_norm", True),), tp_plan=tp_plan)
