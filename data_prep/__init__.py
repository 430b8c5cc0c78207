"""Corpus preparation: tokenizer training and WebDataset token shards."""
