"""Qwen2's transformers adapter: Qwen2ForCausalLM. Its sliding-window layers (use_sliding_window, off in the
published Qwen2 and Qwen2.5 models) are refused."""

from hpctrain.models.llama.hf import HFAdapter


def sliding_layers(config) -> list[str]:
    """The problem of a Qwen config whose layers use a sliding window (hpctrain's window is Mistral's: every layer).
    Qwen3-MoE's config has no layer_types: its window, set, is every layer's."""
    layers = getattr(config, "layer_types", None)
    sliding = "sliding_attention" in layers if layers is not None else getattr(config, "sliding_window", None)
    return ["sliding-window layers (use_sliding_window=True)"] if sliding else []


class Qwen2HF(HFAdapter):
    family, config_class, model_class, model_type = "qwen2", "Qwen2Config", "Qwen2ForCausalLM", "qwen2"

    def _read_traits(self, config):
        return {"qkv_bias": True}, sliding_layers(config)

    def _write_traits(self, args):
        return {"use_sliding_window": False}


ADAPTER = Qwen2HF()
