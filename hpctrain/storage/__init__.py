"""Checkpoints on disk: distributed save and load, the unpickling allow-list, rotation."""
