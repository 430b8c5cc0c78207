"""hpctrain: Slurm-native batch training for Llama-style language models."""

__version__ = "0.1.0"
