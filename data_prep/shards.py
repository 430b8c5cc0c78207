"""Corpus -> token shards + manifest: the library entry points and the `hpctrain prep shards` CLI.

    hpctrain prep shards --corpus 'raw/*.jsonl.zst' --out DIR [--tokenizer DIR | --vocab-size N]
        [--seq-len N] [--workers N] [--shard-mb N] [--text-field text] [--val-fraction F]
        [--task-index I --num-tasks N] [--stripe-count N --stripe-size S] [--overwrite]
    hpctrain prep merge --out DIR      # after the array tasks of a Slurm job array
    hpctrain prep verify DIR [--quick]   # = hpctrain prep shards verify --out DIR

The machinery (work units, journal, merge) is in `data_prep.build`; input readers in `data_prep.sources`;
tokenise/pack/write in `data_prep.packing`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from data_prep import lustre
from data_prep.build import (
    BUILD_DIR,
    DEFAULT_SHARD_MB,
    BuildConfig,
    build,
    check_out_dir,
    clear_journal,
    make_out_dir,
    merge,
)
from data_prep.packing import DEFAULT_BATCH_CHARS, pack_tokens, split_names, write_unit
from data_prep.sources import expand_corpus
from data_prep.tokenizer import TextTokenizer
from hpctrain.core.command import run_command
from hpctrain.core.files import fsync_dir
from hpctrain.core.host import usable_cpus
from hpctrain.core.shard_format import (
    MANIFEST_NAME,
    SPLITS,
    TOKENIZER_DIR,
    DataError,
    Manifest,
    ShardInfo,
    TokenizerInfo,
    is_shard_file,
    sha256_file,
    token_dtype,
    write_manifest,
)

__all__ = ["DEFAULT_SHARD_MB", "build_from_files", "main", "pack_tokens", "prepare_out_dir", "read_text",
           "split_names", "write_shards"]


def read_text(path: str) -> str | None:
    """The file as UTF-8 text, or None when it cannot be read or decoded."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def prepare_out_dir(out_dir: str, overwrite: bool = False) -> None:
    """Make `out_dir` ready for a new shard set written in one go: refuse to replace a complete one unless
    `overwrite`, then drop the manifest first (so a crash never leaves a manifest over half-written shards)
    and remove leftover shards, `.tmp` files and the journal of earlier or interrupted builds."""
    manifest = os.path.join(out_dir, MANIFEST_NAME)
    if os.path.exists(manifest) and not overwrite:
        raise DataError(f"{out_dir} already holds a shard set ({MANIFEST_NAME}): "
                        "choose another output directory or pass overwrite=True / --overwrite")
    # An interrupted write of this function (its mark, no journal) is rerun; a journaled build needs `overwrite`.
    check_out_dir(out_dir, overwrite, resumable=not os.path.exists(os.path.join(out_dir, BUILD_DIR, "plan.json")))
    make_out_dir(out_dir)
    if os.path.exists(manifest):
        os.remove(manifest)
        fsync_dir(out_dir)
    for name in sorted(os.listdir(out_dir)):
        if name.removesuffix(".tmp") == MANIFEST_NAME or is_shard_file(name):
            os.remove(os.path.join(out_dir, name))
    os.makedirs(os.path.join(out_dir, BUILD_DIR), exist_ok=True)  # the mark of an hpctrain build, kept throughout
    clear_journal(out_dir)  # (a journaled build's records: this one replaces it)


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
    """Write a shard set for in-memory document streams ({"train": docs, "val": docs}), in this process:
    each split is one work unit. The tokenizer is saved to `out_dir/tokenizer/`; the manifest is written
    last and atomically. (Corpora on disk go through `build_from_files` / the CLI: parallel, restartable.)"""
    unknown = set(docs) - set(SPLITS)
    if unknown:
        raise DataError(f"unknown split(s) {sorted(unknown)}: use {list(SPLITS)}")
    BuildConfig(seq_len=seq_len, shard_mb=shard_mb).check()
    prepare_out_dir(out_dir, overwrite)
    block_len = seq_len + 1
    dtype = token_dtype(tokenizer.vocab_size)
    tok_path = tokenizer.save(os.path.join(out_dir, TOKENIZER_DIR))
    splits: dict[str, list[ShardInfo]] = {}
    for split in SPLITS:
        splits[split], _ = write_unit(((d, True) for d in docs.get(split, ())), tokenizer, out_dir, split, 0,
                                      block_len, dtype, int(shard_mb * 1_000_000), batch_chars)
    if not splits["train"]:
        raise DataError(f"the train split of {out_dir} has no full block of {block_len} tokens: "
                        "use more text or a smaller seq_len")
    fsync_dir(out_dir)
    manifest = Manifest(
        block_len=block_len, vocab_size=tokenizer.vocab_size, dtype=dtype, eos_id=tokenizer.eos_id,
        tokenizer=TokenizerInfo(path=os.path.relpath(tok_path, out_dir), sha256=sha256_file(tok_path)),
        splits=splits, sources=list(sources or []), created_by=dict(created_by or {}),
    )
    write_manifest(out_dir, manifest)
    return manifest


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
    workers: int = 1,
    **config: Any,
) -> Manifest:
    """Build a shard set from input files (text files are one document each; jsonl/parquet by extension).

    The val hold-out (`val_fraction` of the bytes) is chosen by hashes of the file (piece) names relative
    to `root`; the tokenizer is loaded from `tokenizer` or, if None, trained on the train files with
    `vocab_size`. Extra keyword arguments are `BuildConfig` fields (unit_mb, text_field, bad_lines, ...)."""
    cfg = BuildConfig(seq_len=seq_len, shard_mb=shard_mb, val_fraction=val_fraction, **config)
    return build(list(files), out_dir, cfg, tokenizer=tokenizer, vocab_size=vocab_size, workers=workers,
                 root=root, sources=sources, created_by=created_by, overwrite=overwrite,
                 log=lambda msg: None)


# --------------------------------------------------------------------------- CLI


def _default_workers() -> int:
    """The CPUs this process may use; fewer where Slurm gave the task fewer (a node without task affinity shows all
    of its CPUs), never more (the variable also reaches an salloc shell on the login node, and steps inside)."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return max(1, min(int(slurm), usable_cpus())) if slurm.isdigit() else usable_cpus()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpctrain prep shards",
        description="Corpus -> tokenized WebDataset shards + manifest.json (parallel, restartable, "
                    "deterministic). `hpctrain prep merge --out DIR` finishes an array build; "
                    "`hpctrain prep verify DIR` checks a shard set.")
    p.add_argument("--corpus", nargs="+", metavar="GLOB",
                   help="quoted globs: text files (one document each), *.jsonl[.gz|.zst], *.parquet")
    p.add_argument("--out", required=True, help="output data directory")
    p.add_argument("--tokenizer", help="tokenizer.json or local HF tokenizer dir (default: train one)")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary when training a tokenizer")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--workers", type=int, default=_default_workers(),
                   help="tokeniser processes (default: $SLURM_CPUS_PER_TASK or the CPUs available: %(default)s)")
    p.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB, help="shard size (default %(default)s)")
    p.add_argument("--unit-mb", type=float, default=None,
                   help="input MB per work unit (default: corpus/64 clamped to 32..256)")
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column with the text")
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--bad-lines", choices=("error", "skip"), default="error",
                   help="a bad jsonl line / undecodable file: stop naming file:line (default) or skip and count")
    p.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto", help="token id type")
    p.add_argument("--tokenizer-sample-mb", type=float, default=1000.0,
                   help="text sampled to train a tokenizer (default %(default)s)")
    p.add_argument("--stripe-count", type=int, default=lustre.DEFAULT_STRIPE_COUNT,
                   help="Lustre stripe count of OUT when `lfs` exists (0: leave alone; default %(default)s)")
    p.add_argument("--stripe-size", default=lustre.DEFAULT_STRIPE_SIZE, help="Lustre stripe size (default %(default)s)")
    p.add_argument("--task-index", type=int, default=0, help="this array task (e.g. $SLURM_ARRAY_TASK_ID)")
    p.add_argument("--num-tasks", type=int, default=1, help="array tasks (e.g. $SLURM_ARRAY_TASK_COUNT)")
    p.add_argument("--overwrite", action="store_true", help="replace a complete shard set built differently")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "verify":
        from data_prep import verify

        return verify.main(argv[1:])
    merging = bool(argv) and argv[0] == "merge"
    a = _parser().parse_args(argv[1:] if merging else argv)
    t0 = time.perf_counter()

    def work() -> None:
        if merging:
            merge(a.out)
        else:
            if not a.corpus:
                raise DataError("no corpus given: pass --corpus 'raw/*.jsonl' (quoted)")
            cfg = BuildConfig(seq_len=a.seq_len, shard_mb=a.shard_mb, unit_mb=a.unit_mb,
                              val_fraction=a.val_fraction, text_field=a.text_field, bad_lines=a.bad_lines,
                              dtype=a.dtype, tokenizer_sample_mb=a.tokenizer_sample_mb)
            settings = {**vars(cfg), **({} if a.tokenizer else {"vocab_size": a.vocab_size})}
            build(expand_corpus(a.corpus), a.out, cfg, tokenizer=a.tokenizer,
                  vocab_size=None if a.tokenizer else a.vocab_size, workers=a.workers, task_index=a.task_index,
                  num_tasks=a.num_tasks, corpus=a.corpus, created_by={"tool": "data_prep.shards", "settings": settings},
                  overwrite=a.overwrite, stripe_count=a.stripe_count, stripe_size=a.stripe_size)
        print(f"done in {time.perf_counter() - t0:.1f}s")

    # A full disk or Ctrl-C leaves an unfinished build (no manifest), which the same command goes on with.
    return run_command(work, bad=(DataError,),
                       os_error="fix it, then rerun the same command (finished units are kept)",
                       interrupted="interrupted: rerun the same command to go on (finished units are kept; no manifest "
                                   "was written)")


if __name__ == "__main__":
    sys.exit(main())
