"""Mixtral's transformers adapter (MixtralForCausalLM), and `MoEAdapter`, what every MoE family's adapter shares.

On disk a transformers MoE checkpoint keeps each expert's matrices apart (`...experts.3.w1.weight`); transformers 5
holds them in memory as two fused [E, ...] tensors per layer (`experts.gate_up_proj`: gate rows then up rows, and
`experts.down_proj`), transformers 4 as on disk. hpctrain keeps three [E, out, in] tensors (w1, w3, w2): one
tensor per kind whatever the layout, sharded on E by expert parallelism, and saved or loaded row by row.
"""

from __future__ import annotations

import torch

from hpctrain.core.config import MoEDims, RouterKind
from hpctrain.models.llama.hf import HFAdapter
from hpctrain.models.moe import is_sparse

_KINDS = ("w1", "w3", "w2")  # gate, up, down: our experts' tensors


class MoEAdapter(HFAdapter):
    """The conversions of an MoE family: `disk_prefix` names a layer's MoE module on disk, `disk_experts` each
    expert's gate, up and down matrices there; in memory (transformers 5) the module is `mlp`."""

    disk_prefix = "mlp"
    disk_experts = ("gate_proj", "up_proj", "down_proj")
    FREE = (*HFAdapter.FREE, "moe.aux_loss_coef", "moe.z_loss_coef", "moe.bias_update_rate")
    MOE_FIELDS: dict[str, str] = {}  # model.moe.<key> -> config.json's name

    def _moe_layers(self, args) -> list[int]:
        return [i for i in range(args.n_layers) if is_sparse(args.moe, i)]

    def key_map(self, n_layers: int) -> dict[str, str]:
        """The non-expert names (the router's in memory); the experts' go through disk_names / to_memory."""
        names = super().key_map(n_layers)
        names.update({f"layers.{i}.feed_forward.router.gate.weight": f"model.layers.{i}.mlp.gate.weight"
                      for i in range(n_layers)})
        return names

    def disk_names(self, args) -> dict[str, tuple[str, ...]]:
        names = super().disk_names(args)
        for i in self._moe_layers(args):
            where = f"model.layers.{i}.{self.disk_prefix}"
            names[f"layers.{i}.feed_forward.router.gate.weight"] = (f"{where}.gate.weight",)
            for ours, theirs in zip(_KINDS, self.disk_experts):
                names[f"layers.{i}.feed_forward.experts.{ours}"] = tuple(
                    f"{where}.experts.{e}.{theirs}.weight" for e in range(args.moe.num_experts))
        return names

    def to_memory(self, ours, args, theirs):
        fused = any(k.endswith("experts.gate_up_proj") for k in theirs)
        names, disk = self.key_map(args.n_layers), self.disk_names(args)
        out = {}
        for k, v in ours.items():
            if ".experts." not in k:
                out[names[k]] = v
            elif not fused:  # transformers 4: every expert a module, named as on disk
                out.update(zip(disk[k], v.unbind(0)))
        if fused:
            for i in self._moe_layers(args):
                layer = f"layers.{i}.feed_forward.experts"
                out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([ours[f"{layer}.w1"],
                                                                              ours[f"{layer}.w3"]], dim=1)
                out[f"model.layers.{i}.mlp.experts.down_proj"] = ours[f"{layer}.w2"]
        return out

    def from_memory(self, theirs, args, keys):
        names, disk = self.key_map(args.n_layers), self.disk_names(args)
        out = {}
        for k in keys:
            if ".experts." not in k:
                out[k] = theirs[names[k]]
                continue
            layer, kind = k.rsplit(".", 1)
            fused = f"model.{layer.replace('feed_forward', 'mlp')}"
            if f"{fused}.down_proj" in theirs:  # transformers 5
                gate_up = theirs[f"{fused}.gate_up_proj"]
                out[k] = theirs[f"{fused}.down_proj"] if kind == "w2" else gate_up.chunk(2, dim=1)[kind == "w3"]
            else:
                out[k] = torch.stack([theirs[name] for name in disk[k]])
        return out

    def field_name(self, key: str) -> str:
        if key.startswith("moe."):
            return self.MOE_FIELDS.get(key[len("moe."):], key)
        return super().field_name(key)

    def _moe_problems(self, config) -> list[str]:
        noise = getattr(config, "router_jitter_noise", 0.0) or 0.0
        return [f"router_jitter_noise={noise} (hpctrain routes without noise)"] if noise else []

    @staticmethod
    def _aux_coef(config) -> float:
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)

    def _check_holds(self, args, allowed: dict[str, tuple]) -> None:
        """ValueError (one line) when a model.moe key the family's class has no field for is not one of the values
        it always has (`allowed`: key -> those values)."""
        m = args.moe
        value = {"expert_hidden": m.expert_hidden, "shared_experts": m.shared_experts,
                 "router": RouterKind(m.router).value, "norm_topk": m.norm_topk, "route_scale": m.route_scale,
                 "every": m.every, "dense_layers": list(m.dense_layers)}
        problems = [f"model.moe.{k}={value[k]}" for k, ok in allowed.items() if value[k] not in ok]
        if problems:
            raise ValueError(f"{self.model_class} cannot hold {', '.join(problems)}: use the default or another "
                             "family")


class MixtralHF(MoEAdapter):
    family, config_class, model_class, model_type = "mixtral", "MixtralConfig", "MixtralForCausalLM", "mixtral"
    disk_prefix = "block_sparse_moe"
    disk_experts = ("w1", "w3", "w2")
    MOE_FIELDS = {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok",
                  "aux_loss_coef": "router_aux_loss_coef"}

    def _read_traits(self, config):
        moe = MoEDims(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                      aux_loss_coef=self._aux_coef(config))
        return {"sliding_window": getattr(config, "sliding_window", None), "moe": moe}, self._moe_problems(config)

    def _write_traits(self, args):
        m = args.moe
        self._check_holds(args, {"expert_hidden": (None, args.ffn_hidden), "shared_experts": (0,),
                                 "router": ("softmax",), "norm_topk": (True,), "route_scale": (1.0,), "every": (1,),
                                 "dense_layers": ([],)})
        return {"sliding_window": args.sliding_window, "num_local_experts": m.num_experts,
                "num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coef, "router_jitter_noise": 0.0}


ADAPTER = MixtralHF()
