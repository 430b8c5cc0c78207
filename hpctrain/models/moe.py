"""Mixture-of-experts feed-forward layers: dropless token-choice routing to routed SwiGLU experts, plus optional
shared experts. Knows nothing of parallelism: expert parallelism wraps `GroupedExperts.forward`, whose input is
every routed token sorted by expert and the count per expert (what an all-to-all dispatch needs).

Balancing: the load-balancing loss (E·Σ f_i·P_i per layer, over each sequence: DeepSeek-V3's sequence-wise form of
Switch's, the same in every layout since no layout splits a sequence's routing differently) and the router z-loss
(per token) reach the gradients through `_AuxLoss`, which passes the layer's output through unchanged and gives the
auxiliary term its gradient in backward (as Megatron does): no extra loss plumbing, and a pipeline stage's layers get
theirs in that stage's backward. `set_loss_weight` tells the layers one token's weight in the training objective
(1 / the step's tokens, times fp16's loss scale): both terms are token-weighted means over the step, like the loss.
The auxiliary-loss-free method (DeepSeek-V3) keeps a routing bias per expert (`Router.expert_bias`, a checkpointed
buffer) that training moves toward the mean load after each step, from the `load` each layer counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.core.config import MoEDims, RouterKind

# MoE.stats' entries, summed over training forwards: aux_loss over sequences, the others over tokens
STATS = ("aux_loss", "z_loss", "router_entropy", "sequences", "tokens")


def is_sparse(moe: MoEDims, layer: int) -> bool:
    """Whether layer `layer` (0-based) of a model with these MoE dims has experts."""
    return moe.num_experts > 0 and (layer + 1) % moe.every == 0 and layer not in moe.dense_layers


def expert_hidden(moe: MoEDims, ffn_hidden: int) -> int:
    return moe.expert_hidden or ffn_hidden


class Router(nn.Module):
    """Each token's k experts and their combine weights (float32)."""

    def __init__(self, dim: int, moe: MoEDims):
        super().__init__()
        self.gate = nn.Linear(dim, moe.num_experts, bias=False)
        self.kind, self.top_k, self.norm_topk, self.scale = RouterKind(moe.router), moe.top_k, moe.norm_topk, moe.route_scale
        # Selection only (the weights come from the scores): the balance the aux-loss-free method steers.
        biased = self.kind == RouterKind.sigmoid or moe.bias_update_rate > 0
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts) if biased else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k], experts [N, k], each token's distribution over the experts [N, E], router
        logits [N, E] float32)."""
        logits = self.gate(x).float()
        if self.kind == RouterKind.softmax:
            scores = probs = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        ranked = scores if self.expert_bias is None else scores + self.expert_bias
        chosen = ranked.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scale, chosen, probs, logits


def grouped_mm_works(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch._grouped_mm takes these: on CPU any float dtype, on CUDA bf16 from sm90; every row stride a multiple
    of 16 bytes (its requirement)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9):
        return False
    return all((t.shape[-1] * t.element_size()) % 16 == 0 for t in (x, *weights))


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three [E, out, in] weights (each expert's matrices as nn.Linear keeps them)."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))  # down
        self.grouped = True  # torch._grouped_mm where it works (grouped_mm_works), else a loop over the experts

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [n, D]: tokens sorted by expert, counts [E] (this module's experts) summing to n -> [n, D]."""
        return run_experts(x, counts, self.w1, self.w3, self.w2, self.grouped)


def run_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                grouped: bool = True) -> torch.Tensor:
    """SwiGLU experts [E, ...] over tokens sorted by expert (counts [E]); plain tensors (expert parallelism passes
    its ranks' pieces)."""
    if grouped and grouped_mm_works(x, w1, w2):
        offsets = counts.cumsum(0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, w1.mT, offs=offsets)) * torch._grouped_mm(x, w3.mT, offs=offsets)
        return torch._grouped_mm(h, w2.mT, offs=offsets)
    parts = x.split(counts.tolist())
    return torch.cat([F.linear(F.silu(F.linear(p, w1[e])) * F.linear(p, w3[e]), w2[e])
                      for e, p in enumerate(parts)]) if parts else x


class SwiGLU(nn.Module):
    """A SwiGLU feed-forward (w1 gate, w3 up, w2 down): the shared experts (one of their summed width), and the
    decoder's dense feed-forward."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _AuxLoss(torch.autograd.Function):
    """Identity on the layer's output; backward also gives the auxiliary loss the gradient `weight`."""

    @staticmethod
    def forward(ctx, out, aux, weight: float):
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """Routed experts (+ shared ones). Dropless: every token reaches its k experts, however uneven the load."""

    def __init__(self, dim: int, ffn_hidden: int, moe: MoEDims):
        super().__init__()
        hidden = expert_hidden(moe, ffn_hidden)
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.router = Router(dim, moe)
        self.experts = GroupedExperts(dim, hidden, moe.num_experts)
        self.shared = SwiGLU(dim, hidden * moe.shared_experts) if moe.shared_experts else None
        self.aux_coef, self.z_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.loss_weight = 1.0  # one token's weight in the objective (set_loss_weight)
        # A layout that splits each sequence over ranks (context parallelism) sets this: a sum, with gradients,
        # over the ranks holding the other parts of the same sequences, and how many parts there are.
        self.sequence_sum, self.sequence_parts = None, 1
        # One row per training forward since the last reset: tokens routed to each expert, then the STATS sums.
        self.figures: list[torch.Tensor] = []

    @property
    def load(self) -> torch.Tensor:
        """Tokens routed to each expert over the forwards kept [E] (float64)."""
        return self.summed()[:self.num_experts]

    @property
    def stats(self) -> torch.Tensor:
        """The STATS sums over the forwards kept (float64)."""
        return self.summed()[self.num_experts:]

    def summed(self) -> torch.Tensor:
        """[E + len(STATS)]: the load, then the STATS sums, over the forwards kept (float64)."""
        if not self.figures:
            return torch.zeros(self.num_experts + len(STATS), dtype=torch.float64, device=self.router.gate.weight.device)
        return torch.stack(self.figures).sum(dim=0)

    def keep_last(self, n: int) -> None:
        """Only the last `n` forwards' figures (a pipeline schedule's first run also forwards once to learn the
        shapes: not a training forward)."""
        del self.figures[:-n]

    def reset_stats(self) -> None:
        self.figures.clear()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """After to_empty(): the figures zero, the routing bias zero (a checkpoint's or the weights' loaded later)."""
        self.reset_stats()
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, chosen, probs, logits = self.router(flat)
        # Every (token, choice) pair grouped by expert; stable, so the order is the same in any layout.
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts)
        token = order // self.top_k
        routed = self.experts(flat[token], counts) * weights.flatten()[order, None].to(flat.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, routed)
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.training and torch.is_grad_enabled():
            sequences = shape[0] if len(shape) == 3 else 1
            out = self._balance(out, chosen.view(sequences, -1), counts, probs.view(sequences, -1, self.num_experts),
                                logits)
        return out.view(shape)

    def _balance(self, out, chosen, counts, probs, logits) -> torch.Tensor:
        """The auxiliary losses on the output's gradient, and the layer's figures counted. chosen [S, T·k] and
        probs [S, T, E] by sequence."""
        sequences, length = probs.shape[:2]
        per_expert = torch.zeros(sequences, self.num_experts, dtype=probs.dtype, device=probs.device)
        per_expert.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=probs.dtype))
        prob_sums, whole = probs.sum(dim=1), length
        if self.sequence_sum is not None:  # this rank holds 1/parts of each sequence: the whole sequence's sums
            per_expert, prob_sums = self.sequence_sum(per_expert), self.sequence_sum(prob_sums)
            whole = length * self.sequence_parts
        # Each sequence's E·Σ f_i·P_i (f_i: the share of its k·T choices expert i got, P_i: its mean probability)
        aux = self.num_experts * (per_expert / (whole * self.top_k) * prob_sums / whole).sum(dim=1)
        z = torch.logsumexp(logits, dim=-1).square()
        # Summed over tokens: a sequence's aux counts once per token (this rank's tokens of it: summed over the ranks
        # holding the rest, each sequence's aux counts once per token of the whole sequence).
        if self.aux_coef or self.z_coef:
            term = self.aux_coef * aux.sum() * length + self.z_coef * z.sum()
            out = _AuxLoss.apply(out, term, self.loss_weight)
        # (Not again in an activation checkpoint's recomputation, which runs inside backward.)
        if torch._C._current_graph_task_id() == -1:
            with torch.no_grad():
                entropy = -(probs * probs.clamp_min(1e-20).log()).sum(dim=-1).sum()
                row = [aux.sum(), z.sum(), entropy, torch.tensor(sequences), torch.tensor(z.numel())]
                self.figures.append(torch.cat([counts.to(torch.float64),
                                               torch.stack([f.to(torch.float64).to(counts.device) for f in row])]))
        return out


def saved_bytes_per_token(moe: MoEDims, dim: int, ffn_hidden: int, scale: float) -> float:
    """What an MoE layer saves for backward per token, beyond its input (measured with saved-tensor hooks, fp32):
    per choice the routed copy of the input and the expert's output (12·D bytes), the expert's hidden activations
    (16·H) and int64 indices (32); the router's fp32 logits and probabilities (8·E) and 8 bytes of statistics; the
    shared experts as a dense SwiGLU of their width. `scale`: the activations' bytes over fp32's (bf16: 1/2)."""
    hidden = expert_hidden(moe, ffn_hidden)
    return (moe.top_k * ((12 * dim + 16 * hidden) * scale + 32) + 8 * moe.num_experts + 8
            + 16 * hidden * moe.shared_experts * scale)


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, layer) of every MoE layer the module holds (a pipeline stage: its own)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def set_loss_weight(layers: list[tuple[str, MoE]], weight: float) -> None:
    """One token's weight in the training objective for the next forwards (1 / the step's tokens, times fp16's loss
    scale)."""
    for _, layer in layers:
        layer.loss_weight = weight
