"""Config schema and semantic checks: Hydra's messages for structure, one clear line for the rest."""

from __future__ import annotations

import os

import pytest
from helpers import run_forked
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from hpctrain import cli
from hpctrain.core.config import ConfigError
from hpctrain.models.llama.model import num_params
from hpctrain.runs.resolve import resolve, scaled_lr
from hpctrain.training.optimizer import lr_factor

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def test_defaults_compose(make_cfg):
    cfg = make_cfg()
    plan = resolve(cfg)
    assert (plan.global_batch, plan.micro_batch, plan.grad_accum, plan.dp) == (8, 4, 2, 1)


# Published parameter counts (Llama 2 / Llama 3.2 papers); the two small ones are GPT-3 shapes
# whose nominal size counted a 50k-token embedding, hence the looser bound.
@pytest.mark.parametrize("name,params_b,tol", [
    ("llama_125m", 0.125, 0.15), ("llama_350m", 0.35, 0.05), ("llama_1b", 1.236, 0.01),
    ("llama_3b", 3.213, 0.01), ("llama_7b", 6.738, 0.01), ("llama_13b", 13.016, 0.01),
    ("llama_70b", 68.977, 0.01),
])
def test_model_sizes_are_real(make_cfg, name, params_b, tol):
    from hpctrain.models import model_args

    cfg = make_cfg(f"model={name}", small_model=False)
    n = num_params(model_args(cfg.model)) / 1e9
    assert abs(n - params_b) / params_b < tol, (name, n)


def test_unknown_key_and_wrong_type_fail_in_hydra(make_cfg):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        make_cfg("train.max_stepz=3")
    with pytest.raises((ConfigCompositionException, ValidationError)):
        make_cfg("train.max_steps=lots")
    with pytest.raises((ConfigCompositionException, ValidationError)):
        make_cfg("precision.name=fp8")


@pytest.mark.parametrize("overrides,words", [
    (["train.global_batch=7", "train.micro_batch=2"], ["global_batch=7", "micro_batch×dp=2×1"]),
    (["train.global_batch=8", "train.micro_batch=2", "train.grad_accum=3"], ["8", "2×3×1=6"]),
    (["train.global_batch=null", "train.micro_batch=null"], ["both unset"]),
    (["train.seq_len=128"], ["train.seq_len=128", "model.max_seq_len=64"]),
    (["model.n_kv_heads=3"], ["n_heads=4", "n_kv_heads=3"]),
    (["parallel.dp=2"], ["2", "world size 1"]),
])
def test_semantic_errors_name_the_numbers(make_cfg, overrides, words):
    with pytest.raises(ConfigError) as e:
        resolve(make_cfg(*overrides))
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_batch_derivation(make_cfg):
    plan = resolve(make_cfg("train.global_batch=12", "train.micro_batch=null", "train.grad_accum=3"))
    assert (plan.micro_batch, plan.grad_accum) == (4, 3)
    plan = resolve(make_cfg("train.global_batch=null", "train.micro_batch=2", "train.grad_accum=5"))
    assert plan.global_batch == 10


def test_lr_scaling_and_schedule(make_cfg):
    cfg = make_cfg("optim.lr_scaling=sqrt", "optim.ref_global_batch=2", "optim.lr=1.0")
    assert scaled_lr(cfg.optim, 8) == pytest.approx(2.0)
    cfg = make_cfg("optim.lr_scaling=linear", "optim.ref_global_batch=2", "optim.lr=1.0")
    assert scaled_lr(cfg.optim, 8) == pytest.approx(4.0)
    from hpctrain.core.config import Decay

    f = [lr_factor(s, 10, 100, Decay.cosine, 0.1) for s in range(120)]
    assert f[0] < f[5] < f[9] < 1.0 and f[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[100] == pytest.approx(0.1) and f[119] == pytest.approx(0.1)


def test_cli_batch_error_is_one_line(tmp_path):
    """`python -m hpctrain train.global_batch=7 train.micro_batch=2` exits non-zero with one line."""
    p = run_forked(cli.main, ["train.global_batch=7", "train.micro_batch=2", f"run_dir={tmp_path / 'run'}"],
                   cwd=tmp_path, env={"HPCTRAIN_CACHE": str(tmp_path / "cache")})
    assert p.code != 0
    err = p.err_lines
    assert len(err) == 1, p.err
    assert "global_batch=7" in err[0] and "2" in err[0] and "Traceback" not in p.err + p.out


def test_cli_unknown_key_uses_hydra_message(tmp_path):
    p = run_forked(cli.main, ["train.bogus=1", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert p.code != 0 and "bogus" in p.err and "Traceback" not in p.err
