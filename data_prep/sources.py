"""Corpus inputs: expand globs, cut the files into deterministic pieces, stream documents out of a piece.

Input kinds, by file name:

- ``*.jsonl`` / ``*.ndjson``: one JSON object per line, the text in ``text_field``. Big files are cut into
  byte ranges of about ``piece_bytes`` at line starts, so one file feeds many workers and array tasks.
- ``*.jsonl.gz`` / ``*.jsonl.zst``: the same, streamed through the decompressor; one piece per file
  (a compressed stream cannot be entered in the middle).
- ``*.parquet``: the ``text_field`` column; pieces are runs of whole row groups.
- anything else: a UTF-8 text file that is one document. Files above `TEXT_CHUNK_CHARS` are read in chunks
  cut after a newline, so memory stays bounded (tokens may then differ at a cut from a whole-file encode).

Nothing here reads a whole large file: memory is bounded by one line (at most `MAX_LINE_BYTES`) / one parquet
batch / one text chunk, and the tokenizer gets any document in segments of at most `SEGMENT_CHARS`, cut after a
newline where there is one (it holds ~100 bytes per character of what it is given: a 25 MB document whole took
over a GB; tokens at a cut may differ from a whole-document encode).
A bad jsonl line (not JSON, not an object, no string `text_field`, longer than `MAX_LINE_BYTES`) or undecodable
text is an error naming ``file:line`` by default; with ``bad_lines="skip"`` it is skipped and counted. A
compressed file that is truncated or corrupt is always an error: its missing part is not a bad line.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from hpctrain.core.shard_format import DataError

TEXT_CHUNK_CHARS = 8_000_000
SEGMENT_CHARS = 1_000_000  # what the tokenizer gets at once: it holds ~100 bytes a character while encoding
MAX_LINE_BYTES = 64 * 2**20  # one jsonl line: a 64 MB document is beyond any real corpus's (books: ~1 MB)
PARQUET_BATCH_ROWS = 1024
BAD_LINES = ("error", "skip")


COMPRESSED = (".gz", ".zst", ".bz2", ".xz", ".lz4", ".zip")


def kind_of(path: str) -> str:
    """How a corpus file is read: JSON lines (`.json` too: what `datasets`' `to_json` writes), parquet, or text; a
    compressed file other than JSON lines' `.gz`/`.zst` is one DataError line."""
    name = path.lower()
    for ext in (".jsonl", ".ndjson", ".json"):
        if name.endswith(ext):
            return "jsonl"
        for comp in (".gz", ".zst"):
            if name.endswith(ext + comp):
                return "jsonl" + comp
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(COMPRESSED):
        raise DataError(f"{path}: only JSON lines are read compressed (.jsonl.gz, .jsonl.zst): decompress it, or "
                        "write it as JSON lines")
    return "text"


def expand_corpus(globs: list[str]) -> list[str]:
    """The files the globs match, sorted and de-duplicated; a glob that matches no file is an error."""
    if not globs:
        raise DataError("no corpus given: pass --corpus 'raw/*.jsonl' (quoted, so that Python expands it)")
    files: set[str] = set()
    for pattern in globs:
        found = [f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f)]
        if not found:
            raise DataError(f"corpus glob {pattern!r} matches no files (cwd {os.getcwd()}): "
                            "check the path and quote the glob")
        files.update(os.path.normpath(f) for f in found)
    return sorted(files, key=lambda p: p.replace(os.sep, "/"))


@dataclass(frozen=True)
class Piece:
    """A deterministic slice of one input file; the unit of validation hold-out."""

    path: str  # as given (relative to the working directory, or absolute)
    name: str  # relative to the corpus root, plus "@start" for a slice: what the val hash sees
    kind: str
    start: int = 0  # byte offset (jsonl) or first row group (parquet)
    end: int = -1  # byte end (jsonl) or row-group end (parquet); -1: to the end of the file
    bytes: int = 0  # size estimate, the weight for val fraction and unit grouping

    def to_dict(self) -> dict:
        return asdict(self)


def plan_pieces(files: list[str], piece_bytes: int, root: str | None = None) -> list[Piece]:
    """Cut `files` into pieces of about `piece_bytes` (jsonl byte ranges, parquet row groups)."""
    if not files:
        raise DataError("no input files: pass a non-empty CORPUS glob")
    root = root or os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    pieces: list[Piece] = []
    for path in files:
        name = os.path.relpath(os.path.abspath(path), root).replace(os.sep, "/")
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise DataError(f"cannot read input {path} ({e.strerror}): check the file and its permissions") from None
        kind = kind_of(path)
        if kind == "jsonl":
            pieces += _jsonl_pieces(path, name, size, piece_bytes)
        elif kind == "parquet":
            pieces += _parquet_pieces(path, name, piece_bytes)
        else:
            if kind == "jsonl.zst":  # checked when planned: a bad file stops the build before it writes anything
                with _open_binary(path) as f:
                    check_zstd(path, f)
            pieces.append(Piece(path, name, kind, 0, -1, size))
    return pieces


def _jsonl_pieces(path: str, name: str, size: int, piece_bytes: int) -> list[Piece]:
    cuts = [0]
    with _open_binary(path) as f:
        while cuts[-1] + piece_bytes < size:
            f.seek(cuts[-1] + piece_bytes - 1)  # from the byte before: a cut already at a line start stays
            f.readline()
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    cuts.append(size)
    return [Piece(path, name if a == 0 else f"{name}@{a}", "jsonl", a, b, b - a)
            for a, b in zip(cuts, cuts[1:]) if b > a]


def _parquet_meta(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path} is parquet but pyarrow is not installed: pip install pyarrow") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"cannot read parquet file {path} ({type(e).__name__}: {e}): "
                        "check or remove the file") from None


def _parquet_pieces(path: str, name: str, piece_bytes: int) -> list[Piece]:
    meta = _parquet_meta(path).metadata
    pieces, start, acc = [], 0, 0
    for g in range(meta.num_row_groups):
        acc += meta.row_group(g).total_byte_size
        if acc >= piece_bytes or g == meta.num_row_groups - 1:
            pieces.append(Piece(path, name if start == 0 else f"{name}@{start}", "parquet", start, g + 1, acc))
            start, acc = g + 1, 0
    return pieces


def _open_binary(path: str):
    try:
        return open(path, "rb")  # noqa: SIM115 (callers use it as a context manager)
    except OSError as e:
        raise DataError(f"cannot read input {path} ({e.strerror}): check the file and its permissions") from None


# --------------------------------------------------------------------------- reading documents


@dataclass
class ReadStats:
    documents: int = 0
    skipped: int = 0  # bad lines / undecodable files skipped under bad_lines="skip"
    empty: int = 0  # documents with empty or null text (ignored)
    first_skip: str = ""
    kinds: dict[str, int] = field(default_factory=dict)


class _Reader:
    def __init__(self, text_field: str, bad_lines: str, stats: ReadStats):
        if bad_lines not in BAD_LINES:
            raise DataError(f"bad_lines={bad_lines!r}: use one of {BAD_LINES}")
        self.text_field, self.bad_lines, self.stats = text_field, bad_lines, stats

    def bad(self, where: str, what: str, fix: str) -> None:
        msg = f"{where}: {what}: {fix}, or pass --bad-lines skip to skip and count such lines"
        if self.bad_lines == "error":
            raise DataError(msg)
        self.stats.skipped += 1
        self.stats.first_skip = self.stats.first_skip or msg

    def record(self, line: bytes, where: str) -> str | None:
        try:
            obj = json.loads(line)
        except ValueError as e:
            self.bad(where, f"not valid JSON ({e})", "fix or remove the line")
            return None
        if not isinstance(obj, dict):
            self.bad(where, f"a JSON {type(obj).__name__}, not an object", "write one JSON object per line")
            return None
        return self.field(obj.get(self.text_field, _MISSING), where, lambda: sorted(obj)[:8])

    def field(self, text, where: str, keys) -> str | None:
        if text is _MISSING:
            self.bad(where, f"no field {self.text_field!r} (fields: {', '.join(map(str, keys()))})",
                     "pass --text-field NAME")
            return None
        if text is None or text == "":
            self.stats.empty += 1
            return None
        if not isinstance(text, str):
            self.bad(where, f"field {self.text_field!r} is a {type(text).__name__}, not a string",
                     "pass --text-field naming a string field")
            return None
        self.stats.documents += 1
        return text


_MISSING = object()

Segment = tuple[str, bool]  # (text, ends_document)


def iter_segments(piece: Piece, text_field: str = "text", bad_lines: str = "error",
                  stats: ReadStats | None = None) -> Iterator[Segment]:
    """The piece's documents as (text, ends_document) segments of at most SEGMENT_CHARS, in file order."""
    reader = _Reader(text_field, bad_lines, stats if stats is not None else ReadStats())
    if piece.kind == "text":
        segments = _text_segments(piece, reader)
    else:
        docs = _parquet_docs(piece, reader) if piece.kind == "parquet" else _jsonl_docs(piece, reader)
        segments = ((doc, True) for doc in docs)
    for text, ends in segments:
        yield from _split_long(text, ends)


def _split_long(text: str, ends: bool, n: int = SEGMENT_CHARS) -> Iterator[Segment]:
    """A segment as pieces of at most `n` characters, each cut after the last newline (else whitespace) of its
    window where there is one; the last one ends the document if the segment did."""
    start = 0
    while len(text) - start > n:
        window = text[start:start + n]
        cut = window.rfind("\n") + 1 or max(window.rfind(" "), window.rfind("\t")) + 1 or n
        yield window[:cut], False
        start += cut
    yield text[start:], ends


def iter_documents(piece: Piece, text_field: str = "text", bad_lines: str = "error",
                   stats: ReadStats | None = None, max_chars: int | None = None) -> Iterator[str]:
    """Whole documents (a chunked text file is re-joined, up to `max_chars`)."""
    parts: list[str] = []
    for text, ends in iter_segments(piece, text_field, bad_lines, stats):
        parts.append(text)
        if ends:
            doc = "".join(parts)
            parts = []
            yield doc[:max_chars] if max_chars else doc


def _text_segments(piece: Piece, reader: _Reader) -> Iterator[Segment]:
    """A file below TEXT_CHUNK_CHARS is one segment; a bigger one is cut after its last newline in each
    window of two chunks (or mid-line, for a line longer than a chunk), holding at most two chunks."""
    n = TEXT_CHUNK_CHARS
    with _open_binary(piece.path) as raw:
        f = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        emitted = False
        try:
            pending = f.read(n)
            if not pending:
                reader.stats.empty += 1
                return
            while nxt := f.read(n):
                text = pending + nxt
                cut = max(text.rfind("\n") + 1, len(text) - n)
                yield text[:cut], False
                emitted, pending = True, text[cut:]
        except UnicodeDecodeError as e:
            reader.bad(piece.path, f"not UTF-8 text ({e.reason})", "convert or remove the file")
            if emitted:
                yield "", True  # close the document that was cut short
            return
        reader.stats.documents += 1
        yield pending, True


def _jsonl_docs(piece: Piece, reader: _Reader) -> Iterator[str]:
    with _open_binary(piece.path) as raw:
        if piece.kind == "jsonl.gz":
            f = gzip.GzipFile(fileobj=raw, mode="rb")
        elif piece.kind == "jsonl.zst":
            try:
                import zstandard
            except ImportError:
                raise DataError(f"{piece.path} is zstd-compressed but zstandard is not installed: "
                                "pip install zstandard") from None
            check_zstd(piece.path, raw)
            f = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
        else:
            f = raw
            f.seek(piece.start)
        pos, line_no = piece.start, 0
        end = piece.end if piece.end >= 0 else float("inf")
        while pos < end:
            try:
                line, size = _read_line(f)
            except Exception as e:  # gzip: BadGzipFile/EOFError, zstandard: ZstdError
                raise DataError(f"cannot decompress {piece.path} after line {line_no} ({type(e).__name__}: "
                                f"{e}): the file is corrupt or truncated, re-create or remove it") from None
            if not size:
                break
            line_no += 1
            here, pos = pos, pos + size
            where = f"{piece.path}:{line_no}" if piece.start == 0 else f"{piece.path} (line at byte {here})"
            if line is None:
                reader.bad(where, f"a line of {size:,} bytes, more than {MAX_LINE_BYTES // 2**20} MB",
                           "split that document into several lines")
                continue
            if not line.strip():
                continue
            text = reader.record(line, where)
            if text is not None:
                yield text


def _read_line(f) -> tuple[bytes | None, int]:
    """(the next line, its size in bytes); (None, size) for a line longer than MAX_LINE_BYTES, which is read past
    a chunk at a time and never held; (b"", 0) at the end."""
    line = f.readline(MAX_LINE_BYTES + 1)
    if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
        return line, len(line)
    size = len(line)
    while chunk := f.readline(2**20):
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return None, size


_ZSTD_MAGIC, _SKIPPABLE = 0xFD2FB528, 0x184D2A50


def check_zstd(path: str, f) -> None:
    """zstandard's stream reader ends a truncated file quietly, as if it were whole: its frames are walked first."""
    problem = zstd_damage(f)
    if problem:
        raise DataError(f"cannot decompress {path}: the file is corrupt or truncated ({problem}): re-create or remove "
                        "it (a missing part of a file is not a bad line: --bad-lines skip does not skip it)")


def zstd_damage(f) -> str | None:
    """What is wrong with the frames of a zstd file (read from its start, headers only: the blocks are skipped
    over, not decompressed), or None when every frame ends with its last block. Leaves `f` at its start."""
    import struct

    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0)
    pos, frames = 0, 0
    try:
        while pos < size:
            f.seek(pos)
            magic_bytes = f.read(4)
            if len(magic_bytes) < 4:
                return f"{size - pos} stray bytes after frame {frames}"
            magic = struct.unpack("<I", magic_bytes)[0]
            if magic & 0xFFFFFFF0 == _SKIPPABLE:
                pos += 8 + struct.unpack("<I", f.read(4).ljust(4, b"\0"))[0]
                frames += 1
                continue
            if magic != _ZSTD_MAGIC:
                return f"no zstd frame at byte {pos}"
            descriptor = f.read(1)[0]
            single = descriptor >> 5 & 1
            fcs = (1 if single else 0, 2, 4, 8)[descriptor >> 6]
            pos += 5 + (0 if single else 1) + (0, 1, 2, 4)[descriptor & 3] + fcs
            while True:
                f.seek(pos)
                header = f.read(3)
                if len(header) < 3:
                    return f"frame {frames} ends before its last block (at byte {size})"
                value = int.from_bytes(header, "little")
                block_type, block_size = value >> 1 & 3, value >> 3
                if block_type == 3:
                    return f"a reserved block type at byte {pos}"
                pos += 3 + (1 if block_type == 1 else block_size)
                if pos > size:
                    return f"frame {frames} ends inside a block (at byte {size} of {pos})"
                if value & 1:
                    break
            pos += 4 if descriptor >> 2 & 1 else 0  # the content checksum
            if pos > size:
                return f"frame {frames} ends inside its checksum"
            frames += 1
    finally:
        f.seek(0)
    return None if frames else "no frame at all"


def _parquet_docs(piece: Piece, reader: _Reader) -> Iterator[str]:
    pf = _parquet_meta(piece.path)
    names = pf.schema_arrow.names
    if reader.text_field not in names:
        raise DataError(f"{piece.path}: no column {reader.text_field!r} (columns: {', '.join(names[:8])}): "
                        "pass --text-field NAME")
    row = 0
    groups = list(range(piece.start, piece.end if piece.end >= 0 else pf.metadata.num_row_groups))
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=groups, columns=[reader.text_field]):
        for text in batch.column(0).to_pylist():
            row += 1
            out = reader.field(text, f"{piece.path} row {row} of row group {piece.start}", lambda: names)
            if out is not None:
                yield out
