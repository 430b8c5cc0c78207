"""Train a byte-level BPE tokenizer, or load an existing one (tokenizer.json or a local HF tokenizer dir)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_prep.shard_format import EOS_TOKEN, DataError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Tried in order when a tokenizer does not name its EOS token.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the EOS id that separates documents.

    `encode_batch` returns plain id lists and never adds special tokens (BOS/EOS templates of HF
    tokenizers are skipped): document separation is the writer's job.
    """

    def __init__(self, core: Tokenizer, eos_id: int):
        self.core = core
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


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def train_tokenizer(files: list[str], vocab_size: int, out_dir: str) -> str:
    """Train a byte-level BPE (EOS = `<|endoftext|>`, id 0) on text files; returns out_dir/tokenizer.json.

    Deterministic: the same files in the same order give a byte-identical tokenizer.json.
    """
    if not files:
        raise DataError(f"no training files for the tokenizer in {out_dir}: pass at least one text file")
    if vocab_size < 257:
        raise DataError(f"tokenizer vocab_size={vocab_size} is below 257 (256 bytes + EOS): use a larger one")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train([os.fspath(f) for f in files], trainer)
    return TextTokenizer(core, core.token_to_id(EOS_TOKEN)).save(out_dir)


def load_tokenizer(path: str, eos_token: str | None = None) -> TextTokenizer:
    """Load a tokenizer.json file, a directory holding only tokenizer.json, or any local HF tokenizer
    directory (via transformers, offline). `eos_token` overrides the EOS the tokenizer declares."""
    path = os.fspath(path)
    if os.path.isdir(path):
        json_path = os.path.join(path, TOKENIZER_JSON)
        if os.path.isfile(json_path) and not os.path.isfile(os.path.join(path, TOKENIZER_CONFIG)):
            return load_tokenizer(json_path, eos_token)
        return _load_hf_dir(path, eos_token)
    if not os.path.isfile(path):
        raise DataError(f"tokenizer {path} does not exist: pass a tokenizer.json file or a tokenizer directory")
    try:
        core = Tokenizer.from_file(path)
    except Exception as e:
        raise DataError(f"cannot load tokenizer {path} ({e}): pass a HF tokenizers tokenizer.json") from None
    return TextTokenizer(core, _eos_id(core, eos_token, None, path))


def _load_hf_dir(path: str, eos_token: str | None) -> TextTokenizer:
    from transformers import AutoTokenizer  # slow import: only for HF tokenizer directories

    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
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
    raise DataError(f"tokenizer {path} has no EOS token among {candidates}: pass eos_token=... naming one")
