"""Training/eval data: an elastic, deterministic and exactly resumable stream of token blocks from shards.

The sequence of GLOBAL samples depends only on (manifest, split, seed, shuffle, lanes) - never on the
data-parallel size, the rank or the number of loader workers:

* epoch e permutes the split's non-empty shards by (seed, e) and deals the permutation round-robin to
  `lanes` data lanes (lane l gets permuted shards l, l+L, l+2L, ...); inside a shard the samples are
  permuted by (seed, e, shard). With shuffle=False both are the identity. The shuffle buffer is one shard.
* each lane is an endless stream: its epoch-0 shards, then its epoch-1 shards, ... (loop=False: epoch 0
  only). Lanes advance through epochs independently (their shards hold different sample counts).
* global sample g is sample g // L of lane g % L. Global batch s is samples [s*B, (s+1)*B).
* data-parallel rank r of dp owns the lanes l with l % dp == r, i.e. exactly the global samples with
  g % dp == r: its local part of a global batch is those samples in g order (B/dp of them), cut into
  micro-batches. Each rank opens only the shards of its own lanes.

Rules (checked, one-line DataError): lanes <= the split's non-empty shards, lanes % dp_size == 0,
start_sample % dp_size == 0, and when global_batch is given, global_batch % dp_size == 0 and
(global_batch / dp_size) % batch_size == 0. The global sequence does not depend on global_batch.

Any position maps to (epoch, shard, offset) of every lane from the manifest's sample counts alone, so a
resumed stream - with the same or another dp size dividing `lanes` - opens only the partially consumed
shard of each of its lanes, and yields exactly what the uninterrupted run would have.

With num_workers > 0, the rank's shard visits are put in the order the merge will need them; DataLoader
worker w reads visits w, w+W, ... and the main process merges them back, so workers change nothing.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import itertools
import logging
import os
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander

from hpctrain.core.files import FileCheckError, read_bytes
from hpctrain.core.shard_format import (
    BUILD_HINT,
    TOKENS_EXT,
    DataError,
    Manifest,
    ShardInfo,
    decode_tokens,
    read_manifest,
)

__all__ = ["DataError", "Manifest", "ShardStream", "check_compat", "choose_lanes", "interleave_ranks",
           "read_manifest", "read_shard"]

log = logging.getLogger("hpctrain.data.loader")

_TAG_SHARD_ORDER = 1  # domain separation of the two kinds of permutations
_TAG_SAMPLE_ORDER = 2
ON_CORRUPT = ("error", "skip")


def _rng(*ints: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(i) % 2**64 for i in ints]))


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Manifest shard indices in the order epoch `epoch` visits them (before dealing to lanes)."""
    if not shuffle:
        return np.arange(num_shards)
    return _rng(_TAG_SHARD_ORDER, seed, epoch).permutation(num_shards)


def sample_order(num_samples: int, seed: int, epoch: int, shard: int, shuffle: bool) -> np.ndarray:
    """Positions (in tar order) of shard `shard`'s samples in the order epoch `epoch` yields them."""
    if not shuffle:
        return np.arange(num_samples)
    return _rng(_TAG_SAMPLE_ORDER, seed, epoch, shard).permutation(num_samples)


# --------------------------------------------------------------------------- reading one shard


def _octal(field: bytes) -> int | None:
    field = field.split(b"\0", 1)[0].strip()
    if not field:
        return 0
    try:
        return int(field, 8)
    except ValueError:
        return None


def _parse_tar(buf: bytes, manifest: Manifest, shard: ShardInfo) -> np.ndarray | None:
    """Fast path for a shard in the canonical layout (one regular `{key}.tokens` member per sample).

    Checks every ustar header (name, size, type, checksum) and the end-of-archive marker, then gathers all
    token blocks with one numpy index: several times faster than per-sample tar iteration. Returns None on
    anything unexpected; the caller then reads the shard with webdataset, which handles the general case
    and produces the error message.
    """
    n, itemsize = shard.samples, np.dtype(manifest.dtype).itemsize
    nbytes = manifest.block_len * itemsize
    stride = 512 + -(-nbytes // 512) * 512
    raw = np.frombuffer(buf, dtype=np.uint8)
    if len(raw) < n * stride + 1024 or raw[n * stride:n * stride + 1024].any():
        return None  # truncated, more members than the manifest says, or no end-of-archive marker
    if n == 0:
        return np.empty((0, manifest.block_len), dtype=manifest.dtype)
    starts = np.arange(n) * stride
    headers = raw[starts[:, None] + np.arange(512)]
    size_field = headers[0, 124:136]
    if (_octal(size_field.tobytes()) != nbytes or not (headers[:, 124:136] == size_field).all()
            or not np.isin(headers[:, 156], (0, ord("0"))).all() or headers[:, 345].any()):
        return None  # another size, not a regular file, or a ustar prefix (long name)
    sums = headers.sum(1, dtype=np.int64) - headers[:, 148:156].sum(1, dtype=np.int64) + 8 * 32
    suffix = b"." + TOKENS_EXT.encode()
    names, chk = headers[:, :100].tobytes(), headers[:, 148:156].tobytes()
    prev = None
    for i in range(n):
        name = names[i * 100:(i + 1) * 100].split(b"\0", 1)[0]
        key = name[:-len(suffix)].rsplit(b"/", 1)[-1]
        if (not name.endswith(suffix) or b"." in key or key.startswith(b"__") or key == prev
                or _octal(chk[i * 8:(i + 1) * 8]) != sums[i]):
            return None  # not one {key}.tokens member per sample, or a damaged header
        prev = key
    flat = np.frombuffer(buf, dtype=np.dtype(manifest.dtype).newbyteorder("<"))
    index = ((starts + 512) // itemsize)[:, None] + np.arange(manifest.block_len)
    return flat[index].astype(manifest.dtype, copy=False)


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith("pipe:")


def _read_bytes(path: str, size: int) -> bytes | None:
    """A local shard's bytes: a regular file of at most `size` bytes (a device or a runaway file is a DataError
    here: webdataset would read it forever); None when it cannot be opened (webdataset words that)."""
    try:
        return read_bytes(path, size)
    except FileCheckError as e:
        raise DataError(f"shard {e} (rebuild or re-copy the shard set), or set data.on_corrupt=skip") from None
    except OSError:
        return None


def _check_sha256(url: str, buf: bytes, shard: ShardInfo) -> None:
    digest = hashlib.sha256(buf).hexdigest()
    if digest != shard.sha256:
        raise DataError(f"shard {url} checksum mismatch ({len(buf)} bytes, sha256 {digest[:12]}...; the "
                        f"manifest says {shard.bytes} bytes, {shard.sha256[:12]}...): it changed after the "
                        "build; restore it (rebuild or re-copy the shard set) or set data.on_corrupt=skip")


def _samples(url: str, data: bytes | None = None) -> Iterator[dict]:
    """webdataset's samples of the shard at `url`, or of its bytes `data` when already read."""
    if data is None:
        return wds.tarfile_samples([{"url": url}])
    return group_by_keys(tar_file_expander([{"url": url, "stream": io.BytesIO(data)}]))


def _check_token_range(url: str, blocks: np.ndarray, manifest: Manifest, data: bytes | None) -> None:
    """Token ids >= vocab_size would index past the embedding (a device-side assert on GPU)."""
    if not blocks.size or int(blocks.max()) < manifest.vocab_size:
        return
    row = int(np.flatnonzero((blocks >= manifest.vocab_size).any(1))[0])
    token = int(blocks[row][blocks[row] >= manifest.vocab_size][0])
    try:  # error path only: one more pass for the sample's key
        key = next(itertools.islice(_samples(url, data), row, None))["__key__"]
    except Exception:
        key = "?"
    raise DataError(f"shard {url} sample {row} (key {key}) holds token id {token} >= the manifest's vocab_size "
                    f"{manifest.vocab_size}: the shard does not match its tokenizer; rebuild the shards "
                    "or set data.on_corrupt=skip")


def read_shard(url: str, shard: ShardInfo, manifest: Manifest) -> np.ndarray:
    """All samples of one shard as a [samples, block_len] array in tar order, token ids checked < vocab_size.

    `url` is anything webdataset's gopen accepts (a local path, `pipe:cmd ...`, ...). A local file is read
    whole once: its bytes are checked against the manifest's sha256, then parsed by the fast path (or, when
    not in the canonical layout, by webdataset from the same bytes). Non-local URLs (`pipe:`, `scheme://`)
    stream through webdataset and are NOT checksum-verified (that would take a second pass over the
    stream); their token range is still checked. Every problem is a one-line DataError naming the shard.
    """
    # (a larger file than listed is read, for the checksum's line; a device or a runaway file never is)
    data = _read_bytes(url, 2 * shard.bytes + 2**20) if _is_local(url) else None
    blocks = None
    if data is not None:
        _check_sha256(url, data, shard)
        blocks = _parse_tar(data, manifest, shard)
    if blocks is None:
        blocks = read_shard_wds(url, shard, manifest, data)
    _check_token_range(url, blocks, manifest, data)
    return blocks


def read_shard_wds(url: str, shard: ShardInfo, manifest: Manifest, data: bytes | None = None) -> np.ndarray:
    """`read_shard` through webdataset's per-sample tar iterator only (the general path; no checksum or
    token range check). `data`: the shard's bytes when already read."""
    rows = []
    try:
        for sample in _samples(url, data):
            payload = sample.get(TOKENS_EXT)
            if payload is None:
                raise DataError(f"shard {url} sample {sample.get('__key__')} has no .{TOKENS_EXT} member: "
                                f"rebuild the shards ({BUILD_HINT.format(dir=os.path.dirname(url))})")
            tokens = decode_tokens(payload, manifest.dtype)
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


# --------------------------------------------------------------------------- the plan (no file access)


@dataclass(frozen=True)
class _Visit:
    """Lane `lane` reads shard `shard` of its epoch `epoch` from sample `offset` on.

    `need` is the global sample index of the visit's first sample: visits sorted by it are in the order
    the merge consumes them.
    """

    lane: int
    epoch: int
    shard: int
    offset: int
    need: int


class _Plan:
    """Maps the global sample sequence to lanes and shard visits; picklable (it goes to loader workers)."""

    def __init__(self, data_dir: str, manifest: Manifest, split: str, seed: int, shuffle: bool, loop: bool,
                 lanes: int):
        self.data_dir, self.manifest, self.split = data_dir, manifest, split
        self.seed, self.shuffle, self.loop, self.lanes = seed, shuffle, loop, lanes
        self.shards = manifest.shards(split)
        self.counts = np.array([s.samples for s in self.shards], dtype=np.int64)
        self.epoch_samples = int(self.counts.sum())
        self.nonempty = int((self.counts > 0).sum())
        self._dealt: dict[int, tuple[np.ndarray, ...]] = {}

    def url(self, shard: int) -> str:
        return os.path.join(self.data_dir, self.shards[shard].name)

    def dealt(self, epoch: int) -> tuple[np.ndarray, ...]:
        """Per lane, the manifest indices of the shards it reads in its epoch `epoch`, in order."""
        if epoch not in self._dealt:
            if len(self._dealt) >= 8:  # lanes drift apart by an epoch or so: a few entries suffice
                self._dealt.clear()
            order = shard_order(len(self.shards), self.seed, epoch, self.shuffle)
            order = order[self.counts[order] > 0]
            self._dealt[epoch] = tuple(order[lane::self.lanes] for lane in range(self.lanes))
        return self._dealt[epoch]

    def lane_samples(self, lane: int, epoch: int) -> int:
        return int(self.counts[self.dealt(epoch)[lane]].sum())

    def lane_start(self, lane: int, global_sample: int) -> int:
        """Samples lane `lane` has delivered before global sample `global_sample`."""
        return max(0, global_sample - lane + self.lanes - 1) // self.lanes

    def lane_visits(self, lane: int, start: int) -> Iterator[_Visit]:
        """Shard visits of one lane from lane position `start` on (endless if loop), touching no files."""
        epoch, pos = 0, 0
        while self.loop or epoch == 0:
            n = self.lane_samples(lane, epoch)
            if pos + n <= start:  # whole lane-epoch before the start: skipped without per-shard work
                pos += n
                epoch += 1
                continue
            for shard in self.dealt(epoch)[lane]:
                c = int(self.counts[shard])
                if pos + c > start:
                    offset = max(0, start - pos)
                    yield _Visit(lane, epoch, int(shard), offset, (pos + offset) * self.lanes + lane)
                pos += c
            epoch += 1

    def visits(self, lanes: Sequence[int], global_start: int) -> Iterator[_Visit]:
        """The visits of `lanes` from global sample `global_start` on, in the order the merge needs them."""
        streams = [self.lane_visits(lane, self.lane_start(lane, global_start)) for lane in lanes]
        return heapq.merge(*streams, key=lambda v: v.need)

    def end(self) -> int | None:
        """loop=False: the first global sample whose lane is exhausted (the global sequence ends there)."""
        if self.loop:
            return None
        return min(self.lane_samples(lane, 0) * self.lanes + lane for lane in range(self.lanes))

    def read(self, visit: _Visit, on_corrupt: str) -> tuple[np.ndarray, tuple[str, str] | None]:
        """The visit's samples in sequence order, and (name, why) of the shard it replaced when corrupt.

        on_corrupt="skip": an unreadable or corrupt shard (see `read_shard`) is replaced by the next readable shard in manifest order
        (permuted as this visit would have been, cycled to the same sample count), so batch shapes, lane
        positions and exact resume are kept; the caller counts and logs it.
        """
        shard = visit.shard
        try:
            blocks = read_shard(self.url(shard), self.shards[shard], self.manifest)
        except DataError as e:
            if on_corrupt == "error":
                raise
            why, blocks = str(e), None
            for k in range(1, len(self.shards)):
                sub = (shard + k) % len(self.shards)
                if self.counts[sub] == 0:
                    continue
                try:
                    blocks = read_shard(self.url(sub), self.shards[sub], self.manifest)
                except DataError:
                    continue
                break
            if blocks is None:
                raise DataError(f"every {self.split} shard in {self.data_dir} is unreadable "
                                "(on_corrupt=skip has nothing left to read): rebuild or restore the shards"
                                ) from None
            order = sample_order(len(blocks), self.seed, visit.epoch, shard, self.shuffle)
            order = order[np.arange(self.counts[shard]) % len(order)]
            return blocks[order[visit.offset:]], (self.shards[shard].name, why)
        order = sample_order(len(blocks), self.seed, visit.epoch, shard, self.shuffle)
        return blocks[order[visit.offset:]], None


class _WorkerShards(torch.utils.data.IterableDataset):
    """DataLoader side: worker w of W reads the visits at positions w, w+W, ... of the merged order."""

    def __init__(self, plan: _Plan, lanes: Sequence[int], start_sample: int, on_corrupt: str):
        super().__init__()
        self.plan, self.lanes, self.start_sample, self.on_corrupt = plan, lanes, start_sample, on_corrupt

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for position, visit in enumerate(self.plan.visits(self.lanes, self.start_sample)):
            if position % workers == worker:
                try:
                    chunk, replaced = self.plan.read(visit, self.on_corrupt)
                except DataError as e:  # handed over as a value: the main process re-raises it verbatim
                    yield position, visit.lane, e, None
                    return
                yield position, visit.lane, torch.from_numpy(np.ascontiguousarray(chunk)), replaced


# --------------------------------------------------------------------------- the stream


class ShardStream:
    """Iterable of LongTensor micro-batches [batch_size, block_len]: this dp rank's part of global batches.

    `start_sample` is a GLOBAL sample position (step * global_batch). The stream yields, in g order, the
    global samples g >= start_sample with g % dp_size == dp_rank, batch_size at a time; with
    global_batch = dp_size * batch_size * grad_accum, every grad_accum consecutive micro-batches are this
    rank's part of one global batch (`interleave_ranks` rebuilds the global batch from all ranks' parts).

    loop=True crosses epochs seamlessly; loop=False stops where the first lane runs out of its epoch-0
    samples (all of the split when lanes=1), dropping a final partial batch, with the same number of
    batches on every rank. Resuming with any start_sample yields exactly the uninterrupted tail.

    on_corrupt="error": an unreadable or corrupt shard (checksum mismatch, token id >= vocab_size) raises a
    one-line DataError naming it. "skip": it is replaced (see `_Plan.read`), logged as a warning with the
    reason, and counted in `corrupt_shards` / `corrupt_names`.
    `shards_read` counts shard visits consumed by this process. pin_memory pins the yielded batches
    (only where CUDA is available).
    """

    def __init__(self, data_dir: str, split: str, batch_size: int, seed: int, start_sample: int = 0,
                 loop: bool = True, shuffle: bool = True, num_workers: int = 0, lanes: int = 1,
                 dp_rank: int = 0, dp_size: int = 1, global_batch: int | None = None,
                 pin_memory: bool = False, on_corrupt: str = "error", prefetch: int = 2):
        self.manifest = read_manifest(data_dir)
        self.data_dir, self.split, self.batch_size, self.seed = data_dir, split, batch_size, seed
        self.start_sample, self.loop, self.shuffle = start_sample, loop, shuffle
        self.num_workers = num_workers
        self.lanes, self.dp_rank, self.dp_size, self.global_batch = lanes, dp_rank, dp_size, global_batch
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.on_corrupt, self.prefetch = on_corrupt, prefetch
        self.corrupt_shards = 0
        self.corrupt_names: list[str] = []
        self.shards_read = 0
        shards = self.manifest.shards(split)
        if batch_size < 1 or start_sample < 0 or num_workers < 0 or prefetch < 1:
            raise DataError(f"batch_size={batch_size}, start_sample={start_sample}, num_workers="
                            f"{num_workers}, prefetch={prefetch}: batch_size and prefetch must be >= 1, "
                            "the others >= 0")
        if on_corrupt not in ON_CORRUPT:
            raise DataError(f"on_corrupt={on_corrupt!r}: use one of {', '.join(ON_CORRUPT)}")
        if not shards or not any(s.samples for s in shards):
            have = {k: sum(s.samples for s in v) for k, v in self.manifest.splits.items()}
            raise DataError(f"split {split!r} of {data_dir} has no samples (samples per split: {have}): "
                            "use another split or rebuild with more data")
        check_files(data_dir, self.manifest, split)
        _check_layout(lanes, dp_rank, dp_size, batch_size, global_batch, start_sample)
        self._plan = _Plan(data_dir, self.manifest, split, seed, shuffle, loop, lanes)
        if lanes > self._plan.nonempty:
            raise DataError(f"lanes={lanes} exceeds the {self._plan.nonempty} non-empty {split} shards of "
                            f"{data_dir}: set data.lanes <= {self._plan.nonempty} (and a multiple of dp) or "
                            "rebuild the shards smaller (more shards)")
        if not loop and (end := self._plan.end()) < batch_size * dp_size:
            raise DataError(f"batch_size={batch_size} x dp_size={dp_size} exceeds the {end} samples of "
                            f"split {split!r} in {data_dir} readable with lanes={lanes} (loop=False): use a "
                            "smaller batch, fewer lanes or more data")

    @property
    def block_len(self) -> int:
        return self.manifest.block_len

    @property
    def samples_per_epoch(self) -> int:
        return self._plan.epoch_samples

    @property
    def my_lanes(self) -> list[int]:
        """The lanes this dp rank reads."""
        return list(range(self.dp_rank, self.lanes, self.dp_size))

    def __len__(self) -> int:
        """Batches left for loop=False streams (the same on every rank)."""
        if self.loop:
            raise TypeError("a looping ShardStream is endless")
        return max(0, self._plan.end() - self.start_sample) // (self.batch_size * self.dp_size)

    def _chunks(self) -> Iterator[tuple[int, np.ndarray, str | None]]:
        """(lane, samples, (replaced shard, why) or None) per shard visit of this rank's lanes, in the merged order."""
        lanes = self.my_lanes
        if self.num_workers == 0:
            for visit in self._plan.visits(lanes, self.start_sample):
                chunk, replaced = self._plan.read(visit, self.on_corrupt)
                yield visit.lane, chunk, replaced
            return
        loader = torch.utils.data.DataLoader(
            _WorkerShards(self._plan, lanes, self.start_sample, self.on_corrupt), batch_size=None,
            num_workers=self.num_workers, prefetch_factor=self.prefetch, persistent_workers=False)
        pending: dict[int, tuple] = {}
        expected = 0
        for position, lane, chunk, replaced in loader:  # workers come back round-robin: stays tiny
            pending[position] = (lane, chunk, replaced)
            while expected in pending:
                lane, chunk, replaced = pending.pop(expected)
                if isinstance(chunk, DataError):
                    raise chunk
                yield lane, chunk.numpy(), replaced
                expected += 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        lanes, L, dp, bs = self.my_lanes, self.lanes, self.dp_size, self.batch_size
        buffers: dict[int, deque] = {lane: deque() for lane in lanes}
        chunks = self._chunks()

        def take(lane: int, n: int) -> np.ndarray:
            parts, buf = [], buffers[lane]
            while n:
                while not buf:
                    got_lane, chunk, replaced = next(chunks)
                    self.shards_read += 1
                    if replaced is not None:
                        name, why = replaced
                        self.corrupt_shards += 1
                        self.corrupt_names.append(name)
                        log.warning("shard skipped (on_corrupt=skip; replaced by samples of another shard; "
                                    "%d skipped so far): %s", self.corrupt_shards, why)  # `why` names it
                    if len(chunk):
                        buffers[got_lane].append(chunk)
                chunk = buf[0]
                k = min(n, len(chunk))
                parts.append(chunk[:k])
                if k == len(chunk):
                    buf.popleft()
                else:
                    buf[0] = chunk[k:]
                n -= k
            return parts[0] if len(parts) == 1 else np.concatenate(parts)

        end = self._plan.end()
        n_batches = None if end is None else len(self)
        first = self.start_sample + self.dp_rank  # global index of this rank's local sample 0
        made = 0
        try:
            while n_batches is None or made < n_batches:
                out = torch.empty((bs, self.block_len), dtype=torch.int64, pin_memory=self.pin_memory)
                view = out.numpy()
                if len(lanes) == 1:
                    view[:] = take(lanes[0], bs)
                else:
                    which = (first + (made * bs + np.arange(bs)) * dp) % L
                    for lane in lanes:
                        mask = which == lane
                        if (n := int(mask.sum())):
                            view[mask] = take(lane, n)
                made += 1
                yield out
        finally:
            chunks.close()


def _check_layout(lanes: int, dp_rank: int, dp_size: int, batch_size: int, global_batch: int | None,
                  start_sample: int) -> None:
    if lanes < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"lanes={lanes}, dp_rank={dp_rank}, dp_size={dp_size}: need lanes >= 1, dp_size >= 1 "
                        "and 0 <= dp_rank < dp_size")
    if lanes % dp_size:
        raise DataError(f"data.lanes={lanes} is not a multiple of the data-parallel size dp={dp_size}: set "
                        f"data.lanes to a multiple of {dp_size} (lanes fix the sample order; keep them when "
                        "resuming at another dp)")
    if start_sample % dp_size:
        raise DataError(f"start_sample={start_sample} is not a multiple of dp={dp_size}: start at a global "
                        "batch boundary (step * global_batch)")
    if global_batch is not None:
        if global_batch < 1 or global_batch % (dp_size * batch_size):
            raise DataError(f"global_batch={global_batch} is not a multiple of dp x micro_batch={dp_size} x "
                            f"{batch_size}: choose global_batch = micro_batch x grad_accum x dp")
        if start_sample % global_batch:
            raise DataError(f"start_sample={start_sample} is not a multiple of global_batch={global_batch}: "
                            "resume at a step boundary (step * global_batch)")


def check_files(data_dir: str, manifest: Manifest, split: str) -> None:
    """Every shard of `split` the manifest lists is there (one-line DataError naming the first missing)."""
    shards = manifest.shards(split)
    missing = [s.name for s in shards if not os.path.isfile(os.path.join(data_dir, s.name))]
    if missing:
        raise DataError(f"shard {os.path.join(data_dir, missing[0])} is missing ({len(missing)} of "
                        f"{len(shards)} {split} shards missing): restore the files or rebuild the shards")


DEFAULT_LANES = 8


def choose_lanes(lanes: int | None, dp_size: int, manifest: Manifest, split: str = "train") -> int:
    """`lanes`, or for None the default: the largest multiple of dp_size <= max(DEFAULT_LANES, dp_size)
    that the split's non-empty shards can feed (8 lanes: elastic over dp 1, 2, 4, 8 with at most 8 shards
    in memory per rank). A run must keep its lanes for life: store the result in the checkpoint."""
    nonempty = sum(1 for s in manifest.shards(split) if s.samples)
    if lanes is None:
        lanes = min(max(DEFAULT_LANES, dp_size), nonempty) // dp_size * dp_size
        if lanes == 0:
            raise DataError(f"dp={dp_size} ranks need at least {dp_size} non-empty {split} shards, the shard "
                            f"set has {nonempty}: rebuild the shards smaller (more shards) or lower dp")
    return lanes


def interleave_ranks(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One global batch in g order from the dp ranks' parts (parts[r]: rank r's micro-batches, joined)."""
    dp = len(parts)
    n = sum(len(p) for p in parts)
    if any(len(p) * dp != n for p in parts):
        raise ValueError(f"ranks' parts have different sizes {[len(p) for p in parts]}")
    out = torch.empty((n, *parts[0].shape[1:]), dtype=parts[0].dtype)
    for r, p in enumerate(parts):
        out[r::dp] = p
    return out


def check_compat(manifest: Manifest, vocab_size: int, seq_len: int) -> None:
    """Raise DataError when a model (vocab_size, seq_len) cannot train on these shards."""
    if manifest.vocab_size > vocab_size:
        raise DataError(f"the shards' tokenizer has {manifest.vocab_size} tokens but the model vocab_size is "
                        f"{vocab_size}: set model.vocab_size >= {manifest.vocab_size} or use matching shards")
    if manifest.block_len != seq_len + 1:
        raise DataError(f"the shards hold blocks of {manifest.block_len} tokens (seq_len "
                        f"{manifest.block_len - 1}) but train.seq_len is {seq_len}: set train.seq_len="
                        f"{manifest.block_len - 1} or rebuild the shards with --seq-len {seq_len}")
