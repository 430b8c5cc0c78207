"""Context parallelism (parallel.cp): the ranks of a "cp" group each hold a slice of every sequence, so activations
per rank fall with cp; attention still sees the whole causal context.

Each sequence of T tokens is cut into 2·cp chunks of T/(2·cp) and cp rank r holds chunks r and 2·cp−1−r (the zig-
zag layout: a head chunk, which attends to little, and a tail chunk, which attends to much, so every rank computes
the same number of query-key pairs: `attention_pairs`). The step hands the model only these tokens, with their
global positions (RoPE) and, under document masking, their documents (`SequenceSplit`); the loss is summed over
this rank's targets and over dp×cp, and divided by the global token count as always, so the gradients are the
one-process ones.

Attention (`ContextParallelSdpa`, which takes the place of the model's `Sdpa` module): keys and values are
all-gathered over the cp group and put in sequence order (Llama 3's choice: one collective per layer, simple with
document masks and GQA, whose few K/V heads make it cheap; autograd's backward of the all-gather is a reduce-
scatter), then each of the rank's two query chunks attends to the keys up to its own end, under a mask built once
per forward for every layer (the model's `document_mask` hook): lower-right causal, within the documents and the
window when there are any ([1 or B, 1, c, end] per chunk: T²(2·cp+1)/(4·cp²) elements a rank, `cp_mask_bytes`).
torch's `causal_lower_right` would spare the causal mask on CUDA's efficient kernel, not on CPU nor with GQA
(untested on a GPU: a follow-up). Ring attention (passing K/V blocks round the ring, overlapped
with compute) holds less at once but needs the blocks' partial softmaxes merged by hand; PyTorch's own
`context_parallel` (torch.distributed.tensor.experimental, ring or all-gather) covers only CUDA's SDPA kernels:
on CPU (torch 2.13) it fails with "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered".
"""

from __future__ import annotations

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.core.memory import Term
from hpctrain.models.moe import moe_layers
from hpctrain.models.packing import DocumentMask, Packing, attention_mask


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of 2·cp chunks cp rank `rank` holds: its head and its tail."""
    return rank, 2 * cp - 1 - rank


def zigzag_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """[seq_len / cp] int64: the positions of a sequence cp rank `rank` holds, in its order (head chunk, tail)."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(g * c, (g + 1) * c, device=device) for g in zigzag_chunks(cp, rank)])


def attention_pairs(seq_len: int, cp: int, rank: int) -> int:
    """Query-key pairs rank `rank`'s causal attention computes: c·(g+1)·c for each chunk g it holds (c = T/(2·cp))."""
    c = seq_len // (2 * cp)
    return sum(c * (g + 1) * c for g in zigzag_chunks(cp, rank))


class SequenceSplit:
    """The step's side: this rank's tokens of each sequence and what the model needs with them. cp = 1: the whole
    sequence, as without context parallelism."""

    def __init__(self, cp: int = 1, rank: int = 0):
        self.cp, self.rank = cp, rank

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, documents: DocumentMask | None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(inputs, targets, the model's keyword inputs) of this rank, from a whole [B, T] sequence's. Documents and
        restarted positions are computed over the whole sequence first: a document may span the ranks' chunks."""
        given = documents.kwargs(inputs) if documents is not None else {}
        if self.cp == 1:
            return inputs, targets, given
        B, T = inputs.shape
        if T % (2 * self.cp):
            raise ValueError(f"a sequence of {T} tokens does not split into 2×cp={2 * self.cp} equal chunks")
        idx = zigzag_index(T, self.cp, self.rank, inputs.device)
        given.setdefault("positions", torch.arange(T, device=inputs.device).expand(B, T))
        return inputs[:, idx], targets[:, idx], {k: v[:, idx] for k, v in given.items()}

    def tokens(self, n: int) -> int:
        """This rank's share of `n` target tokens (whole sequences')."""
        return n // self.cp


class ContextParallelSdpa(nn.Module):
    """The model's attention core on a cp group: all-gathered keys and values, then one attention per chunk this
    rank holds, over the keys up to the chunk's end. Given no positions (scoring, generation: whole sequences on
    every rank), the model's own core (`whole`) attends within what it has, as one process does."""

    def __init__(self, cp_mesh: DeviceMesh, whole: nn.Module):
        super().__init__()
        self.group, self.cp, self.rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()
        self.whole, self.window = whole, whole.window
        # gathered (rank) order r0 head, r0 tail, r1 head, ... -> the sequence order of the 2·cp chunks
        held = [g for r in range(self.cp) for g in zigzag_chunks(self.cp, r)]
        self.order = [held.index(g) for g in range(2 * self.cp)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packing | None = None) -> torch.Tensor:
        if packed is None or packed.positions is None:
            return self.whole(q, k, v, packed)
        k, v = (_in_sequence_order(gather(t, 2, self.group), self.order, 2) for t in (k, v))
        c = q.shape[2] // 2
        return torch.cat([F.scaled_dot_product_attention(q_chunk, k[:, :, :(g + 1) * c], v[:, :, :(g + 1) * c],
                                                         attn_mask=mask, enable_gqa=q.size(1) != k.size(1))
                          for g, q_chunk, mask in zip(zigzag_chunks(self.cp, self.rank), q.split(c, dim=2),
                                                      packed.mask)], dim=2)

    def document_masks(self, docs: torch.Tensor | None, dtype: torch.dtype,
                       positions: torch.Tensor | None) -> list | torch.Tensor | None:
        """The model's `document_mask` under cp, built once per forward for every layer: for each held chunk, its
        queries over the keys up to its end, [B, 1, c, end] within the whole sequence's documents (gathered) or
        [1, 1, c, end] causal (and the window's). Whole sequences (no positions): as one process."""
        if positions is None:
            return attention_mask(docs, dtype, self.window) if docs is not None else None
        c = positions.shape[1] // 2
        if docs is not None:  # in sequence order
            docs = _in_sequence_order(gather(docs, 1, self.group), self.order, 1)
        return [prefix_mask(docs, g, c, dtype, self.window, positions.device) for g in zigzag_chunks(self.cp, self.rank)]


def gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`t` of every rank of `group`, concatenated along `dim` in rank order (autograd: the backward reduce-scatters)."""
    return all_gather_tensor_autograd(t.contiguous(), gather_dim=dim, group=group)


def _in_sequence_order(t: torch.Tensor, order: list[int], dim: int) -> torch.Tensor:
    """`t`'s 2·cp equal chunks along `dim` (gathered in rank order) permuted by `order`."""
    shape = t.shape
    chunks = t.unflatten(dim, (len(order), shape[dim] // len(order)))
    return chunks[(slice(None),) * dim + (order,)].reshape(shape)


def prefix_mask(docs: torch.Tensor | None, g: int, c: int, dtype: torch.dtype, window: int | None,
                device=None) -> torch.Tensor:
    """Additive mask of chunk g's queries over the keys before its end ([B, 1, c, (g+1)·c] within their own document
    of `docs` [B, T] in sequence order; [1, 1, c, (g+1)·c] without documents): causal, and within `window`."""
    end = (g + 1) * c
    docs = docs[:, :end] if docs is not None else torch.zeros(1, end, dtype=torch.int64, device=device)
    return attention_mask(docs, dtype, window, first_query=g * c)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Each attention's core becomes a ContextParallelSdpa on the cp group, and the model's documents' mask its
    chunks' masks; MoE layers sum their per-sequence balance statistics over the cp group."""
    if cp_mesh.size() == 1:
        return
    core = None
    for block in model.layers.values():
        core = ContextParallelSdpa(cp_mesh, block.attention.sdpa)
        block.attention.sdpa = core
    if core is not None:
        model.document_mask = core.document_masks
    group = cp_mesh.get_group()
    for _, layer in moe_layers(model):
        layer.sequence_sum, layer.sequence_parts = (lambda t: dist_nn.all_reduce(t, group=group)), cp_mesh.size()


def cp_mask_bytes(rows: int, seq_len: int, cp: int, compute_bytes: int, in_flight: float) -> Term:
    """The masks held through backward: a rank's two chunks' [rows, 1, c, end] (rows: the micro-batch with documents,
    else 1), c²·(2·cp+1) elements, one set per micro-batch in flight on a pipeline stage's chunk."""
    c = seq_len // (2 * cp)
    return Term(backward=rows * c * c * (2 * cp + 1) * compute_bytes * in_flight)


def gathered_bytes(kv_dim: int, tokens: int, cp: int, layers: int, compute_bytes: int, recomputed: bool) -> float:
    """Bytes a rank receives per step for the keys' and values' all-gathers (and sends for their gradients' reduce-
    scatters) of `layers` layers over `tokens` tokens of its own (kv_dim: the K/V width on this rank), forward and
    backward, again in recomputation."""
    per_pass = 2 * kv_dim * tokens * (cp - 1) * compute_bytes * layers
    return per_pass * (3 if recomputed else 2)
