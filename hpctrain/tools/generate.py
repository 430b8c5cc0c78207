"""Sample text from a trained run: `python -m hpctrain generate run_dir=… prompt="def " [max_new_tokens=…]`."""

from __future__ import annotations

import math
import os
import sys

import torch
from omegaconf.errors import OmegaConfBaseException

from hpctrain.storage import checkpoint

USAGE = ("usage: python -m hpctrain generate run_dir=DIR [prompt=TEXT] [max_new_tokens=N] [temperature=T] "
         "[top_k=K] [seed=S] [checkpoint=DIR]\nsamples from the run's latest checkpoint (or checkpoint=DIR); "
         "temperature=0 is greedy, top_k=0 samples from the whole vocabulary, an empty prompt starts a new document")


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = 50, eos_id: int | None = None, generator: torch.Generator | None = None) -> list[int]:
    """Autoregressive sampling (full recompute per token: fine for the context lengths we demo)."""
    ctx = model.args.max_seq_len
    tokens = torch.tensor([prompt], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -ctx:])[0, -1].float()
        if temperature < 1e-4:  # greedy (a smaller temperature would overflow the softmax to NaN)
            nxt = logits.argmax()
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[0]
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
        if eos_id is not None and nxt.item() == eos_id:
            break
    return tokens[0, len(prompt):].tolist()


class GenerateError(ValueError):
    """Bad arguments: one line naming the fix."""


def load_run(run_dir: str, ckpt: str | None = None) -> tuple[torch.nn.Module, object, str, str]:
    """The model of a run's latest (or the given) checkpoint, its config, its data directory and the checkpoint."""
    from hpctrain.models import build_model
    from hpctrain.runs.rundir import run_config

    cfg, ckpt = run_config(run_dir, ckpt)
    model = build_model(cfg.model)
    checkpoint.load_model(ckpt, model)
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise GenerateError(f"checkpoint {ckpt} holds non-finite weights (its run diverged): pass checkpoint=DIR of "
                            "an earlier one")
    return model.eval(), cfg, os.path.expanduser(cfg.data.path), ckpt


# key=value options: type, default, and the smallest and largest values allowed.
MAX_NEW_TOKENS = 100_000  # each token recomputes the whole context: beyond this a run would take days
OPTIONS = {"run_dir": (str, None, None, None), "prompt": (str, "def ", None, None),
           "max_new_tokens": (int, 100, 0, MAX_NEW_TOKENS), "temperature": (float, 0.8, 0.0, 1e6),
           "top_k": (int, 50, 0, 2**31), "seed": (int, 0, 0, 2**63 - 1), "checkpoint": (str, None, None, None)}


def parse(argv: list[str]) -> dict:
    """`key=value` arguments checked against OPTIONS; raises GenerateError naming the bad one."""
    opts = {k: default for k, (_, default, _, _) in OPTIONS.items()}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in OPTIONS:
            raise GenerateError(f"unknown argument {arg!r}: use key=value with keys {', '.join(OPTIONS)}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # bytes the terminal's encoding could not decode (surrogate escapes)
            raise GenerateError(f"{key}= is not valid UTF-8 text: pass it in your terminal's UTF-8 encoding") from None
        kind, _, low, high = OPTIONS[key]
        try:
            opts[key] = kind(value)
        except ValueError:
            raise GenerateError(f"{key}={value} is not {'an integer' if kind is int else 'a number'}") from None
        if low is not None and not (low <= opts[key] <= high) or kind is float and not math.isfinite(opts[key]):
            raise GenerateError(f"{key}={value} must be a finite number within [{low}, {high}]")
    if not opts["run_dir"]:
        raise GenerateError("run_dir=DIR is required: the directory of a training run")
    return opts


def run(opts: dict) -> str:
    from data_prep.tokenizer import load_tokenizer
    from hpctrain.core.shard_format import read_manifest

    model, cfg, data_dir, ckpt = load_run(opts["run_dir"], opts["checkpoint"])
    manifest = read_manifest(data_dir)
    checkpoint.check_tokenizer(ckpt, data_dir, manifest.tokenizer.sha256)
    tok = load_tokenizer(os.path.join(data_dir, manifest.tokenizer.path))
    # An empty prompt samples from a document boundary: documents are joined by EOS in the shards.
    ids = tok.encode(opts["prompt"]) or [manifest.eos_id]
    gen = torch.Generator().manual_seed(opts["seed"])
    out = sample(model, ids, opts["max_new_tokens"], opts["temperature"], opts["top_k"], manifest.eos_id, gen)
    return opts["prompt"] + tok.decode(out, skip_special_tokens=True)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from hpctrain.core.command import run_command
    from hpctrain.core.errors import CheckpointError
    from hpctrain.data.loader import DataError
    from hpctrain.runs.rundir import RunDirError
    from hpctrain.storage.checkpoint import as_tool_says

    def work() -> None:
        with as_tool_says():
            print(run(parse(argv)))

    return run_command(work, "hpctrain generate",
                       (GenerateError, RunDirError, CheckpointError, DataError, OmegaConfBaseException))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
