"""Tokenise documents, pack them into fixed-length blocks and write WebDataset tar shards + manifest.

Memory is bounded by one batch of documents plus one open shard's bookkeeping (blocks are streamed
into the tar as they are cut), not by the corpus. Output is deterministic: the same documents and
tokenizer give byte-identical shards and manifest.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import os
import sys
import tarfile
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from data_prep.shard_format import (
    MANIFEST_NAME,
    SPLITS,
    TAR_FORMAT,
    TOKENIZER_DIR,
    TOKENS_EXT,
    DataError,
    Manifest,
    ShardInfo,
    TokenizerInfo,
    encode_tokens,
    fsync_dir,
    parse_shard_name,
    sample_key,
    sha256_file,
    shard_name,
    tar_member,
    tar_member_bytes,
    token_dtype,
    write_manifest,
)
from data_prep.tokenizer import TextTokenizer, load_tokenizer, train_tokenizer

DEFAULT_SHARD_MB = 64.0
DEFAULT_BATCH_CHARS = 4_000_000  # characters of text handed to one encode_batch call


# --------------------------------------------------------------------------- validation split


def _unit_hash(name: str) -> float:
    """Stable, platform-independent hash of a document name in [0, 1)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64


def split_names(names: Iterable[str], val_fraction: float,
                weights: Mapping[str, float] | None = None) -> dict[str, list[str]]:
    """Document-level hold-out: "val" gets the documents with the smallest name hashes until they hold
    `val_fraction` of the total weight (e.g. bytes; default: one per document).

    Membership depends only on the names (and weights), not on their order. With `val_fraction > 0` and
    at least two documents, val gets at least one document and train keeps at least one.
    Order within each split follows the input order.
    """
    names = list(dict.fromkeys(names))
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1): pass e.g. 0.02")
    weight = (lambda n: float(weights[n])) if weights is not None else (lambda n: 1.0)
    target = val_fraction * sum(weight(n) for n in names)
    val: set[str] = set()
    held = 0.0
    for name in sorted(names, key=lambda n: (_unit_hash(n), n)):
        if val_fraction == 0 or len(val) == len(names) - 1 or (val and held >= target):
            break
        val.add(name)
        held += weight(name)
    return {"train": [n for n in names if n not in val], "val": [n for n in names if n in val]}


# --------------------------------------------------------------------------- writing


class _HashingFile:
    """Write-through file wrapper that hashes and counts the bytes it writes."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.size


class _ShardWriter:
    """Writes one split's blocks into `{split}-NNNNNN.tar` files of about `shard_bytes` each.

    Each shard is written to `name.tar.tmp`, fsynced, then renamed; a crash leaves only `.tmp` files
    and no manifest, which readers refuse and the next build removes.
    """

    def __init__(self, out_dir: str, split: str, dtype: str, block_len: int, shard_bytes: int):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.member_bytes = tar_member_bytes(block_len * np.dtype(dtype).itemsize)
        self.per_shard = max(1, shard_bytes // self.member_bytes)
        self.block_len = block_len
        self.shards: list[ShardInfo] = []
        self.samples = 0  # blocks written in this split so far (= next sample key)
        self._file = self._hash = self._tar = None
        self._in_shard = 0

    def add(self, blocks: np.ndarray) -> None:
        for block in blocks:
            if self._tar is None:
                self._open()
            data = encode_tokens(block, self.dtype)
            self._tar.addfile(tar_member(f"{sample_key(self.samples)}.{TOKENS_EXT}", len(data)),
                              _BytesReader(data))
            self.samples += 1
            self._in_shard += 1
            if self._in_shard == self.per_shard:
                self._close()

    def finish(self) -> list[ShardInfo]:
        if self._tar is not None:
            self._close()
        return self.shards

    def _path(self) -> str:
        return os.path.join(self.out_dir, shard_name(self.split, len(self.shards)))

    def _open(self) -> None:
        self._file = open(self._path() + ".tmp", "wb")  # noqa: SIM115 (closed in _close/abort)
        self._hash = _HashingFile(self._file)
        self._tar = tarfile.open(fileobj=self._hash, mode="w|", format=TAR_FORMAT)  # noqa: SIM115
        self._in_shard = 0

    def _close(self) -> None:
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        path = self._path()
        os.replace(path + ".tmp", path)
        self.shards.append(ShardInfo(name=os.path.basename(path), samples=self._in_shard,
                                     tokens=self._in_shard * self.block_len,
                                     sha256=self._hash.sha.hexdigest(), bytes=self._hash.size))
        self._file = self._hash = self._tar = None

    def abort(self) -> None:
        """Drop the shard being written (completed shards stay; the manifest is never written)."""
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._tar.close()
            self._file.close()
            os.remove(self._path() + ".tmp")
            self._file = self._hash = self._tar = None


class _BytesReader:
    """Minimal file-like over bytes for TarFile.addfile (avoids a BytesIO copy per block)."""

    def __init__(self, data: bytes):
        self.view, self.pos = memoryview(data), 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else self.pos + n
        out = self.view[self.pos:end].tobytes()
        self.pos += len(out)
        return out


def _batches(docs: Iterable[str], batch_chars: int) -> Iterator[list[str]]:
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= batch_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def pack_tokens(docs: Iterable[str], tokenizer: TextTokenizer, block_len: int, dtype: str,
                batch_chars: int = DEFAULT_BATCH_CHARS) -> Iterator[np.ndarray]:
    """Tokenise documents in batches, append EOS after each, and yield [n, block_len] arrays of
    consecutive full blocks. The final partial block is dropped."""
    eos = tokenizer.eos_id
    carry = np.empty(0, dtype=dtype)
    for batch in _batches(docs, batch_chars):
        encoded = tokenizer.encode_batch(batch)
        flat = np.empty(len(carry) + sum(len(ids) + 1 for ids in encoded), dtype=dtype)
        flat[: len(carry)] = carry
        pos = len(carry)
        for ids in encoded:
            flat[pos: pos + len(ids)] = ids
            pos += len(ids)
            flat[pos] = eos
            pos += 1
        n = len(flat) // block_len
        if n:
            yield flat[: n * block_len].reshape(n, block_len)
        carry = flat[n * block_len:].copy()


def prepare_out_dir(out_dir: str, overwrite: bool = False) -> None:
    """Make `out_dir` ready for a new shard set: refuse to replace a complete one unless `overwrite`,
    then drop the manifest first (so a crash never leaves a manifest over half-written shards) and
    remove leftover shards and `.tmp` files of earlier or interrupted builds."""
    manifest = os.path.join(out_dir, MANIFEST_NAME)
    if os.path.exists(manifest) and not overwrite:
        raise DataError(f"{out_dir} already holds a shard set ({MANIFEST_NAME}): "
                        "choose another output directory or pass overwrite=True / --overwrite")
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(manifest):
        os.remove(manifest)
        fsync_dir(out_dir)
    for name in sorted(os.listdir(out_dir)):
        base = name.removesuffix(".tmp")
        if base == MANIFEST_NAME or parse_shard_name(base) is not None:
            os.remove(os.path.join(out_dir, name))


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len} must be an integer >= 1: pass e.g. --seq-len 2048")


def write_shards(
    docs: Mapping[str, Iterable[str]],
    tokenizer: TextTokenizer,
    out_dir: str,
    seq_len: int,
    shard_mb: float = DEFAULT_SHARD_MB,
    sources: list[dict[str, Any]] | None = None,
    created_by: dict[str, Any] | None = None,
    batch_chars: int = DEFAULT_BATCH_CHARS,
    overwrite: bool = False,
) -> Manifest:
    """Write the shard set for `docs` ({"train": docs, "val": docs}) into `out_dir`; returns its manifest.

    The tokenizer is saved to `out_dir/tokenizer/`; the manifest is written last and atomically.
    """
    unknown = set(docs) - set(SPLITS)
    if unknown:
        raise DataError(f"unknown split(s) {sorted(unknown)}: use {list(SPLITS)}")
    _check_seq_len(seq_len)
    prepare_out_dir(out_dir, overwrite)
    block_len = seq_len + 1
    dtype = token_dtype(tokenizer.vocab_size)
    tok_path = tokenizer.save(os.path.join(out_dir, TOKENIZER_DIR))
    shard_bytes = int(shard_mb * 1_000_000)

    splits: dict[str, list[ShardInfo]] = {}
    for split in SPLITS:
        writer = _ShardWriter(out_dir, split, dtype, block_len, shard_bytes)
        try:
            for blocks in pack_tokens(docs.get(split, ()), tokenizer, block_len, dtype, batch_chars):
                writer.add(blocks)
        except BaseException:
            writer.abort()
            raise
        splits[split] = writer.finish()
    if not splits["train"]:
        raise DataError(f"the train split of {out_dir} has no full block of {block_len} tokens: "
                        "use more text or a smaller seq_len")
    fsync_dir(out_dir)
    manifest = Manifest(
        block_len=block_len,
        vocab_size=tokenizer.vocab_size,
        dtype=dtype,
        eos_id=tokenizer.eos_id,
        tokenizer=TokenizerInfo(path=os.path.relpath(tok_path, out_dir), sha256=sha256_file(tok_path)),
        splits=splits,
        sources=list(sources or []),
        created_by=dict(created_by or {}),
    )
    write_manifest(out_dir, manifest)
    return manifest


# --------------------------------------------------------------------------- text-file corpora


def read_text(path: str) -> str | None:
    """The file as UTF-8 text, or None when it cannot be read or decoded."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def build_from_files(
    files: list[str],
    out_dir: str,
    seq_len: int,
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    val_fraction: float = 0.01,
    shard_mb: float = DEFAULT_SHARD_MB,
    root: str | None = None,
    sources: list[dict[str, Any]] | None = None,
    created_by: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Each file is one document. The val hold-out (`val_fraction` of the bytes) is chosen by hashes of
    the file names relative to `root`; the
    tokenizer is loaded from `tokenizer` or, if None, trained on the train files with `vocab_size`."""
    if not files:
        raise DataError(f"no input files for {out_dir}: pass a non-empty CORPUS glob")
    root = root or os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    by_name = {os.path.relpath(os.path.abspath(f), root): f for f in files}
    split = split_names(by_name, val_fraction, {n: os.path.getsize(f) for n, f in by_name.items()})
    _check_seq_len(seq_len)
    prepare_out_dir(out_dir, overwrite)
    if tokenizer is None:
        if vocab_size is None:
            raise DataError("pass a tokenizer path or a vocab_size to train one")
        tok_path = train_tokenizer([by_name[n] for n in split["train"]], vocab_size,
                                   os.path.join(out_dir, TOKENIZER_DIR))
    else:
        tok_path = tokenizer
    tok = load_tokenizer(tok_path)

    def docs(names: list[str]) -> Iterator[str]:
        for name in names:
            text = read_text(by_name[name])
            if text is not None:
                yield text

    return write_shards({s: docs(split[s]) for s in SPLITS}, tok, out_dir, seq_len, shard_mb=shard_mb,
                        sources=sources, created_by=created_by, overwrite=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_prep.shards",
                                description="Text files (one document each) -> token shards + manifest.")
    p.add_argument("--corpus", required=True, help="glob of UTF-8 text files, e.g. 'raw/**/*.txt'")
    p.add_argument("--out", required=True, help="output data directory")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--tokenizer", help="tokenizer.json or local HF tokenizer dir (default: train one)")
    p.add_argument("--vocab-size", type=int, default=32000, help="when training a tokenizer")
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    files = sorted(f for f in glob.glob(a.corpus, recursive=True) if os.path.isfile(f))
    t0 = time.perf_counter()
    settings = {k: getattr(a, k) for k in ("seq_len", "tokenizer", "vocab_size", "val_fraction", "shard_mb")}
    try:
        m = build_from_files(files, a.out, a.seq_len, vocab_size=a.vocab_size, tokenizer=a.tokenizer,
                             val_fraction=a.val_fraction, shard_mb=a.shard_mb,
                             sources=[{"corpus": a.corpus, "files": len(files)}],
                             created_by={"tool": "data_prep.shards", "settings": settings},
                             overwrite=a.overwrite)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"shards: {m.num_samples('train')} train / {m.num_samples('val')} val blocks of {m.block_len} "
          f"tokens in {a.out} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
