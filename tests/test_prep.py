"""Preprocessing at scale: mixed inputs, workers, restart after SIGKILL, array tasks + merge, Lustre, bad input.

Every build runs the real code path (CLI subprocesses or `data_prep.build.build`) on small corpora
generated in tmp dirs; outputs are compared byte for byte.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from data_prep import sources as sources_mod
from data_prep.build import BuildConfig, build, merge
from data_prep.sources import Piece, iter_documents, plan_pieces
from data_prep.tokenizer import load_tokenizer, train_tokenizer_from_docs
from hpctrain.core.shard_format import MANIFEST_NAME, DataError, decode_tokens, read_manifest, sha256_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["alpha", "beta", "gamma", "delta", "shard", "token", "batch", "epoch", "lustre", "rank", "ünïcödé",
         "数据", "λ", "def", "return", "{", "}", "\t", "  "]
SEQ = 16
UNIT_MB = 0.01  # 10 kB work units: dozens of units from a ~250 kB corpus


def _doc(i: int) -> str:
    rng = random.Random(i)
    lines = [f"@@doc-{i:04d}@@"]
    for _ in range(rng.randint(2, 25)):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
    return "\n".join(lines) + "\n"


def _jsonl_lines(ids, extra=True) -> str:
    return "".join(json.dumps({"id": i, "text": _doc(i), **({"meta": {"n": i}} if extra else {})},
                              ensure_ascii=bool(i % 2)) + "\n" for i in ids)


def _write_corpus(root) -> list[str]:
    """Text files, plain / gzip / zstd jsonl and parquet; returns the corpus globs."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (root / "txt").mkdir(parents=True)
    for i in range(6):
        (root / "txt" / f"doc{i}.txt").write_text(_doc(i) * 3, encoding="utf-8")
    (root / "big.jsonl").write_text(_jsonl_lines(range(100, 260)) + '{"id": 0, "text": ""}\n\n',
                                    encoding="utf-8")
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(_jsonl_lines(range(300, 330)))
    (root / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl_lines(range(400, 430)).encode()))
    table = pa.table({"id": list(range(500, 560)), "text": [_doc(i) for i in range(500, 560)]})
    pq.write_table(table, root / "e.parquet", row_group_size=10)
    return [str(root / "txt" / "*.txt"), str(root / "*.jsonl*"), str(root / "*.parquet")]


def _cli(module: str, *args: str, env: dict | None = None, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, **(env or {})}, **kw)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def _load(path: str):
    with open(path, "rb") as f:
        data = f.read()
    return json.loads(data) if path.endswith(".json") else data


def _tree(root: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), root): sha256_file(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


def _one_line(excinfo_or_text, *needles: str) -> str:
    msg = excinfo_or_text if isinstance(excinfo_or_text, str) else str(excinfo_or_text.value)
    msg = msg.strip()
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep_corpus")
    return _write_corpus(root)


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory):
    """Trained by the tokenizer CLI (all input kinds, bounded sample)."""
    out = str(tmp_path_factory.mktemp("prep_tok") / "tok")
    r = _cli("data_prep.tokenizer", "--corpus", *corpus, "--vocab", "400", "--out", out, "--sample-mb", "0.1")
    assert "tokenizer:" in r.stdout
    return out


def _build_args(corpus, tok_dir, out, *extra) -> list[str]:
    return ["--corpus", *corpus, "--out", out, "--tokenizer", tok_dir, "--seq-len", str(SEQ), "--unit-mb",
            str(UNIT_MB), "--shard-mb", "0.02", "--val-fraction", "0.1", "--stripe-count", "0", *extra]


@pytest.fixture(scope="module")
def reference(corpus, tok_dir, tmp_path_factory):
    """An uninterrupted single-process CLI build: what every other build must equal byte for byte."""
    out = str(tmp_path_factory.mktemp("prep_ref") / "ref")
    _cli("data_prep.shards", *_build_args(corpus, tok_dir, out, "--workers", "1"))
    return out


# --------------------------------------------------------------------------- tokenizer + readers


def test_tokenizer_cli_trains_deterministically(corpus, tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    assert tok.vocab_size == 400 and tok.eos_id == 0
    text = _doc(7)
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) < len(text.encode())
    # the same bounded sample in-process gives the same tokenizer.json
    pieces = plan_pieces(sources_mod.expand_corpus(corpus), piece_bytes=256_000_000)
    from data_prep.tokenizer import sample_documents

    again = train_tokenizer_from_docs(sample_documents(pieces, 100_000), 400, str(tmp_path / "again"))
    assert sha256_file(again) == sha256_file(os.path.join(tok_dir, "tokenizer.json"))
    r = _cli("data_prep.tokenizer", "--corpus", str(tmp_path / "nothing*.jsonl"), "--vocab", "300", "--out",
             str(tmp_path / "t"), check=False)
    assert r.returncode == 2 and _one_line(r.stderr, "matches no files")


def test_token_bytes_add_up_to_the_text(tok_dir):
    """Bits per byte's divisor: the bytes each token stands for add up to the UTF-8 bytes of the text it encodes
    (non-ASCII included; EOS stands for none); a tokenizer that is not byte-level counts each token decoded alone."""
    from data_prep.synthetic import word_tokenizer
    from data_prep.tokenizer import token_bytes

    tok = load_tokenizer(tok_dir)
    table = token_bytes(tok)
    text = _doc(3) + " naïve café — 東京 ✓\n\tdef f(x): return x"
    assert sum(table[i] for i in tok.encode(text)) == len(text.encode()) and table[tok.eos_id] == 0
    words = word_tokenizer(50)
    assert token_bytes(words)[words.eos_id] == 0 and token_bytes(words)[12] == len("w12")


def test_jsonl_pieces_cut_at_line_starts(corpus):
    path = os.path.join(os.path.dirname(corpus[1]), "big.jsonl")
    pieces = plan_pieces([path], piece_bytes=7000)
    data = _load(path)
    assert len(pieces) > 5 and pieces[0].start == 0 and pieces[-1].end == len(data)
    for a, b in zip(pieces, pieces[1:]):
        assert a.end == b.start and data[b.start - 1:b.start] == b"\n"
    docs = [d for p in pieces for d in iter_documents(p)]
    assert docs == [_doc(i) for i in range(100, 260)]  # every line exactly once, empty text ignored


def test_big_text_file_is_chunked_losslessly(tmp_path, tok_dir, monkeypatch):
    text = "".join(_doc(i) for i in range(40)) + "a line with no newline at the end " * 50
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setattr(sources_mod, "TEXT_CHUNK_CHARS", 300)
    segments = list(sources_mod.iter_segments(Piece(str(path), "big.txt", "text", 0, -1, len(text))))
    assert len(segments) > 10 and all(len(s) <= 600 for s, _ in segments)
    assert [e for _, e in segments] == [False] * (len(segments) - 1) + [True]
    assert "".join(s for s, _ in segments) == text
    out = str(tmp_path / "out")
    m = build([str(path)], out, BuildConfig(seq_len=SEQ, val_fraction=0.0), tokenizer=tok_dir, log=lambda s: None)
    tok = load_tokenizer(tok_dir)
    flat = np.concatenate([_blocks(out, s, m.dtype) for s in m.shards("train")]).ravel().tolist()
    assert tok.decode(flat) == (text + "<|endoftext|>")[: len(tok.decode(flat))]


# --------------------------------------------------------------------------- the build


def _blocks(out: str, shard, dtype: str) -> np.ndarray:
    import tarfile

    with tarfile.open(os.path.join(out, shard.name)) as tf:
        return np.stack([decode_tokens(tf.extractfile(x).read(), dtype) for x in tf.getmembers()])


def test_mixed_inputs_pack_each_unit_exactly(reference, tok_dir):
    m = read_manifest(reference)
    assert m.dtype == "uint16" and m.block_len == SEQ + 1 and m.vocab_size == 400 and m.eos_id == 0
    assert m.num_samples("train") > 0 and m.num_samples("val") > 0
    assert sha256_file(os.path.join(reference, m.tokenizer.path)) == m.tokenizer.sha256
    [src] = m.sources
    assert src["files"] == 10 and src["documents"] == 6 + 160 + 30 + 30 + 60 and src["skipped_lines"] == 0
    assert src["empty_documents"] == 1
    plan = _load(os.path.join(reference, ".build", "plan.json"))
    kinds = {p["kind"] for u in plan["units"] for p in u["pieces"]}
    assert kinds == {"text", "jsonl", "jsonl.gz", "jsonl.zst", "parquet"} and len(plan["units"]) > 15
    tok = load_tokenizer(tok_dir)
    seen = {"train": set(), "val": set()}
    for unit in plan["units"]:  # each unit = its documents + EOS, cut into blocks, tail dropped
        expected = []
        for p in unit["pieces"]:
            for doc in iter_documents(Piece(**p)):
                expected += tok.encode(doc) + [tok.eos_id]
                seen[unit["split"]].add(doc.split("@@")[1])
        rec = _load(os.path.join(reference, ".build", "units", f"{unit['split']}-{unit['index']:06d}.json"))
        names = [s["name"] for s in rec["shards"]]
        assert all(n.startswith(f"{unit['split']}-{unit['index']:06d}-") for n in names)
        shards = [s for s in m.shards(unit["split"]) if s.name in names]
        got = np.concatenate([_blocks(reference, s, m.dtype) for s in shards]) if shards else np.empty((0, SEQ + 1))
        n = len(expected) // (SEQ + 1)
        assert got.shape == (n, SEQ + 1) and got.ravel().tolist() == expected[: n * (SEQ + 1)]
    assert seen["train"] and seen["val"] and not seen["train"] & seen["val"]
    assert len(seen["train"] | seen["val"]) == 286


def test_workers_do_not_change_the_bytes_and_rerun_is_a_noop(corpus, tok_dir, reference, tmp_path):
    out = str(tmp_path / "w2")
    _cli("data_prep.shards", *_build_args(corpus, tok_dir, out, "--workers", "2"))
    assert _tree(out) == _tree(reference)
    before = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in _tree(out)}
    r = _cli("data_prep.shards", *_build_args(corpus, tok_dir, out, "--workers", "2"))
    assert "up to date" in r.stdout
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in before} == before


def test_sigkill_midway_then_rerun_resumes_byte_identical(corpus, tok_dir, reference, tmp_path):
    out = str(tmp_path / "killed")
    units_dir = os.path.join(out, ".build", "units")
    proc = subprocess.Popen([sys.executable, "-m", "data_prep.shards", *_build_args(corpus, tok_dir, out, "--workers", "1")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HPCTRAIN_PREP_UNIT_DELAY_S": "0.25"})

    def finished_units():  # a record being written is `<unit>.json.<pid>.tmp`: not finished (CI counted one, stop 47)
        return [n for n in os.listdir(units_dir) if n.endswith(".json")] if os.path.isdir(units_dir) else []

    deadline = time.time() + 180  # a fresh interpreter on a loaded 2-core machine
    while time.time() < deadline and len(finished_units()) < 4:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    # (one being written when the kill came is left as a temporary, which the rerun removes)
    done = sorted(finished_units())
    assert 4 <= len(done) < len(_load(os.path.join(out, ".build", "plan.json"))["units"])
    assert not os.path.exists(os.path.join(out, MANIFEST_NAME))
    with pytest.raises(DataError):
        read_manifest(out)
    finished = [s["name"] for d in done for s in _load(os.path.join(units_dir, d))["shards"]]
    mtimes = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in finished}
    r = _cli("data_prep.shards", *_build_args(corpus, tok_dir, out, "--workers", "2"))
    assert f"{len(done)} already done, skipped" in r.stdout
    assert {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in finished} == mtimes  # not rewritten
    assert _tree(out) == _tree(reference)


def test_array_tasks_then_merge_equal_single_build(corpus, tok_dir, reference, tmp_path):
    """The task split through the real sbatch script (Slurm's environment variables, no Slurm)."""
    out = str(tmp_path / "array")
    args = _build_args(corpus, tok_dir, out)
    script = os.path.join(REPO, "sbatch", "preprocess.sbatch")
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "3",
           "SLURM_CPUS_PER_TASK": "1", "SLURM_SUBMIT_DIR": REPO, "PYTHON": sys.executable}
    for task in (2, 0):
        r = subprocess.run(["bash", script, *args], env={**env, "SLURM_ARRAY_TASK_ID": str(task)}, cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"task {task}/3 done" in r.stdout
    assert not os.path.exists(os.path.join(out, MANIFEST_NAME))
    r = _cli("data_prep.shards", "merge", "--out", out, check=False)  # task 1 has not run
    assert r.returncode == 2 and _one_line(r.stderr, "not finished", "rerun")
    assert not os.path.exists(os.path.join(out, MANIFEST_NAME))
    r = _cli("data_prep.shards", *args, "--task-index", "1", "--num-tasks", "3", "--workers", "2")
    assert "task 1/3 done" in r.stdout and not os.path.exists(os.path.join(out, MANIFEST_NAME))
    r = subprocess.run(["bash", script, *args], env={**env, "SLURM_ARRAY_TASK_ID": "0", "PREP_STAGE": "merge"},
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _tree(out) == _tree(reference)


def test_the_default_workers_are_the_tasks_cpus_and_no_more(half_a_core):
    """`--workers` defaults to the CPUs the process may use (its affinity, a cgroup quota), fewer where Slurm gave
    the task fewer, never more: under half a core's quota SLURM_CPUS_PER_TASK=8 is 1 worker, 1 is 1."""
    code = ("import os\nfrom data_prep.shards import _default_workers as w\nfor n in ('8', '1'):\n"
            "    os.environ['SLURM_CPUS_PER_TASK'] = n\n    print(w())")
    p = subprocess.run([*half_a_core, sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["1", "1"], p.stdout + p.stderr


def test_sbatch_submit_mode_chains_the_merge(tmp_path):
    log = tmp_path / "sbatch.log"
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/bash\necho "$@" >> {log}\necho "$(wc -l < {log})4242;cluster"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{fake.parent}:{env['PATH']}"
    r = subprocess.run(["bash", "sbatch/preprocess.sbatch", "--corpus", "raw/*.jsonl", "--out", "shards/web"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    array, merge_job = log.read_text().splitlines()
    assert array == "--parsable sbatch/preprocess.sbatch --corpus raw/*.jsonl --out shards/web"
    assert "--dependency=afterok:14242 --array=0" in merge_job and "PREP_STAGE=merge" in merge_job
    assert merge_job.endswith("sbatch/preprocess.sbatch --corpus raw/*.jsonl --out shards/web")
    assert "array 14242 and merge job 24242" in r.stdout


# --------------------------------------------------------------------------- Lustre


def _fake_lfs(tmp_path, rc: int = 0):
    log = tmp_path / "lfs.log"
    fake = tmp_path / "lfsbin" / "lfs"
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(f'#!/bin/bash\necho "$@" >> {log}\n' + (f"echo 'not a lustre fs' >&2\nexit {rc}\n" if rc else ""))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake.parent, log


def test_lustre_striping_set_before_writing(corpus, tok_dir, tmp_path, monkeypatch, capsys):
    bindir, log = _fake_lfs(tmp_path)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    txt = sorted(sources_mod.expand_corpus(corpus[:1]))
    cfg = BuildConfig(seq_len=SEQ, val_fraction=0.0)
    out = str(tmp_path / "striped")
    build(txt, out, cfg, tokenizer=tok_dir, log=lambda s: None)
    assert log.read_text().splitlines() == [f"setstripe -c 4 -S 4M {out}"]
    out2 = str(tmp_path / "striped2")
    build(txt, out2, cfg, tokenizer=tok_dir, stripe_count=-1, stripe_size="16M", log=lambda s: None)
    assert log.read_text().splitlines()[-1] == f"setstripe -c -1 -S 16M {out2}"
    build(txt, str(tmp_path / "plain"), cfg, tokenizer=tok_dir, stripe_count=0, log=lambda s: None)
    assert len(log.read_text().splitlines()) == 2  # count 0: left alone
    with pytest.raises(DataError) as e:
        build(txt, str(tmp_path / "bad"), cfg, tokenizer=tok_dir, stripe_size="lots", log=lambda s: None)
    _one_line(e, "--stripe-size", "4M")
    bindir, log = _fake_lfs(tmp_path / "failing", rc=1)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    m = build(txt, str(tmp_path / "nfs"), cfg, tokenizer=tok_dir, log=lambda s: None)  # warns, still builds
    assert m.num_samples("train") > 0 and "not a lustre fs" in capsys.readouterr().err


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_one_line_and_never_corrupts_a_set(corpus, tok_dir, reference, tmp_path):
    good_files = sources_mod.expand_corpus(corpus[:1])
    cfg = BuildConfig(seq_len=SEQ, val_fraction=0.0)
    out = str(tmp_path / "set")
    m = build(good_files, out, cfg, tokenizer=tok_dir, log=lambda s: None)
    manifest_bytes = _load(os.path.join(out, MANIFEST_NAME))

    def fails(files, *needles, config=cfg, **kw):
        with pytest.raises(DataError) as e:
            build(files, out, config, tokenizer=kw.pop("tokenizer", tok_dir), overwrite=True, log=lambda s: None,
                  **kw)
        return _one_line(e, *needles)

    # missing / empty corpus globs (CLI): nothing touched
    r = _cli("data_prep.shards", "--corpus", str(tmp_path / "nope" / "*.jsonl"), "--out", out, check=False)
    assert r.returncode == 2 and _one_line(r.stderr, "matches no files", "nope")
    (tmp_path / "emptydir").mkdir()
    r = _cli("data_prep.shards", "--corpus", str(tmp_path / "emptydir" / "*"), "--out", out, check=False)
    assert r.returncode == 2 and _one_line(r.stderr, "matches no files")
    # another build without --overwrite is refused; the set is untouched
    with pytest.raises(DataError) as e:
        build(good_files, out, BuildConfig(seq_len=8, val_fraction=0.0), tokenizer=tok_dir, log=lambda s: None)
    _one_line(e, "already holds a shard set", "--overwrite")
    assert _load(os.path.join(out, MANIFEST_NAME)) == manifest_bytes
    assert read_manifest(out) == m

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.jsonl").write_text(_jsonl_lines(range(3)) + '{"text": "half a line\n' + _jsonl_lines(range(3, 6)))
    msg = fails([str(bad / "broken.jsonl")], f"{bad / 'broken.jsonl'}:4", "not valid JSON", "--bad-lines skip")
    assert "Traceback" not in msg
    # a failed --overwrite run leaves no manifest (never one over changed shards); a fresh build recovers
    assert not os.path.exists(os.path.join(out, MANIFEST_NAME))
    m2 = build([str(bad / "broken.jsonl")], out, BuildConfig(seq_len=SEQ, val_fraction=0.0, bad_lines="skip"),
               tokenizer=tok_dir, overwrite=True, log=lambda s: None)
    assert m2.sources[0]["skipped_lines"] == 1 and m2.sources[0]["documents"] == 6

    (bad / "fields.jsonl").write_text('{"content": "x", "id": 1}\n')
    fails([str(bad / "fields.jsonl")], "fields.jsonl:1", "no field 'text'", "content", "--text-field")
    (bad / "list.jsonl").write_text("[1, 2]\n")
    fails([str(bad / "list.jsonl")], "list.jsonl:1", "not an object")
    skipped_all = BuildConfig(seq_len=SEQ, val_fraction=0.0, bad_lines="skip")
    fails([str(bad / "fields.jsonl")], "every document", "skipped", "--text-field", config=skipped_all)

    gz = gzip.compress(_jsonl_lines(range(200)).encode())
    (bad / "trunc.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    fails([str(bad / "trunc.jsonl.gz")], "trunc.jsonl.gz", "corrupt or truncated")
    (bad / "junk.jsonl.zst").write_bytes(b"this is not zstd at all" * 10)
    fails([str(bad / "junk.jsonl.zst")], "junk.jsonl.zst", "corrupt or truncated")
    (bad / "junk.parquet").write_bytes(b"PAR1 not really")
    fails([str(bad / "junk.parquet")], "junk.parquet", "cannot read parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["some text"] * 3}), bad / "col.parquet")
    fails([str(bad / "col.parquet")], "col.parquet", "no column 'text'", "body", "--text-field")
    (bad / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    fails([str(bad / "latin1.txt")], "latin1.txt", "not UTF-8")
    (bad / "empty.txt").write_text("")
    fails([str(bad / "empty.txt")], "no full block", "--seq-len")
    fails(good_files, "seq_len=0", config=BuildConfig(seq_len=0))
    fails(good_files, "val_fraction=1.5", config=BuildConfig(val_fraction=1.5))
    fails(good_files, "tokenizer", "does not exist", tokenizer=str(tmp_path / "no-tokenizer"))
    fails(good_files, "array tasks need a shared tokenizer", tokenizer=None, vocab_size=300, num_tasks=2)
    with pytest.raises(DataError) as e:
        merge(str(tmp_path / "never-built"))
    _one_line(e, "no preprocessing plan", "--corpus")

    # a vocabulary too large for the requested token dtype
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    big = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    words = tmp_path / "words.txt"
    words.write_text(" ".join(f"w{i}" for i in range(69_950, 70_000)) * 4)
    fails([str(words)], "70001 tokens", "uint16", "--dtype uint32", tokenizer=str(tmp_path / "big.json"),
          config=BuildConfig(seq_len=SEQ, val_fraction=0.0, dtype="uint16"))
    m3 = build([str(words)], out, BuildConfig(seq_len=SEQ, val_fraction=0.0), tokenizer=str(tmp_path / "big.json"),
               overwrite=True, log=lambda s: None)
    assert m3.dtype == "uint32" and _blocks(out, m3.shards("train")[0], "uint32").max() > 65535


def test_out_dir_that_cannot_be_created_is_one_line(corpus, tok_dir, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    out = str(afile / "shards")
    r = _cli("data_prep.shards", *_build_args(corpus, tok_dir, out), check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.strip()]
    _one_line(line, "error: cannot create the output directory", out, f"{afile} is a file", "--out")
    cfg = BuildConfig(seq_len=SEQ, val_fraction=0.0)
    files = sources_mod.expand_corpus(corpus[:1])
    for target in (out, str(afile)):  # under a file, and a file itself
        with pytest.raises(DataError) as e:
            build(files, target, cfg, tokenizer=tok_dir, log=lambda s: None)
        _one_line(e, target, f"{afile} is a file")
    from data_prep.shards import prepare_out_dir

    with pytest.raises(DataError) as e:
        prepare_out_dir(out)
    _one_line(e, out, "is a file")
    if os.geteuid() != 0:  # root ignores permissions
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            with pytest.raises(DataError) as e:
                build(files, str(locked / "out"), cfg, tokenizer=tok_dir, log=lambda s: None)
            _one_line(e, str(locked / "out"), "Permission denied")
        finally:
            locked.chmod(0o700)


def test_synthetic_shards_for_a_vocabulary_beyond_uint16(tmp_path, capsys):
    """data_prep.synthetic: a real word-level tokenizer over the whole vocabulary, Zipf-drawn documents, written by
    the corpus writer; ids above 65535 occur (uint32 shards), the tokenizer maps w<i> to i, and a set already there
    is refused, never overwritten."""
    from data_prep import synthetic
    from hpctrain.data.loader import ShardStream

    out = str(tmp_path / "syn")
    m = synthetic.build_synthetic(out, 70_000, 32, samples=40, val_samples=4, shards=4)
    assert (m.vocab_size, m.block_len, m.dtype) == (70_000, 33, "uint32")
    assert m.num_samples("train") >= 40 and m.num_samples("val") >= 4 and len(m.splits["train"]) >= 3
    tok = load_tokenizer(os.path.join(out, m.tokenizer.path))
    assert tok.encode("w5 w69999") == [5, 69999] and tok.eos_id == 0
    ids = np.concatenate([b.numpy().ravel() for b, _ in zip(ShardStream(out, "train", 8, 0), range(5))])
    assert ids.max() > 65535 and ids.min() >= 0 and ids.max() < 70_000
    assert np.mean(ids < 100) > 0.3  # Zipf: the hundred most frequent words are a third of the text
    assert synthetic.main(["--out", out, "--vocab", "512", "--seq-len", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a shard set" in err[0], err


def test_a_declared_eos_is_the_shards_and_literal_special_text_is_text(tmp_path):
    """A transformers tokenizer directory declaring an EOS other than the usual candidates (`<|im_end|>`, with
    `<|endoftext|>` in its vocabulary too, as instruct tokenizers have): the shards end documents with the declared
    one; a document's literal "<|endoftext|>" or "<|im_end|>" is text, not a boundary. Validation taking far more than
    --val-fraction (whole pieces of a corpus of two files) is warned of."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel()
    docs = [f"doc {i} says <|endoftext|> and <|im_end|> inside " + " ".join(WORDS) for i in range(40)]
    core.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>").save_pretrained(tmp_path / "tok")
    for half in (0, 1):
        (tmp_path / f"c{half}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[half::2]))
    said = []
    manifest = build([str(tmp_path / "c0.jsonl"), str(tmp_path / "c1.jsonl")], str(tmp_path / "out"),
                     BuildConfig(seq_len=SEQ, shard_mb=0.02), tokenizer=str(tmp_path / "tok"), stripe_count=0,
                     log=said.append)
    assert manifest.eos_id == core.token_to_id("<|im_end|>") == 1
    out = str(tmp_path / "out")
    tokens = np.concatenate([_blocks(out, shard, manifest.dtype).ravel() for split in ("train", "val")
                             for shard in manifest.shards(split)])
    # one boundary per document (a split's last, in a tail shorter than a block, is dropped), no other
    assert len(docs) - 2 <= (tokens == 1).sum() <= len(docs) and (tokens == 0).sum() == 0
    assert any(line.startswith("warning: the validation split holds 50% of the blocks (--val-fraction 0.01)")
               for line in said), said


def test_json_lines_named_json_are_documents_and_other_compressed_files_are_one_line(tmp_path, capsys):
    """`datasets`' `to_json` writes JSON lines as .json: read as documents, not as text holding JSON syntax; a
    compressed file prep cannot read (.txt.gz, .bz2) is refused naming what it reads; `prep tokenizer` prints the
    vocabulary it made (fewer than asked where the sample holds no more merges) and refuses an empty sample."""
    from data_prep import tokenizer as tokenizer_cli

    (tmp_path / "hf.json").write_text("".join(json.dumps({"text": f"doc {i} alpha"}) + "\n" for i in range(3)))
    pieces = plan_pieces([str(tmp_path / "hf.json")], piece_bytes=10**6)
    assert [d for p in pieces for d in iter_documents(p, "text")] == [f"doc {i} alpha" for i in range(3)]
    for name in ("notes.txt.gz", "dump.bz2"):
        (tmp_path / name).write_bytes(b"\x1f\x8b")
        with pytest.raises(DataError, match=f"{name}: only JSON lines are read compressed"):
            plan_pieces([str(tmp_path / name)], piece_bytes=10**6)
    out = tmp_path / "tok"
    assert tokenizer_cli.main(["--corpus", str(tmp_path / "hf.json"), "--vocab", "400", "--out", str(out),
                               "--sample-mb", "0"]) == 2
    assert "--sample-mb 0.0: the tokenizer learns from a sample" in capsys.readouterr().err
    assert tokenizer_cli.main(["--corpus", str(tmp_path / "hf.json"), "--vocab", "400", "--out", str(out)]) == 0
    made = load_tokenizer(str(out)).vocab_size
    assert made < 400 and f"(vocab {made} of the 400 asked: the sample held no more merges" in capsys.readouterr().out


def test_the_same_files_named_by_a_glob_or_its_expansion_are_the_same_build(tmp_path):
    """A build rerun with the shell's expansion of the glob it was started with (or the other way round) is the same
    build: up to date when finished, resumed when not; not refused as other inputs."""
    from data_prep.synthetic import word_tokenizer

    files = []
    for i in range(2):
        files.append(str(tmp_path / f"t{i}.txt"))
        (tmp_path / f"t{i}.txt").write_text(" ".join(WORDS * 20))
    word_tokenizer(300).save(str(tmp_path / "tok"))
    said = []
    cfg = BuildConfig(seq_len=SEQ, shard_mb=0.02, val_fraction=0.0)
    first = build(files, str(tmp_path / "out"), cfg, tokenizer=str(tmp_path / "tok"), corpus=[str(tmp_path / "t*.txt")],
                  stripe_count=0, log=said.append)
    again = build(files, str(tmp_path / "out"), cfg, tokenizer=str(tmp_path / "tok"), corpus=files, stripe_count=0,
                  log=said.append)
    assert again == first and "up to date" in said[-1], said[-3:]
