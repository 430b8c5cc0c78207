"""Weights in and out of other formats: the Hugging Face export."""
