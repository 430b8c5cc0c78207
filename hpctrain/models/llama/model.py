"""Llama-style decoder-only transformer in plain PyTorch.

The module knows nothing about parallelism. Tensor/pipeline parallel code relies only on its layout:
separate ``wq/wk/wv/wo`` and ``w1/w3/w2`` Linears (a fused qkv would be split wrongly by a column
shard), head counts inferred from tensor shapes (so a shard sees its local heads), layers in a
``ModuleDict`` keyed by index (names stay stable when a pipeline stage drops layers) and an optional
embedding / final norm / output head (``None`` on middle stages).

RoPE follows the transformers convention (rotate the two halves of ``head_dim``), so weights copy
one-to-one to and from ``transformers.LlamaForCausalLM`` with no q/k permutation.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.core.config import TransformerDims
from hpctrain.models.cross_entropy import linear_cross_entropy


@dataclass
class ModelArgs(TransformerDims):
    """Llama's arguments: the shared decoder dimensions (one definition, with the `model` group's schema)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 even under bf16; cast back before the weight, as transformers does.
        return F.rms_norm(x.float(), (x.size(-1),), eps=self.eps).type_as(x) * self.weight


def rope_cache(head_dim: int, seq_len: int, theta: float, device=None, start: int = 0) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """cos, sin of shape [seq_len, head_dim] for positions start.., computed exactly as transformers' default RoPE."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    freqs = torch.outer(torch.arange(start, start + seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # both halves of head_dim share a frequency
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [T, 1, D]. x*cos + rotate_half(x)*sin, with one fewer temporary."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1: a tensor-parallel shard holds only its local heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        # Slice here, from the full sequence: with sequence parallelism the block input is sharded.
        cos, sin = cos[:T].to(q.dtype), sin[:T].to(q.dtype)  # q is bf16 under autocast
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # The transposes are views: SDPA kernels take strided input, and their output is laid out
        # as [B, T, H, D], so the reshape below does not copy. enable_gqa avoids materialising
        # repeated k/v and is as fast as repeat_interleave with the CPU flash kernel.
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=q.size(2) != k.size(2),
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.dim % args.n_heads or args.n_heads % args.kv_heads or args.head_dim % 2:
            raise ValueError(
                f"need dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head_dim; got dim={args.dim}, "
                f"n_heads={args.n_heads}, n_kv_heads={args.kv_heads}"
            )
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.compile_loss = False  # the fused loss's chunk kernels through torch.compile (parallel.compile sets it)
        # Non-persistent: never in the state_dict; init_weights() fills them (also after to_empty()).
        shape = (args.max_seq_len, 1, args.head_dim)  # broadcasts over [B, T, H, D]
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        if not self.rope_cos.is_meta:
            self.init_weights()

    @torch.no_grad()
    def reset_rope_cache(self, rows: int = 16384) -> None:
        """Fill the tables `rows` positions at a time: no temporary of the tables' size (max_seq_len is the
        planner's to count, once). A meta-device model (the planner's) has nothing to fill."""
        if self.rope_cos.is_meta:
            return
        for start in range(0, self.args.max_seq_len, rows):
            n = min(rows, self.args.max_seq_len - start)
            cos, sin = rope_cache(self.args.head_dim, n, self.args.rope_theta, self.rope_cos.device, start)
            self.rope_cos[start:start + n].copy_(cos.unsqueeze(1))
            self.rope_sin[start:start + n].copy_(sin.unsqueeze(1))

    def init_buffers(self) -> None:
        """Fill the non-persistent buffers (after `to_empty()`), without touching the parameters."""
        self.reset_rope_cache()

    def tie_weights(self) -> None:
        """With tie_embeddings, make output.weight the embedding Parameter (to_empty() from meta unties them)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init: N(0, init_std), residual projections scaled by 1/sqrt(2 n_layers), norms 1.

        A small embedding std also matters for speed: an N(0, 1) embedding drives CPU fp32 into denormals.
        """
        self.reset_rope_cache()
        self.tie_weights()
        std = self.args.init_std
        residual_std = std / math.sqrt(2 * self.args.n_layers)
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, residual_std if name.endswith(("wo", "w2")) else std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]; a pipeline stage without embedding takes and/or returns
        hidden states [B, T, dim] instead. With `targets` [B, T] (a whole model): the summed next-token cross
        entropy instead of the logits, never materialising them (`linear_cross_entropy`)."""
        if self.tok_embeddings is not None:
            if tokens.size(1) > self.args.max_seq_len:
                raise ValueError(f"sequence length {tokens.size(1)} > max_seq_len {self.args.max_seq_len}")
            h = self.tok_embeddings(tokens)
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        if targets is not None:
            return linear_cross_entropy(h, self.output.weight, targets, compiled=self.compile_loss)
        return self.output(h) if self.output is not None else h


def init_rule(args: ModelArgs):
    """The same initialisation as `Llama.init_weights`, by parameter name (for sharded initialisation): norms 1,
    matrices N(0, init_std), residual projections (wo, w2) scaled by 1/sqrt(2 n_layers)."""
    residual_std = args.init_std / math.sqrt(2 * args.n_layers)

    def rule(name: str) -> tuple[str, float]:
        if name.endswith("norm.weight"):
            return "ones", 0.0
        return "normal", residual_std if name.endswith(("wo.weight", "w2.weight")) else args.init_std

    return rule


def _matmul_params_per_layer(a: ModelArgs) -> int:
    return a.dim * a.head_dim * (2 * a.n_heads + 2 * a.kv_heads) + 3 * a.dim * a.ffn_hidden


def num_params(model_or_args: nn.Module | ModelArgs, exclude_embedding: bool = False) -> int:
    """Parameter count, from a module (counted; a tied weight once) or from ModelArgs (by formula).

    exclude_embedding drops the token-embedding table; with tied embeddings that table is also the
    output head, so the shared matrix is dropped once. A module without tok_embeddings (a pipeline
    stage) counts what it holds.
    """
    if isinstance(model_or_args, nn.Module):
        n = sum(p.numel() for p in model_or_args.parameters())  # parameters() yields shared ones once
        emb = getattr(model_or_args, "tok_embeddings", None)
        return n - emb.weight.numel() if exclude_embedding and emb is not None else n
    a = model_or_args
    emb = a.vocab_size * a.dim
    n = a.n_layers * (_matmul_params_per_layer(a) + 2 * a.dim) + a.dim + emb + (0 if a.tie_embeddings else emb)
    return n - emb if exclude_embedding else n


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: 6·N + 12·L·H·Q·T (nanoGPT / PaLM appendix B).

    N counts every matmul weight: wq, wk, wv, wo, w1, w2, w3 of all layers plus the output projection
    (vocab·dim, counted even when tied to the embedding). Not counted: the embedding lookup (a gather)
    and the RMSNorm weights (elementwise). 12·L·H·Q·T is the attention scores and weighted values
    (L layers, H heads, Q head_dim, T = seq_len), over the full T×T matrix, i.e. ignoring causal skipping.
    """
    n = args.n_layers * _matmul_params_per_layer(args) + args.vocab_size * args.dim
    return 6.0 * n + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
