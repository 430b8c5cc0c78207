"""Qwen3's transformers adapter: Qwen3ForCausalLM (q/k norms; attention_bias, which would add an o_proj bias, and
sliding-window layers are refused)."""

from hpctrain.models.llama.hf import HFAdapter
from hpctrain.models.qwen2.hf import sliding_layers


class Qwen3HF(HFAdapter):
    family, config_class, model_class, model_type = "qwen3", "Qwen3Config", "Qwen3ForCausalLM", "qwen3"

    def _read_traits(self, config):
        problems = ["attention_bias=True"] if getattr(config, "attention_bias", False) else []
        return {"qk_norm": True}, problems + sliding_layers(config)

    def _write_traits(self, args):
        return {"attention_bias": False, "use_sliding_window": False}


ADAPTER = Qwen3HF()
