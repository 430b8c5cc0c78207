"""Layer 0: the config schema, errors, file helpers, the shard format, argument parsing. Imports nothing of the project."""
