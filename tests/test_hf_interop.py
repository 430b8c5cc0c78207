import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hpctrain.models.llama.hf import from_hf, from_hf_config, save_hf, to_hf, to_hf_config
from hpctrain.models.llama.model import Llama, ModelArgs

TOL = 1e-5


def small(tie: bool) -> ModelArgs:
    # Non-default theta and eps so that a dropped field shows up.
    return ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                     max_seq_len=32, rope_theta=500.0, norm_eps=1e-6, tie_embeddings=tie)


def hf_config(tie: bool = False, **kw) -> LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, rope_theta=500.0, rms_norm_eps=1e-6,
                tie_word_embeddings=tie)
    return LlamaConfig(**{**base, **kw})


def ours_random(tie: bool) -> Llama:
    torch.manual_seed(0)
    m = Llama(small(tie))
    with torch.no_grad():  # init leaves norms at 1: perturb them so a swapped norm mapping is caught
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return m.eval()


def hf_random(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config(tie))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf.eval()


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(seed))


def max_diff(ours: Llama, hf: LlamaForCausalLM, x: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(x) - hf(input_ids=x).logits).abs().max().item()


@pytest.mark.parametrize("tie", [False, True])
def test_to_hf_logits_match(tie):
    m = ours_random(tie)
    hf = to_hf(m)
    assert not hf.training and all(p.dtype == torch.float32 for p in hf.parameters())
    c = hf.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 4, 2)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (96, 128, 32)
    assert c.rms_norm_eps == 1e-6 and c.tie_word_embeddings == tie
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tie
    assert max_diff(m, hf, tokens()) < TOL
    # Weights are copied, not shared.
    assert hf.model.embed_tokens.weight.data_ptr() != m.tok_embeddings.weight.data_ptr()


@pytest.mark.parametrize("tie", [False, True])
def test_from_hf_logits_match(tie):
    hf = hf_random(tie)
    m = from_hf(hf)
    assert m.args == small(tie)
    assert (m.output.weight is m.tok_embeddings.weight) == tie
    assert max_diff(m, hf, tokens(1)) < TOL


def test_rope_theta_matters():
    """Guard for the test above: a wrong rope_theta would give clearly different logits."""
    hf = hf_random(False)
    m = from_hf(hf)
    m.args.rope_theta = 10000.0
    m.reset_rope_cache()
    assert max_diff(m, hf, tokens(1)) > 1e-3


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_state_dict_identical(tie):
    m = ours_random(tie)
    back = from_hf(to_hf(m))
    assert back.args == m.args
    a, b = m.state_dict(), back.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    hf = hf_random(tie)
    again = to_hf(from_hf(hf)).state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(again[k], v), k


@pytest.mark.parametrize("tie", [False, True])
def test_save_hf_loads_with_from_pretrained(tie, tmp_path):
    m = ours_random(tie)
    out = save_hf(m, tmp_path / "export", eos_token_id=5)
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 5
    loaded = LlamaForCausalLM.from_pretrained(out).eval()  # a local directory: nothing is downloaded
    assert max_diff(m, loaded, tokens(2)) < TOL


def test_to_hf_config_round_trip():
    for args in (small(False), small(True), ModelArgs()):
        assert from_hf_config(to_hf_config(args)) == dataclasses.replace(args, n_kv_heads=args.kv_heads)


@pytest.mark.parametrize(
    "kw",
    [
        dict(attention_bias=True),
        dict(mlp_bias=True),
        dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}),
        dict(hidden_act="gelu"),
    ],
)
def test_unsupported_config_raises(kw):
    hf = LlamaForCausalLM(hf_config(**kw))
    with pytest.raises(ValueError, match="cannot represent") as err:
        from_hf(hf)
    assert "\n" not in str(err.value)


def test_to_hf_refuses_pipeline_stage():
    m = ours_random(False)
    m.output = None
    with pytest.raises(ValueError, match="pipeline stage"):
        to_hf(m)


# --- Starting a run from published weights: model.init_from=hf:/path --------------------------------------------
# The conftest model (SMALL_MODEL: dim 64, 2 layers, 4 heads, 2 kv heads, ffn 176, vocab 512), untied so that pp2
# runs it too.
RUN_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5)


def _published(tmp_path, tie: bool = False, dtype=torch.float32, case: str | None = None) -> str:
    """A transformers checkpoint as a hub download leaves it: several safetensors files and their index. `case`: a
    model of FAMILY_CASES (its own tying) instead of RUN_MODEL's Llama."""
    if case:
        hf = _family_model(case, dtype=dtype)
    else:
        torch.manual_seed(1)
        hf = LlamaForCausalLM(LlamaConfig(**RUN_MODEL, tie_word_embeddings=tie)).to(dtype)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    out = tmp_path / f"published-{case or 'llama'}-{tie}-{str(dtype)[6:]}"
    hf.save_pretrained(out, max_shard_size="100KB")
    assert len(list(out.glob("*.safetensors"))) > 2 and (out / "model.safetensors.index.json").is_file()
    return str(out)


@pytest.mark.parametrize("tie, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_hf_weights_load_into_our_model(tmp_path, tie, dtype):
    """load_hf_weights reads a sharded safetensors directory into our fp32 model: logits equal transformers' (fp32);
    bf16 files, as most published weights are, are widened exactly."""
    from hpctrain.models.llama.hf import load_hf_weights

    path = _published(tmp_path, tie, dtype)
    args = from_hf_config(LlamaConfig.from_pretrained(path))
    ours = Llama(args).eval()
    load_hf_weights(ours, path, args)
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    assert max_diff(ours, hf, x) <= TOL


def _step_one(run_dir) -> tuple[float, float]:
    from hpctrain.core.files import read_metrics

    (first,) = [(r["loss"], r["grad_norm"]) for r in read_metrics(str(run_dir)) if r.get("step") == 1]
    return first


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_runs_start_from_hf_weights_in_every_layout(demo_data, tmp_path, case):
    """model.init_from=hf:PATH and no other model key, for each family: the first step's loss is transformers' on the
    same batch (one process), and every layout (fsdp dp=2 with activation checkpointing, tp2 with sequence
    parallelism, pp2; MoE: tp2 without, and expert parallel ep=2 inside fsdp dp=4, each rank reading only its
    experts' rows) starts from the same weights: the same first loss and gradient norm."""
    from transformers import AutoModelForCausalLM

    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train

    path = _published(tmp_path, case=None if case == "llama" else case)
    run = (f"model.init_from=hf:{path}", f"data.path={demo_data}", "data.prepare_demo=false", "train.max_steps=1",
           "train.eval_every=0", "train.checkpointing=false", "train.global_batch=4", "train.micro_batch=2",
           "train.grad_accum=null", "logging.trackers=[]", "cluster.num_threads=1")
    assert train(compose(list(run)), str(tmp_path / "one"))["status"] == "completed"
    ref = _step_one(tmp_path / "one")
    # The same global batch through transformers: the run's first two micro-batches (one process, in order).
    from hpctrain.data.loader import ShardStream, choose_lanes, read_manifest

    cfg = compose(list(run))
    manifest = read_manifest(cfg.data.path)
    stream = iter(ShardStream(cfg.data.path, "train", 2, cfg.train.seed, lanes=choose_lanes(None, 1, manifest),
                              global_batch=4))
    batch = torch.cat([next(stream), next(stream)])
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert cfg.model.family == FAMILY_CASES.get(case, ("llama",))[0]
    assert abs(ref[0] - want) <= TOL, (ref, want)
    layouts = [("fsdp", ["parallel=fsdp", "parallel.dp=2", "parallel.activation_checkpointing=full"]),
               ("tp2", ["parallel=tp2", "parallel.sequence_parallel=true"]), ("pp2", ["parallel=pp2"])]
    if cfg.model.moe.num_experts:  # MoE: tp without sequence parallelism; the experts shared out, then also sharded
        layouts[1] = ("tp2", ["parallel=tp2"])
        layouts += [("ep2_fsdp4", ["parallel=fsdp", "parallel.dp=4", "parallel.ep=2", "train.micro_batch=1"])]
    for name, layout in layouts:
        assert train(compose([*run, *layout]), str(tmp_path / name))["status"] == "completed"
        loss, norm = _step_one(tmp_path / name)
        print(f"init_from=hf: {case} {name}: |Δ first loss| {abs(loss - ref[0]):.2e}, rel |Δ grad norm| "
              f"{abs(norm - ref[1]) / ref[1]:.2e} vs one process (one process vs transformers: {abs(ref[0] - want):.2e})")
        assert abs(loss - ref[0]) <= TOL and abs(norm - ref[1]) <= TOL * ref[1], (name, loss, norm, ref)


# --- The model's shape from its config.json: model.init_from=hf:DIR is all a user types ------------------------------
def _compose(*overrides):
    from hpctrain.runs.compose import compose

    return compose(["data.prepare_demo=false", *overrides])


def test_the_shape_comes_from_config_json(tmp_path, demo_data):
    """Every model key from config.json (the default `model` group, tiny, says otherwise), the family its model_type
    names, the directory's name; `plan` the same."""
    from helpers import run_forked

    from hpctrain import cli

    path = _published(tmp_path, tie=True)
    m = _compose(f"model.init_from=hf:{path}", f"data.path={demo_data}").model
    assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.max_seq_len) == (
        512, 64, 2, 4, 2, 176, 64)
    assert (m.tie_embeddings, m.rope_theta, m.norm_eps, m.family, m.name) == (
        True, 10000.0, 1e-5, "llama", Path(path).name)
    p = run_forked(cli.main, ["plan", f"model.init_from=hf:{path}", f"data.path={demo_data}"], cwd=tmp_path)
    assert p.code == 0 and f"model {Path(path).name}: " in p.out and "2 layers" not in p.err, p.out + p.err
    assert "attention_dropout" not in p.err, p.err
    # a training-time setting hpctrain does not apply is said, once, before anything starts
    config = json.loads((Path(path) / "config.json").read_text())
    (Path(path) / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    p = run_forked(cli.main, ["plan", f"model.init_from=hf:{path}", f"data.path={demo_data}"], cwd=tmp_path)
    said = [line for line in p.err.splitlines() if "attention_dropout=0.1" in line]
    assert p.code == 0 and len(said) == 1 and "has no dropout" in said[0], p.err


def test_an_override_against_config_json_is_one_line_and_float32_equal_is_equal(tmp_path, demo_data):
    """A model.* override that contradicts config.json is refused naming both; 1e-5 stored as float32
    (9.999999747378752e-06) is 1e-5; model.max_seq_len (the RoPE tables' reach) may differ; another model_type is
    named."""
    from hpctrain.core.config import ConfigError
    from hpctrain.training.run import prepare

    path = Path(_published(tmp_path))
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, "rms_norm_eps": 9.999999747378752e-06}))
    run = (f"model.init_from=hf:{path}", f"data.path={demo_data}", "logging.trackers=[]")
    with pytest.raises(ConfigError) as e:
        _compose(*run, "model.n_layers=3")
    msg = str(e.value)
    assert "\n" not in msg and f"model.n_layers=3 contradicts {path}/config.json (num_hidden_layers=2)" in msg, msg
    cfg = _compose(*run, "model.norm_eps=1e-5", "model.n_heads=4", "model.max_seq_len=32", "train.seq_len=32")
    assert (cfg.model.norm_eps, cfg.model.max_seq_len, cfg.model.dim) == (1e-5, 32, 64)
    with pytest.raises(Exception, match="seq_len 64"):  # the shards' 64-token samples need 64 positions
        prepare(cfg)
    prepare(_compose(*run, "model.norm_eps=1e-5"))  # the weights' check agrees: the same number in float32
    with pytest.raises(ConfigError) as e:  # a shape chosen by name is never silently replaced
        _compose(*run, "model=nano")
    msg = str(e.value)
    assert "\n" not in msg and f"model=nano contradicts {path}/config.json (" in msg and "drop model=" in msg, msg
    (path / "config.json").write_text(json.dumps({**conf, "model_type": "gemma2"}))
    with pytest.raises(ConfigError, match="model_type=\"gemma2\", which no hpctrain model family reads .it reads llama, "
                                          "mistral, qwen2, qwen3."):
        _compose(*run)


def test_shards_of_a_larger_vocabulary_name_the_models_tokenizer(tmp_path, demo_data):
    from hpctrain.data.loader import DataError
    from hpctrain.training.run import prepare

    path = tmp_path / "small-vocab"
    LlamaForCausalLM(LlamaConfig(**{**RUN_MODEL, "vocab_size": 256})).save_pretrained(path)
    with pytest.raises(DataError) as e:
        prepare(_compose(f"model.init_from=hf:{path}", f"data.path={demo_data}"))
    assert "512-token tokenizer" in str(e.value) and f"hpctrain prep shards --tokenizer {path}" in str(e.value)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["llama", "mistral", "qwen2", "qwen3"])
def test_init_from_alone_trains_fsdp_bf16_from_the_command_line(tmp_path, demo_data, case):
    """model.init_from=hf:DIR and no other model key, for each family: a dp=2 FSDP bf16 run trains, and its recorded
    config holds the checkpoint's shape and family."""
    from helpers import run_forked

    from hpctrain import cli
    from hpctrain.core.files import read_json

    path = _published(tmp_path, case=None if case == "llama" else case)
    run = tmp_path / "run"
    p = run_forked(cli.main, [f"run_dir={run}", f"data.path={demo_data}", "data.prepare_demo=false",
                              f"model.init_from=hf:{path}", "parallel=fsdp", "parallel.dp=2", "precision=bf16",
                              "train.max_steps=2", "train.eval_every=0", "train.global_batch=4", "train.micro_batch=2",
                              "logging.trackers=[]", "cluster.num_threads=1"], cwd=tmp_path, timeout=300)
    assert p.code == 0, p.err
    assert read_json(run / "result.json")["status"] == "completed"
    saved = (run / ".hydra" / "config.yaml").read_text()
    assert "dim: 64" in saved and "ffn_hidden: 176" in saved and f"name: {Path(path).name}" in saved, saved
    assert f"family: {case}" in saved, saved


def test_init_from_a_mismatched_or_missing_model_is_one_line(make_cfg, tmp_path):
    from hpctrain.training.run import TrainingError, prepare

    path = _published(tmp_path)
    with pytest.raises(TrainingError) as e:
        prepare(make_cfg("model.dim=128", f"model.init_from=hf:{path}"))
    msg = str(e.value)
    assert "\n" not in msg and "hidden_size=64 vs model.dim=128" in msg and "tie_word_embeddings" in msg, msg
    with pytest.raises(TrainingError, match="has no config.json"):
        prepare(make_cfg(f"model.init_from=hf:{tmp_path}"))


def test_init_from_an_hpctrain_checkpoint_loads_weights_only(make_cfg, tmp_path, monkeypatch):
    """model.init_from=<checkpoint dir>: a fresh run (step 0, new optimizer) that starts from those weights."""
    from hpctrain.core.files import read_metrics
    from hpctrain.models import model_args
    from hpctrain.storage import checkpoint
    from hpctrain.training.run import TrainingError, prepare, train
    from hpctrain.training.step import TrainStep

    first = ("train.eval_every=0", "train.ckpt_every=2", "train.max_steps=2", "logging.trackers=[]")
    train(make_cfg(*first), str(tmp_path / "a"))
    ckpt = checkpoint.latest(str(tmp_path / "a"))
    want = Llama(model_args(make_cfg().model))
    checkpoint.load_model(ckpt, want)
    got = Llama(model_args(make_cfg().model))
    checkpoint.load_weights(ckpt, got)
    assert all(torch.equal(a, b) for a, b in zip(want.state_dict().values(), got.state_dict().values()))
    # Through a run: its first step starts from those weights (its loss is the loaded model's on that batch).
    result = train(make_cfg("train.eval_every=0", "train.max_steps=1", f"model.init_from={ckpt}",
                            "logging.trackers=[]"), str(tmp_path / "b"))
    assert result["status"] == "completed" and result["steps"] == 1
    from hpctrain.data.loader import ShardStream, choose_lanes, read_manifest

    cfg = make_cfg()
    stream = iter(ShardStream(cfg.data.path, "train", 4, cfg.train.seed,
                              lanes=choose_lanes(None, 1, read_manifest(cfg.data.path)), global_batch=8))
    batch = torch.cat([next(stream), next(stream)])
    step = TrainStep(want, torch.optim.SGD(want.parameters(), lr=0.0), _fp32(), 0.0, torch.device("cpu"))
    (loss,) = [r["loss"] for r in read_metrics(str(tmp_path / "b")) if r.get("step") == 1]
    assert abs(step([batch]).loss - loss) <= 1e-6
    # Started over in its own directory from its own checkpoint (train.resume=never sets the old run aside first):
    # the weights are read where they went.
    again = train(make_cfg("train.eval_every=0", "train.max_steps=1", f"model.init_from={ckpt}", "train.resume=never",
                           "logging.trackers=[]"), str(tmp_path / "a"))
    assert again["status"] == "completed" and not os.path.exists(ckpt)
    assert [r["loss"] for r in read_metrics(str(tmp_path / "a")) if r.get("step") == 1] == [loss]
    # The fine-tune resumes from its own checkpoint although its source is gone (rotated away, or set aside as
    # here); a fresh run from it is refused.
    longer = ("train.eval_every=0", "train.max_steps=2", f"model.init_from={ckpt}", "logging.trackers=[]")
    assert train(make_cfg(*longer), str(tmp_path / "b"))["steps"] == 2
    # Started over as a submission does it (on the login node, before the job): the job's checks find the source
    # where it went
    own = checkpoint.latest(str(tmp_path / "a"))
    submitted = make_cfg("train.eval_every=0", "train.max_steps=1", f"model.init_from={own}", "train.resume=never",
                         "logging.trackers=[]")
    from hpctrain.runs import rundir

    rundir.start_over(str(tmp_path / "a"), submitted)
    assert not os.path.exists(own)
    prepare(submitted, run_dir=str(tmp_path / "a"))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # its requeued job too, whatever train.resume says
    prepare(make_cfg(*longer, "train.resume=never"), run_dir=str(tmp_path / "b"))
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    with pytest.raises(TrainingError, match="not a complete checkpoint"):
        train(make_cfg(*longer), str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "c" / "metrics.jsonl")
    with pytest.raises(TrainingError, match="not a complete checkpoint"):
        train(make_cfg(f"model.init_from={tmp_path / 'a'}"), str(tmp_path / "c"))


def _fp32():
    from hpctrain.training.precision import Precision

    return Precision(None, None, "cpu")


@pytest.mark.multiproc
def test_export_hf_from_every_layout(make_cfg, tmp_path, monkeypatch):
    """`hpctrain export-hf RUN_DIR OUT` from checkpoints written by single, fsdp dp=2, tp2 and pp2 runs: transformers
    loads OUT (several safetensors files + index, config.json, the shards' tokenizer) and gives our logits to 1e-5
    and the same greedy continuation; an occupied OUT is refused with one line."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpctrain.models import model_args
    from hpctrain.storage import checkpoint
    from hpctrain.tools.generate import sample
    from hpctrain.training.run import train
    from hpctrain.weights import export_hf

    run = ("train.max_steps=2", "train.eval_every=0", "train.global_batch=4", "train.micro_batch=2",
           "train.grad_accum=null", "logging.trackers=[]", "cluster.num_threads=1")
    x = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(export_hf, "SHARD_BYTES", 200_000)  # several files, as the hub has them
    untied = "model.tie_embeddings=false"
    for name, layout in (("single", [untied]), ("fsdp", [untied, "parallel=fsdp", "parallel.dp=2"]),
                         ("tp2", [untied, "parallel=tp2"]), ("pp2", [untied, "parallel=pp2"]),
                         ("pp2_tied", ["model.tie_embeddings=true", "parallel=pp2"])):
        cfg, run_dir, out = make_cfg(*run, *layout), tmp_path / name, tmp_path / f"{name}-hf"
        assert train(cfg, str(run_dir))["status"] == "completed"
        (run_dir / ".hydra").mkdir()
        OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
        assert export_hf.main([str(run_dir), str(out)]) == 0
        assert len(list(out.glob("model-*.safetensors"))) > 2 and (out / "tokenizer.json").is_file()
        ours = Llama(model_args(cfg.model)).eval()
        checkpoint.load_model(checkpoint.latest(str(run_dir)), ours)
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        diff = max_diff(ours, hf, x)
        print(f"export-hf {name}: max |Δlogit| vs transformers {diff:.2e}")
        assert diff <= TOL, name
        with torch.no_grad():
            theirs = hf.generate(x[:1, :8], max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, 8:].tolist()
        assert sample(ours, x[0, :8].tolist(), 12, temperature=0.0) == theirs, name
        assert AutoTokenizer.from_pretrained(out).decode([5, 6, 7])
    assert export_hf.main([str(tmp_path / "single"), str(tmp_path / "single-hf")]) == 2  # occupied: refused
    # The run's shards gone: the weights are exported, with a warning, and no token ids (transformers' defaults, 1
    # and 2, are not this vocabulary's EOS)
    cfg.data.path = str(tmp_path / "gone")
    OmegaConf.save(cfg, tmp_path / "single" / ".hydra" / "config.yaml")
    from helpers import run_forked

    ran = run_forked(export_hf.main, [str(tmp_path / "single"), str(tmp_path / "bare-hf")], cwd=tmp_path)
    config = json.loads((tmp_path / "bare-hf" / "config.json").read_text())
    assert ran.code == 0 and f"shards (data.path={tmp_path / 'gone'}) cannot be read" in ran.err, ran.err
    assert config.get("eos_token_id") is None and config.get("bos_token_id") is None, config
    assert not (tmp_path / "bare-hf" / "tokenizer.json").exists()


@pytest.mark.multiproc
def test_export_hf_at_end(make_cfg, tmp_path):
    """train.export_hf_at_end=true (fsdp dp=2): the final checkpoint is also <run_dir>/hf/step-N, which transformers
    loads with our logits; starting the finished run again leaves it as it is."""
    from transformers import AutoModelForCausalLM

    from hpctrain.models import model_args
    from hpctrain.storage import checkpoint
    from hpctrain.training.run import train

    cfg = make_cfg("train.max_steps=2", "train.eval_every=0", "train.global_batch=4", "train.micro_batch=2",
                   "train.grad_accum=null", "train.export_hf_at_end=true", "parallel=fsdp", "parallel.dp=2",
                   "logging.trackers=[]", "cluster.num_threads=1")
    assert train(cfg, str(tmp_path))["status"] == "completed"
    out = tmp_path / "hf" / "step-0000002"
    ours = Llama(model_args(cfg.model)).eval()
    checkpoint.load_model(checkpoint.latest(str(tmp_path)), ours)
    x = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    assert max_diff(ours, AutoModelForCausalLM.from_pretrained(out).eval(), x) <= TOL
    stamp = (out / "config.json").stat().st_mtime_ns
    assert train(cfg, str(tmp_path))["status"] == "completed"
    assert (out / "config.json").stat().st_mtime_ns == stamp


@pytest.mark.multiproc
def test_tied_hf_weights_start_a_pipeline_as_one_process(make_cfg, tmp_path):
    """A tied checkpoint (no lm_head.weight in the files) under pp2: the last stage's copy of the embedding is read
    from the embedding's tensor, so the first step is one process's."""
    from hpctrain.training.run import train

    path = _published(tmp_path, tie=True)
    run = ("model.tie_embeddings=true", f"model.init_from=hf:{path}", "train.max_steps=1", "train.eval_every=0",
           "train.checkpointing=false", "train.global_batch=4", "train.micro_batch=2", "train.grad_accum=null",
           "logging.trackers=[]", "cluster.num_threads=1")
    refs = {}
    for name, layout in (("one", []), ("pp2", ["parallel=pp2"])):
        assert train(make_cfg(*run, *layout), str(tmp_path / name))["status"] == "completed"
        refs[name] = _step_one(tmp_path / name)
    (loss, norm), (want_loss, want_norm) = refs["pp2"], refs["one"]
    assert abs(loss - want_loss) <= TOL and abs(norm - want_norm) <= TOL * want_norm, refs


def _swap_token_ids(tokenizer_json) -> None:
    """The same tokens, two of them numbered the other way round: another tokenizer as far as the weights go."""
    doc = json.loads(tokenizer_json.read_text())
    vocab = doc["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tokenizer_json.write_text(json.dumps(doc))


def test_init_from_hf_weights_of_another_tokenizer_is_one_line(make_cfg, tmp_path):
    """A transformers directory that ships its tokenizer.json starts a run only on shards whose tokenizer numbers
    every token the same way (the embedding's rows are token ids); a directory without one is not compared."""
    from hpctrain.core.shard_format import read_manifest
    from hpctrain.training.run import TrainingError, prepare

    path = Path(_published(tmp_path))
    cfg = make_cfg("model.tie_embeddings=false", f"model.init_from=hf:{path}")
    prepare(cfg)  # no tokenizer.json beside the weights
    ours = Path(cfg.data.path) / read_manifest(cfg.data.path).tokenizer.path
    shutil.copy(ours, path / "tokenizer.json")
    prepare(cfg)  # the shards' own tokenizer
    _swap_token_ids(path / "tokenizer.json")
    with pytest.raises(TrainingError) as e:
        prepare(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "numbers tokens differently" in msg and "id 300: " in msg, msg
    assert f"--tokenizer {path}" in msg, msg


def test_a_moe_model_trained_with_a_routing_bias_starts_from_transformers_and_is_not_exported(tmp_path, demo_data):
    """Mixtral weights with aux-loss-free balancing (model.moe.bias_update_rate: a routing bias of ours, zero at the
    start, transformers has no field for): the run starts (a KeyError before), and its export is refused in one line
    (it was written, routing tokens to other experts than the model it came from)."""
    from helpers import run_forked
    from omegaconf import OmegaConf

    from hpctrain.runs.compose import compose
    from hpctrain.storage import checkpoint
    from hpctrain.training.run import train
    from hpctrain.weights import export_hf

    path = Path(_published(tmp_path, case="mixtral"))
    cfg = compose([f"model.init_from=hf:{path}", f"data.path={demo_data}", "data.prepare_demo=false",
                   "model.moe.bias_update_rate=0.05", "train.max_steps=2", "train.global_batch=4", "train.micro_batch=2",
                   "train.eval_every=0", "logging.trackers=[]", "cluster.num_threads=1"])
    run_dir = tmp_path / "run"
    assert train(cfg, str(run_dir))["status"] == "completed"
    bias = {f"layers.{i}.feed_forward.router.expert_bias": torch.empty(4) for i in (0, 1)}
    checkpoint.read_weights(checkpoint.latest(str(run_dir)), bias)
    assert any(b.any() for b in bias.values())  # (it moved: the refusal below is not vacuous)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    ran = run_forked(export_hf.main, [str(run_dir), str(tmp_path / "out")], cwd=tmp_path)
    assert ran.code == 2 and "router.expert_bias" in ran.err and "which transformers' MixtralForCausalLM has no " \
        "place for" in ran.err and len(ran.err.strip().splitlines()) == 1, ran.err
    assert not (tmp_path / "out").exists()


def _trained_and_exported(tmp_path, demo_data, path, *overrides):
    """A short run (micro-batches of 2, `overrides`) started from the transformers directory `path`, exported by
    `export-hf`: (its config, its run directory, the export)."""
    from omegaconf import OmegaConf

    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train
    from hpctrain.weights import export_hf

    cfg = compose([f"model.init_from=hf:{path}", f"data.path={demo_data}", "data.prepare_demo=false",
                   "train.micro_batch=2", "train.eval_every=0", "logging.trackers=[]", "cluster.num_threads=1",
                   *overrides])
    run_dir, out = tmp_path / "run", tmp_path / "exported"
    assert train(cfg, str(run_dir))["status"] == "completed"
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    assert export_hf.main([str(run_dir), str(out)]) == 0
    return cfg, run_dir, out


@pytest.mark.parametrize("case", ["llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_an_export_gives_back_the_model_the_run_started_from(tmp_path, demo_data, case):
    """A run started from a published instruct model of each family (its own special-token ids, a chat template,
    generation settings): `export-hf` writes the same class with the original's token ids, tokenizer files, chat
    template and generation_config.json, and transformers gives our logits to 1e-5."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    from hpctrain.data.loader import read_manifest
    from hpctrain.models import model_args
    from hpctrain.storage import checkpoint

    path = Path(_published(tmp_path, case=None if case == "llama" else case))
    manifest = read_manifest(demo_data)  # the shards' tokenizer is the model's (as `prep shards --tokenizer` makes it)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(demo_data) / manifest.tokenizer.path))
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.7, top_p=0.9).save_pretrained(path)
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, "bos_token_id": 1, "eos_token_id": 2}))

    cfg, run_dir, out = _trained_and_exported(tmp_path, demo_data, path, "train.max_steps=2", "train.global_batch=4")
    config = json.loads((out / "config.json").read_text())
    original = AutoModelForCausalLM.from_pretrained(path)
    assert (config["bos_token_id"], config["eos_token_id"], config["architectures"]) == (
        1, 2, [type(original).__name__])
    theirs = json.loads((path / "config.json").read_text())
    head_dim = theirs["hidden_size"] // theirs["num_attention_heads"]
    for key in ("model_type", "head_dim", "rope_parameters", "sliding_window", "tie_word_embeddings",
                "max_position_embeddings", "rms_norm_eps", "num_key_value_heads"):
        # (Qwen2's config.json has no head_dim, Mixtral's a null one: dim / heads)
        mine, first = ((c.get(key) or head_dim) if key == "head_dim" else c.get(key) for c in (config, theirs))
        assert mine == first, (key, mine, first)
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (path / "generation_config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (path / name).read_bytes(), name
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf) is type(original)
    ours = Llama(model_args(cfg.model)).eval()
    checkpoint.load_model(checkpoint.latest(str(run_dir)), ours)
    assert max_diff(ours, hf, torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))) <= TOL


# --- The families: Llama 3.x RoPE scaling and head_dim, Mistral, Qwen2/2.5, Qwen3 ---------------------------------
# Each case: (family, config.json fields beyond RUN_MODEL, a field whose default would give other logits). Small random
# models of the family's own transformers class, saved by the test.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILY_CASES = {
    "llama3": ("llama", dict(head_dim=24, rope_parameters=LLAMA3_ROPE), "rope_parameters"),
    "linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
               "rope_parameters"),
    # dynamic NTK grows theta past max_position_embeddings: a run sets model.max_seq_len beyond it to get there
    "dynamic": ("llama", dict(max_position_embeddings=32,
                              rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
                "rope_parameters"),
    "mistral": ("mistral", dict(sliding_window=24, head_dim=32), "sliding_window"),  # a window shorter than the run's
    "qwen2": ("qwen2", dict(tie_word_embeddings=True), None),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True), None),
    # MoE: every layer sparse (Mixtral); layer 1 dense, the others 4 experts of another width, renormalised (Qwen3)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=3), "num_experts_per_tok"),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    norm_topk_prob=True, mlp_only_layers=[1]), "norm_topk_prob"),
}


def _family_model(case: str, drop: bool = False, dtype=torch.float32):
    """A random transformers model of the case's family (norms and biases away from their init, so that a dropped or
    swapped one shows); `drop`: the same draw without the case's distinguishing field."""
    from hpctrain.models import get_spec

    family, extra, field = FAMILY_CASES[case]
    extra = {k: v for k, v in extra.items() if not (drop and k == field)}
    config_cls, model_cls = get_spec(family).hf().hf_classes()
    base = {k: v for k, v in RUN_MODEL.items() if not ("rope_parameters" in extra and k == "rope_theta")}
    torch.manual_seed(1)
    hf = model_cls(config_cls(**{**base, **extra})).to(dtype)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # a router far from uniform: no near-tie decides a choice
                p.normal_(0.0, 1.0)
    return hf.eval()


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_each_family_converts_both_ways_with_transformers_logits(case, tmp_path):
    """Each family's transformers model -> ours: the logits to 1e-5 on 64 positions (past Mistral's 24-token window
    and dynamic RoPE's 32-position original context); ours -> the same class back, and a saved directory loads with
    AutoModelForCausalLM as that class with the same logits. The distinguishing field matters (its default gives
    other logits), so the match is not an accident."""
    from transformers import AutoModelForCausalLM

    from hpctrain.models import get_spec

    family, _, field = FAMILY_CASES[case]
    adapter = get_spec(family).hf()
    hf = _family_model(case)
    ours = adapter.from_hf(hf)
    if ours.args.max_seq_len < 64:  # dynamic: the tables reach past the original context (model.max_seq_len)
        longer = Llama(dataclasses.replace(ours.args, max_seq_len=64))
        longer.load_state_dict(ours.state_dict())
        ours = longer
    ours.eval()
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    diff = max_diff(ours, hf, x)
    back = adapter.to_hf(ours)
    saved = AutoModelForCausalLM.from_pretrained(adapter.save_hf(ours, tmp_path / case)).eval()
    print(f"{case}: max |Δlogit| hf->ours {diff:.2e}, ours->hf {max_diff(ours, back, x):.2e}, saved "
          f"{max_diff(ours, saved, x):.2e}")
    assert diff <= TOL and max_diff(ours, back, x) <= TOL and max_diff(ours, saved, x) <= TOL, case
    assert type(back) is type(hf) and type(saved) is type(hf), (type(back), type(saved))
    if field:
        assert max_diff(ours, _family_model(case, drop=True), x) > 1e-3, f"{case}: {field} changes nothing"


@pytest.mark.parametrize("family, kw, words", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), "sliding-window layers"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True"),
    # (Qwen3-MoE's config has no layer_types: transformers windows every layer)
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "sliding-window layers"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                    "original_max_position_embeddings": 32}), "rope type 'yarn'"),
])
def test_a_family_config_hpctrain_cannot_represent_is_one_line(family, kw, words):
    from hpctrain.models import get_spec

    adapter = get_spec(family).hf()
    config = adapter.hf_classes()[0](**{k: v for k, v in RUN_MODEL.items() if k != "rope_theta"}, **kw)
    with pytest.raises(ValueError, match=f"cannot represent this transformers config as hpctrain {family}") as e:
        adapter.from_hf_config(config)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_family_option_on_another_family_is_one_line(make_cfg):
    from hpctrain.core.config import ConfigError
    from hpctrain.models import model_args

    with pytest.raises(ConfigError, match=r"model.sliding_window=16 is not an option of model.family=qwen2 \(it is "
                                          r"mistral and mixtral's\): drop it or choose that family"):
        model_args(make_cfg("model.family=qwen2", "model.sliding_window=16").model)
    assert model_args(make_cfg("model.family=mistral", "model.sliding_window=16").model).sliding_window == 16


@pytest.mark.parametrize("bad", ["device", "too-large"])
def test_a_carried_file_that_is_a_device_or_too_large_is_one_line(tmp_path, monkeypatch, bad):
    """The files an export carries over from model.init_from's directory are read as regular files of sane size: a
    tokenizer.json that is a device (a link to /dev/zero would be read forever) or larger than CARRIED_BYTES is refused
    in one line naming it, not copied."""
    from hpctrain.weights import export_hf

    origin, dest = tmp_path / "origin", tmp_path / "dest"
    origin.mkdir(), dest.mkdir()
    (origin / "config.json").write_text(json.dumps({"bos_token_id": 1}))
    if bad == "device":
        (origin / "tokenizer.json").symlink_to("/dev/zero")
    else:
        (origin / "tokenizer.json").write_bytes(b"x" * 2048)
        monkeypatch.setattr(export_hf, "CARRIED_BYTES", 1024)
    with pytest.raises(export_hf.ExportError) as e:
        export_hf._carry_over(str(origin), str(dest))
    msg = str(e.value)
    assert "\n" not in msg and "cannot carry" in msg and "tokenizer.json" in msg, msg
    assert not (dest / "tokenizer.json").exists()


def test_a_run_started_from_a_directory_since_removed_resumes(tmp_path, demo_data):
    """A run started with model.init_from=hf:DIR resumes from its own checkpoint (the same command, more steps)
    after DIR is gone: the shape is the one it recorded, and init_from is not read again."""
    from helpers import run_forked

    from hpctrain import cli
    from hpctrain.core.files import read_json, read_metrics

    path = _published(tmp_path, case="qwen3")
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"data.path={demo_data}", "data.prepare_demo=false", f"model.init_from=hf:{path}",
            "train.eval_every=0", "train.global_batch=4", "train.micro_batch=2", "train.ckpt_every=1",
            "logging.trackers=[]", "cluster.num_threads=1"]
    assert run_forked(cli.main, [*args, "train.max_steps=1"], cwd=tmp_path).code == 0
    shutil.rmtree(path)
    p = run_forked(cli.main, [*args, "train.max_steps=2"], cwd=tmp_path)
    assert p.code == 0, p.err
    assert read_json(run / "result.json")["status"] == "completed"
    assert [r["step"] for r in read_metrics(str(run)) if "loss" in r and "step" in r][-1] == 2
    assert "family: qwen3" in (run / ".hydra" / "config.yaml").read_text()
    assert run_forked(cli.main, [*args, "train.max_steps=3"], cwd=tmp_path).code == 0  # and again
    p = run_forked(cli.main, [f"run_dir={tmp_path / 'fresh'}", *args[1:], "train.max_steps=1"], cwd=tmp_path)
    assert p.code == 2 and "has no config.json" in p.err, p.err  # a new run still needs the directory


def test_a_config_json_transformers_cannot_read_is_one_line(tmp_path, demo_data):
    """A hand-edited or truncated config.json that transformers' own checks refuse (a missing RoPE field, a null
    where a number belongs): one line naming the file, not transformers' traceback."""
    from hpctrain.core.config import ConfigError

    path = Path(_published(tmp_path))
    conf = json.loads((path / "config.json").read_text())
    for bad in ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
                {"num_hidden_layers": None}):
        (path / "config.json").write_text(json.dumps({**conf, **bad}))
        with pytest.raises(ConfigError) as e:
            _compose(f"model.init_from=hf:{path}", f"data.path={demo_data}")
        msg = str(e.value)
        assert "\n" not in msg and f"{path}/config.json: transformers cannot read it (" in msg, msg
        assert "fix that field or download config.json again" in msg, msg


def test_an_moe_checkpoints_loss_coefficients_may_be_set(tmp_path, demo_data):
    """model.moe.aux_loss_coef and z_loss_coef are training settings, not the checkpoint's shape: a run from a
    published MoE model may set them (router_aux_loss_coef in its config.json notwithstanding)."""
    path = _published(tmp_path, case="qwen3_moe")
    m = _compose(f"model.init_from=hf:{path}", f"data.path={demo_data}", "model.moe.aux_loss_coef=0.01",
                 "model.moe.z_loss_coef=0.001").model
    assert (m.family, m.moe.aux_loss_coef, m.moe.z_loss_coef, m.moe.num_experts) == ("qwen3_moe", 0.01, 0.001, 4)


def test_the_index_says_which_safetensors_files_are_the_model(tmp_path):
    """With model.safetensors.index.json, the files it lists are the model (a Mistral download's consolidated.safetensors
    under names of its own is not read, as transformers does not); one it lists that is missing (an interrupted
    download) is named."""
    from safetensors.torch import save_file

    from hpctrain.models.llama.hf import ADAPTER, load_hf_weights

    path = Path(_published(tmp_path))
    save_file({"layers.0.attention.wk.weight": torch.zeros(32, 64)}, path / "consolidated.safetensors")
    args = ADAPTER.read_args(path)
    ADAPTER.check_hf_dir(path, args)
    ours = Llama(args).eval()
    load_hf_weights(ours, path, args)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert max_diff(ours, hf, torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))) <= TOL
    listed = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (path / listed[1]).unlink()
    with pytest.raises(ValueError) as e:
        ADAPTER.check_hf_dir(path, args)
    assert str(e.value) == f"{path}/{listed[1]}, listed in model.safetensors.index.json, is missing (1 of " \
                           f"{len(listed)} files): download it again"


def test_an_export_keeps_the_originals_context_and_takes_the_shards_tokenizer_where_it_had_none(tmp_path, demo_data):
    """A run from a model of weights and config.json alone (no tokenizer files), trained at a model.max_seq_len below
    the original's max_position_embeddings: the export's config.json keeps the original's context, and the shards'
    tokenizer (the run's: `prep shards --tokenizer` made them) is beside it. Its RoPE is written in both
    transformers' forms."""
    from transformers import AutoTokenizer

    path = tmp_path / "weights-only"
    shape = {k: v for k, v in RUN_MODEL.items() if k not in ("rope_theta", "max_position_embeddings")}
    LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=256, rope_parameters=LLAMA3_ROPE)).save_pretrained(
        path)
    _, _, out = _trained_and_exported(tmp_path, demo_data, path, "model.max_seq_len=64", "train.max_steps=1",
                                      "train.global_batch=2")
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 256
    assert AutoTokenizer.from_pretrained(out).vocab_size == 512
    # RoPE in transformers 4's keys too, for readers that know only those: the same parameters read from them alone
    assert (config["rope_theta"], config["rope_scaling"]["rope_type"]) == (500000.0, "llama3"), config
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"}
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    assert LlamaConfig.from_pretrained(tmp_path / "legacy").rope_parameters == LlamaConfig.from_pretrained(
        out).rope_parameters == {**LLAMA3_ROPE}
