"""Restartable, parallel, array-splittable preprocessing: plan -> work units -> journal -> merge -> manifest.

A build is cut into deterministic *work units* (a group of small text files, a byte range of a big jsonl,
a compressed jsonl file, a run of parquet row groups). Each unit is tokenised and packed on its own into
its own shards ``{split}-{unit:06d}-{part:04d}.tar`` (its last partial block is dropped), so the output
depends only on the inputs and settings, never on the number of workers or array tasks.

``OUT/.build/plan.json`` holds the plan and a fingerprint of everything that determines the bytes;
``OUT/.build/units/<unit>.json`` is written (atomically) when a unit's shards are all in place. A rerun
with the same fingerprint skips finished units; `merge` checks that every unit is finished, removes
stale shard files and writes ``manifest.json`` last, atomically. A complete set is only replaced with
`overwrite`, and its manifest is removed before anything else is touched, so a failed run leaves either
the previous usable set or no manifest at all.

Validation hold-out: whole *pieces* (text files, jsonl byte ranges / files, parquet row-group runs) are
routed to val by a hash of their name until they hold `val_fraction` of the bytes. Val units are packed
like train units, so there is no per-unit tiny val shard and no extra pass over the data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

from data_prep import lustre
from data_prep.packing import DEFAULT_BATCH_CHARS, split_names, write_unit
from data_prep.sources import BAD_LINES, Piece, ReadStats, iter_segments, plan_pieces
from data_prep.tokenizer import (
    TOKENIZER_JSON,
    check_vocab,
    load_tokenizer,
    sample_documents,
    train_tokenizer_from_docs,
)
from hpctrain.core.files import fsync_dir, read_json, write_json
from hpctrain.core.host import usable_cpus
from hpctrain.core.shard_format import (
    MANIFEST_NAME,
    MAX_BLOCK_LEN,
    SPLITS,
    TOKENIZER_DIR,
    DataError,
    Manifest,
    ShardInfo,
    TokenizerInfo,
    is_shard_file,
    read_manifest,
    sha256_file,
    token_dtype,
    write_manifest,
)

BUILD_DIR = ".build"
DEMO_MARKER = ".hpctrain-demo"  # written first into a directory the demo build owns (data_prep.demo)
PLAN_NAME = "plan.json"
UNITS_DIR = "units"
PLAN_VERSION = 1
DEFAULT_SHARD_MB = 64.0
MIN_UNIT_BYTES, MAX_UNIT_BYTES = 32_000_000, 256_000_000
DEFAULT_TOKENIZER_SAMPLE_MB = 1000.0
DELAY_ENV = "HPCTRAIN_PREP_UNIT_DELAY_S"  # testing aid: sleep after each unit (to kill a build midway)

Log = Callable[[str], None]


@dataclasses.dataclass
class BuildConfig:
    """Everything that determines the output bytes (workers and array tasks do not)."""

    seq_len: int = 2048
    shard_mb: float = DEFAULT_SHARD_MB
    unit_mb: float | None = None  # None: from the corpus size, clamp(total / 64, 32 MB, 256 MB)
    val_fraction: float = 0.01
    text_field: str = "text"
    bad_lines: str = "error"
    dtype: str = "auto"
    tokenizer_sample_mb: float = DEFAULT_TOKENIZER_SAMPLE_MB

    def check(self) -> None:
        if not isinstance(self.seq_len, int) or not 1 <= self.seq_len < MAX_BLOCK_LEN:
            raise DataError(f"seq_len={self.seq_len} must be an integer within [1, {MAX_BLOCK_LEN - 1}]: pass e.g. "
                            "--seq-len 2048")
        if not self.shard_mb > 0:
            raise DataError(f"shard_mb={self.shard_mb} must be > 0: pass e.g. --shard-mb 64")
        if self.unit_mb is not None and not self.unit_mb > 0:
            raise DataError(f"unit_mb={self.unit_mb} must be > 0: pass e.g. --unit-mb 256")
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"val_fraction={self.val_fraction} must be in [0, 1): pass e.g. 0.01")
        if self.bad_lines not in BAD_LINES:
            raise DataError(f"bad_lines={self.bad_lines!r}: use one of {BAD_LINES}")
        if self.dtype not in ("auto", "uint16", "uint32"):
            raise DataError(f"dtype={self.dtype!r}: use auto, uint16 or uint32")
        if not self.tokenizer_sample_mb > 0:
            raise DataError(f"tokenizer_sample_mb={self.tokenizer_sample_mb} must be > 0")

    def unit_bytes(self, total: int) -> int:
        if self.unit_mb is not None:
            return max(1, int(self.unit_mb * 1_000_000))
        return int(min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, total // 64)))


# --------------------------------------------------------------------------- small file helpers


def _build_path(out_dir: str, *parts: str) -> str:
    return os.path.join(out_dir, BUILD_DIR, *parts)


def _write_json_atomic(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, obj, sort_keys=True)


def make_out_dir(out_dir: str) -> None:
    """Create the output directory (and parents): a one-line DataError naming the obstacle when it cannot be
    created or written to (checked up front, not as a traceback halfway through the build)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        blocker = _file_in_path(out_dir)
        why = f"{blocker} is a file, not a directory" if blocker else e.strerror
        raise DataError(f"cannot create the output directory {out_dir} ({why}): choose an --out path under a "
                        "directory you can write to") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise DataError(f"the output directory {out_dir} is not writable: fix its permissions or choose "
                        "another --out")


def check_out_dir(out_dir: str, overwrite: bool, resumable: bool = False) -> None:
    """What a build may write into: a new or empty directory, or one of hpctrain's own builds (its journal
    `.build/`, a manifest, or the demo's mark). An unfinished build of other inputs or settings is replaced only
    with `overwrite`, unless `resumable` (it is the same build: its finished units are kept). Everything else is a
    one-line DataError: nothing of a directory hpctrain cannot prove it made is ever deleted or overwritten."""
    try:
        names = set(os.listdir(out_dir))
    except (FileNotFoundError, NotADirectoryError):  # new, or not a directory: make_out_dir says which
        return
    if names and not names & {BUILD_DIR, MANIFEST_NAME, DEMO_MARKER}:
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise DataError(f"{out_dir} is not empty ({shown}) and holds no shard build of hpctrain's (no "
                        f"{BUILD_DIR}/ or {MANIFEST_NAME}): choose a new or empty --out; nothing in it is touched")
    if not names & {BUILD_DIR, DEMO_MARKER} and MANIFEST_NAME in names:  # a common name: ours only if it parses
        try:
            read_manifest(out_dir)
        except DataError as e:
            raise DataError(f"{out_dir} holds a {MANIFEST_NAME} that is not an hpctrain shard set's ({e}): choose a "
                            "new or empty --out; nothing in it is touched") from None
    unfinished = BUILD_DIR in names and MANIFEST_NAME not in names
    if unfinished and not (resumable or overwrite):
        raise DataError(f"{out_dir} holds an unfinished build ({BUILD_DIR}/, no {MANIFEST_NAME}) of other inputs or "
                        "settings: rerun it with the same ones to finish it (finished units are kept), pass "
                        "--overwrite to discard it, or choose another --out")


def _file_in_path(path: str) -> str | None:
    """`path` itself or the parent of it that is an existing non-directory, if any."""
    path = os.path.abspath(path)
    while True:
        if os.path.exists(path) and not os.path.isdir(path):
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _read_json(path: str) -> Any | None:
    """A journal file, or None when missing or unreadable (a unit then counts as not done; a plan as absent)."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


def unit_id(unit: dict) -> str:
    return f"{unit['split']}-{unit['index']:06d}"


# --------------------------------------------------------------------------- planning


def group_units(pieces: list[Piece], val_fraction: float, unit_bytes: int) -> list[dict]:
    """Route pieces to train/val, then group each split's pieces into units (text files are pooled up
    to `unit_bytes`; a jsonl range / compressed file / row-group run is a unit of its own)."""
    by_name = {p.name: p for p in pieces}
    split = split_names(list(by_name), val_fraction, {n: max(p.bytes, 1) for n, p in by_name.items()})
    units: list[dict] = []
    for s in SPLITS:
        group: list[Piece] = []
        acc = 0

        def flush(group: list[Piece], split: str = s) -> None:
            if group:
                units.append({"split": split, "index": sum(u["split"] == split for u in units),
                              "pieces": [p.to_dict() for p in group], "bytes": sum(p.bytes for p in group)})

        for name in split[s]:
            piece = by_name[name]
            if piece.kind != "text":
                flush(group)
                group, acc = [], 0
                flush([piece])
                continue
            group.append(piece)
            acc += piece.bytes
            if acc >= unit_bytes:
                flush(group)
                group, acc = [], 0
        flush(group)
    return units


def _input_stats(files: list[str]) -> list[dict]:
    out = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError as e:
            raise DataError(f"cannot read input {f} ({e.strerror}): check the file and its permissions") from None
        out.append({"path": f, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


# --------------------------------------------------------------------------- one unit (runs in workers)

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_json: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER["tok"] = load_tokenizer(tokenizer_json)


def _unit_done(out_dir: str, fingerprint: str, unit: dict) -> bool:
    rec = _read_json(_build_path(out_dir, UNITS_DIR, unit_id(unit) + ".json"))
    if not isinstance(rec, dict) or rec.get("fingerprint") != fingerprint:
        return False
    for s in rec.get("shards", []):
        path = os.path.join(out_dir, s["name"])
        if not os.path.isfile(path) or os.path.getsize(path) != s["bytes"]:
            return False
    return True


def process_unit(out_dir: str, job: dict, unit: dict, tok=None) -> dict:
    """Tokenise, pack and write one unit, then record it in the journal; returns the record."""
    tok = tok if tok is not None else _WORKER["tok"]
    stats = ReadStats()
    pieces = [Piece(**p) for p in unit["pieces"]]
    segments = itertools.chain.from_iterable(
        iter_segments(p, job["text_field"], job["bad_lines"], stats) for p in pieces)
    shards, counts = write_unit(segments, tok, out_dir, unit["split"], unit["index"], job["block_len"],
                                job["dtype"], job["shard_bytes"], job.get("batch_chars", DEFAULT_BATCH_CHARS))
    if stats.skipped and not stats.documents:
        raise DataError(f"every document of work unit {unit_id(unit)} was skipped; the first: {stats.first_skip}")
    record = {"fingerprint": job["fingerprint"], "unit": unit_id(unit),
              "shards": [dataclasses.asdict(s) for s in shards], "documents": stats.documents,
              "skipped_lines": stats.skipped, "empty_documents": stats.empty, "tokens": counts.get("tokens", 0),
              "dropped_tokens": counts.get("dropped_tokens", 0)}
    _write_json_atomic(_build_path(out_dir, UNITS_DIR, unit_id(unit) + ".json"), record)
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay:
        time.sleep(delay)
    return record


def _work(args: tuple[str, dict, dict]) -> dict:
    return process_unit(*args)


def run_units(out_dir: str, job: dict, units: list[dict], workers: int, log: Log) -> list[dict]:
    """Process `units` with `workers` spawned processes (in this process when workers <= 1)."""
    records = []
    t0 = time.perf_counter()
    tok_json = os.path.join(out_dir, TOKENIZER_DIR, TOKENIZER_JSON)

    def progress(rec: dict) -> None:
        records.append(rec)
        log(f"  unit {rec['unit']} done: {len(rec['shards'])} shards, {rec['tokens']:,} tokens "
            f"[{len(records)}/{len(units)}, {time.perf_counter() - t0:.1f}s]")

    if workers <= 1 or len(units) <= 1:
        tok = load_tokenizer(tok_json)
        for unit in units:
            progress(process_unit(out_dir, job, unit, tok))
        return records
    # spawn: safe with the tokenizers thread pool and any parent state; in-flight work is one unit per
    # worker (imap hands out the next unit only when a worker asks), so memory does not grow with the corpus
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(workers, len(units)), initializer=_init_worker, initargs=(tok_json,)) as pool:
        for rec in pool.imap_unordered(_work, [(out_dir, job, u) for u in units], chunksize=1):
            progress(rec)
    return records


# --------------------------------------------------------------------------- build + merge


def _remove_manifest(out_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, MANIFEST_NAME))
        fsync_dir(out_dir)


def _clear_units(out_dir: str) -> None:
    """The journal's unit records (every file in `.build/units/` is one the build wrote, or its temporary)."""
    units_dir = _build_path(out_dir, UNITS_DIR)
    if os.path.isdir(units_dir):
        for name in os.listdir(units_dir):
            os.remove(os.path.join(units_dir, name))


def clear_journal(out_dir: str) -> None:
    """The journal's records, the plan (and its temporaries) and the units'; `.build/` itself, the mark of an
    hpctrain build, stays. Nothing else in `.build/` is touched."""
    for name in os.listdir(_build_path(out_dir)):
        if name.startswith(PLAN_NAME):
            os.remove(_build_path(out_dir, name))
    _clear_units(out_dir)


def _wipe_stale(out_dir: str) -> None:
    """Remove the shards and journal of an unfinished build with other settings (no manifest refers to them)."""
    for name in os.listdir(out_dir):
        if is_shard_file(name):
            os.remove(os.path.join(out_dir, name))
    _clear_units(out_dir)


def build(
    files: list[str],
    out_dir: str,
    config: BuildConfig,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    workers: int = 1,
    task_index: int = 0,
    num_tasks: int = 1,
    root: str | None = None,
    corpus: list[str] | None = None,
    sources: list[dict[str, Any]] | None = None,
    created_by: dict[str, Any] | None = None,
    overwrite: bool = False,
    stripe_count: int = lustre.DEFAULT_STRIPE_COUNT,
    stripe_size: str = lustre.DEFAULT_STRIPE_SIZE,
    log: Log = print,
) -> Manifest | None:
    """Preprocess `files` into `out_dir`. With `num_tasks == 1` the build ends with `merge` and returns the
    manifest; array task `task_index` of `num_tasks` only processes its share of the units (returns None)."""
    _check_arguments(files, out_dir, config, tokenizer, vocab_size, workers, task_index, num_tasks, stripe_count,
                     stripe_size)
    inputs = _input_stats(files)
    tok, tok_ident, dtype = _given_tokenizer(tokenizer, vocab_size, config)
    total = sum(i["size"] for i in inputs)
    settings = {**dataclasses.asdict(config), "unit_bytes": config.unit_bytes(total)}
    # (what the output depends on: not how the files were named on the command line, a glob or its expansion)
    fingerprint = _sha({"version": PLAN_VERSION, "settings": settings, "inputs": inputs, "root": root,
                        "tokenizer": tok_ident, "dtype": dtype, "sources": sources, "created_by": created_by})

    old = _read_json(_build_path(out_dir, PLAN_NAME))
    same = isinstance(old, dict) and old.get("fingerprint") == fingerprint
    check_out_dir(out_dir, overwrite, resumable=same or old is None)  # (no plan: no unit of other inputs yet)
    pieces = plan_pieces(files, settings["unit_bytes"], root)  # (a damaged input stops it before anything is made)
    if _up_to_date(out_dir, same, overwrite, log):
        return read_manifest(out_dir) if num_tasks == 1 else None
    make_out_dir(out_dir)
    os.makedirs(_build_path(out_dir), exist_ok=True)  # the mark of an hpctrain build, before anything else
    lustre.set_striping(out_dir, stripe_count, stripe_size)
    if old is not None and not same and num_tasks == 1:
        _wipe_stale(out_dir)

    units = group_units(pieces, config.val_fraction, settings["unit_bytes"])
    tok_json = _place_tokenizer(out_dir, tok, units, old if same else None, vocab_size, config, log)
    tok_final = load_tokenizer(tok_json)
    plan = {
        "version": PLAN_VERSION, "fingerprint": fingerprint, "settings": settings, "corpus": corpus,
        "inputs": inputs, "tokenizer_sha256": sha256_file(tok_json), "vocab_size": tok_final.vocab_size,
        "eos_id": tok_final.eos_id, "dtype": dtype, "sources": sources, "created_by": created_by or {},
        "units": units,
    }
    if old != plan:
        _write_json_atomic(_build_path(out_dir, PLAN_NAME), plan)
    _run_share(out_dir, plan, len(files), total, len(pieces), config, workers, task_index, num_tasks, log)
    if num_tasks > 1:
        log(f"task {task_index}/{num_tasks} done; when all tasks are: hpctrain prep merge --out {out_dir}")
        return None
    return merge(out_dir, log)


def _up_to_date(out_dir: str, same: bool, overwrite: bool, log: Log) -> bool:
    """Whether out_dir's shard set is this build's already; a set of other inputs or settings is refused, or with
    --overwrite loses its manifest first (from then on a crash leaves no manifest over changing shards)."""
    if not os.path.exists(os.path.join(out_dir, MANIFEST_NAME)):
        return False
    if same:
        log(f"{out_dir} is up to date (same inputs and settings): nothing to do")
        return True
    if not overwrite:
        raise DataError(f"{out_dir} already holds a shard set ({MANIFEST_NAME}) built from other inputs or "
                        "settings: choose another output directory or pass --overwrite")
    _remove_manifest(out_dir)
    return False


def _check_arguments(files, out_dir, config: BuildConfig, tokenizer, vocab_size, workers, task_index, num_tasks,
                     stripe_count, stripe_size) -> None:
    """Every argument of a build checked before anything is read or written."""
    config.check()
    lustre.check_striping(stripe_count, stripe_size)
    if not files:
        raise DataError(f"no input files for {out_dir}: pass a non-empty CORPUS glob")
    if workers < 1:
        raise DataError(f"workers={workers} must be >= 1: pass e.g. --workers {usable_cpus()}")
    if not (num_tasks >= 1 and 0 <= task_index < num_tasks):
        raise DataError(f"task {task_index} of {num_tasks}: need 0 <= --task-index < --num-tasks")
    if tokenizer is None and num_tasks > 1:
        raise DataError("array tasks need a shared tokenizer: train one first (hpctrain prep tokenizer / "
                        "make tokenizer) and pass --tokenizer DIR")
    if tokenizer is None and vocab_size is None:
        raise DataError("pass --tokenizer DIR (a tokenizer.json or local HF tokenizer dir) or --vocab-size N")
    if tokenizer is None:
        check_vocab(vocab_size)


def _given_tokenizer(tokenizer: str | None, vocab_size: int | None, config: BuildConfig):
    """(the given tokenizer loaded or None, what identifies it in the build's fingerprint, the token dtype)."""
    tok = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
        tok_ident = {"sha256": hashlib.sha256(tok.core.to_str(pretty=True).encode()).hexdigest(),
                     "eos_id": tok.eos_id}
        vocab = tok.vocab_size
    else:
        tok_ident = {"train_vocab_size": vocab_size, "sample_mb": config.tokenizer_sample_mb}
        vocab = vocab_size
    dtype = token_dtype(vocab) if config.dtype == "auto" else config.dtype
    if dtype == "uint16" and vocab > 2**16:
        raise DataError(f"the tokenizer has {vocab} tokens, too many for uint16 token ids: pass --dtype uint32 "
                        "(or --dtype auto)")
    return tok, tok_ident, dtype


def _place_tokenizer(out_dir: str, tok, units, same_plan: dict | None, vocab_size, config: BuildConfig,
                     log: Log) -> str:
    """The build's tokenizer in out_dir/tokenizer/: the given one saved, or one trained on the train units (kept
    when the same build trained it already); returns its tokenizer.json."""
    tok_dir = os.path.join(out_dir, TOKENIZER_DIR)
    tok_json = os.path.join(tok_dir, TOKENIZER_JSON)
    if tok is not None:
        tok.save(tok_dir)
    elif not (same_plan and os.path.isfile(tok_json) and sha256_file(tok_json) == same_plan.get("tokenizer_sha256")):
        train_pieces = [Piece(**p) for u in units if u["split"] == "train" for p in u["pieces"]]
        log(f"training a {vocab_size}-token BPE tokenizer on up to {config.tokenizer_sample_mb:g} MB "
            f"of {len(train_pieces)} train pieces")
        train_tokenizer_from_docs(sample_documents(train_pieces, int(config.tokenizer_sample_mb * 1e6),
                                                   config.text_field, config.bad_lines), vocab_size, tok_dir)
    return tok_json


def _run_share(out_dir: str, plan: dict, n_files: int, total: int, n_pieces: int, config: BuildConfig, workers: int,
               task_index: int, num_tasks: int, log: Log) -> None:
    """This task's share of the plan's units, those not done already."""
    units, fingerprint = plan["units"], plan["fingerprint"]
    mine = [u for i, u in enumerate(units) if i % num_tasks == task_index]
    todo = [u for u in mine if not _unit_done(out_dir, fingerprint, u)]
    n_val = sum(u["split"] == "val" for u in units)
    log(f"plan: {n_files} files, {total / 1e6:.1f} MB -> {len(units)} work units ({n_val} val)"
        + (f"; task {task_index}/{num_tasks} has {len(mine)}" if num_tasks > 1 else "")
        + (f"; {len(mine) - len(todo)} already done, skipped" if len(todo) < len(mine) else ""))
    if not n_val and config.val_fraction > 0:
        log(f"warning: no validation split ({n_pieces} input piece(s)); lower --unit-mb or add files")
    job = {"fingerprint": fingerprint, "block_len": config.seq_len + 1, "dtype": plan["dtype"],
           "shard_bytes": int(config.shard_mb * 1_000_000), "text_field": config.text_field,
           "bad_lines": config.bad_lines}
    run_units(out_dir, job, todo, workers, log)


def merge(out_dir: str, log: Log = print) -> Manifest:
    """Combine the finished units of a build into `manifest.json` (written last, atomically)."""
    plan = _read_json(_build_path(out_dir, PLAN_NAME))
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        raise DataError(f"no preprocessing plan in {out_dir}/{BUILD_DIR}: run the build (or its array tasks) "
                        "first, e.g. hpctrain prep shards --corpus ... --out " + out_dir)
    units = plan["units"]
    missing = [unit_id(u) for u in units if not _unit_done(out_dir, plan["fingerprint"], u)]
    if missing:
        raise DataError(f"{len(missing)} of {len(units)} work units in {out_dir} are not finished (first: "
                        f"{missing[0]}): rerun the build or the failed array tasks (finished units are skipped), "
                        "then merge again")
    tok_json = os.path.join(out_dir, TOKENIZER_DIR, TOKENIZER_JSON)
    if not os.path.isfile(tok_json) or sha256_file(tok_json) != plan["tokenizer_sha256"]:
        raise DataError(f"{tok_json} is missing or changed since the units were tokenised: rerun the build "
                        "with --overwrite")
    splits: dict[str, list[ShardInfo]] = {s: [] for s in SPLITS}
    totals = {"documents": 0, "skipped_lines": 0, "empty_documents": 0, "tokens": 0, "dropped_tokens": 0}
    for u in units:
        rec = _read_json(_build_path(out_dir, UNITS_DIR, unit_id(u) + ".json"))
        splits[u["split"]] += [ShardInfo(**s) for s in rec["shards"]]
        for k in totals:
            totals[k] += rec.get(k, 0)
    block_len = plan["settings"]["seq_len"] + 1
    if not splits["train"]:
        raise DataError(f"the train split of {out_dir} has no full block of {block_len} tokens: "
                        "use more text or a smaller --seq-len")
    sources = plan["sources"]
    if sources is None:
        sources = [{"corpus": plan["corpus"], "files": len(plan["inputs"]),
                    "bytes": sum(i["size"] for i in plan["inputs"]), **totals}]
    keep = {s.name for v in splits.values() for s in v}
    for name in sorted(os.listdir(out_dir)):
        if is_shard_file(name) and name not in keep:
            os.remove(os.path.join(out_dir, name))
    known = {unit_id(u) + ".json" for u in units}
    for name in os.listdir(_build_path(out_dir, UNITS_DIR)):
        if name not in known:
            os.remove(_build_path(out_dir, UNITS_DIR, name))
    fsync_dir(out_dir)
    manifest = Manifest(
        block_len=block_len, vocab_size=plan["vocab_size"], dtype=plan["dtype"], eos_id=plan["eos_id"],
        tokenizer=TokenizerInfo(path=os.path.relpath(tok_json, out_dir).replace(os.sep, "/"),
                                sha256=plan["tokenizer_sha256"]),
        splits=splits, sources=sources, created_by=plan["created_by"],
    )
    write_manifest(out_dir, manifest)
    log(f"shards: {manifest.num_samples('train')} train / {manifest.num_samples('val')} val blocks of "
        f"{block_len} tokens in {sum(map(len, splits.values()))} shards, {out_dir}/{MANIFEST_NAME} written")
    asked, val = plan["settings"].get("val_fraction") or 0, manifest.num_samples("val")
    share = val / max(1, val + manifest.num_samples("train"))
    if asked and share > 2 * asked:  # validation takes whole pieces: a few large ones overshoot
        log(f"warning: the validation split holds {share:.0%} of the blocks (--val-fraction {asked:g}): it takes whole "
            "pieces of the corpus (a compressed file is one), and this corpus has few; split it into more files, or "
            "pass --val-fraction 0 and build a validation set of its own")
    return manifest
