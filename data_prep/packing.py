"""Tokenise text segments, pack them into fixed-length blocks and write one work unit's tar shards.

Memory is bounded by one batch of text (`batch_chars`) plus the block carry-over, never by the corpus.
Deterministic: the same segments and tokenizer give byte-identical shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import tarfile
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from data_prep.tokenizer import TextTokenizer
from hpctrain.core.shard_format import (
    TAR_FORMAT,
    TOKENS_EXT,
    DataError,
    ShardInfo,
    encode_tokens,
    sample_key,
    tar_member,
    tar_member_bytes,
    unit_shard_name,
)

DEFAULT_BATCH_CHARS = 1_000_000  # characters per encode_batch call: bounds a worker at ~100-150 MB


# --------------------------------------------------------------------------- validation split


def _unit_hash(name: str) -> float:
    """Stable, platform-independent hash of a name in [0, 1)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64


def split_names(names: Iterable[str], val_fraction: float,
                weights: Mapping[str, float] | None = None) -> dict[str, list[str]]:
    """Hold-out by name: "val" gets the names with the smallest hashes until they hold `val_fraction` of
    the total weight (e.g. bytes; default: one per name).

    Membership depends only on the names (and weights), not on their order. With `val_fraction > 0` and
    at least two names, val gets at least one and train keeps at least one.
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


# --------------------------------------------------------------------------- packing


def _batches(segments: Iterable[tuple[str, bool]], batch_chars: int) -> Iterator[list[tuple[str, bool]]]:
    batch, chars = [], 0
    for seg in segments:
        batch.append(seg)
        chars += len(seg[0])
        if chars >= batch_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def pack_segments(segments: Iterable[tuple[str, bool]], tokenizer: TextTokenizer, block_len: int, dtype: str,
                  batch_chars: int = DEFAULT_BATCH_CHARS, counts: dict | None = None) -> Iterator[np.ndarray]:
    """Tokenise (text, ends_document) segments in batches, append EOS after each document, and yield
    [n, block_len] arrays of consecutive full blocks. The final partial block is dropped (its size is
    added to counts["dropped_tokens"]; counts["tokens"] gets every token including EOS)."""
    eos = tokenizer.eos_id
    carry = np.empty(0, dtype=dtype)
    counts = counts if counts is not None else {}
    top = np.iinfo(dtype).max
    for batch in _batches(segments, batch_chars):
        encoded = tokenizer.encode_batch([text for text, _ in batch])
        size = len(carry) + sum(len(ids) + ends for ids, (_, ends) in zip(encoded, batch))
        pieces = itertools.chain.from_iterable(
            itertools.chain(ids, (eos,)) if ends else ids for ids, (_, ends) in zip(encoded, batch))
        flat = np.empty(size, dtype=dtype)
        flat[: len(carry)] = carry
        new = np.fromiter(pieces, dtype=np.int64, count=size - len(carry))
        if len(new) and int(new.max()) > top:
            raise DataError(f"token id {int(new.max())} does not fit {dtype}: pass --dtype uint32")
        flat[len(carry):] = new
        counts["tokens"] = counts.get("tokens", 0) + len(new)
        n = len(flat) // block_len
        if n:
            yield flat[: n * block_len].reshape(n, block_len)
        carry = flat[n * block_len:].copy()
    counts["dropped_tokens"] = counts.get("dropped_tokens", 0) + len(carry)


def pack_tokens(docs: Iterable[str], tokenizer: TextTokenizer, block_len: int, dtype: str,
                batch_chars: int = DEFAULT_BATCH_CHARS) -> Iterator[np.ndarray]:
    """`pack_segments` for whole documents."""
    return pack_segments(((d, True) for d in docs), tokenizer, block_len, dtype, batch_chars)


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


class _BytesReader:
    """Minimal file-like over bytes for TarFile.addfile (avoids a BytesIO copy per block)."""

    def __init__(self, data: bytes):
        self.view, self.pos = memoryview(data), 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else self.pos + n
        out = self.view[self.pos:end].tobytes()
        self.pos += len(out)
        return out


class UnitWriter:
    """Writes one work unit's blocks into `{split}-{unit}-{part}.tar` files of about `shard_bytes` each.

    Each shard is written to `name.tar.tmp`, fsynced, then renamed: a crash leaves at most one `.tmp`
    file and complete shards that no manifest references yet; a rerun rewrites the unit.
    """

    def __init__(self, out_dir: str, split: str, unit: int, dtype: str, block_len: int, shard_bytes: int):
        self.out_dir, self.split, self.unit, self.dtype = out_dir, split, unit, dtype
        self.per_shard = max(1, shard_bytes // tar_member_bytes(block_len * np.dtype(dtype).itemsize))
        self.block_len = block_len
        self.shards: list[ShardInfo] = []
        self.samples = 0  # blocks written in this unit so far (= next sample key)
        self._file = self._hash = self._tar = None
        self._in_shard = 0

    def add(self, blocks: np.ndarray) -> None:
        for block in blocks:
            if self._tar is None:
                self._open()
            data = encode_tokens(block, self.dtype)
            self._tar.addfile(tar_member(f"{sample_key(self.samples, self.unit)}.{TOKENS_EXT}", len(data)),
                              _BytesReader(data))
            self.samples += 1
            self._in_shard += 1
            if self._in_shard == self.per_shard:
                self._close()

    def finish(self) -> list[ShardInfo]:
        if self._tar is not None:
            self._close()
        return self.shards

    def _name(self) -> str:
        return unit_shard_name(self.split, self.unit, len(self.shards))

    def _open(self) -> None:
        self._file = open(os.path.join(self.out_dir, self._name()) + ".tmp", "wb")  # noqa: SIM115
        self._hash = _HashingFile(self._file)
        self._tar = tarfile.open(fileobj=self._hash, mode="w|", format=TAR_FORMAT)  # noqa: SIM115
        self._in_shard = 0

    def _close(self) -> None:
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = self._name()
        path = os.path.join(self.out_dir, name)
        os.replace(path + ".tmp", path)
        self.shards.append(ShardInfo(name=name, samples=self._in_shard, tokens=self._in_shard * self.block_len,
                                     sha256=self._hash.sha.hexdigest(), bytes=self._hash.size))
        self._file = self._hash = self._tar = None

    def abort(self) -> None:
        """Drop the shard being written (completed shards stay; no manifest references them)."""
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._tar.close()
            self._file.close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.out_dir, self._name()) + ".tmp")
            self._file = self._hash = self._tar = None


def write_unit(segments: Iterable[tuple[str, bool]], tokenizer: TextTokenizer, out_dir: str, split: str,
               unit: int, block_len: int, dtype: str, shard_bytes: int,
               batch_chars: int = DEFAULT_BATCH_CHARS) -> tuple[list[ShardInfo], dict]:
    """Tokenise, pack and write one unit; returns (shards, counts)."""
    writer = UnitWriter(out_dir, split, unit, dtype, block_len, shard_bytes)
    counts: dict = {}
    try:
        for blocks in pack_segments(segments, tokenizer, block_len, dtype, batch_chars, counts):
            writer.add(blocks)
    except BaseException:
        writer.abort()
        raise
    return writer.finish(), counts
