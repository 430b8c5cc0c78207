"""`model.init_from=hf:DIR` is all a run needs to say about its model: the shape comes from DIR's config.json.

Applied where a config is composed (`runs.compose.compose`, the training command, `plan`), with the overrides the
user typed: every model key config.json sets replaces the `model` group's default, the family is the one that reads
the directory's `model_type`, and a `model.KEY=value` override that contradicts config.json is refused in one line
(numbers equal once rounded to float32 are equal). `model.max_seq_len` and `model.init_std` may be set apart from
the checkpoint: how far the RoPE tables reach, and the scale of a draw the weights replace.
"""

from __future__ import annotations

import dataclasses
import os

from omegaconf import OmegaConf

from hpctrain.core.config import ConfigError, TransformerDims
from hpctrain.models import flat, float32_equal, init_source, spec_for_hf


def typed_model_keys(overrides) -> set[str]:
    """The `model.KEY` names among command-line overrides (`model.dim=64`, `+model.x=1`, `++model.y=2`)."""
    keys = set()
    for override in overrides or ():
        key = str(override).split("=", 1)[0].lstrip("+~")
        if key.startswith("model.") and "=" in str(override):
            keys.add(key[len("model."):])
    return keys


def shape_from_checkpoint(cfg, overrides) -> None:
    """Fill `cfg.model` (in place) from model.init_from's config.json when it names a transformers directory;
    ConfigError naming the file and the fix otherwise. A no-op for any other run."""
    source, init = cfg.model.init_from, init_source(cfg.model)
    if not init or not init[0]:
        return
    path = init[1]
    try:
        spec = spec_for_hf(path)
        adapter = spec.hf()
        args = adapter.read_args(path)
    except (ValueError, OSError) as e:  # (ConfigError is a ValueError)
        raise ConfigError(f"model.init_from={source}: {' '.join(str(e).split())}") from None
    typed = typed_model_keys(overrides)
    theirs = dict(flat(args))
    for key in sorted(typed):
        top, mine = key.split(".")[0], OmegaConf.select(cfg.model, key)
        mine = getattr(mine, "value", mine)  # (an enum)
        if top not in adapter.FREE and key in theirs and not float32_equal(mine, theirs[key]):
            raise ConfigError(
                f"model.{key}={mine} contradicts {os.path.join(path, 'config.json')} "
                f"({adapter.HF_FIELDS.get(top, top)}{key[len(top):]}={theirs[key]}): drop the override (with "
                "model.init_from=hf:DIR the shape comes from the checkpoint)")
    ours = {f.name for f in dataclasses.fields(TransformerDims)}  # (not the family's traits: family says them)
    for key, value in theirs.items():
        if key not in typed and key.split(".")[0] in ours:
            OmegaConf.update(cfg.model, key, value)
    cfg.model.family = spec.family
    cfg.model.name = os.path.basename(os.path.normpath(path))
