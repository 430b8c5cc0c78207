"""Preprocessing throughput: sharding pipeline vs the bare tokenizer, and 1 -> N worker scaling.

    hpctrain bench data [--mb 8] [--workers 2] [--vocab 4096]

Corpus: this interpreter's standard-library sources written as jsonl (no network). Every figure is
measured in this run, on one core per process (TOKENIZERS_PARALLELISM=false), and printed as ratios:

- overhead = 1 - (pipeline tokens/s with 1 worker) / (bare `encode_batch` tokens/s on the same text);
  the pipeline adds reading + JSON parsing, packing, tar writing, hashing and fsync (target <= 15 %);
- scaling = (pipeline tokens/s with N workers) / (with 1 worker); ideal N on N free cores.

Pipeline figures are end to end (planning, worker start-up, merge included); each is the best of
`--repeats` interleaved runs, so other load on a shared machine distorts them less.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process, before tokenizers is used

from data_prep.build import BuildConfig, build  # noqa: E402
from data_prep.demo import stdlib_files  # noqa: E402
from data_prep.packing import DEFAULT_BATCH_CHARS  # noqa: E402
from data_prep.shards import read_text  # noqa: E402
from data_prep.tokenizer import load_tokenizer, train_tokenizer_from_docs  # noqa: E402
from hpctrain.core.host import usable_cpus


def make_corpus(dir_: str, max_bytes: int, files: int = 8) -> tuple[list[str], list[str]]:
    """(jsonl paths, documents): the stdlib sources as `files` jsonl files of {"text": ...} lines."""
    _, paths, _ = stdlib_files(max_bytes)
    docs = [t for t in (read_text(p) for p in paths) if t]
    out = []
    per = -(-len(docs) // files)
    for i in range(files):
        path = os.path.join(dir_, f"part-{i:03d}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for d in docs[i * per:(i + 1) * per]:
                f.write(json.dumps({"id": i, "text": d}) + "\n")
        out.append(path)
    return out, docs


def bare_tokens_per_s(tok, docs: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    c0 = time.process_time()
    tokens, batch, chars = 0, [], 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if chars >= DEFAULT_BATCH_CHARS:
            tokens += sum(map(len, tok.encode_batch(batch)))
            batch, chars = [], 0
    if batch:
        tokens += sum(map(len, tok.encode_batch(batch)))
    _CPU["bare"] = min(_CPU.get("bare", float("inf")), time.process_time() - c0)
    return tokens / (time.perf_counter() - t0), tokens


_CPU: dict[str, float] = {}  # best CPU seconds (this process) per in-process measurement


def pipeline_tokens_per_s(files, out, tok_dir, workers: int, unit_mb: float) -> tuple[float, int]:
    cfg = BuildConfig(seq_len=2048, shard_mb=16, unit_mb=unit_mb, val_fraction=0.0)
    t0 = time.perf_counter()
    c0 = time.process_time()
    m = build(files, out, cfg, tokenizer=tok_dir, workers=workers, stripe_count=0, log=lambda s: None)
    dt = time.perf_counter() - t0
    if workers == 1:  # in-process: its CPU time is the whole pipeline's
        _CPU["one"] = min(_CPU.get("one", float("inf")), time.process_time() - c0)
    tokens = m.sources[0]["tokens"]
    return tokens / dt, tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hpctrain bench data", description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=8.0, help="corpus size in MB (default %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="worker count for the scaling run (default %(default)s)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3, help="best of this many interleaved runs (default %(default)s)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-data-") as tmp:
        files, docs = make_corpus(tmp, int(a.mb * 1e6))
        tok_dir = os.path.join(tmp, "tok")
        train_tokenizer_from_docs(iter(docs[: max(1, len(docs) // 4)]), a.vocab, tok_dir)
        tok = load_tokenizer(tok_dir + "/tokenizer.json")
        unit_mb = a.mb / (4 * max(a.workers, 1))  # enough units to keep every worker busy
        bare = one = many = 0.0
        for rep in range(a.repeats):  # interleaved, best of: robust to other load on a shared machine
            bare = max(bare, bare_tokens_per_s(tok, docs)[0])
            r1, n_one = pipeline_tokens_per_s(files, os.path.join(tmp, f"w1-{rep}"), tok_dir, 1, unit_mb)
            rn, n_many = pipeline_tokens_per_s(files, os.path.join(tmp, f"wn-{rep}"), tok_dir, a.workers, unit_mb)
            one, many = max(one, r1), max(many, rn)
        n_bare = sum(len(ids) for ids in tok.encode_batch(docs))
    assert n_one == n_many, (n_one, n_many)
    cores = usable_cpus()
    print(f"corpus: {a.mb:g} MB stdlib jsonl, {len(docs)} documents, {n_bare:,} tokens (vocab {a.vocab}); "
          f"{cores} cores, load avg {os.getloadavg()[0]:.1f}")
    print(f"bare tokenizer (1 core):       {bare:12,.0f} tokens/s")
    print(f"pipeline, 1 worker:            {one:12,.0f} tokens/s  ({n_one:,} tokens incl. EOS)")
    print(f"pipeline, {a.workers} workers:           {many:12,.0f} tokens/s  ({many / a.workers:,.0f} per worker)")
    print(f"sharding overhead vs bare:     {1 - one / bare:12.1%}  (target <= 15%; wall clock)")
    print(f"  same, in CPU seconds:        {1 - _CPU['bare'] / _CPU['one']:12.1%}  "
          f"(bare {_CPU['bare']:.2f}s vs pipeline {_CPU['one']:.2f}s; not distorted by other load)")
    print(f"scaling 1 -> {a.workers} workers:        {many / one:12.2f}x  (ideal {a.workers}x on {a.workers} free cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
