"""The training data loader: shards streamed per rank, deterministic and resumable."""
