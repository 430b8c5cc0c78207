"""A weighted mixture of shard sets as one elastic, deterministic and exactly resumable stream.

Global sample g of the mixture comes from source `src(g)`, chosen by deficit scheduling: the source whose count
lags its weight the most (w·(g+1) − count, ties to the first listed); a schedule switches weights at given
positions, each phase exact in its own prefixes. Every prefix of the stream then holds each
source within one sample of weight × length — not approximately, as random draws would. Weights are read as exact
fractions (0.7 is 7/10), so the choice repeats with a period Q (the least common denominator): any position's
counts come from one period's table, and a resumed stream starts anywhere at once.

Every source is read through its own lanes (the same `lanes` for all; each source needs that many non-empty
shards): sample g is lane l = g % lanes of its source, and within that lane the next one the mixture has not yet
taken. Data-parallel rank r owns the lanes l ≡ r (mod dp), i.e. exactly the global samples g ≡ r (mod dp), as for
one source (hpctrain.data.loader), so the global sequence depends on (sources, weights, seed, shuffle, lanes) and
never on dp, ranks or workers. A source that runs out starts its next epoch, reshuffled.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from hpctrain.core.shard_format import DataError, read_manifest
from hpctrain.data.loader import ON_CORRUPT, _check_layout, _Plan, check_files

log = logging.getLogger("hpctrain.data.loader")

MAX_PERIOD = 100_000  # weights whose least common denominator is larger are refused (round them)
WINDOW_SAMPLES = 256  # a rank's samples assembled at once (~0.5 MB of 257-token blocks)


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    weight: float


def weights_valid(weights: Sequence[float]) -> bool:
    """Weights a mixture can draw by: every one finite and >= 0, one > 0."""
    return bool(weights) and all(math.isfinite(w) and w >= 0 for w in weights) and any(weights)


def fractions(weights: Sequence[float]) -> list[Fraction]:
    """The weights as exact fractions summing to 1 (0.7 is 7/10: its decimal, not its binary float)."""
    if not weights_valid(weights):
        raise DataError(f"mixture weights {list(weights)}: every weight must be >= 0 and one > 0, all finite")
    exact = [Fraction(str(w)) for w in weights]
    total = sum(exact)
    return [w / total for w in exact]


def period(weights: Sequence[float]) -> np.ndarray:
    """The source of each position of one period of the schedule ([Q] of source indices)."""
    exact = fractions(weights)
    q = math.lcm(*(w.denominator for w in exact))
    if q > MAX_PERIOD:
        raise DataError(f"mixture weights {list(weights)} repeat only every {q} samples: round them to fewer "
                        f"decimals (a period of at most {MAX_PERIOD})")
    share = [int(w * q) for w in exact]  # counts per period, integers summing to q
    counts = [0] * len(share)
    out = np.empty(q, dtype=np.int16)
    for g in range(q):  # deficit (scaled by q): share·(g+1) − q·count
        s = max(range(len(share)), key=lambda i: (share[i] * (g + 1) - q * counts[i], -i))
        counts[s] += 1
        out[g] = s
    return out


def lane_counts(cycle: np.ndarray, sources: int, lanes: int, n: int, offset: int = 0) -> np.ndarray:
    """[sources, lanes]: how many of `n` global samples from `offset` on, drawn by `cycle` from `offset`, each
    (source, lane) delivers (the pattern repeats every lcm(period, lanes) samples)."""
    q = len(cycle)
    whole = math.lcm(q, lanes)

    def table(k: int) -> np.ndarray:
        pos = np.arange(k)
        return np.bincount(cycle[pos % q].astype(np.int64) * lanes + (offset + pos) % lanes,
                           minlength=sources * lanes).reshape(sources, lanes)

    return (n // whole) * table(whole) + table(n % whole)


class Schedule:
    """The mixture's phases: from global sample `starts[k]` on, the deficit schedule of weights `k` (restarted there,
    so each phase is exact in its own prefixes); every source continues from its own position across a switch."""

    def __init__(self, phases: Sequence[tuple[int, Sequence[float]]]):
        self.starts = [int(start) for start, _ in phases]
        if self.starts[0] != 0 or any(b <= a for a, b in zip(self.starts, self.starts[1:])):
            raise DataError(f"mixture phases start at samples {self.starts}: the first at 0, each later than the last")
        self.cycles = [period(weights) for _, weights in phases]

    def source(self, g: np.ndarray) -> np.ndarray:
        """The source of each global sample in `g`."""
        k = np.searchsorted(self.starts, g, side="right") - 1
        out = np.empty(len(g), dtype=np.int64)
        for phase in np.unique(k):
            mask = k == phase
            cycle = self.cycles[phase]
            out[mask] = cycle[(g[mask] - self.starts[phase]) % len(cycle)]
        return out

    def counts(self, sources: int, lanes: int, g: int) -> np.ndarray:
        """[sources, lanes]: what each (source, lane) delivered before global sample `g`."""
        total = np.zeros((sources, lanes), dtype=np.int64)
        ends = [*self.starts[1:], None]
        for start, end, cycle in zip(self.starts, ends, self.cycles):
            if start >= g:
                break
            total += lane_counts(cycle, sources, lanes, (g if end is None else min(g, end)) - start, start)
        return total


class MixtureStream:
    """Iterable of LongTensor micro-batches [batch_size, block_len]: this dp rank's part of the mixture's global
    batches, from GLOBAL sample `start_sample` on (same contract as `ShardStream`, looping). Reads in this process
    (`num_workers` is not used for a mixture)."""

    def __init__(self, sources: Sequence[Source], split: str, batch_size: int, seed: int, start_sample: int = 0,
                 shuffle: bool = True, lanes: int = 1, dp_rank: int = 0, dp_size: int = 1,
                 global_batch: int | None = None, pin_memory: bool = False, on_corrupt: str = "error",
                 schedule: Sequence[tuple[int, Sequence[float]]] = ()):
        """`schedule`: later phases, (global sample where it begins, a weight per source) each."""
        if on_corrupt not in ON_CORRUPT:
            raise DataError(f"on_corrupt={on_corrupt!r}: use one of {', '.join(ON_CORRUPT)}")
        _check_layout(lanes, dp_rank, dp_size, batch_size, global_batch, start_sample)
        self.sources = list(sources)
        self.schedule = Schedule([(0, [s.weight for s in self.sources]), *schedule])
        manifests = [read_manifest(s.path) for s in self.sources]
        check_sources(self.sources, manifests)
        self.manifest = manifests[0]
        for source, m in zip(self.sources, manifests):
            check_nonempty(source, m, split)
            check_files(source.path, m, split)
        self._plans = [_Plan(s.path, m, split, seed, shuffle, True, lanes) for s, m in zip(self.sources, manifests)]
        for source, plan in zip(self.sources, self._plans):
            if lanes > plan.nonempty:
                raise DataError(f"data.lanes={lanes} exceeds the {plan.nonempty} non-empty {split} shards of source "
                                f"{source.name!r} ({source.path}): every source is read through all lanes; set "
                                f"data.lanes <= {plan.nonempty} or rebuild that source with more, smaller shards")
        self.split, self.batch_size, self.start_sample = split, batch_size, start_sample
        self.lanes, self.dp_rank, self.dp_size = lanes, dp_rank, dp_size
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.on_corrupt = on_corrupt
        self.corrupt_shards, self.corrupt_names, self.shards_read = 0, [], 0

    @property
    def block_len(self) -> int:
        return self.manifest.block_len

    def counts(self, g: int) -> np.ndarray:
        """[sources]: samples each source delivered before global sample `g`."""
        return self.schedule.counts(len(self.sources), self.lanes, g).sum(axis=1)

    @property
    def epoch_samples(self) -> np.ndarray:
        """[sources]: the samples of each source's split (one epoch)."""
        return np.array([plan.epoch_samples for plan in self._plans], dtype=float)

    def __iter__(self) -> Iterator[torch.Tensor]:
        S, L, dp, bs = len(self.sources), self.lanes, self.dp_size, self.batch_size
        lanes = list(range(self.dp_rank, L, dp))
        start = self.schedule.counts(S, L, self.start_sample)
        visits = {(s, lane): self._plans[s].lane_visits(lane, int(start[s, lane])) for s in range(S) for lane in lanes}
        buffers: dict[tuple[int, int], deque] = {key: deque() for key in visits}

        def take(key: tuple[int, int], n: int) -> np.ndarray:
            parts, buf = [], buffers[key]
            while n:
                while not buf:
                    chunk, replaced = self._plans[key[0]].read(next(visits[key]), self.on_corrupt)
                    self.shards_read += 1
                    if replaced is not None:
                        self.corrupt_shards += 1
                        self.corrupt_names.append(replaced[0])
                        log.warning("shard skipped (on_corrupt=skip; replaced by samples of another shard; %d skipped "
                                    "so far): %s", self.corrupt_shards, replaced[1])  # (names it)
                    if len(chunk):
                        buf.append(chunk)
                k = min(n, len(buf[0]))
                parts.append(buf[0][:k])
                if k == len(buf[0]):
                    buf.popleft()
                else:
                    buf[0] = buf[0][k:]
                n -= k
            return parts[0] if len(parts) == 1 else np.concatenate(parts)

        # Micro-batches are filled WINDOW at a time: one take per (source, lane) per window, not per micro-batch.
        window = max(1, WINDOW_SAMPLES // bs)
        g = self.start_sample + self.dp_rank + np.arange(window * bs) * dp  # this rank's next samples, global indices
        while True:
            out = torch.empty((window * bs, self.block_len), dtype=torch.int64, pin_memory=self.pin_memory)
            view = out.numpy()
            key_of = self.schedule.source(g) * L + g % L
            order = np.argsort(key_of, kind="stable")  # each key's samples in g order
            keys = key_of[order]
            bounds = np.flatnonzero(np.diff(keys)) + 1
            for rows in np.split(order, bounds):
                key = int(key_of[rows[0]])
                view[rows] = take((key // L, key % L), len(rows))
            g = g + window * bs * dp
            yield from out.split(bs)


def check_nonempty(source: Source, manifest, split: str) -> None:
    """A source with samples in `split` (one-line DataError naming it)."""
    if not manifest.num_samples(split):
        raise DataError(f"source {source.name!r} ({source.path}) has no {split} samples: build its {split} split "
                        "(hpctrain prep shards) or take it out of data.sources")


def check_sources(sources: Sequence[Source], manifests) -> None:
    """Sources that can be mixed: distinct names, one tokenizer, one block length (one-line DataError)."""
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise DataError(f"data.sources names {names} repeat: give each source its own name")
    first, ref = sources[0], manifests[0]
    for source, m in zip(sources[1:], manifests[1:]):
        if m.tokenizer.sha256 != ref.tokenizer.sha256:
            raise DataError(f"source {source.name!r} ({source.path}) was tokenised with another tokenizer than "
                            f"{first.name!r} (sha256 {m.tokenizer.sha256[:12]} vs {ref.tokenizer.sha256[:12]}): "
                            "build every source's shards with the same tokenizer (prep shards --tokenizer DIR)")
        if m.block_len != ref.block_len:
            raise DataError(f"source {source.name!r} holds {m.block_len}-token blocks, {first.name!r} "
                            f"{ref.block_len}: build every source with the same --seq-len")
