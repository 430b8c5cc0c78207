"""Sample text from a trained run: `python -m hpctrain.generate run_dir=… prompt="def " [max_new_tokens=…]`."""

from __future__ import annotations

import os
import sys

import torch
from omegaconf import OmegaConf

from hpctrain import checkpoint
from hpctrain.model import Llama

USAGE = ("usage: python -m hpctrain.generate run_dir=DIR [prompt=TEXT] [max_new_tokens=N] [temperature=T] "
         "[top_k=K] [seed=S] [checkpoint=DIR]")


@torch.no_grad()
def sample(model: Llama, prompt: list[int], max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = 50, eos_id: int | None = None, generator: torch.Generator | None = None) -> list[int]:
    """Autoregressive sampling (full recompute per token: fine for the context lengths we demo)."""
    ctx = model.args.max_seq_len
    tokens = torch.tensor([prompt], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -ctx:])[0, -1].float()
        if temperature <= 0:
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


def load_run(run_dir: str, ckpt: str | None = None) -> tuple[Llama, object, str]:
    """The model of a run's latest (or the given) checkpoint, its config, and its data directory."""
    from hpctrain.config import model_args, register

    register()  # the saved config may use hpctrain's resolvers (e.g. the demo data path)
    cfg = OmegaConf.load(os.path.join(run_dir, ".hydra", "config.yaml"))
    ckpt = ckpt or checkpoint.latest(run_dir)
    if ckpt is None:
        raise SystemExit(f"hpctrain.generate: error: no complete checkpoint in {run_dir}/checkpoints")
    model = Llama(model_args(cfg))
    checkpoint.load_model(ckpt, model)
    return model.eval(), cfg, os.path.expanduser(cfg.data.path)


def main(argv: list[str]) -> None:
    opts = dict(a.split("=", 1) for a in argv if "=" in a)
    if "run_dir" not in opts or any("=" not in a for a in argv):
        raise SystemExit(USAGE)
    from data_prep.shard_format import read_manifest
    from data_prep.tokenizer import load_tokenizer

    model, cfg, data_dir = load_run(opts["run_dir"], opts.get("checkpoint"))
    manifest = read_manifest(data_dir)
    tok = load_tokenizer(os.path.join(data_dir, manifest.tokenizer.path))
    prompt = opts.get("prompt", "def ")
    ids = tok.encode(prompt)
    gen = torch.Generator().manual_seed(int(opts.get("seed", 0)))
    out = sample(model, ids, int(opts.get("max_new_tokens", 100)), float(opts.get("temperature", 0.8)),
                 int(opts.get("top_k", 50)), manifest.eos_id, gen)
    print(prompt + tok.decode(out, skip_special_tokens=True))


if __name__ == "__main__":
    main(sys.argv[1:])
