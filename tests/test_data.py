"""Corpus -> tokenizer -> WebDataset token shards -> ShardStream, on real files in tmp dirs."""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from conftest import DEMO_KW
from helpers import one_line

from data_prep import demo as demo_mod
from data_prep.demo import build_demo
from data_prep.shards import build_from_files, read_text, split_names, write_shards
from data_prep.tokenizer import load_tokenizer, train_tokenizer
from hpctrain.core.shard_format import (
    MANIFEST_NAME,
    DataError,
    decode_tokens,
    encode_tokens,
    read_manifest,
    sha256_file,
    token_dtype,
)
from hpctrain.data import loader as data_mod
from hpctrain.data.loader import ShardStream, check_compat, read_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega",
         "def", "return", "class", "import", "tensor", "shard", "token", "batch", "epoch", "ünïcödé", "数据", "λ"]


def _doc(i: int) -> str:
    rng = random.Random(i)
    lines = [f"@@doc-{i:04d}@@"]
    for _ in range(rng.randint(5, 40)):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    files = []
    for i in range(60):
        path = root / f"doc{i:03d}.txt"
        path.write_text(_doc(i), encoding="utf-8")
        files.append(str(path))
    return files


@pytest.fixture(scope="session")
def tiny(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    build_from_files(corpus, out, seq_len=16, vocab_size=300, val_fraction=0.1, shard_mb=0.1)
    return out


def _tiny_split(corpus) -> dict[str, list[str]]:
    """The hold-out build_from_files chose for the `tiny` set (by file name, weighted by bytes)."""
    return split_names([os.path.basename(f) for f in corpus], 0.1,
                       {os.path.basename(f): os.path.getsize(f) for f in corpus})


def _take(stream: ShardStream, n_batches: int) -> torch.Tensor:
    out = []
    for batch in stream:
        out.append(batch)
        if len(out) == n_batches:
            break
    return torch.cat(out) if out else torch.empty(0, stream.block_len, dtype=torch.long)


def _tree_hashes(root: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), root): sha256_file(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


# --------------------------------------------------------------------------- format + tokenizer


def test_token_codec_dtypes():
    assert token_dtype(512) == "uint16" and token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"
    for dtype, top in (("uint16", 65535), ("uint32", 2**32 - 1)):
        tokens = np.array([0, 1, 258, top], dtype=dtype)
        data = encode_tokens(tokens, dtype)
        assert data[:4] == np.array([0, 1], dtype=np.dtype(dtype).newbyteorder("<")).tobytes()[:4]
        np.testing.assert_array_equal(decode_tokens(data, dtype), tokens)


def test_tokenizer_trains_and_round_trips(corpus, tmp_path):
    path = train_tokenizer(corpus, 300, str(tmp_path / "tok"))
    assert path == str(tmp_path / "tok" / "tokenizer.json")
    tok = load_tokenizer(path)
    assert tok.vocab_size == 300 and tok.eos_id == tok.core.token_to_id("<|endoftext|>") == 0
    for text in (_doc(3), "  leading spaces\n\ttabs ünïcödé 数据 🙂 never-seen-bytes \x00", ""):
        assert tok.decode(tok.encode(text)) == text
    [a, b] = tok.encode_batch(["tensor shard token", "epoch seed"])
    assert a == tok.encode("tensor shard token") and b == tok.encode("epoch seed")
    assert len(tok.encode("tensor shard token batch")) < len("tensor shard token batch")  # merges learnt
    # deterministic training; loading the directory goes through transformers (HF tokenizer dir)
    path2 = train_tokenizer(corpus, 300, str(tmp_path / "tok2"))
    assert sha256_file(path) == sha256_file(path2)
    hf = load_tokenizer(str(tmp_path / "tok"))
    assert hf.eos_id == 0 and hf.encode(_doc(5)) == tok.encode(_doc(5))
    from transformers import PreTrainedTokenizerFast  # a directory written by transformers itself

    PreTrainedTokenizerFast(tokenizer_object=tok.core, eos_token="<|endoftext|>").save_pretrained(tmp_path / "hf")
    assert load_tokenizer(str(tmp_path / "hf")).encode(_doc(6)) == tok.encode(_doc(6))
    with pytest.raises(DataError) as e:
        load_tokenizer(str(tmp_path / "nope.json"))
    one_line(e, "nope.json")


# --------------------------------------------------------------------------- writer


def test_manifest_matches_tar_contents(demo_data):
    m = read_manifest(demo_data)
    assert m.block_len == 65 and m.dtype == "uint16" and m.vocab_size == 512 and m.eos_id == 0
    assert len(m.splits["train"]) >= 3 and len(m.splits["val"]) >= 1
    assert sha256_file(os.path.join(demo_data, m.tokenizer.path)) == m.tokenizer.sha256
    assert sorted(os.listdir(demo_data)) == sorted(
        [MANIFEST_NAME, "tokenizer", ".build", ".hpctrain-demo"] + [s.name for v in m.splits.values() for s in v])
    for split, shards in m.splits.items():
        key = 0
        for i, shard in enumerate(shards):  # the demo is one work unit per split
            path = os.path.join(demo_data, shard.name)
            assert shard.name == f"{split}-000000-{i:04d}.tar"
            assert (os.path.getsize(path), sha256_file(path)) == (shard.bytes, shard.sha256)
            with tarfile.open(path) as tf:
                members = tf.getmembers()
                assert [x.name for x in members] == [f"000000-{k:010d}.tokens" for k in range(key, key + len(members))]
                assert {(x.size, x.mtime, x.mode, x.uid, x.uname) for x in members} == {(130, 0, 0o444, 0, "hpctrain")}
                tokens = decode_tokens(tf.extractfile(members[0]).read(), m.dtype)
                assert tokens.max() < m.vocab_size
            assert len(members) == shard.samples and shard.tokens == shard.samples * m.block_len
            key += len(members)


def test_blocks_are_documents_joined_by_eos(corpus, tiny):
    """The unshuffled train stream is exactly: train docs in order, each + EOS, cut into blocks."""
    m = read_manifest(tiny)
    tok = load_tokenizer(os.path.join(tiny, m.tokenizer.path))
    names = {os.path.basename(f): f for f in corpus}
    train = _tiny_split(corpus)["train"]
    expected = []
    for name in train:
        with open(names[name], encoding="utf-8") as f:
            expected += tok.encode(f.read()) + [m.eos_id]
    got = _take(ShardStream(tiny, "train", 1, seed=0, loop=False, shuffle=False), 10**9)
    n = len(expected) // m.block_len
    assert got.shape == (n, m.block_len) == (m.num_samples("train"), 17)
    assert got.flatten().tolist() == expected[: n * m.block_len]
    assert (got == m.eos_id).sum() >= len(train) - 1  # at most the dropped tail loses an EOS


def test_val_documents_disjoint_from_train(corpus, tiny):
    names = [os.path.basename(f) for f in corpus]
    split = _tiny_split(corpus)
    assert set(split_names(list(reversed(names)), 0.1)["val"]) == set(split_names(names, 0.1)["val"])
    assert len(split_names(names, 0.1)["val"]) == 6
    assert split["val"] and set(split["val"]).isdisjoint(split["train"])
    assert sorted(split["val"] + split["train"]) == sorted(names)
    assert split_names(["only-a", "only-b"], 0.001)["val"]  # at least one val document
    m = read_manifest(tiny)
    tok = load_tokenizer(os.path.join(tiny, m.tokenizer.path))
    text = {s: tok.decode(_take(ShardStream(tiny, s, 1, 0, loop=False, shuffle=False), 10**9).flatten().tolist())
            for s in ("train", "val")}
    val_ids = {int(n[3:6]) for n in split["val"]}
    for i in range(len(names)):
        marker = f"@@doc-{i:04d}@@"
        assert marker not in text["train" if i in val_ids else "val"]
    assert any(f"@@doc-{i:04d}@@" in text["val"] for i in val_ids)


def test_rebuild_is_byte_identical(demo_data, tmp_path):
    other = str(tmp_path / "again")
    build_demo(other, **DEMO_KW)
    assert _tree_hashes(other) == _tree_hashes(demo_data)


def test_cached_build_does_no_work(demo_data, tmp_path, monkeypatch, capsys):
    before = {p: os.stat(os.path.join(demo_data, p)).st_mtime_ns for p in _tree_hashes(demo_data)}

    def boom(*a, **k):
        raise AssertionError("cached build must not rebuild")

    monkeypatch.setattr(demo_mod, "build_from_files", boom)
    monkeypatch.setattr(demo_mod, "stdlib_files", boom)
    assert build_demo(demo_data, **DEMO_KW) == read_manifest(demo_data)
    assert capsys.readouterr().out.startswith("demo data: cached")
    assert {p: os.stat(os.path.join(demo_data, p)).st_mtime_ns for p in before} == before
    monkeypatch.undo()
    # other settings -> rebuilt in place
    copy = str(tmp_path / "copy")
    shutil.copytree(demo_data, copy)
    m = build_demo(copy, **{**DEMO_KW, "seq_len": 32})
    assert m.block_len == 33 and read_manifest(copy).block_len == 33
    assert "built" in capsys.readouterr().out


def test_demo_cli_cached(demo_data):
    args = [f"--{k.replace('_', '-')}={v}" for k, v in DEMO_KW.items()]
    r = subprocess.run([sys.executable, "-m", "data_prep.demo", "--out", demo_data, *args],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("demo data: cached") and len(r.stdout.splitlines()) == 1


def test_interrupted_write_not_picked_up_and_rerun_completes(corpus, tiny, tmp_path):
    out = str(tmp_path / "interrupted")
    tok = load_tokenizer(os.path.join(tiny, "tokenizer", "tokenizer.json"))
    texts = [read_text(f) for f in corpus]

    def dying_docs():
        yield from texts[:40]
        raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        write_shards({"train": dying_docs(), "val": texts[40:]}, tok, out, seq_len=16, shard_mb=0.05,
                     batch_chars=2000)
    left = os.listdir(out)
    assert MANIFEST_NAME not in left and not any(n.endswith(".tmp") for n in left)
    assert any(n.endswith(".tar") for n in left)  # some shards completed before the interrupt
    # what a hard kill (no Python cleanup) leaves: a half-written .tar.tmp; plus a stale shard of an older build
    with open(os.path.join(out, "train-000007.tar.tmp"), "wb") as f:
        f.write(b"\0" * 700)
    open(os.path.join(out, "train-000999.tar"), "wb").close()
    with pytest.raises(DataError) as e:
        ShardStream(out, "train", 4, seed=0)
    one_line(e, out, "make demo-data")
    m = write_shards({"train": texts[:40], "val": texts[40:]}, tok, out, seq_len=16, shard_mb=0.05)
    assert sorted(n for n in os.listdir(out) if n.endswith((".tar", ".tmp"))) == sorted(
        s.name for v in m.splits.values() for s in v)
    assert len(_take(ShardStream(out, "train", 4, seed=0, loop=False), 10**9)) == m.num_samples("train") // 4 * 4
    with pytest.raises(DataError) as e:  # a complete set is never overwritten silently
        write_shards({"train": texts}, tok, out, seq_len=16)
    one_line(e, out, "overwrite")


# --------------------------------------------------------------------------- loader


def test_stream_deterministic_and_seeded(demo_data):
    a = _take(ShardStream(demo_data, "train", 8, seed=1), 40)
    b = _take(ShardStream(demo_data, "train", 8, seed=1), 40)
    c = _take(ShardStream(demo_data, "train", 8, seed=2), 40)
    assert a.dtype == torch.int64 and a.shape == (320, 65)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_epoch_visits_every_sample_once(demo_data):
    n = ShardStream(demo_data, "train", 1, seed=0).samples_per_epoch
    plain = _take(ShardStream(demo_data, "train", 1, seed=0, loop=False, shuffle=False), 10**9)
    assert len(plain) == n == read_manifest(demo_data).num_samples("train")
    for seed in (0, 5):
        epochs = _take(ShardStream(demo_data, "train", 1, seed=seed), 2 * n)
        e0, e1 = epochs[:n], epochs[n:]
        assert not torch.equal(e0, plain) and not torch.equal(e0, e1)
        for e in (e0, e1):
            assert collections.Counter(map(bytes, e.numpy())) == collections.Counter(map(bytes, plain.numpy()))


def test_resume_equals_uninterrupted_tail(demo_data, monkeypatch):
    bs = 16
    stream = ShardStream(demo_data, "train", bs, seed=3)
    n = stream.samples_per_epoch
    total = (n // bs) * 2 + 5  # crosses the first epoch boundary and more
    ref = _take(stream, total)
    shard0 = read_manifest(demo_data).splits["train"][0].samples
    for k in sorted({1, shard0 // bs, shard0 // bs + 1, n // bs - 1, n // bs, n // bs + 1, total - 3}):
        got = _take(ShardStream(demo_data, "train", bs, seed=3, start_sample=k * bs), total - k)
        assert torch.equal(got, ref[k * bs:]), k
    # a start inside a batch shifts the sample sequence, and whole shards before it are never read
    reads = []
    real_read = data_mod.read_shard
    monkeypatch.setattr(data_mod, "read_shard", lambda url, *a: reads.append(url) or real_read(url, *a))
    start = n + 2 * shard0 + 5  # second epoch, third visited shard
    got = _take(ShardStream(demo_data, "train", 1, seed=3, start_sample=start), 10)
    assert torch.equal(got, ref[start: start + 10])
    assert len(reads) == 1


@pytest.mark.parametrize("split,loop,shuffle,start", [("train", True, True, 0), ("train", True, True, 1000),
                                                      ("val", False, False, 0), ("train", False, True, 24)])
def test_num_workers_do_not_change_the_sequence(demo_data, split, loop, shuffle, start):
    n = ShardStream(demo_data, split, 1, seed=0).samples_per_epoch
    batches = (2 * n) // 8 if loop else 10**9
    seqs = [_take(ShardStream(demo_data, split, 8, seed=7, start_sample=start, loop=loop, shuffle=shuffle,
                              num_workers=w), batches) for w in (0, 1, 2)]
    assert len(seqs[0]) > 0
    assert torch.equal(seqs[0], seqs[1]) and torch.equal(seqs[0], seqs[2])


def test_non_looping_stream_stops(demo_data):
    plain = _take(ShardStream(demo_data, "val", 1, seed=0, loop=False, shuffle=False), 10**9)
    n = len(plain)
    bs = 7 if n % 7 else 6
    stream = ShardStream(demo_data, "val", bs, seed=0, loop=False, shuffle=False)
    batches = list(stream)
    assert len(batches) == len(stream) == n // bs and n % bs  # the final partial batch is dropped
    assert all(b.shape == (bs, 65) for b in batches)
    assert torch.equal(torch.cat(batches), plain[: n // bs * bs])
    assert torch.equal(torch.cat(list(stream)), torch.cat(batches))  # re-iterable
    assert list(ShardStream(demo_data, "val", bs, seed=0, loop=False, start_sample=n)) == []


def test_pipe_url_reads_same_samples(demo_data):
    m = read_manifest(demo_data)
    shard = m.splits["train"][1]
    path = os.path.join(demo_data, shard.name)
    np.testing.assert_array_equal(read_shard(f"pipe:cat {path}", shard, m), read_shard(path, shard, m))


def _edited_copy(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, MANIFEST_NAME)) as f:
        raw = json.load(f)
    edit(raw)
    with open(os.path.join(dst, MANIFEST_NAME), "w") as f:
        json.dump(raw, f)
    return dst


def test_bad_input_gives_one_line_data_errors(demo_data, tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(DataError) as e:
        ShardStream(missing, "train", 4, seed=0)
    one_line(e, missing, "make demo-data")

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as e:
        ShardStream(str(empty), "train", 4, seed=0)
    one_line(e, str(empty), "manifest.json")

    (empty / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(DataError) as e:
        ShardStream(str(empty), "train", 4, seed=0)
    one_line(e, str(empty / MANIFEST_NAME))

    old = _edited_copy(demo_data, str(tmp_path / "old"), lambda r: r.update(format_version=0))
    with pytest.raises(DataError) as e:
        ShardStream(old, "train", 4, seed=0)
    one_line(e, old, "version")

    nokeys = _edited_copy(demo_data, str(tmp_path / "nokeys"), lambda r: r.pop("splits"))
    with pytest.raises(DataError) as e:
        ShardStream(nokeys, "train", 4, seed=0)
    one_line(e, nokeys, "invalid")

    names = [s.name for s in read_manifest(demo_data).splits["train"]]  # relative paths inside the set
    gone = str(tmp_path / "gone")
    shutil.copytree(demo_data, gone)
    os.remove(os.path.join(gone, names[1]))
    with pytest.raises(DataError) as e:
        ShardStream(gone, "train", 4, seed=0)
    one_line(e, names[1], "missing")

    noval = _edited_copy(demo_data, str(tmp_path / "noval"), lambda r: r["splits"].update(val=[]))
    with pytest.raises(DataError) as e:
        ShardStream(noval, "val", 4, seed=0, loop=False)
    one_line(e, "'val'", "no samples")
    with pytest.raises(DataError) as e:
        ShardStream(demo_data, "test", 4, seed=0)
    one_line(e, "'test'")

    n_val = read_manifest(demo_data).num_samples("val")
    with pytest.raises(DataError) as e:
        ShardStream(demo_data, "val", n_val + 1, seed=0, loop=False)
    one_line(e, f"batch_size={n_val + 1}", str(n_val))
    assert len(_take(ShardStream(demo_data, "val", n_val + 1, seed=0), 2)) == 2 * (n_val + 1)  # looping is fine

    def miscount(r):
        r["splits"]["train"][2]["samples"] += 1

    wrong = _edited_copy(demo_data, str(tmp_path / "wrong"), miscount)
    for workers in (0, 1):
        with pytest.raises(DataError) as e:
            _take(ShardStream(wrong, "train", 4, seed=0, shuffle=False, loop=False, num_workers=workers), 10**9)
        assert "worker" not in one_line(e, names[2], "samples but the manifest says")

    corrupt = str(tmp_path / "corrupt")
    shutil.copytree(demo_data, corrupt)
    with open(os.path.join(corrupt, names[0]), "r+b") as f:
        f.truncate(3000)
    with pytest.raises(DataError) as e:
        _take(ShardStream(corrupt, "train", 4, seed=0, shuffle=False), 10**9)
    one_line(e, names[0])


def test_data_path_that_is_a_file(demo_data):
    manifest = os.path.join(demo_data, MANIFEST_NAME)
    for call in (lambda: read_manifest(manifest), lambda: ShardStream(manifest, "train", 4, seed=0)):
        with pytest.raises(DataError) as e:
            call()
        one_line(e, f"{manifest} is a file, not a shard directory", "holds manifest.json")
    r = subprocess.run([sys.executable, "-m", "data_prep.verify", manifest], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith(f"error: {manifest} is a file")


def test_verify_command(demo_data, tmp_path, capsys):
    from data_prep import verify

    good = str(tmp_path / "good")
    shutil.copytree(demo_data, good)
    n = sum(len(v) for v in read_manifest(good).splits.values())
    assert verify.main([good]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"ok: {n} shards")

    name = read_manifest(good).splits["train"][1].name
    with open(os.path.join(good, name), "r+b") as f:  # first sample's tokens, tar headers untouched
        f.seek(512)
        head = f.read(64)
        f.seek(512)
        f.write(bytes(b ^ 1 for b in head))
    assert verify.main([good, "--quick"]) == 0  # same size: --quick cannot tell
    capsys.readouterr()
    assert verify.main([good]) == 1
    bad, summary = capsys.readouterr().out.splitlines()
    assert name in bad and "checksum mismatch" in bad and summary.startswith("1 bad file(s)")

    os.truncate(os.path.join(good, name), 4096)
    r = subprocess.run([sys.executable, "-m", "data_prep.shards", "verify", "--out", good, "--quick"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and name in r.stdout and "4096 bytes" in r.stdout, r.stdout + r.stderr

    missing = str(tmp_path / "missing")
    assert verify.main([missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: data directory {missing} does not exist")


def test_prep_and_bench_steps_of_the_hpctrain_command(demo_data, tmp_path, capsys):
    """`hpctrain prep STEP` runs the data_prep command STEP names; an unknown step or benchmark is one line, exit 2."""
    from hpctrain import cli

    assert cli.main(["prep", "verify", demo_data, "--quick"]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    for argv, words in ((["prep", "shardz"], "prep 'shardz' is not a step: use one of tokenizer, shards, merge"),
                        (["bench", "disk"], "bench 'disk' is not a benchmark: use one of data, host, scale")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"hpctrain: error: {words}"), err
    # each step and benchmark names itself as it is called: its usage line is the command the user typed
    steps = [["prep", s] for s in cli.PREP if s != "merge"] + [["bench", b] for b in cli.BENCHES] + [["gpu-check"]]
    for argv in steps:
        with pytest.raises(SystemExit) as e:
            cli.main([*argv, "--help"])
        assert e.value.code == 0 and capsys.readouterr().out.startswith(f"usage: hpctrain {' '.join(argv)} ")


def test_check_compat(demo_data):
    m = read_manifest(demo_data)
    check_compat(m, vocab_size=512, seq_len=64)
    check_compat(m, vocab_size=32000, seq_len=64)
    with pytest.raises(DataError) as e:
        check_compat(m, vocab_size=256, seq_len=64)
    one_line(e, "512", "256", "vocab_size")
    with pytest.raises(DataError) as e:
        check_compat(m, vocab_size=512, seq_len=128)
    one_line(e, "65", "128", "seq_len")


def test_demo_corpus_is_stdlib(demo_data):
    m = read_manifest(demo_data)
    [src] = m.sources
    assert src["kind"] == "python-stdlib" and src["bytes"] >= DEMO_KW["max_bytes"] and src["files"] > 5
    assert m.created_by["settings"]["vocab_size"] == 512
    root, files, total = demo_mod.stdlib_files(DEMO_KW["max_bytes"])
    assert files == sorted(files, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))
    assert "site-packages" not in "".join(files) and total == src["bytes"]


def test_shards_cli(corpus, tmp_path):
    out = str(tmp_path / "cli")
    cmd = [sys.executable, "-m", "data_prep.shards", "--corpus", os.path.join(os.path.dirname(corpus[0]), "*.txt"),
           "--out", out, "--seq-len", "32", "--vocab-size", "300", "--val-fraction", "0.1"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    m = read_manifest(out)
    assert m.block_len == 33 and m.num_samples("train") > 0 and m.num_samples("val") > 0
    [src] = m.sources
    assert src["corpus"] == [cmd[4]] and src["files"] == len(corpus) and src["documents"] == len(corpus)
    assert src["bytes"] == sum(os.path.getsize(f) for f in corpus) and src["skipped_lines"] == 0
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)  # same build: a no-op
    assert r.returncode == 0 and "up to date" in r.stdout, r.stderr
    r = subprocess.run(cmd[:-2] + ["--val-fraction", "0.2"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)  # another build refuses to overwrite
    assert r.returncode == 2 and "--overwrite" in r.stderr and len(r.stderr.splitlines()) == 1
