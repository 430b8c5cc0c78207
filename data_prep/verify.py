"""Check a shard set against its manifest before a long run (or after copying it to scratch).

    hpctrain prep verify DIR [--quick]       # also: hpctrain prep shards verify --out DIR

Checks the manifest, the tokenizer's sha256 and every shard's existence and size; without --quick also
every shard's sha256, sample count, block length and token ids (< vocab_size). Prints one line per bad
shard and a summary line. Exit status: 0 all good, 1 bad shards, 2 usage or manifest errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile

from hpctrain.core.command import run_command
from hpctrain.core.shard_format import (
    DataError,
    Manifest,
    ShardInfo,
    decode_tokens,
    read_manifest,
    sha256_file,
)


def check_shard(data_dir: str, manifest: Manifest, shard: ShardInfo, quick: bool) -> str | None:
    """What is wrong with one shard (one line), or None when it is good."""
    path = os.path.join(data_dir, shard.name)
    if not os.path.isfile(path):
        return f"shard {path} is missing: restore it or rebuild the shards"
    size = os.path.getsize(path)
    if size != shard.bytes:
        return f"shard {path} has {size} bytes, the manifest says {shard.bytes}: restore it or rebuild the shards"
    if quick:
        return None
    if sha256_file(path) != shard.sha256:
        return f"shard {path} checksum mismatch: it changed after the build; restore it or rebuild the shards"
    try:
        return _check_samples(path, manifest, shard)
    except (tarfile.TarError, OSError) as e:
        return f"cannot read shard {path} ({type(e).__name__}: {e}): restore it or rebuild the shards"


def _check_samples(path: str, manifest: Manifest, shard: ShardInfo) -> str | None:
    """Sample count, block length and token range, read with the standard library's tar reader (this package
    shares only the format with the loader, not its code)."""
    with tarfile.open(path) as tf:
        members = [m for m in tf if m.isfile()]
        if len(members) != shard.samples:
            return f"shard {path} has {len(members)} samples, the manifest says {shard.samples}: rebuild the shards"
        for i, member in enumerate(members):
            tokens = decode_tokens(tf.extractfile(member).read(), manifest.dtype)
            if tokens.size != manifest.block_len:
                return (f"shard {path} sample {i} ({member.name}) has {tokens.size} tokens, the manifest's "
                        f"block_len is {manifest.block_len}: rebuild the shards")
            if tokens.size and int(tokens.max()) >= manifest.vocab_size:
                return (f"shard {path} sample {i} ({member.name}) holds token id {int(tokens.max())} >= the "
                        f"manifest's vocab_size {manifest.vocab_size}: rebuild the shards")
    return None


def check_tokenizer(data_dir: str, manifest: Manifest) -> str | None:
    path = os.path.join(data_dir, manifest.tokenizer.path)
    if not os.path.isfile(path):
        return f"tokenizer {path} is missing: restore it or rebuild the shards"
    if sha256_file(path) != manifest.tokenizer.sha256:
        return f"tokenizer {path} checksum mismatch: it is not the one that produced the shards; restore it"
    return None


def verify(data_dir: str, quick: bool = False, out=print) -> int:
    """Print the problems of the shard set in `data_dir` and a summary; returns the number of bad files.
    Raises DataError when there is no readable manifest."""
    manifest = read_manifest(data_dir)
    shards = [s for split in manifest.splits.values() for s in split]
    bad = 0
    for problem in [check_tokenizer(data_dir, manifest)] + [check_shard(data_dir, manifest, s, quick)
                                                          for s in shards]:
        if problem:
            bad += 1
            out(problem)
    what = "existence and size" if quick else "size, sha256, samples and token ids"
    samples = sum(s.samples for s in shards)
    if bad:
        out(f"{bad} bad file(s) among the tokenizer and {len(shards)} shards of {data_dir} ({what} checked): "
            "restore them from a good copy or rebuild the shards; data.on_corrupt=skip trains around bad shards")
    else:
        out(f"ok: {len(shards)} shards, {samples} samples of {manifest.block_len} tokens in {data_dir} "
            f"({what} checked)")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hpctrain prep verify", description=__doc__.splitlines()[0])
    p.add_argument("dir", nargs="?", metavar="DIR", help="the shard directory (the one holding manifest.json)")
    p.add_argument("--out", metavar="DIR", help="same as DIR (as in `hpctrain prep shards verify --out DIR`)")
    p.add_argument("--quick", action="store_true", help="only existence and sizes (no reading)")
    a = p.parse_args(argv)
    data_dir = a.dir or a.out
    if not data_dir or (a.dir and a.out and a.dir != a.out):
        p.error("give the shard directory once: DIR or --out DIR")
    bad: list[int] = []
    code = run_command(lambda: bad.append(verify(data_dir, a.quick)), bad=(DataError,),
                       os_error="check the shard directory's path and permissions",
                       interrupted="interrupted (verify only reads: nothing changed)")
    return code or (1 if bad[0] else 0)


if __name__ == "__main__":
    sys.exit(main())
