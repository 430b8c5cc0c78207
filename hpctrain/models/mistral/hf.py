"""Mistral's transformers adapter: MistralForCausalLM, whose config adds `sliding_window` (null: none)."""

from hpctrain.models.llama.hf import HFAdapter


class MistralHF(HFAdapter):
    family, config_class, model_class, model_type = "mistral", "MistralConfig", "MistralForCausalLM", "mistral"

    def _read_traits(self, config):
        return {"sliding_window": getattr(config, "sliding_window", None)}, []

    def _write_traits(self, args):
        return {"sliding_window": args.sliding_window}


ADAPTER = MistralHF()
