"""Next-token cross entropy fused with the output projection, chunked over tokens: the [tokens, vocab] logits are
never held whole.

With Llama 3's 128,256-token vocabulary the logits of one 2048-token sample are 1 GiB in fp32, and the plain path
(`F.linear` then `F.cross_entropy`) keeps several such tensors alive into backward (the bf16 logits, their fp32
copy, the log-probabilities, then their gradients). Here the loss's gradient is computed in forward, one chunk of
tokens at a time (logits, softmax, softmax − one-hot, and its two matmuls back into the hidden states and the
weight): what is kept for backward is one gradient of the hidden states and one of the weight, and the largest
temporary is one chunk's logits (`CHUNK_ELEMENTS`). The FLOPs are those of the plain path (no recomputation).

Numerics follow the plain path under autocast: matmuls in the autocast dtype (fp32 accumulation), the softmax
and the loss in fp32; the weight's gradient is summed over chunks in fp32.
"""

from __future__ import annotations

import torch

from hpctrain.core.memory import Term

IGNORE_INDEX = -100  # targets that count nothing (F.cross_entropy's default ignore_index)
CHUNK_ELEMENTS = 2**28  # logits per chunk at most: 1 GiB in fp32 (2,048 tokens of a 128,256-token vocabulary)


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk for this vocabulary: a multiple of 128 (whole matmul tiles) where one fits, else at least
    one."""
    n = CHUNK_ELEMENTS // vocab_size
    return n // 128 * 128 if n >= 128 else max(1, n)


def loss_buffers(vocab: int, dim: int, tokens: int, tp: int, compute_bytes: int, pipelined: bool,
                 fused: bool) -> Term:
    """The loss's buffers at the start of backward (freed before any block is recomputed). Plain: fp32
    log-probabilities kept for backward, their gradient and the logits' (one more with loss_parallel, `tp` > 1,
    which keeps its own softmax statistics of the vocab shard); a pipeline schedule also keeps the last stage's
    output (the logits, in the compute dtype). Fused: the gradients it computed in forward (the weight's in fp32,
    the hidden states'), its compute-dtype copies of both inputs, and one chunk's fp32 logits with their
    compute-dtype gradient, or the weight gradient's per-chunk temporaries, whichever is larger."""
    if not fused:
        return Term(backward=tokens * vocab / tp * ((16 if tp > 1 else 12) + (compute_bytes if pipelined else 0)))
    weight, hidden, low = vocab * dim, tokens * dim, compute_bytes == 2
    copies = (weight + hidden) * compute_bytes if low else 0
    chunk = min(tokens, chunk_tokens(vocab)) * vocab
    # A chunk's peak: its fp32 logits (the gradient is made in place) and, in bf16/fp16, the gradient's cast; then
    # that gradient and the weight gradient's matmul result with, in bf16/fp16, its fp32 copy.
    return Term(backward=4 * weight + 4 * hidden + copies + max(
        chunk * (4 + (compute_bytes if low else 0)), chunk * compute_bytes + weight * (compute_bytes + (4 if low else 0))))


def _chunk(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, with_grad: bool):
    """One chunk: (each token's loss in fp32, d(loss)/d(logits) in the compute dtype, or None). Written in place, so that
    eager keeps one fp32 [chunk, vocab] tensor; torch.compile fuses the elementwise passes into the matmul's."""
    logits = (x @ w.T).float()
    keep = targets != IGNORE_INDEX
    safe = targets.masked_fill(~keep, 0).unsqueeze(1)
    # log-sum-exp in place (torch.logsumexp would make a second [chunk, vocab] fp32 tensor): shift by the row
    # max, read the target's shifted logit, exponentiate, sum.
    logits.sub_(logits.amax(dim=-1, keepdim=True))
    picked = logits.gather(1, safe).squeeze(1)
    total = logits.exp_().sum(dim=-1)
    loss = (total.log() - picked) * keep
    if not with_grad:
        return loss, None
    # d(sum of losses)/d(logits) = softmax − one-hot, zero on ignored rows; made in place of the logits.
    g = logits.div_(total.unsqueeze(1))
    g.scatter_add_(1, safe, -torch.ones_like(safe, dtype=g.dtype))
    g.mul_(keep.unsqueeze(1))
    return loss, g.to(x.dtype)


_compiled_chunk = None


def _chunk_fn(compiled: bool):
    global _compiled_chunk
    if not compiled:
        return _chunk
    if _compiled_chunk is None:  # compiled once per process, at first use; a shape of its own per chunk length
        _compiled_chunk = torch.compile(_chunk, dynamic=False)
    return _compiled_chunk


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, dtype, with_grad, compiled):
        compute = dtype or hidden.dtype
        h, w = hidden.to(compute), weight.to(compute)
        one_chunk = _chunk_fn(compiled)
        rows = torch.empty(h.shape[0], dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if with_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grad else None
        for start in range(0, h.shape[0], chunk):
            x = h[start:start + chunk]
            loss, g = one_chunk(x, w, targets[start:start + chunk], with_grad)
            rows[start:start + chunk] = loss
            if with_grad:
                grad_h[start:start + chunk] = (g @ w).to(hidden.dtype)
                grad_w += (g.T @ x).float()
        if with_grad:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(rows)  # kept for figures (a sample's loss), never differentiated
        return rows.sum(), rows

    @staticmethod
    def backward(ctx, grad_out, _grad_rows):
        grad_h, grad_w = ctx.saved_tensors
        # In fp32: the upstream gradient (1/tokens, times a loss scale) rounded to bf16 would scale this part of
        # the model differently from the rest.
        return ((grad_h.float() * grad_out).to(grad_h.dtype), (grad_w * grad_out).to(ctx.weight_dtype),
                None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None, compiled: bool = False, per_token: bool = False):
    """Summed cross entropy of `hidden @ weight.T` ([..., dim] hidden states, [vocab, dim] weight) against
    `targets` ([...] token ids; IGNORE_INDEX counts nothing), without materialising the logits; with `per_token`,
    also each token's loss ([...] fp32, detached).

    Equals `F.cross_entropy(F.linear(hidden, weight).flatten(0, -2), targets.flatten(), reduction="sum")`, in
    value and gradients, under autocast too (its dtype is read here and applied inside). `compiled`: each chunk's
    kernels through torch.compile (one fused pass over the logits instead of several)."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):
        total, rows = _LinearCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(),
                                                chunk or chunk_tokens(weight.shape[0]), dtype, with_grad, compiled)
    return (total, rows.view(targets.shape)) if per_token else total
