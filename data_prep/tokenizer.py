"""Train a byte-level BPE tokenizer, or load an existing one (tokenizer.json or a local HF tokenizer dir).

`hpctrain prep tokenizer --corpus GLOB... --vocab N --out DIR [--text-field text] [--sample-mb M]`
trains on a bounded sample streamed from the corpus (any input kind `data_prep.sources` reads).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_prep.sources import Piece, iter_segments
from hpctrain.core.files import FileCheckError, MiB, atomic_write, check_file, read_json
from hpctrain.core.shard_format import EOS_TOKEN, DataError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_TOKENIZER_BYTES = 512 * MiB  # the largest published tokenizer.json files are tens of MB
MAX_VOCAB = 2**20  # a trained vocabulary: far beyond any published one; the BPE trainer's memory grows with it
# Tried in order when a tokenizer does not name its EOS token.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the EOS id that separates documents.

    `encode_batch` returns plain id lists and never adds special tokens (BOS/EOS templates of HF
    tokenizers are skipped): document separation is the writer's job.
    """

    def __init__(self, core: Tokenizer, eos_id: int):
        self.core = core
        core.encode_special_tokens = True  # a document's literal "<|endoftext|>" is text, not a boundary (unsaved)
        self.eos_id = int(eos_id)
        self.eos_token = core.id_to_token(self.eos_id)

    @property
    def vocab_size(self) -> int:
        return self.core.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.core.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encode = getattr(self.core, "encode_batch_fast", self.core.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.core.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, out_dir: str) -> str:
        """Write `tokenizer.json` (+ a minimal `tokenizer_config.json` so that
        `transformers.AutoTokenizer.from_pretrained(out_dir)` works); returns the tokenizer.json path."""
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, TOKENIZER_JSON)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.eos_token,
            "eos_token": self.eos_token,
            "unk_token": self.eos_token,
            "add_bos_token": False,
            "add_eos_token": False,
        }
        _write_atomic(path, self.core.to_str(pretty=True))
        _write_atomic(os.path.join(out_dir, TOKENIZER_CONFIG), json.dumps(config, indent=2, sort_keys=True))
        return path


_BYTE_LEVEL = frozenset(pre_tokenizers.ByteLevel.alphabet())  # a byte-level token's characters, one per byte


def token_bytes(tok: TextTokenizer) -> list[int]:
    """The UTF-8 bytes of text each token id stands for, special tokens (EOS) 0: bits per byte's divisor, which does
    not depend on the tokenizer. Exact for byte-level BPE (GPT-2's, Llama 3's, the demo's: each character of a token
    is one byte); for other tokenizers the token decoded alone (a decoder that strips a leading space counts it not)."""
    core = tok.core
    special = {tok.eos_id} | {i for i, t in core.get_added_tokens_decoder().items() if t.special}
    byte_level = isinstance(core.decoder, decoders.ByteLevel)
    out = []
    for i in range(tok.vocab_size):
        piece = core.id_to_token(i)
        if i in special or piece is None:
            out.append(0)
        elif byte_level and all(c in _BYTE_LEVEL for c in piece):
            out.append(len(piece))
        else:
            out.append(len(core.decode([i], skip_special_tokens=False).encode("utf-8")))
    return out


def _write_atomic(path: str, text: str) -> None:
    """Replace `path` by `text` atomically; a no-op when it already holds exactly that (so concurrent
    array tasks saving the same tokenizer never rewrite a file another task is reading)."""
    data = text.encode("utf-8")
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except OSError:
        pass
    atomic_write(path, data)


def check_vocab(vocab_size: int) -> None:
    if not 257 <= vocab_size <= MAX_VOCAB:
        raise DataError(f"tokenizer vocab_size={vocab_size} must be within [257, {MAX_VOCAB}] (256 bytes + EOS at "
                        "least; published vocabularies are 32k-256k): pass e.g. --vocab-size 32000")


def _bpe(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    check_vocab(vocab_size)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return core, trainer


def train_tokenizer(files: list[str], vocab_size: int, out_dir: str) -> str:
    """Train a byte-level BPE (EOS = `<|endoftext|>`, id 0) on text files; returns out_dir/tokenizer.json.

    Deterministic: the same files in the same order give a byte-identical tokenizer.json.
    """
    if not files:
        raise DataError(f"no training files for the tokenizer in {out_dir}: pass at least one text file")
    core, trainer = _bpe(vocab_size)
    core.train([os.fspath(f) for f in files], trainer)
    return TextTokenizer(core, core.token_to_id(EOS_TOKEN)).save(out_dir)


def train_tokenizer_from_docs(docs: Iterable[str], vocab_size: int, out_dir: str) -> str:
    """Train the same byte-level BPE from a document iterator (streamed: only the trainer's word counts
    stay in memory); returns out_dir/tokenizer.json. Deterministic for the same documents."""
    core, trainer = _bpe(vocab_size)
    seen = [0]

    def counted() -> Iterator[str]:
        for doc in docs:
            seen[0] += 1
            yield doc

    core.train_from_iterator(counted(), trainer)
    if not seen[0]:
        raise DataError(f"no documents to train the tokenizer in {out_dir} on: check the corpus and --text-field")
    return TextTokenizer(core, core.token_to_id(EOS_TOKEN)).save(out_dir)


def sample_documents(pieces: Sequence[Piece], max_bytes: int, text_field: str = "text",
                     bad_lines: str = "error") -> Iterator[str]:
    """A deterministic, bounded sample for tokenizer training: every piece contributes its first documents
    up to its share (by size) of `max_bytes`, so the sample spans the whole corpus without reading it. A long
    document comes as its segments (`iter_segments`): the trainer holds every word of what it is given at once."""
    total = sum(max(p.bytes, 1) for p in pieces)
    for piece in pieces:
        budget = max_bytes * max(piece.bytes, 1) / total
        taken = 0
        for text, _ in iter_segments(piece, text_field, bad_lines):
            yield text[:max(int(budget), 1)]
            taken += len(text)
            if taken >= budget:
                break


def load_tokenizer(path: str, eos_token: str | None = None) -> TextTokenizer:
    """Load a tokenizer.json file, a directory holding only tokenizer.json, or any local HF tokenizer
    directory (via transformers, offline). `eos_token` overrides the EOS the tokenizer declares."""
    path = os.fspath(path)
    if os.path.isdir(path):
        json_path = os.path.join(path, TOKENIZER_JSON)
        # no config, or a generic fast tokenizer's: no transformers import needed
        if os.path.isfile(json_path) and _generic_config(os.path.join(path, TOKENIZER_CONFIG)) is not None:
            return load_tokenizer(json_path, eos_token)
        return _load_hf_dir(path, eos_token)
    if not os.path.isfile(path):
        raise DataError(f"tokenizer {path} does not exist: pass a tokenizer.json file or a tokenizer directory")
    core = _core(path)
    # a tokenizer.json beside a generic config (as `save` writes it) has the EOS that config declares
    config = _generic_config(os.path.join(os.path.dirname(path), TOKENIZER_CONFIG)) \
        if os.path.basename(path) == TOKENIZER_JSON else None
    declared = (config or {}).get("eos_token")
    declared = declared.get("content") if isinstance(declared, dict) else declared
    return TextTokenizer(core, _eos_id(core, eos_token or declared, None, path))


def _core(path: str) -> Tokenizer:
    """A tokenizer.json file, its size checked first."""
    try:
        check_file(path, MAX_TOKENIZER_BYTES)
        return Tokenizer.from_file(path)
    except FileCheckError as e:
        raise DataError(f"tokenizer {e}") from None
    except Exception as e:
        raise DataError(f"cannot load tokenizer {path} ({e}): pass a HF tokenizers tokenizer.json") from None


def vocab_difference(a: str, b: str) -> str | None:
    """None when the tokenizer.json files `a` and `b` give every token the same id; else the sizes and the first id
    that differs, `a`'s first (a model's weights trained on one mean nothing in the other's ids)."""
    va, vb = (_core(path).get_vocab(with_added_tokens=True) for path in (a, b))
    if va == vb:
        return None
    ia, ib = ({i: t for t, i in v.items()} for v in (va, vb))
    first = min(i for i in set(ia) | set(ib) if ia.get(i) != ib.get(i))
    return f"{len(va)} vs {len(vb)} tokens; id {first}: {ia.get(first, 'none')!r} vs {ib.get(first, 'none')!r}"


def _generic_config(path: str) -> dict | None:
    """{} when there is no tokenizer_config.json, the config when it names the generic
    PreTrainedTokenizerFast class (its tokenizer.json is used as is), else None (load via transformers)."""
    if not os.path.isfile(path):
        return {}
    try:
        config = read_json(path)
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and config.get("tokenizer_class") == "PreTrainedTokenizerFast":
        return config
    return None


def _refuse_code(path: str) -> None:
    """A directory whose configs map classes to its own Python files (`auto_map`) would have transformers offer to
    run them: data directories never run code here (one DataError line, before transformers is asked)."""
    for name in (TOKENIZER_CONFIG, "config.json"):
        file = os.path.join(path, name)
        try:
            doc = read_json(file) if os.path.isfile(file) else {}
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {file} ({e}): fix or remove it") from None
        if isinstance(doc, dict) and doc.get("auto_map"):
            raise DataError(f"tokenizer directory {path} asks to run its own Python code ({name} has an auto_map): "
                            "hpctrain never runs code from a data directory; pass its tokenizer.json alone, or a "
                            "tokenizer directory without custom code")


def _load_hf_dir(path: str, eos_token: str | None) -> TextTokenizer:
    from transformers import AutoTokenizer  # slow import: only for HF tokenizer directories

    _refuse_code(path)
    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise DataError(f"cannot load tokenizer directory {path} ({type(e).__name__}): "
                        "pass a tokenizer.json file or a local HF tokenizer directory") from None
    core = getattr(hf, "backend_tokenizer", None)
    if core is None:
        raise DataError(f"tokenizer in {path} has no fast (tokenizers) backend: convert it to tokenizer.json")
    return TextTokenizer(core, _eos_id(core, eos_token, getattr(hf, "eos_token", None), path))


def _eos_id(core: Tokenizer, eos_token: str | None, declared: str | None, path: str) -> int:
    candidates = [eos_token] if eos_token else [t for t in (declared, *EOS_CANDIDATES) if t]
    for token in candidates:
        token_id = core.token_to_id(token)
        if token_id is not None:
            return token_id
    raise DataError(f"tokenizer {path} has no EOS token among {candidates}: declare one (set the tokenizer's "
                    "eos_token and save_pretrained it again)")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import time

    from data_prep.sources import expand_corpus, plan_pieces
    from hpctrain.core.command import run_command

    p = argparse.ArgumentParser(prog="hpctrain prep tokenizer",
                                description="Train a byte-level BPE tokenizer on a corpus (streamed, bounded sample).")
    p.add_argument("--corpus", nargs="+", required=True, metavar="GLOB",
                   help="text files (one document each), .jsonl[.gz|.zst] or .parquet; quote the globs")
    p.add_argument("--vocab", "--vocab-size", dest="vocab", type=int, required=True, help="vocabulary size")
    p.add_argument("--out", required=True, help="output directory (gets tokenizer.json + tokenizer_config.json)")
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    p.add_argument("--sample-mb", type=float, default=1000.0,
                   help="train on at most this much text, spread over the whole corpus (default %(default)s)")
    p.add_argument("--bad-lines", choices=("error", "skip"), default="error")
    a = p.parse_args(argv)
    t0 = time.perf_counter()

    def work() -> None:
        taken = [n for n in (TOKENIZER_JSON, TOKENIZER_CONFIG) if os.path.lexists(os.path.join(a.out, n))]
        if taken:
            raise DataError(f"{a.out} already holds {taken[0]}: choose a new --out (a tokenizer is never overwritten)")
        check_vocab(a.vocab)  # before the corpus is read
        if not a.sample_mb > 0:
            raise DataError(f"--sample-mb {a.sample_mb}: the tokenizer learns from a sample of the corpus; pass a "
                            "positive size, e.g. --sample-mb 1000")
        pieces = plan_pieces(expand_corpus(a.corpus), piece_bytes=256_000_000)
        docs = sample_documents(pieces, int(a.sample_mb * 1e6), a.text_field, a.bad_lines)
        path = train_tokenizer_from_docs(docs, a.vocab, a.out)
        got = _core(path).get_vocab_size(with_added_tokens=True)
        short = f" of the {a.vocab} asked: the sample held no more merges" if got < a.vocab else ""
        print(f"tokenizer: {path} (vocab {got}{short}, {time.perf_counter() - t0:.1f}s)")

    return run_command(work, bad=(DataError,), os_error="choose an --out you can write to",
                       interrupted="interrupted: nothing was written")


if __name__ == "__main__":
    sys.exit(main())
