"""The Llama-style decoder-only transformer in plain PyTorch, shared by the families that are variants of it (Llama,
Mistral, Qwen2, Qwen3: hpctrain.models): their differences are options of ModelArgs, off by default.

The module knows nothing about parallelism. Tensor/pipeline parallel code relies only on its layout:
separate ``wq/wk/wv/wo`` and ``w1/w3/w2`` Linears (a fused qkv would be split wrongly by a column
shard), head counts inferred from tensor shapes (so a shard sees its local heads), layers in a
``ModuleDict`` keyed by index (names stay stable when a pipeline stage drops layers) and an optional
embedding / final norm / output head (``None`` on middle stages).

RoPE follows the transformers convention (rotate the two halves of ``head_dim``), so weights copy
one-to-one to and from transformers' classes with no q/k permutation.
"""

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.core.config import ConfigError, MoEDims, RopeScaling, RopeType, TransformerDims
from hpctrain.models.cross_entropy import linear_cross_entropy
from hpctrain.models.moe import MoE, SwiGLU, expert_hidden, is_sparse
from hpctrain.models.packing import Packing, attention_mask, window_masks


@dataclass
class ModelArgs(TransformerDims):
    """The decoder's arguments: the shared decoder dimensions (one definition, with the `model` group's schema), with
    head_dim resolved and rope_scaling a RopeScaling, and the traits a family fixes (ModelSpec.traits)."""

    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)

    def __post_init__(self):
        if not isinstance(self.rope_scaling, RopeScaling):  # a config node or a dict
            given = {f.name: self.rope_scaling[f.name] for f in fields(RopeScaling) if f.name in self.rope_scaling}
            self.rope_scaling = RopeScaling(**given)
        kind = self.rope_scaling.type
        self.rope_scaling.type = RopeType(getattr(kind, "value", kind))
        if not isinstance(self.moe, MoEDims):  # a config node or a dict
            given = {f.name: self.moe[f.name] for f in fields(MoEDims) if f.name in self.moe}
            self.moe = MoEDims(**{**given, "dense_layers": list(given.get("dense_layers", []))})
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: choose "
                                  "dimensions that divide, or set model.head_dim")
            self.head_dim = self.dim // self.n_heads

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


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling, seq_len: int = 0,
                     device=None) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2], computed exactly as transformers' RoPE of the same type; `dynamic`
    depends on the length of the sequence (`seq_len`) beyond original_max_seq_len."""
    kind, factor = scaling.type, scaling.factor
    if kind == RopeType.dynamic and seq_len > scaling.original_max_seq_len:
        # NTK: a larger theta for a longer sequence (as transformers', in float32: its seq_len is a tensor)
        grown = factor * torch.tensor(seq_len) / scaling.original_max_seq_len - (factor - 1)
        theta = theta * grown ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / theta ** exponents
    if kind == RopeType.linear:
        inv_freq = inv_freq / factor
    elif kind == RopeType.llama3:
        # Wavelengths longer than the original context are stretched by factor, short ones kept, a smooth band between.
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        context = scaling.original_max_seq_len
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < context / high) * ~(wavelen > context / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cache(head_dim: int, seq_len: int, theta: float, device=None, start: int = 0,
               scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq_len, head_dim] for positions start.., computed exactly as transformers' RoPE (dynamic
    scaling: for a sequence of start + seq_len positions)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling or RopeScaling(), start + seq_len, device)
    freqs = torch.outer(torch.arange(start, start + seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # both halves of head_dim share a frequency
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [T, 1, D]. x*cos + rotate_half(x)*sin, with one fewer temporary."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)


def sliding_window_mask(seq_len: int, window: int, device=None) -> torch.Tensor:
    """[T, T] bool, True where query i may attend key j: j <= i and i - j < window (transformers' sliding window)."""
    i = torch.arange(seq_len, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


class Sdpa(nn.Module):
    """Causal attention of [B, H, T, D] queries over [B, H_kv, T, D] keys and values (GQA without repeating them):
    under the packed documents' mask when there is one, else a sliding window's, else plainly causal. A layout may
    put another in its place (context parallelism: hpctrain.parallel.context)."""

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packing | None = None) -> torch.Tensor:
        T = q.shape[2]
        if packed is not None and packed.mask is not None:  # the documents' mask (the window folded in)
            mask = packed.mask
        elif window_masks(self.window, T):
            mask = sliding_window_mask(T, self.window, q.device)
        else:  # within the window, causal attention is the same thing: no mask (and its slower kernel)
            mask = None
        # enable_gqa avoids materialising repeated k/v and is as fast as repeat_interleave with the CPU flash kernel.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=q.size(1) != k.size(1))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Qwen3: each head's query and key normalised (over head_dim) before RoPE.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.sdpa = Sdpa(args.sliding_window)
        scaling = args.rope_scaling
        # Dynamic NTK RoPE: a sequence longer than the original context gets tables of its own length.
        self.dynamic = (args.rope_theta, scaling) if scaling.type == RopeType.dynamic else None

    def _rope(self, T: int, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables' rows of positions 0..T-1, or of `positions` [B, T] ([B, T, 1, D]: restarted at each packed
        document, or a context-parallel rank's own)."""
        if self.dynamic is not None and self.dynamic[1].original_max_seq_len < T:
            cos, sin = rope_cache(self.head_dim, T, self.dynamic[0], cos.device, scaling=self.dynamic[1])
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (cos[positions], sin[positions]) if positions is not None else (cos[:T], sin[:T])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: Packing | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1: a tensor-parallel shard holds only its local heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Slice here, from the full sequence: with sequence parallelism the block input is sharded.
        cos, sin = self._rope(T, cos, sin, packed.positions if packed is not None else None)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # q is bf16 under autocast
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # The transposes are views: SDPA kernels take strided input, and their output is laid out
        # as [B, T, H, D], so the reshape below does not copy.
        y = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), packed)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(SwiGLU):
    """The dense feed-forward: one SwiGLU (w1 gate, w3 up, w2 down) of ffn_hidden."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.dim, args.ffn_hidden)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = (MoE(args.dim, args.ffn_hidden, args.moe) if is_sparse(args.moe, layer)
                             else FeedForward(args))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: Packing | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, packed)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.n_heads % args.kv_heads or args.head_dim % 2:
            raise ValueError(f"need n_heads % n_kv_heads == 0 and an even head_dim; got n_heads={args.n_heads}, "
                             f"n_kv_heads={args.kv_heads}, head_dim={args.head_dim}")
        self.args = args
        # Without nn.Embedding's own N(0, 1) draw: init_weights (or the sharded init) draws every weight, and
        # normal_ on the meta device imports torch._dynamo: 0.6 of the 3.8 core-s `hpctrain plan` took.
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim,
                                                                _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
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
            cos, sin = rope_cache(self.args.head_dim, n, self.args.rope_theta, self.rope_cos.device, start,
                                  self.rope_scaling())
            self.rope_cos[start:start + n].copy_(cos.unsqueeze(1))
            self.rope_sin[start:start + n].copy_(sin.unsqueeze(1))

    def rope_scaling(self) -> RopeScaling:
        """The scaling of the tables: dynamic NTK's are plain RoPE up to the original context (Attention computes
        longer sequences' own)."""
        scaling = self.args.rope_scaling
        return RopeScaling() if scaling.type == RopeType.dynamic else scaling

    def init_buffers(self) -> None:
        """Fill the non-persistent buffers (after `to_empty()`), without touching the parameters."""
        self.reset_rope_cache()
        for m in self.modules():
            if isinstance(m, MoE):
                m.init_buffers()

    def tie_weights(self) -> None:
        """With tie_embeddings, make output.weight the embedding Parameter (to_empty() from meta unties them)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init: N(0, init_std), residual projections scaled by 1/sqrt(2 n_layers), norms 1, biases 0.

        A small embedding std also matters for speed: an N(0, 1) embedding drives CPU fp32 into denormals.
        """
        self.reset_rope_cache()
        self.tie_weights()
        std = self.args.init_std
        residual_std = std / math.sqrt(2 * self.args.n_layers)
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, residual_std if name.endswith(("wo", "w2")) else std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, MoE):
                for w in (m.experts.w1, m.experts.w3):
                    nn.init.normal_(w, 0.0, std)
                nn.init.normal_(m.experts.w2, 0.0, residual_std)
                m.init_buffers()

    def document_mask(self, docs: torch.Tensor | None, dtype: torch.dtype, positions: torch.Tensor | None = None):
        """The mask every layer's attention applies (`Packing.mask`): packed documents' `docs` [B, T], else none; a
        layout whose attention needs another (context parallelism) puts its own builder in this method's place."""
        return attention_mask(docs, dtype, self.args.sliding_window) if docs is not None else None

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, per_token: bool = False,
                docs: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """tokens [B, T] -> logits [B, T, vocab]; a pipeline stage without embedding takes and/or returns
        hidden states [B, T, dim] instead. With `targets` [B, T] (a whole model): the summed next-token cross
        entropy instead of the logits, never materialising them (`linear_cross_entropy`), and with `per_token`
        each token's loss too ([B, T], detached). `docs` [B, T]: the packed document of each token, which attends
        only within it (`hpctrain.models.packing`); `positions` [B, T]: RoPE's positions (default 0..T-1)."""
        if self.tok_embeddings is not None:
            if tokens.size(1) > self.args.max_seq_len:
                raise ValueError(f"sequence length {tokens.size(1)} > max_seq_len {self.args.max_seq_len}")
            h = self.tok_embeddings(tokens)
        else:
            h = tokens
        packed = None
        if docs is not None or positions is not None:  # one mask for every layer, in the dtype attention computes in
            kind = h.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype
            packed = Packing(self.document_mask(docs, dtype, positions), positions)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin, packed)
        if self.norm is not None:
            h = self.norm(h)
        if targets is not None:
            return linear_cross_entropy(h, self.output.weight, targets, compiled=self.compile_loss, per_token=per_token)
        return self.output(h) if self.output is not None else h


def init_rule(args: ModelArgs):
    """The same initialisation as `Llama.init_weights`, by parameter name (for sharded initialisation): norms 1,
    biases 0, matrices N(0, init_std), residual projections (wo, w2) scaled by 1/sqrt(2 n_layers)."""
    residual_std = args.init_std / math.sqrt(2 * args.n_layers)

    def rule(name: str) -> tuple[str, float]:
        if name.endswith("norm.weight"):
            return "ones", 0.0
        if name.endswith(".bias"):
            return "zeros", 0.0
        return "normal", residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else args.init_std

    return rule


def _matmul_params_per_layer(a: ModelArgs, layer: int, active: bool = False) -> int:
    """The layer's matmul weights; `active`: those one token goes through (its k routed experts, not all E)."""
    attention = a.dim * a.head_dim * (2 * a.n_heads + 2 * a.kv_heads)
    if not is_sparse(a.moe, layer):
        return attention + 3 * a.dim * a.ffn_hidden
    m, hidden = a.moe, expert_hidden(a.moe, a.ffn_hidden)
    experts = m.top_k if active else m.num_experts
    return attention + a.dim * m.num_experts + 3 * a.dim * hidden * (experts + m.shared_experts)


def _vector_params_per_layer(a: ModelArgs) -> int:
    """Norm weights and biases: two block norms, the q/k/v biases, the per-head q/k norms."""
    return (2 * a.dim + (a.n_heads + 2 * a.kv_heads) * a.head_dim * a.qkv_bias + 2 * a.head_dim * a.qk_norm)


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
    n = sum(_matmul_params_per_layer(a, i) + _vector_params_per_layer(a) for i in range(a.n_layers)) + a.dim + emb + (
        0 if a.tie_embeddings else emb)
    return n - emb if exclude_embedding else n


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: 6·N + 12·L·H·Q·T (nanoGPT / PaLM appendix B).

    N counts every matmul weight a token goes through (MoE layers: the router, its k routed experts and the shared
    ones: *active* parameters): wq, wk, wv, wo, w1, w2, w3 of all layers plus the output projection
    (vocab·dim, counted even when tied to the embedding). Not counted: the embedding lookup (a gather)
    and the RMSNorm weights (elementwise). 12·L·H·Q·T is the attention scores and weighted values
    (L layers, H heads, Q head_dim, T = seq_len), over the full T×T matrix, i.e. ignoring causal skipping.
    """
    n = sum(_matmul_params_per_layer(args, i, active=True) for i in range(args.n_layers)) + args.vocab_size * args.dim
    return 6.0 * n + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
