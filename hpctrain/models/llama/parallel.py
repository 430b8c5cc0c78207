"""How Llama parallelizes: its Megatron-style tensor-parallel plan and the sizes each layout must divide."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from hpctrain.core.config import ConfigError
from hpctrain.models.moe import saved_bytes_per_token
from hpctrain.models.packing import window_masks


def tp_plan(sequence_parallel: bool) -> tuple[dict, dict]:
    """(root plan, per-block plan): column-shard wq/wk/wv/w1/w3 and the vocab, row-shard wo/w2.

    With sequence parallelism the activations between blocks (norms, residual stream) are sharded along the
    sequence, turning each all-reduce into a reduce-scatter + all-gather pair. The output head stays
    vocab-sharded (a DTensor) for `loss_parallel`, so full logits are never gathered.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    block = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block.update({
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return root, block


def check_layout(args, layout, sequence_parallel: bool) -> None:
    """What the layout's degrees must divide; ConfigError with one line naming the fix."""
    kv = args.kv_heads
    if layout.ep > 1 and not args.moe.num_experts:
        raise ConfigError(f"parallel.ep={layout.ep} shares out MoE experts, and this model has none: set parallel.ep=1 "
                          "or a model with experts (model.moe.num_experts; e.g. model=moe_tiny)")
    if args.n_heads % kv:
        raise ConfigError(f"model.n_heads={args.n_heads} is not divisible by model.n_kv_heads={kv}")
    if args.head_dim % 2:
        raise ConfigError(f"head_dim={args.head_dim} (model.head_dim, or model.dim/n_heads) must be even for RoPE")
    scaling = args.rope_scaling
    if scaling.type.value in ("llama3", "dynamic") and not scaling.original_max_seq_len:
        raise ConfigError(f"model.rope_scaling.type={scaling.type.value} needs model.rope_scaling.original_max_seq_len "
                          "(the context the model was pretrained at)")
    if scaling.type.value == "llama3" and scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError("model.rope_scaling.high_freq_factor must exceed low_freq_factor (llama3 RoPE scaling)")
    if layout.pipelined:
        stages, pp, v = layout.pp_stages, layout.pp, layout.pp_virtual_stages
        if args.n_layers < stages:
            raise ConfigError(f"model.n_layers={args.n_layers} is fewer than parallel.pp×pp_virtual_stages="
                              f"{pp}×{v}={stages} pipeline stages: each stage needs a layer; lower pp or the "
                              "virtual stages")
    for what, n in (("model.n_heads", args.n_heads), ("model.n_kv_heads", kv), ("model.vocab_size", args.vocab_size),
                    ("model.ffn_hidden", args.ffn_hidden)):
        if n % layout.tp:
            raise ConfigError(f"{what}={n} is not divisible by parallel.tp={layout.tp}: choose a tp that divides it")


# Bytes a block saves for backward, per token, measured with saved-tensor hooks (docs/planner.md): (norm-side, linear
# inputs) × dim replicated over tp (the first split by sequence parallelism), then (q-sized, kv-sized, ffn)
# coefficients of what tp shards; a q-sized tensor is n_heads × head_dim (dim unless head_dim is set apart).
ACT_BYTES = {"fp32": (16, 8, (8, 8, 16)),  # fp32 / tf32
             "autocast": (16, 10, (4, 4, 8)),  # bf16/fp16 autocast over fp32 parameters: fp32 residual stream
             "lowp": (12, 4, (4, 4, 8))}  # bf16/fp16 parameters (FSDP/replicate MixedPrecisionPolicy)
# The same under parallel.compile (per-block torch.compile; tp = 1, sp = 1): Inductor's partitioner saves the block's
# input, the attention output projection's output (the second norm's input is recomputed from the two), both norms'
# outputs, q, k, v, attention's output and SwiGLU's gate, up and product, and recomputes every other pointwise result.
# Measured with saved-tensor hooks on the compiled block (tests/test_plan_compiled.py), and on an H100 against the
# allocator's peak (llama_1b, bf16: within 1 %, docs/planner.md). MoE experts and q/k norms keep their eager terms.
ACT_BYTES_COMPILED = {"fp32": (8, 8, (8, 8, 12)), "autocast": (6, 4, (4, 4, 6)), "lowp": (4, 4, (4, 4, 6))}
# Qwen3's q/k norms, per element of q and k: the norm's fp32 input and its normalised output.
QK_NORM_BYTES = {"fp32": 8, "autocast": 6, "lowp": 6}


def block_activations(args, tokens: int, kind: str, tp: int, sp: int, seq_len: int,
                      packed: bool = False, cp: int = 1, compiled: bool = False) -> tuple[float, float]:
    """(what one block saves for backward over `tokens` tokens (micro-batches of `seq_len`), what it keeps when
    checkpointed: its input), with tp-sharded parts / tp and the norm side and the input / sp (sequence parallel).
    `kind`: ACT_BYTES' key; `packed`: a mask counted apart, once per forward (document masking's, context
    parallelism's) holds the window; `cp`: `tokens` are this rank's share of each sequence, and attention saves the
    keys and values of the whole of it (gathered over the cp ranks); `compiled`: the block runs through torch.compile."""
    norm, lin, (kh, kkv, kf) = (ACT_BYTES_COMPILED if compiled else ACT_BYTES)[kind]
    q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    heads = args.n_heads + args.kv_heads if args.qk_norm else 0  # q/k-normed heads
    # An MoE layer's experts run whole on every tp rank (the largest of its blocks: the sparse ones); eager's figure
    ffn = (saved_bytes_per_token(args.moe, args.dim, args.ffn_hidden, ACT_BYTES[kind][2][2] / 16) * tp
           if args.moe.num_experts else kf * args.ffn_hidden)
    per_token = (norm * args.dim / sp + lin * args.dim
                 + (kh * q + kkv * kv * cp + ffn) / tp
                 + 8 + 4 * args.n_heads / tp  # RMSNorm statistics, attention log-sum-exp
                 + (QK_NORM_BYTES[kind] * args.head_dim + 4) * heads / tp)  # q/k norms: input, output, statistics
    saved = tokens * per_token
    if window_masks(args.sliding_window, seq_len) and not packed:
        # The window's [T, T] mask: SDPA keeps it as an additive mask of the compute dtype, one per micro-batch.
        saved += seq_len * seq_len * (4 if kind == "fp32" else 2)
    return saved, tokens * (2 if kind == "lowp" else 4) * args.dim / sp
