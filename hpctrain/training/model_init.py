"""The run's model on its layout, with the weights one process would draw."""

from __future__ import annotations

import os

import torch

from hpctrain.core.config import ModelConfig, ParallelConfig
from hpctrain.models import init_source, spec_of
from hpctrain.parallel.init import init_parameters
from hpctrain.parallel.layout import Layout
from hpctrain.parallel.parallelize import parallelize, tied_aliases


def build_model(model_cfg: ModelConfig, parallel: ParallelConfig, layout: Layout, mesh, device: torch.device,
                dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """Build on the meta device, parallelize (computing in `dtype`), then allocate and initialise from `seed`: each
    rank materialises and draws only its shards, with the values one process draws (`hpctrain.parallel.init`). No
    full copy on any rank."""
    spec = spec_of(model_cfg)
    args = spec.args(model_cfg)
    with torch.device("meta"):
        model = spec.build(args)
    model = parallelize(model, layout, mesh, parallel, spec, dtype)
    model.to_empty(device=device)
    model.init_buffers()
    model.tie_weights()
    init_parameters(model, spec.init_rule(args), seed, tied_aliases(model))
    return model.train()


def check_init_from(model_cfg: ModelConfig, tokenizer_sha256: str | None = None,
                    tokenizer_json: str | None = None) -> None:
    """model.init_from names weights this model can start from, trained on the token ids of the run's shards
    (their tokenizer: `tokenizer_sha256`, `tokenizer_json`) when the source says which — a checkpoint's recorded
    sha, a transformers directory's own tokenizer.json — (one-line ValueError/CheckpointError otherwise); reads
    only metadata and tokenizers, before anything is spawned."""
    from hpctrain.storage import checkpoint

    source = init_source(model_cfg)
    if source is None:
        return
    hf, path = source
    spec = spec_of(model_cfg)
    if hf:
        spec.hf().check_hf_dir(path, spec.args(model_cfg))
        _check_hf_tokenizer(path, tokenizer_json)
        return
    theirs = checkpoint.trained_tokenizer(path)  # (a complete checkpoint first: its trainer state)
    checkpoint.check_model(path, spec.weights(spec.args(model_cfg)))
    if tokenizer_sha256 and theirs and theirs != tokenizer_sha256:
        raise ValueError(f"its weights were trained on token ids of another tokenizer (sha256 {theirs[:12]}) than "
                         f"data.path's shards ({tokenizer_sha256[:12]}): point data.path at shards made with that "
                         "tokenizer (make shards TOKENIZER=<its run's data.path>/tokenizer)")


def _check_hf_tokenizer(path: str, tokenizer_json: str | None) -> None:
    """A transformers directory that ships its tokenizer.json gives its tokens the ids of the shards' tokenizer
    (a directory without one: nothing to compare)."""
    from data_prep.tokenizer import TOKENIZER_JSON, vocab_difference
    from hpctrain.core.shard_format import DataError

    theirs = os.path.join(path, TOKENIZER_JSON)
    if tokenizer_json is None or not os.path.lexists(theirs):
        return
    try:
        difference = vocab_difference(theirs, tokenizer_json)
    except DataError as e:
        raise ValueError(str(e)) from None
    if difference:
        raise ValueError(f"its tokenizer ({theirs}) numbers tokens differently from the one of data.path's shards "
                         f"({difference}): its weights would read other words; build the shards with its tokenizer "
                         f"(hpctrain prep shards --tokenizer {path} ...)")


def load_initial_weights(model: torch.nn.Module, model_cfg: ModelConfig, run_dir: str) -> str | None:
    """Overwrite the drawn weights with model.init_from's, in place, each rank reading its own shards; returns
    what was loaded (None when unset). Collective when distributed. A source in the outputs of the run this one
    started over from (its own export or checkpoint) is read where they were set aside."""
    from hpctrain.runs.rundir import moved
    from hpctrain.storage import checkpoint

    source = init_source(model_cfg)
    if source is None:
        return None
    hf, path = source[0], moved(source[1], run_dir)
    spec = spec_of(model_cfg)
    if hf:
        spec.hf().load_hf_weights(model, path, spec.args(model_cfg))
    else:
        checkpoint.load_weights(path, model, spec.weights(spec.args(model_cfg)))
    return model_cfg.init_from
