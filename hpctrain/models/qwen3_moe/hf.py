"""Qwen3-MoE's transformers adapter: Qwen3MoeForCausalLM (q/k norms; sparse layers by decoder_sparse_step and
mlp_only_layers, dense ones of intermediate_size; experts of moe_intermediate_size; no shared experts)."""

from hpctrain.core.config import MoEDims
from hpctrain.models.mixtral.hf import MoEAdapter
from hpctrain.models.qwen2.hf import sliding_layers


class Qwen3MoeHF(MoEAdapter):
    family, config_class, model_class, model_type = "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe"
    MOE_FIELDS = {"num_experts": "num_experts", "top_k": "num_experts_per_tok", "expert_hidden": "moe_intermediate_size",
                  "norm_topk": "norm_topk_prob", "every": "decoder_sparse_step", "dense_layers": "mlp_only_layers",
                  "aux_loss_coef": "router_aux_loss_coef"}

    def _read_traits(self, config):
        problems = ["attention_bias=True"] if getattr(config, "attention_bias", False) else []
        moe = MoEDims(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                      expert_hidden=config.moe_intermediate_size, norm_topk=bool(config.norm_topk_prob),
                      every=config.decoder_sparse_step, dense_layers=list(config.mlp_only_layers or []),
                      aux_loss_coef=self._aux_coef(config))
        return {"qk_norm": True, "moe": moe}, problems + sliding_layers(config) + self._moe_problems(config)

    def _write_traits(self, args):
        m = args.moe
        self._check_holds(args, {"shared_experts": (0,), "router": ("softmax",), "route_scale": (1.0,)})
        return {"attention_bias": False, "use_sliding_window": False, "num_experts": m.num_experts,
                "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.expert_hidden or args.ffn_hidden,
                "norm_topk_prob": m.norm_topk, "decoder_sparse_step": m.every, "mlp_only_layers": list(m.dense_layers),
                "router_aux_loss_coef": m.aux_loss_coef}


ADAPTER = Qwen3MoeHF()
