"""Hydra set-up: the schema and resolvers registered, the config groups found, and a run's config composed.

The one place that knows where `conf/` lives and what `${...}` interpolations the configs may use.
"""

from __future__ import annotations

import os

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from hpctrain.core.config import Config, ConfigError, sbatch_option


def _slurm(key: str, *, _root_: DictConfig):
    """`${hpctrain_slurm:nodes}` etc. in the launcher configs: the job shape of the layout (a layout that cannot
    be placed is reported by the launcher's checks, with its fix, before anything is submitted)."""
    from hpctrain.parallel.layout import job_shape, restarts_in_allocation

    if key in ("sbatch_extra", "exclude"):  # (an exclude of cluster.sbatch_extra joins the bad-node list's)
        extra = OmegaConf.to_container(_root_.cluster.sbatch_extra)
        own_exclude = [str(v) for k, v in extra.items() if sbatch_option(k) == "exclude"]
    if key == "sbatch_extra":  # --no-kill with spare nodes (or shrinking): a lost node must not end the job
        try:
            supervised = restarts_in_allocation(_root_.parallel, _root_.cluster)
        except ConfigError:  # (reported with its fix by the launcher's checks)
            supervised = False
        spare = {"no_kill": True} if supervised else {}
        return {"requeue": True, **spare, **{k: v for k, v in extra.items() if sbatch_option(k) != "exclude"}}
    if key == "exclude":  # the bad-node list's nodes (hpctrain.runtime.bad_nodes), and any sbatch_extra.exclude
        from hpctrain.runtime import bad_nodes

        bad = sorted(bad_nodes.excluded(_root_.cluster.bad_nodes, _root_.cluster.bad_node_expiry_h))
        return ",".join(bad + own_exclude) or None
    try:
        shape = job_shape(_root_.parallel, _root_.cluster)
    except ConfigError:
        return 1
    return shape[key] + (_root_.cluster.spare_nodes or 0) if key == "nodes" else shape[key]


def _demo_data_dir() -> str:
    from data_prep.demo import default_out_dir

    return default_out_dir()


def register() -> None:
    """Make the schema and the `${demo_data_dir:}` / `${hpctrain_slurm:KEY}` resolvers known to Hydra (idempotent)."""
    store = ConfigStore.instance()
    if "base_config.yaml" not in store.repo:  # (building the schema's node was a fifth of each compose)
        store.store(name="base_config", node=Config)
    if not OmegaConf.has_resolver("demo_data_dir"):
        OmegaConf.register_new_resolver("demo_data_dir", _demo_data_dir)
    if not OmegaConf.has_resolver("hpctrain_slurm"):
        OmegaConf.register_new_resolver("hpctrain_slurm", _slurm)


def conf_dir() -> str:
    """The config groups: `conf/` beside the package in a checkout (an editable install), or the copy a wheel
    installs inside it (`hpctrain/conf/`)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hpctrain/, above runs/
    installed = os.path.join(package, "conf")
    return installed if os.path.isdir(installed) else os.path.abspath(os.path.join(package, os.pardir, "conf"))


def compose(overrides: list[str]):
    """The config a run with these overrides gets, composed as `python -m hpctrain` does (no run directory), the
    model's shape taken from model.init_from's config.json when it names a transformers directory."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from hpctrain.runs.hf_shape import shape_from_checkpoint

    register()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    shape_from_checkpoint(cfg, overrides)  # model.init_from=hf:DIR: the shape from its config.json
    return cfg


def typed(cfg) -> Config:
    """The composed config as the schema's own objects (`core.config.Config` and its groups' dataclasses), once its
    checks have passed: what a run's components are built from. Interpolations are resolved here; keys a `+key=`
    override added stay as attributes."""
    return cfg if isinstance(cfg, Config) else OmegaConf.to_object(cfg)
