"""The demo corpus: this interpreter's standard-library `.py` sources, tokenised into shards.

It exists on every machine and needs no network. `hpctrain prep demo [--out DIR]`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import sysconfig
import time

import tokenizers

from data_prep.build import DEMO_MARKER
from data_prep.shards import build_from_files, read_text
from hpctrain.core.command import run_command
from hpctrain.core.shard_format import DataError, Manifest, read_manifest, sha256_file

# encodings/ is mostly generated codec tables: a model trained on them samples tables, not code.
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "encodings"}
CORPUS_VERSION = 2  # bump when the file selection changes, so cached demo sets are rebuilt


def default_out_dir() -> str:
    """`$HPCTRAIN_CACHE/demo_shards` (default ~/.cache/hpctrain/demo_shards), where conf/data/demo.yaml looks."""
    cache = os.environ.get("HPCTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hpctrain")
    return os.path.join(cache, "demo_shards")


def stdlib_files(max_bytes: int, root: str | None = None) -> tuple[str, list[str], int]:
    """(root, files, bytes): `.py` files under the stdlib in sorted relative-path order, skipping
    site-packages and files that are not readable UTF-8, stopping once `max_bytes` are collected."""
    root = root or sysconfig.get_paths()["stdlib"]
    rel: list[str] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
        rel += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".py")]
    files, total = [], 0
    for r in sorted(rel, key=lambda p: p.replace(os.sep, "/")):
        if total >= max_bytes:
            break
        path = os.path.join(root, r)
        text = read_text(path)
        if text:
            files.append(path)
            total += len(text.encode("utf-8"))
    return root, files, total


MARKER = DEMO_MARKER  # written first into a directory the demo build owns


def _check_owned(out_dir: str) -> None:
    """The demo build replaces what is in `out_dir`: only ever a new or empty directory, or an earlier demo
    build (marked, or with a demo manifest), never a user's shard set or anything else."""
    if not os.path.isdir(out_dir) or not os.listdir(out_dir) or os.path.exists(os.path.join(out_dir, MARKER)):
        return
    try:
        if read_manifest(out_dir).created_by.get("tool") == "data_prep.demo":
            return
    except DataError:
        pass
    raise DataError(f"{out_dir} is not empty and holds no demo build: the demo corpus is only built into a new "
                    "or empty directory (or its own cache): choose another --out")


def _cached(out_dir: str, created_by: dict) -> Manifest | None:
    try:
        m = read_manifest(out_dir)
    except DataError:
        return None
    if m.created_by != created_by:
        return None
    for shard in (s for split in m.splits.values() for s in split):
        path = os.path.join(out_dir, shard.name)
        if not os.path.isfile(path) or os.path.getsize(path) != shard.bytes:
            return None
    tok = os.path.join(out_dir, m.tokenizer.path)
    return m if os.path.isfile(tok) and sha256_file(tok) == m.tokenizer.sha256 else None


def build_demo(out_dir: str, max_bytes: int = 8_000_000, vocab_size: int = 4096, seq_len: int = 256,
               val_fraction: float = 0.02, shard_mb: float = 4) -> Manifest:
    """Build (or reuse, when `out_dir` holds a complete build with the same settings) the demo shards."""
    settings = {"max_bytes": max_bytes, "vocab_size": vocab_size, "seq_len": seq_len,
                "val_fraction": val_fraction, "shard_mb": shard_mb,
                "python": platform.python_version(), "tokenizers": tokenizers.__version__,
                "corpus_version": CORPUS_VERSION}
    created_by = {"tool": "data_prep.demo", "settings": settings}
    t0 = time.perf_counter()
    m = _cached(out_dir, created_by)
    if m is not None:
        print(f"demo data: cached in {out_dir} ({_summary(m)})")
        return m
    _check_owned(out_dir)
    root, files, total = stdlib_files(max_bytes)
    if not files:
        raise DataError(f"no readable .py files under {root}: pass --max-bytes > 0 or use `make shards`")
    try:
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, MARKER), "a").close()
    except OSError as e:
        raise DataError(f"cannot create the demo data directory {out_dir} ({e.strerror}): choose another "
                        "--out or set HPCTRAIN_CACHE") from None
    m = build_from_files(files, out_dir, seq_len, vocab_size=vocab_size, val_fraction=val_fraction,
                         shard_mb=shard_mb, root=root,
                         sources=[{"kind": "python-stdlib", "root": root, "files": len(files), "bytes": total}],
                         created_by=created_by, overwrite=True)
    print(f"demo data: built in {out_dir} ({_summary(m)}, {time.perf_counter() - t0:.1f}s)")
    return m


def _summary(m: Manifest) -> str:
    return (f"{m.num_samples('train')} train / {m.num_samples('val')} val blocks of {m.block_len} tokens, "
            f"vocab {m.vocab_size}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hpctrain prep demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=default_out_dir(), help="output data directory (default: %(default)s)")
    p.add_argument("--max-bytes", type=int, default=8_000_000)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--shard-mb", type=float, default=4)
    a = p.parse_args(argv)
    return run_command(lambda: build_demo(a.out, a.max_bytes, a.vocab_size, a.seq_len, a.val_fraction, a.shard_mb),
                       bad=(DataError,), os_error="fix it, then rerun",
                       interrupted="interrupted: rerun to build the demo data (no manifest was written)")


if __name__ == "__main__":
    sys.exit(main())
