"""A synthetic shard set for any vocabulary size: the memory and scale benchmarks need a 128k-token vocabulary
(Llama 3's) that no corpus small enough for a test trains a BPE to.

The tokenizer is a real `tokenizers` word-level model over the words w1 … w{vocab_size-1} plus the EOS token
(id 0); the documents are random words, drawn Zipf-like as natural text is, so every id occurs and frequent
ones dominate. They go through the same writer as real corpora (`data_prep.shards.write_shards`): a
manifest, shards and the tokenizer that produced them.

`hpctrain prep synthetic --out DIR --vocab 128256 --seq-len 512 --samples 64`
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from data_prep.shards import write_shards
from data_prep.tokenizer import TextTokenizer
from hpctrain.core.shard_format import EOS_TOKEN, DataError, Manifest, token_dtype


def word_tokenizer(vocab_size: int) -> TextTokenizer:
    """EOS is id 0, word `w{i}` is id i."""
    if vocab_size < 2:
        raise DataError(f"vocab_size={vocab_size}: a synthetic vocabulary needs at least 2 tokens")
    vocab = {EOS_TOKEN: 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token=EOS_TOKEN))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TextTokenizer(core, 0)


def documents(vocab_size: int, n_tokens: int, seed: int, doc_tokens: int = 1000) -> list[str]:
    """About `n_tokens` words in documents of `doc_tokens`; word i drawn with weight 1/i (Zipf, s=1)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(1, vocab_size)]
    weights = [1 / i for i in range(1, vocab_size)]
    docs, left = [], n_tokens
    while left > 0:
        n = min(doc_tokens, left)
        docs.append(" ".join(rng.choices(words, weights, k=n)))
        left -= n
    return docs


def build_synthetic(out_dir: str, vocab_size: int, seq_len: int, samples: int, val_samples: int = 0,
                    seed: int = 0, shards: int = 8, overwrite: bool = False, doc_tokens: int = 1000) -> Manifest:
    """A shard set of `samples` training blocks (and `val_samples` validation ones) of seq_len + 1 tokens, the
    training ones in about `shards` shards (data-parallel ranks need one each at least), from documents of
    `doc_tokens` words (shorter than a block: several packed in each)."""
    if samples < 1 or val_samples < 0:
        raise DataError(f"samples={samples}, val_samples={val_samples}: need at least one training sample")
    # Each document ends with EOS and a split's tail shorter than a block is dropped: draw a little more.
    def split(n: int, salt: int) -> list[str]:
        return documents(vocab_size, int(n * (seq_len + 1) * 1.01) + seq_len + 1, seed * 2 + salt,
                         doc_tokens) if n else []

    docs = {"train": split(samples, 0), "val": split(val_samples, 1)}
    shard_mb = samples * (seq_len + 1) * np.dtype(token_dtype(vocab_size)).itemsize / max(shards, 1) / 1e6
    return write_shards(docs, word_tokenizer(vocab_size), out_dir, seq_len, shard_mb, overwrite=overwrite,
                        created_by={"tool": "data_prep.synthetic", "settings": {
                            "vocab_size": vocab_size, "seq_len": seq_len, "samples": samples,
                            "val_samples": val_samples, "seed": seed, "shards": shards,
                            "doc_tokens": doc_tokens}})


def cached_synthetic(out_dir: str, vocab_size: int, seq_len: int, samples: int, shards: int = 8) -> str:
    """`out_dir` holding a synthetic shard set of these settings: built once, reused by later calls (the
    benchmarks'); a DataError when it holds another shard set."""
    from hpctrain.core.shard_format import MANIFEST_NAME, read_manifest

    if os.path.exists(os.path.join(out_dir, MANIFEST_NAME)):
        m = read_manifest(out_dir)
        if m.vocab_size == vocab_size and m.block_len == seq_len + 1 and m.num_samples("train") >= samples:
            return out_dir
        raise DataError(f"{out_dir} holds another shard set (vocabulary {m.vocab_size}, blocks of {m.block_len}): "
                        "remove it or choose another directory")
    build_synthetic(out_dir, vocab_size, seq_len, samples, shards=shards)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hpctrain prep synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (must not hold a shard set)")
    ap.add_argument("--vocab", type=int, required=True, help="vocabulary size, EOS included")
    ap.add_argument("--seq-len", type=int, required=True, help="tokens per sample (blocks hold one more)")
    ap.add_argument("--samples", type=int, default=64, help="training samples")
    ap.add_argument("--val-samples", type=int, default=0, help="validation samples")
    ap.add_argument("--shards", type=int, default=8, help="about this many training shards")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--doc-tokens", type=int, default=1000, help="words per document (each ends with EOS)")
    a = ap.parse_args(argv)
    try:
        m = build_synthetic(a.out, a.vocab, a.seq_len, a.samples, a.val_samples, a.seed, a.shards,
                            doc_tokens=a.doc_tokens)
    except DataError as e:
        print(f"data_prep.synthetic: error: {e}", file=sys.stderr)
        return 2
    print(f"synthetic shards: {m.num_samples('train')} train / {m.num_samples('val')} val samples of "
          f"{m.block_len} tokens, vocabulary {m.vocab_size}, in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
