"""MoE layers after each step: their counts summed over every rank, the auxiliary-loss-free routing bias moved toward
the mean load, and the figures for the log (hpctrain.models.moe counts them in the forwards).

Every rank holds the same sums (one all-reduce of [sparse layers, experts + figures] float64 over the world, each
layer's row filled by the ranks holding it — a pipeline stage its own layers — and divided by the copies of each:
its tensor-parallel ranks), so the bias moves the same way on every copy of a layer. Logged:
`moe/imbalance` (the largest max/mean expert load over the layers: 1 is perfect balance), `moe/aux_loss`,
`moe/z_loss`, `moe/router_entropy` (means over the layers) and per layer `moe/layer<i>/imbalance` and
`moe/layer<i>/load` (tokens per expert, metrics.jsonl only), all over the last step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.core.config import MoEDims
from hpctrain.models.moe import STATS, is_sparse, moe_layers


def _layer_index(name: str) -> int:
    return int(name.split("layers.", 1)[1].split(".", 1)[0])


class ExpertBalance:
    def __init__(self, model: torch.nn.Module, moe: MoEDims, n_layers: int, device: torch.device, copies: int = 1):
        self.layers = [(_layer_index(name), layer) for name, layer in moe_layers(model)]
        self.rate, self.experts, self.copies, self.device = moe.bias_update_rate, moe.num_experts, copies, device
        self.rows = [i for i in range(n_layers) if is_sparse(moe, i)]  # every sparse layer of the whole model
        self.enabled = bool(self.rows)
        self.row = {i: r for r, i in enumerate(self.rows)}

    def after_step(self, applied: bool) -> dict:
        """The step's figures (reset for the next); the routing bias moved when the step was `applied`."""
        if not self.enabled:
            return {}
        # (a pipeline stage of dense layers only still joins the all-reduce)
        table = torch.zeros(len(self.rows), self.experts + len(STATS), dtype=torch.float64, device=self.device)
        for i, layer in self.layers:
            table[self.row[i]] = layer.summed()
            layer.reset_stats()
        if dist.is_initialized():
            dist.all_reduce(table)
            table /= self.copies
        load, stats = table[:, :self.experts], table[:, self.experts:]
        if applied and self.rate:
            with torch.no_grad():
                for i, layer in self.layers:
                    row = load[self.row[i]]
                    layer.router.expert_bias += (self.rate * torch.sign(row.mean() - row)).to(
                        layer.router.expert_bias.dtype)
        return self._figures(load.cpu(), stats.cpu())

    def _figures(self, load: torch.Tensor, stats: torch.Tensor) -> dict:
        per = {"aux_loss": "sequences", "z_loss": "tokens", "router_entropy": "tokens"}
        imbalance = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-12)
        out = {f"moe/{name}": (stats[:, STATS.index(name)] / stats[:, STATS.index(n)].clamp_min(1)).mean().item()
               for name, n in per.items()}
        out["moe/imbalance"] = imbalance.max().item()
        for row, i in enumerate(self.rows):
            out[f"moe/layer{i}/imbalance"] = imbalance[row].item()
            out[f"moe/layer{i}/load"] = [int(n) for n in load[row].tolist()]
        return out
