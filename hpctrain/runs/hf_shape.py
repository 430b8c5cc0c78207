"""`model.init_from=hf:DIR` is all a run needs to say about its model: the shape comes from DIR's config.json.

Applied where a config is composed (`runs.compose.compose`, the training command, `plan`), with the overrides the
user typed: every model key config.json sets replaces the `model` group's default, the family is the one that reads
the directory's `model_type`, and a `model.KEY=value` override that contradicts config.json is refused in one line
(numbers equal once rounded to float32 are equal). `model.max_seq_len` and `model.init_std` may be set apart from
the checkpoint: how far the RoPE tables reach, and the scale of a draw the weights replace.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from omegaconf import OmegaConf

from hpctrain.core.config import ConfigError, TransformerDims
from hpctrain.models import flat, float32_equal, init_source, spec_for_hf

log = logging.getLogger(__name__)


def typed_model_keys(overrides) -> set[str]:
    """The `model.KEY` names among command-line overrides (`model.dim=64`, `+model.x=1`, `++model.y=2`)."""
    keys = set()
    for override in overrides or ():
        key = str(override).split("=", 1)[0].lstrip("+~")
        if key.startswith("model.") and "=" in str(override):
            keys.add(key[len("model."):])
    return keys


def chosen_group(overrides) -> str | None:
    """The `model=NAME` group among command-line overrides, if one is chosen."""
    for override in overrides or ():
        key, _, value = str(override).partition("=")
        if key.lstrip("+~") == "model" and value:
            return value
    return None


def _recorded_model(run_dir: str, source: str):
    """The `model` group a run in `run_dir` recorded when it started from `source` and has a checkpoint to resume
    from (None otherwise)."""
    from hpctrain.core.files import absolute_path, read_yaml
    from hpctrain.models import HF_PREFIX
    from hpctrain.storage.checkpoint import complete_checkpoints

    record = os.path.join(run_dir, ".hydra", "config.yaml")
    if not os.path.isfile(record) or not complete_checkpoints(run_dir):
        return None
    try:
        model = read_yaml(record).model
    except Exception:  # noqa: BLE001 - an unreadable record: the run's own checks name it later
        return None
    # (None: a resume that found the directory gone before recorded no init_from, below)
    return model if model.get("init_from") in (None, str(source), absolute_path(str(source), HF_PREFIX)) else None  # (recorded as typed before)


def shape_from_checkpoint(cfg, overrides, run_dir: str | None = None) -> None:
    """Fill `cfg.model` (in place) from model.init_from's config.json when it names a transformers directory;
    ConfigError naming the file and the fix otherwise. A no-op for any other run. A run in `run_dir` that started
    from that directory and resumes (its weights are its checkpoint's) takes the shape it recorded when the directory
    is gone."""
    source, init = cfg.model.init_from, init_source(cfg.model)
    if not init or not init[0]:
        return
    path = init[1]
    resuming = run_dir and cfg.train.resume != "never" and not os.path.exists(path)
    recorded = _recorded_model(run_dir, source) if resuming else None
    if recorded is not None:
        for key in cfg.model:
            if key in recorded:
                OmegaConf.update(cfg.model, key, recorded[key], merge=True)
        cfg.model.init_from = None  # a resumed run's weights are its checkpoint's: nothing is read from DIR
        return
    try:
        spec = spec_for_hf(path)
        adapter = spec.hf()
        args = adapter.read_args(path)
    except (ValueError, OSError) as e:  # (ConfigError is a ValueError)
        raise ConfigError(f"model.init_from={source}: {' '.join(str(e).split())}") from None
    for setting in adapter.unapplied(path):
        log.warning("model.init_from=%s: config.json's %s", source, setting)
    typed = typed_model_keys(overrides)
    theirs = dict(flat(args))
    for key in sorted(typed):
        top, mine = key.split(".")[0], OmegaConf.select(cfg.model, key)
        mine = getattr(mine, "value", mine)  # (an enum)
        if key not in adapter.FREE and top not in adapter.FREE and key in theirs and not float32_equal(mine, theirs[key]):
            raise ConfigError(
                f"model.{key}={mine} contradicts {os.path.join(path, 'config.json')} "
                f"({adapter.field_name(key)}={theirs[key]}): drop the override (with "
                "model.init_from=hf:DIR the shape comes from the checkpoint)")
    ours = {f.name for f in dataclasses.fields(TransformerDims)}  # (not the family's traits: family says them)
    group = chosen_group(overrides)
    if group:  # a shape chosen by name must be the checkpoint's: never silently replaced
        for key, value, mine in adapter.mismatches(args, spec.args(cfg.model)):
            if key.split(".")[0] in ours and key not in typed:
                raise ConfigError(
                    f"model={group} contradicts {os.path.join(path, 'config.json')} "
                    f"({adapter.field_name(key)}={value} vs model.{key}={mine}): drop "
                    "model=… (with model.init_from=hf:DIR the shape comes from the checkpoint)")
    for key, value in theirs.items():
        if key not in typed and key.split(".")[0] in ours:
            OmegaConf.update(cfg.model, key, value)
    cfg.model.family = spec.family
    cfg.model.name = os.path.basename(os.path.normpath(path))
