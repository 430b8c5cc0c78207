"""Documents packed into one block (train.document_mask): each token attends only to its own document.

The shards join documents with EOS and cut the stream into fixed blocks, so a block holds the end of one document,
whole ones, and the start of another. With `document_ids` the model is given which document each token belongs to
(the token after an EOS starts the next one, the EOS ends its own); `attention_mask` turns that into SDPA's mask,
built once per forward and shared by every layer, and `document_positions` optionally restarts RoPE's positions at
each document. No change to the shard format: the EOS is already there.

Memory: the mask is [B, 1, T, T] in the attention's dtype, one per micro-batch in flight (`mask_bytes`); every
layer's attention saves that same tensor for backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hpctrain.core.memory import Term


class Packing(NamedTuple):
    """What attention is given beside the tokens: the packed documents' `mask` (`attention_mask`'s [B, 1, T, T],
    additive: 0 where query i may attend key j, −inf elsewhere; a context-parallel attention's own: the model's
    `document_mask`) and `positions` [B, T] (RoPE's; None: 0..T-1 across the block)."""

    mask: torch.Tensor | list | None
    positions: torch.Tensor | None


@dataclass(frozen=True)
class DocumentMask:
    """train.document_mask: what the model is given with a batch so that each document attends only within itself;
    `restart_positions`: RoPE's positions restart at 0 at each document."""

    eos_id: int
    restart_positions: bool = False

    def one_per_row(self) -> DocumentMask:
        """The same inputs for rows that are one document each (scoring requests): no token ends one."""
        return DocumentMask(-1, self.restart_positions)

    def kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for `inputs` [B, T]: `docs`, and `positions` when they restart."""
        docs = document_ids(inputs, self.eos_id)
        return {"docs": docs, "positions": document_positions(docs)} if self.restart_positions else {"docs": docs}


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, T] int64: the document of each input token, counted from 0 in each row; the token after an EOS starts the
    next document."""
    ends = (inputs == eos_id).to(torch.int64)
    return ends.cumsum(1) - ends  # EOS belongs to the document it ends


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """[B, T] int64: each token's position within its document (0 at its first token)."""
    idx = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(1).values


def attention_mask(docs: torch.Tensor, dtype: torch.dtype, window: int | None = None,
                   first_query: int = 0) -> torch.Tensor:
    """[B, 1, T − first_query, T] additive mask in `dtype`: query i (from position `first_query` on: a context-parallel
    chunk's) may attend key j of its own document with j <= i (and i − j < `window`, a sliding window). Built with
    one such bool beside it (no int64 [T, T] distances)."""
    T = docs.shape[1]
    causal = torch.ones(T - first_query, T, dtype=torch.bool, device=docs.device).tril_(first_query)
    if window:
        causal.triu_(first_query + 1 - window)
    allowed = docs[:, first_query:, None] == docs[:, None, :]
    allowed &= causal
    # Additive, in the attention's dtype: SDPA would turn a bool mask into one of these in every layer.
    mask = torch.full(allowed.shape, float("-inf"), dtype=dtype, device=docs.device)
    return mask.masked_fill_(allowed, 0.0).unsqueeze(1)


def packed_masks(document_mask: bool, cp: int) -> bool:
    """Whether attention is given a mask with every batch (`Packing.mask`): under document masking, and in every
    context-parallel run (each chunk's prefix mask, parallel.context). A sliding window then lives inside it."""
    return document_mask or cp > 1


def window_masks(window: int | None, seq_len: int) -> bool:
    """Whether a sliding window is shorter than the sequence: without packed masks, attention builds the window's
    [T, T] mask itself (llama.model.Sdpa); within the window, causal attention is the same thing."""
    return bool(window and window < seq_len)


def mask_bytes(micro_batch: int, seq_len: int, compute_bytes: int, in_flight: int) -> Term:
    """The masks held through backward: one [B, 1, T, T] per micro-batch in flight on a pipeline stage's chunk."""
    return Term(backward=micro_batch * seq_len * seq_len * compute_bytes * in_flight)
