"""ShardStream: elastic determinism (dp size, workers), exact mid-epoch resume, corrupt shards, layout rules.

Real shards on disk (the stdlib demo corpus at a small size), checked against an oracle written from the
documented definition of the global sample sequence.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shutil
import tarfile

import numpy as np
import pytest
import torch
from helpers import WarningLines, edit_tokens

from data_prep.demo import build_demo
from hpctrain.core.shard_format import (
    DataError,
    read_manifest,
    sha256_file,
)
from hpctrain.data import loader as data_mod
from hpctrain.data.loader import (
    ShardStream,
    choose_lanes,
    interleave_ranks,
    read_shard,
    read_shard_wds,
    sample_order,
    shard_order,
)

LANES = 4
SEED = 11


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """~23 train shards of 48 blocks and a short last one: 4 lanes get unequal sample counts."""
    out = str(tmp_path_factory.mktemp("loader"))
    build_demo(out, max_bytes=150_000, vocab_size=512, seq_len=64, shard_mb=0.05)
    return out


def oracle(data_dir: str, n: int, lanes: int = LANES, seed: int = SEED, shuffle: bool = True,
           loop: bool = True) -> np.ndarray:
    """The first n global samples, straight from the definition in hpctrain/data/loader.py's docstring."""
    m = read_manifest(data_dir)
    shards = m.splits["train"]
    blocks = [read_shard_wds(os.path.join(data_dir, s.name), s, m) for s in shards]
    lane_seqs = []
    for lane in range(lanes):
        parts, have, epoch = [], 0, 0
        while have <= n // lanes and (loop or epoch == 0):
            order = [i for i in shard_order(len(shards), seed, epoch, shuffle) if shards[i].samples]
            for i in order[lane::lanes]:
                parts.append(blocks[i][sample_order(len(blocks[i]), seed, epoch, i, shuffle)])
                have += len(parts[-1])
            epoch += 1
        lane_seqs.append(np.concatenate(parts))
    if not loop:
        n = min(n, min(len(s) * lanes + lane for lane, s in enumerate(lane_seqs)))
    out = np.empty((n, m.block_len), dtype=np.int64)
    for lane in range(lanes):
        out[lane::lanes] = lane_seqs[lane][: len(range(lane, n, lanes))]
    return out


def take(stream: ShardStream, n: int) -> list[torch.Tensor]:
    it = iter(stream)
    try:
        return [next(it) for _ in range(n)]
    finally:
        it.close()  # shuts the DataLoader workers down now


def global_batches(data_dir: str, steps: int, dp: int, workers: int = 0, start_step: int = 0,
                   global_batch: int = 16, micro: int = 2, **kw) -> torch.Tensor:
    """Global batches start_step .. start_step+steps-1 as trained at this dp: [steps * global_batch, T]."""
    accum = global_batch // (dp * micro)
    per_rank = []
    for rank in range(dp):
        stream = ShardStream(data_dir, "train", micro, SEED, start_sample=start_step * global_batch,
                             num_workers=workers, lanes=LANES,
                             dp_rank=rank, dp_size=dp, global_batch=global_batch, **kw)
        per_rank.append(take(stream, steps * accum))
    out = []
    for s in range(steps):
        out.append(interleave_ranks([torch.cat(b[s * accum:(s + 1) * accum]) for b in per_rank]))
    return torch.cat(out)


def one_line(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.strip() == msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


def test_fixture_exercises_uneven_lanes(shards):
    counts = [s.samples for s in read_manifest(shards).splits["train"]]
    assert len(counts) >= 2 * LANES and len(set(counts)) > 1


def test_global_batches_independent_of_dp_and_workers(shards):
    epoch = read_manifest(shards).num_samples("train")
    steps = epoch // 16 + 6  # every lane crosses into its second epoch
    ref = torch.from_numpy(oracle(shards, steps * 16))
    for dp in (1, 2, 4):
        for workers in (0, 1, 2):
            got = global_batches(shards, steps, dp, workers)
            assert torch.equal(got, ref), (dp, workers)


def test_local_batches_are_the_ranks_lanes(shards):
    """Rank r of dp gets exactly the global samples g % dp == r, and reads only its lanes' shards."""
    ref = torch.from_numpy(oracle(shards, 64))
    for dp in (2, 4):
        for rank in range(dp):
            s = ShardStream(shards, "train", 4, SEED, lanes=LANES, dp_rank=rank, dp_size=dp)
            assert s.my_lanes == list(range(rank, LANES, dp))
            assert torch.equal(torch.cat(take(s, 64 // (4 * dp))), ref[rank::dp])


@pytest.mark.parametrize("save_dp,resume_dp,workers", [(2, 2, 0), (2, 4, 0), (2, 1, 0), (2, 4, 2), (4, 1, 1)])
def test_resume_equals_uninterrupted(shards, save_dp, resume_dp, workers):
    epoch = read_manifest(shards).num_samples("train")
    total = epoch // 16 + 4
    ref = global_batches(shards, total, save_dp)
    assert torch.equal(ref, torch.from_numpy(oracle(shards, total * 16)))
    for k in (1, 3, epoch // 16 - 1, epoch // 16 + 1):  # mid-shard, near and past the epoch boundary
        got = global_batches(shards, total - k, resume_dp, workers, start_step=k)
        assert torch.equal(got, ref[k * 16:]), k


def test_resume_reads_only_the_partial_shard_of_each_lane(shards, monkeypatch):
    reads = []
    real = data_mod.read_shard
    monkeypatch.setattr(data_mod, "read_shard",
                        lambda url, *a: reads.append(os.path.relpath(url, shards)) or real(url, *a))
    m = read_manifest(shards)
    train = m.splits["train"]
    start = (m.num_samples("train") // 16 + 5) * 16  # second epoch (a step boundary), inside a shard
    plan = ShardStream(shards, "train", 2, SEED, lanes=LANES)._plan
    expected = {}
    for lane in range(LANES):
        pos = plan.lane_start(lane, start)
        epoch = 0
        while pos >= plan.lane_samples(lane, epoch):
            pos -= plan.lane_samples(lane, epoch)
            epoch += 1
        for i in plan.dealt(epoch)[lane]:
            if pos < train[i].samples:
                assert pos > 0  # really mid-shard
                expected[lane] = train[i].name
                break
            pos -= train[i].samples
    ref = torch.from_numpy(oracle(shards, start + 64))
    for dp in (1, 2, 4):
        for rank in range(dp):
            reads.clear()
            s = ShardStream(shards, "train", 16 // dp, SEED, start_sample=start, lanes=LANES, dp_rank=rank,
                            dp_size=dp)
            [batch] = take(s, 1)  # 4 samples per lane: no lane leaves its partial shard
            assert torch.equal(batch, ref[start + rank:start + 16:dp])
            assert sorted(reads) == sorted(expected[lane] for lane in s.my_lanes), (dp, rank)
            assert s.shards_read == len(s.my_lanes)


def test_non_looping_stream_same_length_on_every_rank(shards):
    ref = torch.from_numpy(oracle(shards, 10**9, loop=False))
    for dp in (1, 2, 4):
        streams = [ShardStream(shards, "train", 4, SEED, loop=False, lanes=LANES, dp_rank=r, dp_size=dp)
                   for r in range(dp)]
        lens = {len(s) for s in streams}
        assert lens == {len(ref) // (4 * dp)}
        parts = [torch.cat(list(s)) for s in streams]
        assert {len(p) for p in parts} == {lens.pop() * 4}
        n = len(parts[0]) * dp
        assert torch.equal(interleave_ranks(parts), ref[:n])


def _corrupt_copy(src: str, dst: str, index: int = 3) -> tuple[str, str]:
    shutil.copytree(src, dst)
    name = read_manifest(dst).splits["train"][index].name
    with open(os.path.join(dst, name), "r+b") as f:
        f.truncate(5000)
    return dst, name


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_shard_is_an_error_naming_it(shards, tmp_path, workers):
    bad, name = _corrupt_copy(shards, str(tmp_path / "bad"))
    s = ShardStream(bad, "train", 8, SEED, lanes=LANES, num_workers=workers)
    with pytest.raises(DataError) as e:
        take(s, 10**6)
    assert "worker" not in one_line(e, name, "rebuild or re-copy")


def test_corrupt_shard_skipped_counted_and_resumable(shards, tmp_path):
    bad, name = _corrupt_copy(shards, str(tmp_path / "bad"))
    epoch = read_manifest(bad).num_samples("train")
    steps = epoch // 16 + 2
    records = WarningLines()
    logging.getLogger("hpctrain.data.loader").addHandler(records)
    try:
        s = ShardStream(bad, "train", 16, SEED, lanes=LANES, on_corrupt="skip", num_workers=2)
        run = take(s, steps)
    finally:
        logging.getLogger("hpctrain.data.loader").removeHandler(records)
    assert s.corrupt_shards >= 1 and set(s.corrupt_names) == {name}  # counted in the main process
    assert len(records.messages) == s.corrupt_shards
    assert all(name in m and "skipped" in m for m in records.messages)
    assert {tuple(b.shape) for b in run} == {(16, 65)}
    good = torch.from_numpy(oracle(shards, steps * 16))
    got = torch.cat(run)
    assert not torch.equal(got, good)  # the bad shard's samples were replaced
    m = read_manifest(shards)
    bad_rows = {bytes(r) for r in read_shard(os.path.join(shards, name), m.splits["train"][3], m).astype(int)}
    assert not bad_rows & {bytes(r) for r in got.numpy()}
    for k in (2, steps // 2):  # resume (at another dp) reproduces the skipping run exactly
        resumed = global_batches(bad, steps - k, 2, start_step=k, on_corrupt="skip")
        assert torch.equal(resumed, got[k * 16:]), k


def _skip_run(data_dir: str, steps: int) -> tuple[ShardStream, list[torch.Tensor], list[str]]:
    records = WarningLines()
    logging.getLogger("hpctrain.data.loader").addHandler(records)
    try:
        s = ShardStream(data_dir, "train", 16, SEED, lanes=LANES, on_corrupt="skip")
        return s, take(s, steps), records.messages
    finally:
        logging.getLogger("hpctrain.data.loader").removeHandler(records)


def test_altered_tokens_fail_the_checksum(shards, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(shards, bad)
    m = read_manifest(bad)
    info = m.splits["train"][3]
    path = edit_tokens(bad, 3, lambda i, t: (t + 1) % m.vocab_size)  # every token, same size
    assert os.path.getsize(path) == info.bytes
    with pytest.raises(DataError) as e:
        read_shard(path, info, m)
    one_line(e, path, "checksum mismatch", "rebuild or re-copy", "on_corrupt=skip")
    with open(path, "rb") as f:
        assert data_mod._parse_tar(f.read(), m, info) is not None  # valid tar: only the checksum catches it
    for workers in (0, 2):
        with pytest.raises(DataError) as e:
            take(ShardStream(bad, "train", 8, SEED, lanes=LANES, num_workers=workers), 10**6)
        assert "worker" not in one_line(e, info.name, "checksum mismatch")
    # documented limit: pipe: URLs stream through webdataset unhashed
    altered = read_shard(f"pipe:cat {path}", info, m)
    assert np.array_equal(altered, (read_shard_wds(os.path.join(shards, info.name), info, m) + 1) % m.vocab_size)

    steps = m.num_samples("train") // 16 + 2
    s, run, messages = _skip_run(bad, steps)
    assert s.corrupt_shards >= 1 and set(s.corrupt_names) == {info.name}
    assert len(messages) == s.corrupt_shards and all(info.name in x and "checksum" in x for x in messages)
    assert {tuple(b.shape) for b in run} == {(16, m.block_len)}
    assert not {bytes(r) for r in altered.astype(np.int64)} & {bytes(r) for r in torch.cat(run).numpy()}


def test_token_id_beyond_vocab_names_shard_and_sample(shards, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(shards, bad)
    m = read_manifest(bad)
    wrong = m.vocab_size + 3

    def poke(i, tokens):
        if i == 5:
            tokens[7] = wrong
        return tokens

    path = edit_tokens(bad, 2, poke, fix_sha256=True)  # checksum matches: only the range check catches it
    m = read_manifest(bad)
    info = m.splits["train"][2]
    with tarfile.open(path) as tf:
        key = tf.getnames()[5].split(".")[0]
    for url in (path, f"pipe:cat {path}"):
        with pytest.raises(DataError) as e:
            read_shard(url, info, m)
        one_line(e, url, "sample 5", key, f"token id {wrong}", f"vocab_size {m.vocab_size}", "rebuild")
    with pytest.raises(DataError) as e:
        take(ShardStream(bad, "train", 8, SEED, lanes=LANES), 10**6)
    one_line(e, info.name, "sample 5")
    s, run, messages = _skip_run(bad, m.num_samples("train") // 16 + 2)
    assert set(s.corrupt_names) == {info.name} and all("sample 5" in x for x in messages)
    assert int(torch.cat(run).max()) < m.vocab_size


def test_layout_rules_are_one_line_errors(shards):
    n = len(read_manifest(shards).splits["train"])
    cases = [
        (dict(lanes=3, dp_size=2), ("lanes=3", "dp=2", "multiple of 2")),
        (dict(lanes=n + 1), (f"lanes={n + 1}", f"{n} non-empty", f"<= {n}")),
        (dict(lanes=4, dp_size=2, start_sample=7), ("start_sample=7", "dp=2")),
        (dict(lanes=4, dp_size=2, global_batch=12), ("global_batch=12", "2 x 4")),
        (dict(lanes=4, dp_size=2, global_batch=16, start_sample=8), ("start_sample=8", "global_batch=16")),
        (dict(lanes=4, dp_rank=2, dp_size=2), ("dp_rank=2", "dp_size=2")),
        (dict(on_corrupt="ignore"), ("on_corrupt='ignore'", "skip")),
    ]
    for kw, needles in cases:
        with pytest.raises(DataError) as e:
            ShardStream(shards, "train", 4, SEED, **kw)
        one_line(e, *needles)


def test_choose_lanes(shards):
    m = read_manifest(shards)
    n = len(m.splits["train"])
    assert [choose_lanes(None, dp, m) for dp in (1, 2, 3, 4, 8)] == [8, 8, 6, 8, 8]
    assert choose_lanes(4, 2, m) == 4  # explicit: validated by ShardStream
    with pytest.raises(DataError) as e:
        choose_lanes(None, n + 1, m)
    one_line(e, f"dp={n + 1}", f"has {n}")


def test_fast_tar_path_matches_webdataset_and_falls_back(shards, tmp_path):
    m = read_manifest(shards)
    for s in m.splits["train"] + m.splits["val"]:
        path = os.path.join(shards, s.name)
        with open(path, "rb") as f:
            fast = data_mod._parse_tar(f.read(), m, s)
        assert fast is not None and fast.dtype == m.dtype
        np.testing.assert_array_equal(fast, read_shard_wds(path, s, m))
    # a non-canonical but valid shard (an extra member per sample, GNU format): webdataset reads it
    s = m.splits["train"][0]
    blocks = read_shard(os.path.join(shards, s.name), s, m)
    other = str(tmp_path / "other.tar")
    with tarfile.open(os.path.join(shards, s.name)) as src, \
            tarfile.open(other, "w", format=tarfile.GNU_FORMAT) as dst:
        for member in src:
            dst.addfile(member, src.extractfile(member))
            extra = tarfile.TarInfo(member.name.replace(".tokens", ".json"))
            extra.size = 2
            dst.addfile(extra, io.BytesIO(b"{}"))
    with open(other, "rb") as f:
        assert data_mod._parse_tar(f.read(), m, s) is None
    with pytest.raises(DataError) as e:  # other bytes than the manifest's sha256
        read_shard(other, s, m)
    one_line(e, other, "checksum mismatch")
    s = dataclasses.replace(s, sha256=sha256_file(other), bytes=os.path.getsize(other))
    np.testing.assert_array_equal(read_shard(other, s, m), blocks)
    np.testing.assert_array_equal(read_shard(f"pipe:cat {other}", s, m), blocks)


def test_pin_memory_flag_is_harmless_without_cuda(shards):
    [a] = take(ShardStream(shards, "train", 4, SEED, lanes=LANES, pin_memory=True), 1)
    [b] = take(ShardStream(shards, "train", 4, SEED, lanes=LANES), 1)
    assert torch.equal(a, b) and a.dtype == torch.int64 and a.is_pinned() == torch.cuda.is_available()


def test_bench_data_smoke(shards, capsys):
    from hpctrain.tools import bench_data

    doc = bench_data.main(["--data", shards, "--samples", "800", "--repeats", "1", "--train-steps", "0"])
    rates = doc["loader_tokens_per_s"]
    assert len(rates) >= 6 and all(v > 0 for v in rates.values())
    assert "M tokens/s" in capsys.readouterr().out
