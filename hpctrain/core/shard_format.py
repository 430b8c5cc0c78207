"""The on-disk token shard format: the one thing `data_prep` (writer) and `hpctrain.data.loader` (loader) share.

A data directory holds::

    manifest.json                written last, atomically; its presence marks a complete shard set
    tokenizer/tokenizer.json     the tokenizer that produced the tokens (sha256 recorded in the manifest)
    train-000000-0000.tar ...    WebDataset shards: {split}-{unit}-{part}.tar, one sample per packed block
    val-000000-0000.tar ...
    .build/                      the preprocessing journal (plan + one record per finished work unit)

The manifest lists each split's shards in order; a shard `name` is a path relative to the data directory
(older sets use ``{split}-NNNNNN.tar``). Each sample is one tar member ``{key}.tokens`` (key =
``{unit:06d}-{block:010d}``, unique within the split) holding `block_len` little-endian unsigned integers
(uint16 when the vocabulary fits, else uint32). `block_len = seq_len + 1`: a block is a model input plus
its shifted target.

Pure Python + numpy on purpose: no torch here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpctrain.core.files import MAX_MANIFEST_BYTES, atomic_write, open_checked, read_json

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "val")
TOKENS_EXT = "tokens"
EOS_TOKEN = "<|endoftext|>"
BUILD_HINT = "build shards with `make demo-data` or `make shards CORPUS=... OUT={dir}`"

# Fixed tar member metadata so that the same tokens give byte-identical shards.
TAR_FORMAT = tarfile.USTAR_FORMAT
TAR_MTIME = 0
TAR_MODE = 0o444
TAR_OWNER = "hpctrain"

_SHARD_RE = re.compile(r"^(?P<split>[a-z]+)-(?P<index>\d{6})\.tar$")
_UNIT_SHARD_RE = re.compile(r"^(?P<split>[a-z]+)-(?P<unit>\d{6,})-(?P<part>\d{4,})\.tar$")


class DataError(ValueError):
    """Bad or missing data. The message is one line: what is wrong, where, and how to fix it."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def parse_shard_name(name: str) -> tuple[str, int] | None:
    """`("train", 3)` for "train-000003.tar", None for anything else."""
    m = _SHARD_RE.match(name)
    return (m["split"], int(m["index"])) if m else None


def unit_shard_name(split: str, unit: int, part: int) -> str:
    """Shard `part` of work unit `unit` of `split`: "train-000012-0003.tar"."""
    return f"{split}-{unit:06d}-{part:04d}.tar"


def is_shard_file(name: str) -> bool:
    """True for shard file names this code writes (either naming scheme), with or without `.tmp`."""
    base = name.removesuffix(".tmp")
    return bool(_SHARD_RE.match(base) or _UNIT_SHARD_RE.match(base))


def sample_key(index: int, unit: int | None = None) -> str:
    return f"{index:010d}" if unit is None else f"{unit:06d}-{index:010d}"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def encode_tokens(tokens: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(tokens, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def decode_tokens(data: bytes, dtype: str) -> np.ndarray:
    """Raw little-endian token bytes -> 1-D array in native byte order."""
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype, copy=False)


def tar_member(name: str, size: int) -> tarfile.TarInfo:
    """A TarInfo with fixed metadata (no timestamps, owners or modes of the writing machine)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = TAR_MTIME
    info.mode = TAR_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = TAR_OWNER
    return info


def tar_member_bytes(size: int) -> int:
    """Bytes one member of `size` data bytes occupies in a tar file (header + padded data)."""
    return tarfile.BLOCKSIZE + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open_checked(path, 2**62) as f:  # a regular file: a device would be hashed forever
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class ShardInfo:
    name: str  # file name inside the data directory
    samples: int
    tokens: int
    sha256: str
    bytes: int


@dataclass
class TokenizerInfo:
    path: str  # relative to the data directory
    sha256: str  # of tokenizer.json


@dataclass
class Manifest:
    block_len: int
    vocab_size: int
    dtype: str
    eos_id: int
    tokenizer: TokenizerInfo
    splits: dict[str, list[ShardInfo]]
    sources: list[dict[str, Any]] = field(default_factory=list)
    created_by: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def seq_len(self) -> int:
        return self.block_len - 1

    def shards(self, split: str) -> list[ShardInfo]:
        return self.splits.get(split, [])

    def num_samples(self, split: str) -> int:
        return sum(s.samples for s in self.shards(split))

    def num_tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.shards(split))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        d = dict(d)
        d["tokenizer"] = TokenizerInfo(**d["tokenizer"])
        d["splits"] = {k: [ShardInfo(**s) for s in v] for k, v in d["splits"].items()}
        return cls(**d)


def manifest_json(manifest: Manifest) -> str:
    return json.dumps(manifest.to_dict(), indent=2, sort_keys=True) + "\n"


def read_manifest(data_dir: str) -> Manifest:
    hint = BUILD_HINT.format(dir=data_dir)
    if os.path.isfile(data_dir):
        raise DataError(f"{data_dir} is a file, not a shard directory: point data.path (or --out) at the directory "
                        f"that holds {MANIFEST_NAME}")
    if not os.path.isdir(data_dir):
        raise DataError(f"data directory {data_dir} does not exist: {hint}")
    path = os.path.join(data_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise DataError(f"no {MANIFEST_NAME} in {data_dir} (missing or interrupted build): {hint}")
    try:
        raw = read_json(path, MAX_MANIFEST_BYTES)
    except (OSError, ValueError) as e:  # FileCheckError included
        raise DataError(f"cannot read {path} ({e}): {hint}") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != FORMAT_VERSION:
        raise DataError(
            f"{path} has shard format version {version!r}, this code reads version {FORMAT_VERSION}: "
            f"rebuild the shards ({hint})"
        )
    try:
        manifest = Manifest.from_dict(raw)
    except (TypeError, KeyError, AttributeError) as e:
        raise DataError(f"invalid {path} ({type(e).__name__}: {e}): {hint}") from None
    problem = _invalid(manifest)
    if problem:
        raise DataError(f"invalid {path} ({problem}): {hint}")
    return manifest


MAX_BLOCK_LEN = 2**24 + 1  # 16M-token sequences: beyond any context length trained today
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _inside(rel) -> bool:
    """A path relative to the data directory that stays inside it."""
    return isinstance(rel, str) and bool(rel) and not os.path.isabs(rel) and \
        os.path.normpath(rel).split(os.sep)[0] not in ("..", "")


def _count(value, low: int = 0, high: int = 2**62) -> bool:
    return type(value) is int and low <= value <= high


def _invalid(m: Manifest) -> str | None:
    """What makes a manifest's values unusable (each is read like a config value), or None."""
    if m.dtype not in ("uint16", "uint32"):
        return f"dtype={m.dtype!r}"
    if not _count(m.block_len, 2, MAX_BLOCK_LEN):
        return f"block_len={m.block_len!r} (2 to {MAX_BLOCK_LEN})"
    if not _count(m.vocab_size, 1, np.iinfo(m.dtype).max + 1):
        return f"vocab_size={m.vocab_size!r} for {m.dtype} token ids"
    if not _count(m.eos_id, 0, m.vocab_size - 1):
        return f"eos_id={m.eos_id!r} outside the vocabulary of {m.vocab_size}"
    if not (_inside(m.tokenizer.path) and isinstance(m.tokenizer.sha256, str) and _SHA256.match(m.tokenizer.sha256)):
        return f"tokenizer {m.tokenizer.path!r}, sha256 {m.tokenizer.sha256!r}"
    if set(m.splits) - set(SPLITS):
        return f"splits {sorted(m.splits)} (only {list(SPLITS)})"
    for split, shards in m.splits.items():
        for s in shards:
            if not (_inside(s.name) and _count(s.samples) and _count(s.tokens) and _count(s.bytes)
                    and isinstance(s.sha256, str) and _SHA256.match(s.sha256)):
                return f"{split} shard {s.name!r}: samples {s.samples!r}, tokens {s.tokens!r}, bytes {s.bytes!r}"
    return None


def write_manifest(data_dir: str, manifest: Manifest) -> str:
    """Write `manifest.json` atomically (tmp file, fsync, rename, fsync dir); returns its path."""
    path = os.path.join(data_dir, MANIFEST_NAME)
    atomic_write(path, manifest_json(manifest), sync_dir=True)
    return path
