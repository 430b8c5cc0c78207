"""Training/eval data: a deterministic, exactly resumable stream of token blocks from WebDataset shards.

One GLOBAL sample sequence exists per (manifest, split, seed). Epoch e visits the split's shards in
an order permuted by (seed, e) and, inside shard s, its samples in an order permuted by (seed, e, s);
with shuffle=False both are the identity. The shuffle buffer is exactly one shard: memory is bounded
by the shard size, and any position in the sequence maps to (epoch, shard, offset) from the manifest's
sample counts alone, so resuming skips whole shards without reading them.

`ShardStream` yields consecutive `batch_size` blocks of that sequence from `start_sample` on. With
num_workers > 0, DataLoader worker w reads the shard visits w, w+W, w+2W, ... and the main process
puts them back in visit order, so the sequence does not depend on the number of workers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import webdataset as wds

from data_prep.shard_format import (
    BUILD_HINT,
    TOKENS_EXT,
    DataError,
    Manifest,
    ShardInfo,
    decode_tokens,
    read_manifest,
)

__all__ = ["DataError", "Manifest", "ShardStream", "check_compat", "read_manifest", "read_shard"]

_TAG_SHARD_ORDER = 1  # domain separation of the two kinds of permutations
_TAG_SAMPLE_ORDER = 2


def _rng(*ints: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(i) % 2**64 for i in ints]))


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Manifest shard indices in the order epoch `epoch` visits them."""
    if not shuffle:
        return np.arange(num_shards)
    return _rng(_TAG_SHARD_ORDER, seed, epoch).permutation(num_shards)


def sample_order(num_samples: int, seed: int, epoch: int, shard: int, shuffle: bool) -> np.ndarray:
    """Positions (in tar order) of shard `shard`'s samples in the order epoch `epoch` yields them."""
    if not shuffle:
        return np.arange(num_samples)
    return _rng(_TAG_SAMPLE_ORDER, seed, epoch, shard).permutation(num_samples)


def read_shard(url: str, shard: ShardInfo, manifest: Manifest) -> np.ndarray:
    """All samples of one shard as a [samples, block_len] array in tar order.

    `url` is anything webdataset's gopen accepts (a local path, `pipe:cmd ...`, ...).
    """
    rows = []
    try:
        for sample in wds.tarfile_samples([{"url": url}]):
            data = sample.get(TOKENS_EXT)
            if data is None:
                raise DataError(f"shard {url} sample {sample.get('__key__')} has no .{TOKENS_EXT} member: "
                                f"rebuild the shards ({BUILD_HINT.format(dir=os.path.dirname(url))})")
            tokens = decode_tokens(data, manifest.dtype)
            if tokens.size != manifest.block_len:
                raise DataError(f"shard {url} sample {sample['__key__']} has {tokens.size} tokens, manifest "
                                f"block_len is {manifest.block_len}: rebuild the shards")
            rows.append(tokens)
    except DataError:
        raise
    except Exception as e:  # truncated/corrupt tar, failing pipe, ...
        raise DataError(f"cannot read shard {url} ({type(e).__name__}: {e}): rebuild or re-copy it") from None
    if len(rows) != shard.samples:
        raise DataError(f"shard {url} has {len(rows)} samples but the manifest says {shard.samples}: "
                        "rebuild the shards or restore the file")
    if not rows:
        return np.empty((0, manifest.block_len), dtype=manifest.dtype)
    return np.stack(rows)


@dataclass(frozen=True)
class _Visit:
    """One shard visit of the global sequence: read shard `shard` of epoch `epoch` from `offset` on."""

    position: int  # 0, 1, 2, ... counted from the stream's start
    epoch: int
    shard: int
    offset: int


class _Plan:
    """Maps the global sample sequence to shard visits; picklable (it crosses into DataLoader workers)."""

    def __init__(self, data_dir: str, manifest: Manifest, split: str, seed: int, shuffle: bool, loop: bool):
        self.data_dir, self.manifest, self.split = data_dir, manifest, split
        self.seed, self.shuffle, self.loop = seed, shuffle, loop
        self.shards = manifest.shards(split)
        self.epoch_samples = sum(s.samples for s in self.shards)

    def url(self, shard: int) -> str:
        return os.path.join(self.data_dir, self.shards[shard].name)

    def visits(self, start_sample: int) -> Iterator[_Visit]:
        """Shard visits from global sample `start_sample` on (endless if loop), touching no files."""
        epoch, skip = divmod(start_sample, self.epoch_samples)
        position = 0
        while self.loop or epoch == 0:
            for shard in shard_order(len(self.shards), self.seed, epoch, self.shuffle):
                n = self.shards[shard].samples
                if skip >= n:  # wholly before the start: not read
                    skip -= n
                    continue
                yield _Visit(position, epoch, int(shard), skip)
                position += 1
                skip = 0
            epoch += 1

    def read(self, visit: _Visit) -> np.ndarray:
        """The visit's samples in sequence order: one shard read, permuted, cut at the offset."""
        blocks = read_shard(self.url(visit.shard), self.shards[visit.shard], self.manifest)
        order = sample_order(len(blocks), self.seed, visit.epoch, visit.shard, self.shuffle)
        return blocks[order[visit.offset:]]


class _WorkerShards(torch.utils.data.IterableDataset):
    """DataLoader side: worker w of W reads the visits whose position % W == w, in order."""

    def __init__(self, plan: _Plan, start_sample: int):
        super().__init__()
        self.plan, self.start_sample = plan, start_sample

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for visit in self.plan.visits(self.start_sample):
            if visit.position % workers == worker:
                try:
                    chunk = torch.from_numpy(np.ascontiguousarray(self.plan.read(visit)))
                except DataError as e:  # handed over as a value: the main process re-raises it verbatim
                    yield visit.position, e
                    return
                yield visit.position, chunk


class ShardStream:
    """Iterable of LongTensor micro-batches [batch_size, block_len] from one split of a shard set.

    Resuming with start_sample = k * batch_size yields exactly what the uninterrupted stream yields
    from batch k on. loop=True crosses epochs seamlessly (a batch may span two); loop=False stops at
    the end of the split and drops a final partial batch.
    """

    def __init__(self, data_dir: str, split: str, batch_size: int, seed: int, start_sample: int = 0,
                 loop: bool = True, shuffle: bool = True, num_workers: int = 0):
        self.manifest = read_manifest(data_dir)
        self.data_dir, self.split, self.batch_size, self.seed = data_dir, split, batch_size, seed
        self.start_sample, self.loop, self.shuffle, self.num_workers = start_sample, loop, shuffle, num_workers
        shards = self.manifest.shards(split)
        if batch_size < 1 or start_sample < 0 or num_workers < 0:
            raise DataError(f"batch_size={batch_size}, start_sample={start_sample}, num_workers={num_workers}: "
                            "batch_size must be >= 1, the others >= 0")
        if not shards or not any(s.samples for s in shards):
            have = {k: sum(s.samples for s in v) for k, v in self.manifest.splits.items()}
            raise DataError(f"split {split!r} of {data_dir} has no samples (samples per split: {have}): "
                            "use another split or rebuild with more data")
        missing = [s.name for s in shards if not os.path.isfile(os.path.join(data_dir, s.name))]
        if missing:
            raise DataError(f"shard {os.path.join(data_dir, missing[0])} is missing ({len(missing)} of "
                            f"{len(shards)} {split} shards missing): restore the files or rebuild the shards")
        self._plan = _Plan(data_dir, self.manifest, split, seed, shuffle, loop)
        if not loop and batch_size > self._plan.epoch_samples:
            raise DataError(f"batch_size={batch_size} exceeds the {self._plan.epoch_samples} samples of split "
                            f"{split!r} in {data_dir} (loop=False): use a smaller batch or more data")

    @property
    def block_len(self) -> int:
        return self.manifest.block_len

    @property
    def samples_per_epoch(self) -> int:
        return self._plan.epoch_samples

    def __len__(self) -> int:
        """Batches left for loop=False streams."""
        if self.loop:
            raise TypeError("a looping ShardStream is endless")
        return max(0, self._plan.epoch_samples - self.start_sample) // self.batch_size

    def _chunks(self) -> Iterator[np.ndarray]:
        """Consecutive pieces of the global sequence, one per shard visit, in visit order."""
        if self.num_workers == 0:
            for visit in self._plan.visits(self.start_sample):
                yield self._plan.read(visit)
            return
        loader = torch.utils.data.DataLoader(_WorkerShards(self._plan, self.start_sample), batch_size=None,
                                             num_workers=self.num_workers)
        pending: dict[int, torch.Tensor | DataError] = {}
        expected = 0
        for position, chunk in loader:  # DataLoader already returns workers round-robin: stays tiny
            pending[position] = chunk
            while expected in pending:
                chunk = pending.pop(expected)
                if isinstance(chunk, DataError):
                    raise chunk
                yield chunk.numpy()
                expected += 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        parts: list[np.ndarray] = []
        have = 0
        for chunk in self._chunks():
            while len(chunk):
                take = min(len(chunk), self.batch_size - have)
                parts.append(chunk[:take])
                have += take
                chunk = chunk[take:]
                if have == self.batch_size:
                    batch = np.concatenate(parts) if len(parts) > 1 else parts[0]
                    yield torch.from_numpy(batch.astype(np.int64))
                    parts, have = [], 0


def check_compat(manifest: Manifest, vocab_size: int, seq_len: int) -> None:
    """Raise DataError when a model (vocab_size, seq_len) cannot train on these shards."""
    if manifest.vocab_size > vocab_size:
        raise DataError(f"the shards' tokenizer has {manifest.vocab_size} tokens but the model vocab_size is "
                        f"{vocab_size}: set model.vocab_size >= {manifest.vocab_size} or use matching shards")
    if manifest.block_len != seq_len + 1:
        raise DataError(f"the shards hold blocks of {manifest.block_len} tokens (seq_len "
                        f"{manifest.block_len - 1}) but train.seq_len is {seq_len}: set train.seq_len="
                        f"{manifest.block_len - 1} or rebuild the shards with --seq-len {seq_len}")
