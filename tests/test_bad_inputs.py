"""Bad inputs, as a new user or an attacker would type them: every one ends in ONE line naming the fix,
a non-zero exit, no traceback, and nothing changed on disk (the shard sets and the checkpoints of an
existing run are hashed before and after). Commands run forked from this process (see helpers.run_forked):
the real entry points, without a new interpreter's start-up per case.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys

import pytest
from conftest import SMALL_MODEL
from helpers import edit_tokens, run_forked, tree_digest

from data_prep import demo as demo_cli
from data_prep import shards as shards_cli
from data_prep import tokenizer as tokenizer_cli
from hpctrain import cli
from hpctrain.runs import rundir
from hpctrain.storage import checkpoint
from hpctrain.tools import generate
from hpctrain.tools import summary as metrics
from hpctrain.weights import export_hf

# 1.5 GiB per device planned (fp32, Adam, micro-batches of 4), on the tests' 512-token vocabulary
BIG_MODEL = ["model.dim=768", "model.n_layers=12", "model.n_heads=12", "model.n_kv_heads=12", "model.ffn_hidden=2048"]
BASE = [*SMALL_MODEL, "train.global_batch=8", "train.micro_batch=4", "train.max_steps=2", "train.log_every=1",
        "train.eval_every=0", "logging.trackers=[]", "cluster.num_threads=1"]


class _Exploit:
    """Unpickling this runs a shell command that leaves a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy_run(w, name: str, data: str | None = None):
    """A copy of the world's finished run (its config pointing at `data` when given)."""
    shutil.copytree(w / "run", w / name, symlinks=True)
    if data:
        config = w / name / ".hydra" / "config.yaml"
        config.write_text(config.read_text().replace(str(w / "data"), str(w / data)))
    return w / name


def _edit_json(path, edit) -> None:
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def _edit_states(run, edit) -> None:
    """`edit(trainer_state)` on every checkpoint of a run."""
    for ck in checkpoint.complete_checkpoints(str(run)):
        _edit_json(os.path.join(ck, checkpoint.STATE_FILE), edit)


def _qualname_metadata(target: str) -> bytes:
    """A .metadata pickle that renames an allowed function or class (`module:name`) by BUILD: vars() unchanged."""
    module, name = target.split(":")
    s = lambda text: pickle.SHORT_BINUNICODE + bytes([len(text)]) + text.encode()  # noqa: E731
    return (pickle.PROTO + b"\x04" + s(module) + s(name) + pickle.STACK_GLOBAL + pickle.NONE + pickle.EMPTY_DICT
            + s("__qualname__") + s("pwned") + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP)


def _safetensors(path) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), f.read()


def _write_safetensors(path, header: dict, data: bytes, n: int | None = None) -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if n is None else n) + raw + data)


def _hf_variant(w, name: str, edit) -> None:
    """A copy of the world's transformers model with its safetensors file edited: edit(path, header, data)."""
    shutil.copytree(w / "hf", w / name)
    path = w / name / "model.safetensors"
    edit(path, *_safetensors(path))


def _hf_int8(path, header, data) -> None:
    key = "model.layers.0.mlp.up_proj.weight"
    begin, end = header[key]["data_offsets"]
    header[key]["dtype"] = "I8"  # the same bytes read as int8: a quantized tensor in shape but not in size
    header[key]["data_offsets"] = [begin, begin + (end - begin) // 4]
    _write_safetensors(path, header, data)


def _hf_int32(path, header, data) -> None:
    header["model.layers.0.mlp.up_proj.weight"]["dtype"] = "I32"  # the same size as F32: only the dtype tells
    _write_safetensors(path, header, data)


def _hf_shape(path, header, data) -> None:
    key = "model.layers.0.mlp.up_proj.weight"
    header[key]["shape"] = header[key]["shape"][::-1]
    _write_safetensors(path, header, data)


def _hf_missing(path, header, data) -> None:
    del header["model.layers.1.mlp.down_proj.weight"]
    _write_safetensors(path, header, data)


def _hf_overlap(path, header, data) -> None:
    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    _write_safetensors(path, header, data)


@pytest.fixture(scope="module")
def lock_holder():
    """Another process holding the run-directory lock of a path (as a live run's main rank does)."""
    procs = []

    def hold(run_dir) -> None:
        code = "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print(1, " \
               "flush=True); time.sleep(3600)"
        p = subprocess.Popen([sys.executable, "-c", code, str(run_dir / rundir.LOCK_FILE)], stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"1"
        procs.append(p)

    yield hold
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def world(tmp_path_factory, demo_data, lock_holder):
    """Shard sets and runs, good and damaged, that the cases point at; built once per module."""
    from omegaconf import OmegaConf

    from hpctrain.training.run import train

    w = tmp_path_factory.mktemp("world")
    shutil.copytree(demo_data, w / "data")
    # A `make shards-slurm` build whose merge has not run: shards and journal, no manifest.json.
    shutil.copytree(demo_data, w / "unfinished")
    os.remove(w / "unfinished" / "manifest.json")
    os.remove(w / "unfinished" / demo_cli.MARKER)  # a shard build of the user's, not the demo's
    # A shard set without a validation split.
    shutil.copytree(demo_data, w / "noval")
    with open(w / "noval" / "manifest.json") as f:
        manifest = json.load(f)
    manifest["splits"]["val"] = []
    with open(w / "noval" / "manifest.json", "w") as f:
        json.dump(manifest, f)
    (w / "afile").write_text("not a directory\n")
    # A finished run with two checkpoints and its config (as `python -m hpctrain` writes it).
    from conftest import CONF_DIR
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*BASE, f"data.path={w / 'data'}", "data.prepare_demo=false",
                                                       "train.ckpt_every=1"])
    train(cfg, str(w / "run"))
    os.makedirs(w / "run" / ".hydra")
    OmegaConf.save(cfg, w / "run" / ".hydra" / "config.yaml")
    # The same run with every checkpoint's metadata replaced by a pickle that runs a command.
    shutil.copytree(w / "run", w / "evil", symlinks=True)
    for ck in checkpoint.complete_checkpoints(str(w / "evil")):
        with open(os.path.join(ck, ".metadata"), "wb") as f:
            pickle.dump(_Exploit(str(w / "pwned")), f)
    # ... and with trainer states that are not JSON.
    shutil.copytree(w / "run", w / "badstate", symlinks=True)
    for ck in checkpoint.complete_checkpoints(str(w / "badstate")):
        with open(os.path.join(ck, checkpoint.STATE_FILE), "w") as f:
            f.write("{not json")
    # Shards whose every token was altered (same size: only the checksum can tell), and shards holding a token id
    # beyond the vocabulary under a matching checksum (only the range check can tell).
    from hpctrain.core.shard_format import read_manifest

    shutil.copytree(demo_data, w / "altered")
    vocab = read_manifest(str(w / "altered")).vocab_size
    for i in range(len(read_manifest(str(w / "altered")).splits["train"])):
        edit_tokens(str(w / "altered"), i, lambda _, t: (t + 1) % vocab)
    shutil.copytree(demo_data, w / "badids")
    for i in range(len(read_manifest(str(w / "badids")).splits["train"])):
        edit_tokens(str(w / "badids"), i, lambda k, t: t if k else t * 0 + vocab + 7, fix_sha256=True)
    # A run that has not written a checkpoint yet.
    os.makedirs(w / "nockpt" / ".hydra")
    shutil.copy(w / "run" / ".hydra" / "config.yaml", w / "nockpt" / ".hydra" / "config.yaml")
    _second_round(w, lock_holder)
    return w


def _second_round(w, lock_holder) -> None:
    """The inputs of the second hardening round (issue 26), by class."""
    import torch
    import zstandard
    from omegaconf import OmegaConf
    from transformers import LlamaForCausalLM

    from hpctrain.models import build_model
    from hpctrain.models.llama.hf import to_hf_config

    # A user's own directories: notes, and experiment outputs under the names a run writes.
    (w / "notes").mkdir()
    (w / "notes" / "plan.txt").write_text("keep me\n")
    (w / "mine").mkdir()
    (w / "mine" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (w / "mine" / "result.json").write_text('{"mine": true}\n')
    (w / "mylog").mkdir()
    (w / "mylog" / "train.log").write_text("my own log\n")
    # Corpora: small text files; one jsonl line beyond the 64 MB a line may be; a truncated .jsonl.zst.
    (w / "corpus").mkdir()
    for i in range(3):
        (w / "corpus" / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 200)
    (w / "bigline").mkdir()
    with open(w / "bigline" / "big.jsonl", "w") as f:
        f.write('{"text": "' + "a" * (64 * 2**20 + 16) + '"}\n')
    (w / "zst").mkdir()
    lines = "".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(3000)).encode()
    packed = zstandard.ZstdCompressor().compress(lines)
    (w / "zst" / "part.jsonl.zst").write_bytes(packed[: len(packed) // 2])
    # A tokenizer directory that maps its class to its own Python file, which would leave ./pwned.
    (w / "evil_tok").mkdir()
    shutil.copy(w / "data" / "tokenizer" / "tokenizer.json", w / "evil_tok" / "tokenizer.json")
    (w / "evil_tok" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
    (w / "evil_tok" / "evil.py").write_text(f"import pathlib\npathlib.Path({str(w / 'pwned')!r}).touch()\n")
    # ... named by a shard set's manifest, which a run's generate reads.
    shutil.copytree(w / "data", w / "evildata")
    shutil.copytree(w / "evil_tok", w / "evildata" / "evil_tok")
    _edit_json(w / "evildata" / "manifest.json", lambda m: m["tokenizer"].update(path="evil_tok"))
    _copy_run(w, "evilgen", data="evildata")
    # Checkpoint directories a run did not write: a stray step-N directory, a stray step-N file.
    (_copy_run(w, "stray") / "checkpoints" / "step-0000003").mkdir()
    (_copy_run(w, "strayfile") / "checkpoints" / "step-0000004").write_text("a backup note\n")
    # Files that are devices: a trainer state, a metadata file, a run's metrics, a run's config.
    for name, rel in (("zerostate", f"checkpoints/step-0000002/{checkpoint.STATE_FILE}"),
                      ("zerometa", "checkpoints/step-0000002/.metadata"), ("zerometrics", "metrics.jsonl"),
                      ("zeroconfig", ".hydra/config.yaml")):
        os.remove(_copy_run(w, name) / rel)
        os.symlink("/dev/zero", w / name / rel)
    alerts = _copy_run(w, "zeroalerts") / "alerts.jsonl"  # (read on resume: the rules' states)
    alerts.unlink(missing_ok=True)
    os.symlink("/dev/zero", alerts)
    # Trainer states with values no run writes.
    _edit_states(_copy_run(w, "negstep"), lambda d: d["run"].update(step=-1000))
    _edit_states(_copy_run(w, "bigstep"), lambda d: d["run"].update(step=10**9))
    _edit_states(_copy_run(w, "badsched"), lambda d: d["scheduler"].update(base_lrs=[-0.5, -0.5]))
    _edit_states(_copy_run(w, "offsched"), lambda d: d["scheduler"].update(last_epoch=7))
    _edit_states(_copy_run(w, "othertok"), lambda d: d["run"].update(tokenizer_sha256="0" * 64))
    # Metadata that renames an allowed function or class.
    for name, target in (("qualfn", "torch.serialization:_get_layout"),
                         ("qualcls", "torch.distributed.checkpoint.filesystem:_StorageInfo")):
        for ck in checkpoint.complete_checkpoints(str(_copy_run(w, name))):
            with open(os.path.join(ck, ".metadata"), "wb") as f:
                f.write(_qualname_metadata(target))
    # A run whose config says one layer: its two-layer checkpoints are another model's.
    cfg = OmegaConf.load(w / "run" / ".hydra" / "config.yaml")
    small = _copy_run(w, "small")
    OmegaConf.save(OmegaConf.merge(cfg, {"model": {"n_layers": 1}}), small / ".hydra" / "config.yaml")
    # A run whose saved config was edited to a sequence length whose RoPE tables no machine holds.
    huge = _copy_run(w, "hugeseq")
    OmegaConf.save(OmegaConf.merge(cfg, {"model": {"max_seq_len": 10**10}}), huge / ".hydra" / "config.yaml")
    # A directory holding someone's manifest.json (not a shard set's) and their notes beside it.
    (w / "theirmanifest").mkdir()
    (w / "theirmanifest" / "manifest.json").write_text('{"files": ["a", "b"]}\n')
    (w / "theirmanifest" / "notes.txt").write_text("keep me\n")
    # Shards of another tokenizer (as far as the manifest says).
    shutil.copytree(w / "data", w / "otherdata")
    _edit_json(w / "otherdata" / "manifest.json", lambda m: m["tokenizer"].update(sha256="1" * 64))
    # A checkpoint with non-finite weights (the checkpointer never writes one: written by hand).
    nan = _copy_run(w, "nanrun")
    model = build_model(cfg.model)
    checkpoint.load_model(str(nan / "checkpoints" / "step-0000002"), model)
    with torch.no_grad():
        model.output.weight[0, 0] = float("nan")
    shutil.rmtree(nan / "checkpoints" / "step-0000002")
    state = json.loads((w / "run" / "checkpoints" / "step-0000002" / checkpoint.STATE_FILE).read_text())
    checkpoint.save(str(nan), 2, model, torch.optim.AdamW(model.parameters()), state, keep=2)
    # A run whose newest checkpoint is cut short (export-hf fails after it made its partial directory).
    ck = _copy_run(w, "trunc") / "checkpoints" / "step-0000002"
    for name in os.listdir(ck):
        if name.endswith(".distcp"):
            os.truncate(ck / name, os.path.getsize(ck / name) // 2)
    # A transformers model of the run's shape, saved here, and damaged copies of its safetensors.
    args = build_model(cfg.model).args
    LlamaForCausalLM(to_hf_config(args)).save_pretrained(w / "hf")
    _hf_variant(w, "hf_int8", _hf_int8)
    _hf_variant(w, "hf_int32", _hf_int32)
    _hf_variant(w, "hf_shape", _hf_shape)
    _hf_variant(w, "hf_missing", _hf_missing)
    _hf_variant(w, "hf_overlap", _hf_overlap)
    _hf_variant(w, "hf_hdrlen", lambda p, h, d: _write_safetensors(p, h, d, n=2**40))
    _hf_variant(w, "hf_json", lambda p, h, d: p.write_bytes(struct.pack("<Q", 9) + b"{not json"))
    _hf_variant(w, "hf_trunc", lambda p, h, d: os.truncate(p, os.path.getsize(p) - 100))
    _hf_variant(w, "hf_zero", lambda p, h, d: (os.remove(p), os.symlink("/dev/zero", p)))
    # ... shipping a tokenizer that numbers the shards' tokens otherwise, or one that is a device.
    shutil.copytree(w / "hf", w / "hf_othertok")
    tok = json.loads((w / "data" / "tokenizer" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (w / "hf_othertok" / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copytree(w / "hf", w / "hf_tokzero")
    os.symlink("/dev/zero", w / "hf_tokzero" / "tokenizer.json")
    # A run directory another live process holds.
    lock_holder(_copy_run(w, "busy"))


# Shard sets, corpora, tokenizers, models and a user's directories whole; of runs, the checkpoints (a run that
# starts rewrites its .hydra/ and appends to its log), or the whole run where nothing may be written at all.
RUNS = ("run", "evil", "badstate", "evilgen", "negstep", "bigstep", "badsched", "offsched", "othertok", "qualfn",
        "qualcls", "small", "hugeseq", "nanrun", "trunc", "zerostate", "zerometa", "stray", "strayfile", "zerometrics",
        "zeroalerts")
WATCHED = ("data", "unfinished", "noval", "altered", "badids", "afile", "nockpt", "notes", "mine", "mylog", "corpus",
           "bigline", "zst", "evil_tok", "evildata", "otherdata", "zeroconfig", "busy", "hf", "hf_int8", "hf_shape",
           "theirmanifest", "hf_int32", "hugeseq/.hydra",
           "hf_missing", "hf_overlap", "hf_hdrlen", "hf_json", "hf_trunc", "hf_zero",
           "hf_othertok", "hf_tokzero", *(f"{run}/checkpoints" for run in RUNS))


def _hp(*args):
    return cli.main, ["run_dir={w}/new", "data.path={w}/data", *BASE, *args]


def _run(name: str, *args):
    """`python -m hpctrain` in the world's run directory `name`."""
    return cli.main, [f"run_dir={{w}}/{name}", "data.path={w}/data", *BASE, *args]


PREP = ["--corpus", "{w}/corpus/*.txt", "--vocab-size", "300", "--seq-len", "16"]


# (id, entry point, argv with {w} = the world dir, words the one error line must contain)
CASES = [
    # 1. Data loss: the demo corpus is never built over a user's directory, or at a mistyped path.
    ("unfinished-shard-build", *_hp("data.path={w}/unfinished"), ["no manifest.json", "unfinished"]),
    ("mistyped-data-path", *_hp("data.path={w}/shardz"), ["does not exist"]),
    ("demo-out-over-a-run", demo_cli.main, ["--out", "{w}/run", "--max-bytes", "20000"], ["not empty"]),
    ("demo-out-over-a-shard-build", demo_cli.main, ["--out", "{w}/unfinished", "--max-bytes", "20000"],
     ["not empty"]),
    # 2. Code execution from a checkpoint: resuming, generate.
    ("crafted-metadata-resume", *_hp("train.resume={w}/evil/checkpoints/step-0000002"), ["step-0000002"]),
    ("crafted-metadata-resume-auto", cli.main, ["run_dir={w}/evil", "data.path={w}/data", *BASE,
                                                "train.max_steps=4"], ["can be loaded", "not allowed"]),
    ("crafted-metadata-generate", generate.main, ["run_dir={w}/evil", "max_new_tokens=2"], ["evil"]),
    ("crafted-metadata-generate-explicit", generate.main,
     ["run_dir={w}/run", "checkpoint={w}/evil/checkpoints/step-0000001", "max_new_tokens=2"], ["step-0000001"]),
    # 3. A global batch the data cannot hold, a micro-batch the memory cannot.
    ("huge-global-batch", *_hp("train.global_batch=100000000"), ["global_batch=100000000", "samples"]),
    ("nan-mixture-weight", *_hp("data.sources=[{name:a,path:{w}/data,weight:nan},{name:b,path:{w}/data,weight:1}]"),
     ["mixture weights [nan, 1.0]", "all finite"]),
    ("huge-global-batch-derived", *_hp("train.global_batch=null", "train.grad_accum=10000000"),
     ["samples", "lower train.global_batch"]),
    ("model-too-big-for-memory", cli.main, ["run_dir={w}/new", "data.path={w}/data", "model=llama_70b", *BASE[7:]],
     ["GiB", "train.micro_batch"]),
    ("model-too-big-for-memory-13b", cli.main, ["run_dir={w}/new", "data.path={w}/data", "model=llama_13b",
                                                *BASE[7:]], ["GiB", "the weights, gradients and optimizer state", "parallel.zero_stage=3"]),
    # 4. Non-finite or non-positive hyper-parameters.
    ("lr-inf", *_hp("optim.lr=inf"), ["optim.lr=inf", "finite"]),
    ("lr-nan", *_hp("optim.lr=nan"), ["optim.lr=nan"]),
    ("lr-negative", *_hp("optim.lr=-0.1"), ["optim.lr=-0.1", "(0, 1000"]),
    ("beta2-one", *_hp("optim.beta2=1.0"), ["optim.beta2"]),
    # 6. No validation split while evaluation is on.
    ("no-val-split", *_hp("data.path={w}/noval", "train.eval_every=1"),
     ["validation split", "have 0", "--val-fraction"]),
    ("no-val-split-default-eval", *_hp("data.path={w}/noval", "train.eval_every=100"), ["train.eval_every=0"]),
    # 7. Unknown keys, whatever the prefix.
    ("unknown-key-plus", *_hp("+train.max_stepz=5"), ["unknown config key train.max_stepz", "train.max_steps"]),
    ("unknown-key-plusplus", *_hp("++train.max_stepz=5"), ["train.max_stepz"]),
    ("unknown-key", *_hp("train.max_stepz=5"), ["unknown config key train.max_stepz"]),
    ("unknown-key-group", *_hp("+model.depth=5"), ["model.depth"]),
    ("unknown-group-option", *_hp("model=llama_8b"), ["model=llama_8b is not an option", "llama_1b"]),
    ("wrong-type", *_hp("train.max_steps=lots"), ["train.max_steps=lots", "Integer"]),
    ("unparsable-override", *_hp("train.max_steps=[1"), ["train.max_steps=[1"]),
    # Tracebacks that are one line now.
    ("n-heads-zero", *_hp("model.n_heads=0"), ["model.n_heads=0"]),
    ("n-layers-zero", *_hp("model.n_layers=0"), ["model.n_layers=0"]),
    ("unknown-model-family", *_hp("model.family=gpt9"), ["model.family='gpt9'", "use one of llama"]),
    ("option-of-another-family", *_hp("model.family=qwen2", "model.sliding_window=16"),
     ["model.sliding_window=16 is not an option of model.family=qwen2", "mistral and mixtral's"]),
    ("odd-head-dim", *_hp("model.head_dim=15"), ["head_dim=15", "must be even"]),
    ("llama3-rope-without-context", *_hp("model.rope_scaling.type=llama3", "model.rope_scaling.factor=8"),
     ["model.rope_scaling.original_max_seq_len"]),
    ("run-dir-is-a-file", cli.main, ["run_dir={w}/afile", "data.path={w}/data", *BASE], ["afile", "is a file"]),
    ("run-dir-under-a-file", cli.main, ["run_dir={w}/afile/run", "data.path={w}/data", *BASE], ["afile"]),
    ("trainer-state-not-json", *_hp("train.resume={w}/badstate/checkpoints/step-0000002"), ["trainer_state"]),
    ("trainer-state-not-json-auto", cli.main, ["run_dir={w}/badstate", "data.path={w}/data", *BASE,
                                               "train.max_steps=4"], ["badstate"]),
    ("trainer-state-not-json-auto-tp2", cli.main, ["run_dir={w}/badstate", "data.path={w}/data", *BASE,
                                                   "train.max_steps=4", "parallel=tp2"],
     ["of 2 failed", "trainer_state.json"]),
    ("resume-path-missing", *_hp("train.resume={w}/nothing/step-0000002"), ["train.resume", "not a complete"]),
    ("generate-missing-run-dir", generate.main, ["run_dir={w}/nope"], ["does not exist"]),
    ("generate-not-a-run-dir", generate.main, ["run_dir={w}/data"], ["not a run directory"]),
    ("generate-max-new-tokens", generate.main, ["run_dir={w}/run", "max_new_tokens=many"], ["not an integer"]),
    ("generate-temperature", generate.main, ["run_dir={w}/run", "temperature=-1"], ["temperature"]),
    ("generate-unknown-arg", generate.main, ["run_dir={w}/run", "promt=x"], ["promt"]),
    ("generate-no-checkpoint", generate.main, ["run_dir={w}/nockpt"], ["no complete checkpoint"]),
    ("metrics-no-argument", metrics.main, [], ["run_dir"]),
    ("metrics-missing-dir", metrics.main, ["{w}/nope"], ["not a directory"]),
    ("shards-out-under-a-file", shards_cli.main, ["--corpus", "{w}/afile", "--out", "{w}/afile/x",
                                                  "--vocab-size", "300"], ["afile"]),
    ("shards-out-is-a-file", shards_cli.main, ["--corpus", "{w}/afile", "--out", "{w}/afile", "--vocab-size", "300"],
     ["afile"]),
    ("shards-verify-missing", shards_cli.main, ["verify", "--out", "{w}/nope"], ["nope"]),
    # Nonsense that was silently accepted.
    ("seq-len-negative", *_hp("train.seq_len=-5"), ["train.seq_len=-5"]),
    ("seq-len-zero", *_hp("train.seq_len=0"), ["train.seq_len=0", "null"]),
    ("ckpt-every-negative", *_hp("train.ckpt_every=-1"), ["train.ckpt_every=-1"]),
    ("ckpt-every-word", *_hp("train.ckpt_every=often"), ["train.ckpt_every=often", "or auto"]),
    ("node-mtbf-zero", *_hp("cluster.node_mtbf_h=0"), ["cluster.node_mtbf_h=0"]),
    ("eval-every-negative", *_hp("train.eval_every=-2"), ["train.eval_every=-2"]),
    ("grad-clip-negative", *_hp("optim.grad_clip=-1"), ["optim.grad_clip=-1"]),
    ("gpu-mem-negative", *_hp("cluster.gpu_mem_gb=-3"), ["cluster.gpu_mem_gb"]),
    ("export-without-checkpoints", *_hp("train.export_hf_at_end=true", "train.checkpointing=false"),
     ["train.export_hf_at_end=true", "train.checkpointing=false"]),
    ("fused-loss-with-tp", *_hp("train.fused_loss=true", "parallel=tp2"),
     ["train.fused_loss=true needs parallel.tp=1 and parallel.pp=1", "drop train.fused_loss"]),
    ("restart-positions-without-mask", *_hp("train.restart_positions=true"),
     ["train.restart_positions=true", "set train.document_mask=true too"]),
    ("profile-steps-backwards", *_hp("train.profile_steps=[3,1]"),
     ["train.profile_steps=[3, 1]", "1 <= first <= last <= train.max_steps=2"]),
    ("init-from-not-a-model", *_hp("model.init_from=hf:{w}/data"), ["model.init_from=hf:", "no config.json"]),
    ("adafactor-fused", *_hp("optim=adafactor", "optim.implementation=fused"),
     ["optim.implementation=fused", "optim.implementation=foreach"]),
    ("data-path-is-a-file", *_hp("data.path={w}/afile"), ["is a file"]),
    ("plan-unknown-key", cli.main, ["plan", "+train.max_stepz=3"], ["unknown config key"]),
    ("plan-missing-option", cli.main, ["plan", "model=llama_9b"], ["model=llama_9b is not an option", "tiny"]),
    ("local-multirun-bad-point", cli.main, ["-m", "hydra.sweep.dir={w}/sweep", "data.path={w}/data", *BASE,
                                            "optim.lr=-1,1e-3"], ["sweep point #0 (optim.lr=-1): optim.lr=-1.0"]),
    ("local-multirun-bad-batch", cli.main, ["-m", "hydra.sweep.dir={w}/sweep", "data.path={w}/data", *BASE,
                                            "train.global_batch=7,8"], ["sweep point #0 (train.global_batch=7): "]),
    # 8. Shards that are not what the manifest says: found as they are read, the run stops on one line.
    ("altered-shards", *_hp("data.path={w}/altered", "train.resume=never"), ["checksum mismatch", "on_corrupt"]),
    ("token-id-beyond-vocab", *_hp("data.path={w}/badids", "train.resume=never"),
     ["sample 0", "token id 519", "vocab_size 512"]),
    ("slurm-launcher-without-slurm", *_hp("hydra/launcher=slurm"), ["sbatch", "hydra/launcher=local"]),
    ("slurm-sweep-without-slurm", cli.main, ["-m", "hydra/launcher=slurm", "hydra.sweep.dir={w}/sweep2",
                                             "data.path={w}/data", *BASE, "optim.lr=1e-3,3e-3"], ["sbatch"]),
    # A packed sweep looks for Slurm before it makes the points' directories too (Hydra writes multirun.yaml).
    ("slurm-packed-sweep-without-slurm", cli.main, ["-m", "hydra/launcher=slurm", "hydra.sweep.dir={w}/sweep4",
                                                    "cluster.pack=2", "data.path={w}/data", *BASE,
                                                    "optim.lr=1e-3,3e-3"], ["sbatch and srun are not on PATH"]),
    # What a job asks of its nodes, checked before it is submitted (before sbatch is looked for): a 1.5 GiB model
    # on 1 GiB of a CPU node's --mem, of a GPU, and two GPU ranks' asynchronous checkpoint copies on the host.
    ("submit-over-a-nodes-memory", *_hp("hydra/launcher=slurm", *BIG_MODEL, "cluster.mem_gb=1"),
     ["needs about 1.5 GiB", "more than cluster.mem_gb=1, a node's --mem (1.0 GiB"]),
    ("submit-over-a-gpus-memory", *_hp("hydra/launcher=slurm", *BIG_MODEL, "cluster.gpus_per_node=1",
                                       "cluster.gpu_mem_gb=1"), ["needs about 1.5 GiB", "cluster.gpu_mem_gb=1"]),
    # Options of cluster.sbatch_extra that would replace what hpctrain writes into the job script from its own keys.
    ("sbatch-extra-time", *_hp("+cluster.sbatch_extra.time=30"),
     ["cluster.sbatch_extra.time would replace the job's --time, which hpctrain writes from cluster.time_min",
      "set that instead"]),
    ("sbatch-extra-no-requeue", *_hp("hydra/launcher=slurm", "+cluster.sbatch_extra.no_requeue=true"),
     ["cluster.sbatch_extra.no_requeue would replace the job's --requeue", "resumes", "leave it out"]),
    # ... or change sbatch's answer: with --parsable the job ran and hpctrain failed on "Submitted batch job N" missing
    ("sbatch-extra-parsable", *_hp("hydra/launcher=slurm", "+cluster.sbatch_extra.parsable=true"),
     ["cluster.sbatch_extra.parsable: sbatch would print the job's id alone", "fail as it starts", "leave it out"]),
    ("submit-time-limit-inside-the-lead", *_hp("hydra/launcher=slurm", "cluster.time_min=2"),
     ["cluster.time_min=2 (120 s) leaves 0 s", "cluster.signal_lead_s=120", "raise cluster.time_min"]),
    ("submit-async-copies-over-a-nodes-memory", *_hp("hydra/launcher=slurm", *BIG_MODEL, "cluster.gpus_per_node=2",
                                                     "parallel=ddp", "parallel.dp=2", "train.ckpt_async=true",
                                                     "cluster.mem_gb=1"),
     ["host copy", "(2 ranks × ", "cluster.mem_gb=1", "train.ckpt_async=false"]),
    # --- Second round (issue 26), by the class numbers ---
    # 1. data_prep never deletes or overwrites what it cannot prove it made.
    ("prep-over-an-unfinished-build", shards_cli.main, [*PREP, "--out", "{w}/unfinished"],
     ["unfinished build", "--overwrite"]),
    ("prep-into-a-users-directory", shards_cli.main, [*PREP, "--out", "{w}/notes"],
     ["notes is not empty", "holds no shard build"]),
    ("prep-into-a-dir-with-their-manifest", shards_cli.main, [*PREP, "--out", "{w}/theirmanifest"],
     ["holds a manifest.json that is not an hpctrain shard set's"]),
    ("tokenizer-over-a-tokenizer", tokenizer_cli.main, ["--corpus", "{w}/corpus/*.txt", "--vocab", "300",
                                                        "--out", "{w}/data/tokenizer"], ["already holds tokenizer.json"]),
    # 2. A step-N in checkpoints/ that no run completed is never replaced.
    ("resume-at-a-dp-the-lanes-cannot-share", *_run("run", "parallel=ddp", "parallel.dp=3", "train.global_batch=12",
                                                    "train.max_steps=4"),
     ["lanes, which dp=3 ranks cannot share", "resume at a dp among [1, 2,"]),
    ("stray-checkpoint-directory", *_run("stray", "train.max_steps=4"), ["step-0000003 is not a complete checkpoint"]),
    ("stray-checkpoint-file", *_run("strayfile", "train.max_steps=4"), ["step-0000004 is not a complete checkpoint"]),
    # 3. Code in a data directory never runs.
    ("prep-tokenizer-with-code", shards_cli.main, [*PREP, "--out", "{w}/out", "--tokenizer", "{w}/evil_tok"],
     ["asks to run its own Python code", "auto_map"]),
    ("generate-tokenizer-with-code", generate.main, ["run_dir={w}/evilgen", "max_new_tokens=2"],
     ["asks to run its own Python code"]),
    # 4. Every input that scales memory is counted: the RoPE tables of model.max_seq_len.
    ("max-seq-len-huge", *_hp("model.max_seq_len=1000000000"), ["GiB", "RoPE tables", "lower model.max_seq_len"]),
    ("max-seq-len-huge-two-ranks", *_hp("model.max_seq_len=200000000", "parallel=fsdp", "parallel.dp=2"),
     ["GiB", "RoPE tables"]),
    # ... and in a run's saved config, which generate and export-hf build a model from.
    ("generate-config-seq-len-huge", generate.main, ["run_dir={w}/hugeseq", "max_new_tokens=2"],
     ["hugeseq/.hydra/config.yaml needs", "RoPE tables, model.max_seq_len=10000000000"]),
    ("export-config-seq-len-huge", export_hf.main, ["{w}/hugeseq", "{w}/out"], ["GiB before any activation"]),
    # 5. One line of a corpus is bounded.
    ("jsonl-line-beyond-64-mb", shards_cli.main, ["--corpus", "{w}/bigline/*.jsonl", "--out", "{w}/out",
                                                  "--vocab-size", "300"], ["big.jsonl:1", "more than 64 MB"]),
    ("jsonl-line-beyond-64-mb-skipped", tokenizer_cli.main, ["--corpus", "{w}/bigline/*.jsonl", "--vocab", "300",
                                                             "--out", "{w}/out", "--bad-lines", "skip"],
     ["no documents to train the tokenizer"]),
    # 6. A directory holding someone else's files of the names a run writes is never written into.
    ("run-dir-holds-their-metrics", cli.main, ["run_dir={w}/mine", "data.path={w}/data", *BASE],
     ["run_dir={w}/mine holds metrics.jsonl, result.json that no hpctrain run wrote"]),
    ("run-dir-holds-their-log", cli.main, ["run_dir={w}/mylog", "data.path={w}/data", *BASE], ["train.log"]),
    ("submission-into-their-directory", cli.main, ["run_dir={w}/mine", "hydra/launcher=local", "data.path={w}/data",
                                                   *BASE], ["no hpctrain run wrote"]),
    # 7. The notify command is checked before start (its output is bounded: test_safety.py).
    ("notify-cmd-missing", *_hp("monitor.notify_cmd=[/nonexistent/page-me]"), ["is not an executable program"]),
    ("notify-cmd-not-on-path", *_hp("monitor.notify_cmd=[no-such-pager-xyz,--urgent]"), ["no-such-pager-xyz"]),
    # 8. Files read from a run or a checkpoint are regular files of a bounded size.
    ("init-from-state-is-a-device", *_hp("model.init_from={w}/zerostate/checkpoints/step-0000002"),
     ["trainer_state.json is a character device"]),
    ("resume-metadata-is-a-device", *_hp("train.resume={w}/zerometa/checkpoints/step-0000002"),
     [".metadata is a character device"]),
    ("resume-metrics-is-a-device", *_run("zerometrics", "train.max_steps=4"), ["metrics.jsonl is a character device"]),
    ("resume-alerts-is-a-device", *_run("zeroalerts", "train.max_steps=4"), ["alerts.jsonl is a character device"]),
    ("generate-config-is-a-device", generate.main, ["run_dir={w}/zeroconfig"], ["is a character device"]),
    # 9. Checkpoints load strictly: another model's are refused, whoever reads them.
    ("resume-with-fewer-layers", *_run("run", "model.n_layers=1", "train.max_steps=4"),
     ["written for another model", "layers.1.", "which this model has not"]),
    ("init-from-with-fewer-layers", *_hp("model.init_from={w}/run/checkpoints/step-0000002", "model.n_layers=1"),
     ["written for another model"]),
    ("generate-another-models-checkpoint", generate.main, ["run_dir={w}/small", "max_new_tokens=2"],
     ["written for another model", "pass the directory of the run that wrote it"]),
    ("export-another-models-checkpoint", export_hf.main, ["{w}/small", "{w}/out"],
     ["written for another model", "pass the directory of the run that wrote it"]),
    # ... and a run's data.path rebuilt since with another tokenizer: generate would decode, and export-hf ship, the
    # wrong text
    ("generate-checkpoint-of-another-tokenizer", generate.main, ["run_dir={w}/othertok", "max_new_tokens=2"],
     ["another tokenizer (sha256 000000000000)", "put the run's shards"]),
    ("export-checkpoint-of-another-tokenizer", export_hf.main, ["{w}/othertok", "{w}/out"],
     ["another tokenizer (sha256 000000000000)"]),
    # 10. model.init_from's token ids are the shards'.
    ("init-from-other-tokenizer-shards", *_hp("data.path={w}/otherdata",
                                              "model.init_from={w}/run/checkpoints/step-0000002"), ["another tokenizer"]),
    ("init-from-other-tokenizer-state", *_hp("model.init_from={w}/othertok/checkpoints/step-0000002"),
     ["another tokenizer"]),
    # 11. A saved schedule sets no rate (a changed optim.lr applies on resume: test_safety.py).
    ("resume-negative-base-lr", *_hp("train.resume={w}/badsched/checkpoints/step-0000002"), ["base_lrs=-0.5"]),
    ("resume-schedule-off-its-step", *_hp("train.resume={w}/offsched/checkpoints/step-0000002"),
     ["scheduler.last_epoch=7"]),
    # 12. Trainer state values are checked like config values.
    ("resume-negative-step", *_hp("train.resume={w}/negstep/checkpoints/step-0000002"),
     ["step=-1000 is not an integer within [0,"]),
    ("resume-huge-step", *_hp("train.resume={w}/bigstep/checkpoints/step-0000002"), ["run.step=1000000000"]),
    # a checkpoint at train.max_steps already: the run would end at once, "completed" with nothing of its own
    ("resume-at-max-steps", *_hp("train.resume={w}/run/checkpoints/step-0000002"),
     ["is at step 2, train.max_steps=2", "raise train.max_steps"]),
    # 13. One run per run directory.
    ("run-dir-in-use", *_run("busy", "train.max_steps=4"), ["run_dir={w}/busy is in use by another run"]),
    ("submission-into-a-dir-in-use", cli.main, ["run_dir={w}/busy", "hydra/launcher=local", "data.path={w}/data",
                                                *BASE, "train.max_steps=4"], ["is in use by another run"]),
    # 14. Metadata cannot change what it names, in vars() or not.
    ("metadata-renames-a-function", *_hp("train.resume={w}/qualfn/checkpoints/step-0000002"),
     ["bad .metadata", "it modifies _get_layout"]),
    ("metadata-renames-a-class", *_hp("train.resume={w}/qualcls/checkpoints/step-0000002"),
     ["bad .metadata", "it modifies _StorageInfo"]),
    # 15. A truncated .zst is damage, not a bad line.
    ("zst-truncated-skip", shards_cli.main, ["--corpus", "{w}/zst/*.zst", "--out", "{w}/out", "--vocab-size", "300",
                                             "--bad-lines", "skip"], ["part.jsonl.zst", "corrupt or truncated"]),
    ("zst-truncated", shards_cli.main, ["--corpus", "{w}/zst/*.zst", "--out", "{w}/out", "--vocab-size", "300"],
     ["corrupt or truncated", "ends inside a block"]),
    # 16. A transformers directory's tensors: floating point, of the described shapes (+ malformed files below).
    ("init-from-int8-weights", *_hp("model.init_from=hf:{w}/hf_int8"), ["is I8 (quantized?)"]),
    ("init-from-int32-weights", *_hp("model.init_from=hf:{w}/hf_int32"), ["up_proj.weight is I32 (quantized?)"]),
    ("init-from-wrong-shape", *_hp("model.init_from=hf:{w}/hf_shape"), ["up_proj.weight is [64, 176]", "needs"]),
    # The shape comes from config.json: a typed model key against it is refused (no run directory made).
    ("init-from-hf-contradicting-override", *_hp("model.init_from=hf:{w}/hf", "model.n_layers=3"),
     ["model.n_layers=3 contradicts", "num_hidden_layers=2", "drop the override"]),
    # 17. A run that applied no step is never "completed" (the run dir stays, its result.json says failed).
    ("every-step-skipped", *_hp("model.init_std=1e30"), ["none of this run's 2 steps was applied"]),
    ("non-finite-from-the-first-step", *_hp("model.init_std=1e30", "train.max_nonfinite=1"),
     ["not finite from the first step on", "model.init_std=1e+30"]),
    # 18. Schedules that make no sense.
    ("decay-steps-zero", *_hp("optim.decay_steps=0"), ["optim.decay_steps=0 must be >= 1"]),
    ("gc-every-negative", *_hp("train.gc_every=-1"),
     ["train.gc_every=-1 must be >= 0", "0 leaves garbage collection automatic"]),
    ("decay-ends-before-warmup", *_hp("optim.decay_steps=50", "optim.warmup_steps=100"),
     ["optim.decay_steps=50 must be > optim.warmup_steps=100"]),
    ("scaled-lr-above-the-cap", *_hp("optim.lr=900", "optim.lr_scaling=linear", "optim.ref_global_batch=1"),
     ["is 7200", "above 1000"]),
    # 19. generate's sizes and text.
    ("generate-max-new-tokens-huge", generate.main, ["run_dir={w}/run", "max_new_tokens=1000000000"],
     ["max_new_tokens=1000000000", "within [0, 100000]"]),
    ("generate-max-new-tokens-negative", generate.main, ["run_dir={w}/run", "max_new_tokens=-1"],
     ["max_new_tokens=-1", "within [0, 100000]"]),
    ("generate-seed-20-digits", generate.main, ["run_dir={w}/run", "seed=12345678901234567890"], ["seed="]),
    # Medium and low: malformed safetensors, before anything starts.
    ("hf-header-length-huge", *_hp("model.init_from=hf:{w}/hf_hdrlen"), ["header in a", "truncated or not"]),
    ("hf-header-not-json", *_hp("model.init_from=hf:{w}/hf_json"), ["not JSON"]),
    ("hf-data-truncated", *_hp("model.init_from=hf:{w}/hf_trunc"), ["truncated or damaged"]),
    ("hf-offsets-overlap", *_hp("model.init_from=hf:{w}/hf_overlap"), ["overlap"]),
    ("hf-tensor-missing", *_hp("model.init_from=hf:{w}/hf_missing"), ["has no tensor", "down_proj"]),
    ("hf-weights-are-a-device", *_hp("model.init_from=hf:{w}/hf_zero"), ["character device"]),
    ("init-from-hf-of-another-tokenizer", *_hp("model.init_from=hf:{w}/hf_othertok"),
     ["numbers tokens differently", "id 300: ", "--tokenizer"]),
    ("init-from-hf-tokenizer-is-a-device", *_hp("model.init_from=hf:{w}/hf_tokzero"), ["character device"]),
    # export-hf where nothing can be written, or its read fails midway: nothing of OUT stays.
    ("export-under-a-file", export_hf.main, ["{w}/run", "{w}/afile/out"], ["cannot create", "afile"]),
    ("export-into-proc", export_hf.main, ["{w}/run", "/proc/hpctrain-export"], ["cannot create"]),
    ("export-truncated-checkpoint", export_hf.main, ["{w}/trunc", "{w}/out"], ["a file ends early"]),
    # a tool's fix is another checkpoint=DIR, not a resume
    ("export-checkpoints-dir", export_hf.main, ["{w}/run", "{w}/out", "checkpoint={w}/run/checkpoints"],
     ["cannot load checkpoint {w}/run/checkpoints", "pass checkpoint=RUN_DIR/checkpoints/step-N"]),
    ("generate-checkpoints-dir", generate.main, ["run_dir={w}/run", "checkpoint={w}/run/checkpoints"],
     ["cannot load checkpoint {w}/run/checkpoints", "pass checkpoint=RUN_DIR/checkpoints/step-N"]),
    # generate on non-finite weights and text that is not UTF-8.
    ("generate-non-finite-weights", generate.main, ["run_dir={w}/nanrun", "max_new_tokens=2"],
     ["holds non-finite weights"]),
    ("generate-prompt-not-utf8", generate.main, ["run_dir={w}/run", "prompt=caf\udce9"], ["not valid UTF-8"]),
    # Numbers that became overflows.
    ("pg-timeout-huge", *_hp("cluster.pg_timeout_s=1e300"), ["cluster.pg_timeout_s=1e+300"]),
    ("loss-scale-huge", *_hp("precision=fp16", "precision.loss_scale_init=1e300"), ["precision.loss_scale_init"]),
    ("prep-vocab-huge", shards_cli.main, ["--corpus", "{w}/corpus/*.txt", "--out", "{w}/out",
                                          "--vocab-size", "100000000"], ["vocab_size=100000000"]),
    ("tokenizer-vocab-huge", tokenizer_cli.main, ["--corpus", "{w}/corpus/*.txt", "--vocab", "100000000",
                                                  "--out", "{w}/out"], ["vocab_size=100000000"]),
    # Serving and tracking addresses checked before start.
    ("prometheus-address-malformed", *_hp("monitor.prometheus_port=0", "monitor.prometheus_addr=bad_host"),
     ["monitor.prometheus_addr='bad_host' is not an address"]),
    ("prometheus-address-not-here", *_hp("monitor.prometheus_port=0", "monitor.prometheus_addr=203.0.113.7"),
     ["cannot be served on '203.0.113.7'"]),
    ("mlflow-server-not-answering", *_hp("logging.trackers=[mlflow]", "logging.mlflow_tracking_uri=http://127.0.0.1:9"),
     ["does not answer"]),
    ("mlflow-sqlite-at-a-users-file", *_hp("logging.trackers=[mlflow]",
                                           "logging.mlflow_tracking_uri=sqlite:///{w}/notes/plan.txt"),
     ["is not an SQLite database"]),
    # A grid checked point by point before anything is submitted (sbatch/sweep.sbatch runs it).
    ("grid-with-a-bad-point", cli.main, ["check", "optim.lr=1e-3,-1", "--", "data.path={w}/data", *BASE],
     ["sweep point #1 (optim.lr=-1", "optim.lr=-1.0 must be"]),
    ("grid-with-an-unknown-key", cli.main, ["check", "optim.lr=1e-3,3e-3", "--", "train.max_stepz=3",
                                            "data.path={w}/data", *BASE], ["sweep point #0", "train.max_stepz"]),
]


# Found only while training (shards are checked as they are read; every step skipped): the run dir stays, its
# result.json says failed.
STARTED = {"altered-shards", "token-id-beyond-vocab", "every-step-skipped", "non-finite-from-the-first-step"}
# Found only as the corpus is read: the build stays unfinished (rerun to go on), with no manifest.
BUILD_STARTED = {"jsonl-line-beyond-64-mb"}


@pytest.mark.parametrize("name,main,argv,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(world, name, main, argv, words):
    argv = [a.replace("{w}", str(world)) for a in argv]
    before = {name: tree_digest(world / name) for name in WATCHED}
    # No Slurm client on PATH here (the cases that need it are in test_slurm.py); a cache of its own, so a demo
    # build would show.
    env = {"PATH": os.path.dirname(os.__file__), "HPCTRAIN_CACHE": str(world / "cache")}
    try:
        ran = run_forked(main, argv, cwd=world, env=env)
        leftovers = [gone for gone in ("new", "shardz", "pwned", "cache", "sweep/0", "sweep4/0", "out") if (world / gone).exists()]
        leftovers += glob.glob(str(world / "*.partial-*")) + glob.glob(str(world / "notes" / "*.lock"))
        if name in BUILD_STARTED:
            leftovers.remove("out")
            assert not (world / "out" / "manifest.json").exists()
        if name in STARTED:
            leftovers.remove("new")
            with open(world / "new" / "result.json") as f:
                assert json.load(f)["status"] == "failed"
    finally:  # a case that fails here must not spoil the next ones
        for made in ("new", "out"):
            shutil.rmtree(world / made, ignore_errors=True)
    assert ran.code != 0, ran.out + ran.err
    assert "Traceback" not in ran.out + ran.err, ran.err
    assert len(ran.err_lines) == 1, ran.err
    for w in words:
        assert w.replace("{w}", str(world)) in ran.err_lines[0], (w, ran.err_lines[0])
    assert ran.code == 2, ran.err
    assert {name: tree_digest(world / name) for name in WATCHED} == before
    assert not leftovers  # no run dir, no demo build, no code run



@pytest.mark.parametrize("var, value, words", [
    ("SBATCH_TIMELIMIT", "30", ["SBATCH_TIMELIMIT=30 in the environment would replace cluster.time_min=60",
                                "unset SBATCH_TIMELIMIT and set cluster.time_min"]),
    ("SBATCH_SIGNAL", "USR1@60", ["SBATCH_SIGNAL=USR1@60 in the environment would override the job script's --signal",
                                  "cluster.signal_lead_s"]),
    ("SBATCH_NO_REQUEUE", "", ["SBATCH_NO_REQUEUE", "--requeue", "unset SBATCH_NO_REQUEUE"]),
    ("SBATCH_OUTPUT", "/tmp/x.out", ["SBATCH_OUTPUT=/tmp/x.out", "--output", "submitit reads the job's result"]),
    ("SBATCH_EXPORT", "NONE", ["SBATCH_EXPORT=NONE", "--export=ALL", "the environment it is submitted from"]),
    ("SBATCH_EXPORT", "ALLOWED=1", ["SBATCH_EXPORT=ALLOWED=1", "--export=ALL"]),
    ("SBATCH_WAIT", "YES", ["SBATCH_WAIT=YES in the environment would keep sbatch from returning until the job ends",
                            "unset SBATCH_WAIT", "cluster.wait=true"]),
    # Not in the way: the same time limit, a flag sbatch reads as unset, the whole environment and more
    ("SBATCH_TIMELIMIT", "1:00:00", ["sbatch and srun are not on PATH"]),
    ("SBATCH_NO_REQUEUE", "0", ["sbatch and srun are not on PATH"]),
    ("SBATCH_WAIT", "0", ["sbatch and srun are not on PATH"]),
    ("SBATCH_WAIT", "1 ", ["sbatch and srun are not on PATH"]),  # (measured: sbatch reads it as unset)
    ("SBATCH_EXPORT", "FOO=1,ALL", ["sbatch and srun are not on PATH"]),
    ("SBATCH_EXPORT", "ALL,FOO=1", ["sbatch and srun are not on PATH"])])
def test_sbatch_environment_over_the_job_script_is_refused_before_submitting(world, var, value, words):
    """sbatch takes SBATCH_* over the script's #SBATCH lines: a time limit, warning signal or no-requeue there would
    run the job on other terms than its checks and requeue plan. One line, before Slurm is even looked for."""
    main, argv = _hp("hydra/launcher=slurm")
    ran = run_forked(main, [a.replace("{w}", str(world)) for a in argv], cwd=world,
                     env={"PATH": os.path.dirname(os.__file__), var: value})
    assert ran.code == 2 and len(ran.err_lines) == 1 and all(w in ran.err for w in words), ran.err
    assert not (world / "new").exists()


def test_an_sbatch_answer_submitit_cannot_read_is_one_line_and_keeps_the_run_dir(world, tmp_path):
    """An sbatch wrapper (or --parsable) that answers with the job id alone: the job may be queued all the same, so
    one line saying so (exit 1, no bad input), and the run directory the job would write is kept. Before that, with
    no srun on PATH (submitit looks for it first), one line and no run directory."""
    for name, text in (("sbatch", "echo 12345"), ("srun", "exit 1")):  # (sbatch --parsable's answer; srun: not run)
        (tmp_path / name).write_text(f"#!/bin/sh\n{text}\n")
        (tmp_path / name).chmod(0o755)
    main, argv = _hp("hydra/launcher=slurm")
    argv = [a.replace("{w}", str(world)).replace("/new", "/answered") for a in argv]
    path = f"{tmp_path}:{os.path.dirname(os.__file__)}"
    (tmp_path / "srun").rename(tmp_path / "srun-aside")
    ran = run_forked(main, argv, cwd=world, env={"PATH": path})
    assert ran.code == 2 and ran.err_lines == ["hpctrain: error: hydra/launcher=slurm needs Slurm, and srun is not on "
                                               "PATH here: run on a Slurm login node, or use hydra/launcher=local (or "
                                               "no launcher) to run on this machine"], ran.err
    assert not (world / "answered").exists()
    (tmp_path / "srun-aside").rename(tmp_path / "srun")
    ran = run_forked(main, argv, cwd=world, env={"PATH": path})
    assert ran.code == 1 and len(ran.err_lines) == 1, ran.err
    assert "sbatch answered '12345', not 'Submitted batch job N': submitit cannot put the job's files in place, so a " \
           "job queued all the same fails as it starts (squeue --me; scancel it)" in ran.err, ran.err
    assert (world / "answered" / ".submitit").is_dir()


def test_sbatch_extra_is_one_printable_option_per_key():
    """cluster.sbatch_extra becomes `#SBATCH --key=value` lines: a key that is no option name or a value with a
    newline would write a line of its own into the script; other options, short or long, pass."""
    from hpctrain.core.config import ConfigError, check_sbatch_text

    for extra in ({"comment": "a\nsrun id"}, {"x y": 1}, {"mail-type\nsrun id": "END"}):
        with pytest.raises(ConfigError, match="the key must be an sbatch option's name and the value one line"):
            check_sbatch_text({"sbatch_extra": extra})
    with pytest.raises(ConfigError, match="cluster.sbatch_extra.cpus_per_task would replace the job's "
                                          "--cpus-per-task, which hpctrain writes from cluster.cpus_per_task"):
        check_sbatch_text({"sbatch_extra": {"cpus_per_task": 4}})
    # sbatch reads an unambiguous start of a name as the option (`#SBATCH --partit=x` is --partition)
    with pytest.raises(ConfigError, match=r"cluster.sbatch_extra.partit: sbatch takes the start of an option's name for "
                                          r"the option where only one begins so.*\(--partition, which hpctrain writes "
                                          r"from cluster.partition\)"):
        check_sbatch_text({"sbatch_extra": {"partit": "gpu"}})
    with pytest.raises(ConfigError, match="requeue=false would write --requeue=False: an #SBATCH flag takes no value"):
        check_sbatch_text({"sbatch_extra": {"requeue": False}})
    check_sbatch_text({"sbatch_extra": {"cpus_per_task": 4}}, "eval.cluster", options=False)  # (eval jobs: not theirs)
    with pytest.raises(ConfigError, match="cluster.sbatch_extra.mem would replace the job's --mem, which hpctrain "
                                          "writes from cluster.mem_gb"):
        check_sbatch_text({"mem_gb": 64, "sbatch_extra": {"mem": 0}})
    check_sbatch_text({"mem_gb": None, "sbatch_extra": {"mem": 0}})  # all of a node's memory, where none is planned
    # Options that change sbatch's answer or the job's environment, long, short or begun.
    for extra, words in (({"test_only": True}, "test_only: sbatch would submit no job"),
                         ({"wait": True}, "wait: sbatch would not return until the job ends: set cluster.wait=true"),
                         ({"export": "NONE"}, "export=NONE: the job would not start in the environment it is submitted"),
                         ({"export": "ALLOWED=1"}, "export=ALLOWED=1: the job would not start in the environment"),
                         ({"pars": True}, r"pars: sbatch takes the start of an option's name .*\(--parsable"),
                         # submitit writes a key as --KEY: --J=name is unrecognized, --t=30 ambiguous (measured)
                         ({"J": "name"}, "J: submitit writes it as --J, which sbatch does not read as -J .*: use its "
                                         "long name"),
                         ({"t": 30}, "t: submitit writes it as --t.*: use --time, which hpctrain writes from "
                                     "cluster.time_min")):
        with pytest.raises(ConfigError, match=words):
            check_sbatch_text({"sbatch_extra": extra})
    check_sbatch_text({"sbatch_extra": {"export": "FOO=1,ALL", "wait_all_nodes": 1}})
    check_sbatch_text({"sbatch_extra": {"exclusive": True, "requeue": True, "x": "n3", "mail_type": "END",
                                        "mem-per-cpu": "2G", "job_name": "name"}})


def test_a_run_dir_that_existed_before_is_kept(world, tmp_path):
    """Only what this command made is removed after a failed check: an existing run dir and its files stay, and
    of a new run dir's parents only those Hydra made for it go."""
    mine = tmp_path / "mine"
    os.makedirs(mine / "notes")
    (mine / "notes" / "plan.txt").write_text("keep me\n")
    os.makedirs(tmp_path / "runs")  # an empty parent the user made (e.g. to set its Lustre striping)
    before = tree_digest(tmp_path)
    for run_dir in (mine, tmp_path / "runs" / "2026" / "exp1"):
        ran = run_forked(cli.main, [f"run_dir={run_dir}", f"data.path={world / 'data'}", *BASE, "optim.lr=nan"],
                         cwd=world)
        assert ran.code == 2 and len(ran.err_lines) == 1, ran.err
    assert tree_digest(tmp_path) == before


def test_truncated_checkpoint_falls_back_to_the_previous_one(world, tmp_path):
    """A cut .distcp in the newest checkpoint: the run says so in one warning and resumes from the one before."""
    run = tmp_path / "run"
    shutil.copytree(world / "run", run, symlinks=True)
    newest = run / "checkpoints" / "step-0000002"
    for name in os.listdir(newest):
        if name.endswith(".distcp"):
            size = os.path.getsize(newest / name)
            with open(newest / name, "r+b") as f:
                f.truncate(size // 2)
    ran = run_forked(cli.main, [f"run_dir={run}", f"data.path={world / 'data'}", *BASE, "train.max_steps=3"],
                     cwd=tmp_path)
    assert ran.code == 0, ran.err
    log = (run / "train.log").read_text()
    assert f"checkpoint {newest} cannot be loaded" in log and "falling back to" in log and "step-0000001" in log
    assert "resumed from" in log and f"{run}/checkpoints/step-0000001 at step 1" in log
    with open(run / "result.json") as f:
        assert json.load(f)["status"] == "completed"


def test_help_names_the_commands_and_launchers(tmp_path):
    ran = run_forked(cli.main, ["--help"], cwd=tmp_path)
    assert ran.code == 0, ran.err
    for words in ("python -m hpctrain plan", "python -m hpctrain preflight", "python -m hpctrain generate",
                  "python -m hpctrain summary", "hydra/launcher=local", "hydra/launcher=slurm", "model: llama_125m"):
        assert words in ran.out, words
    assert "__main__" not in ran.out
    ran = run_forked(cli.main, ["--no-such-flag"], cwd=tmp_path)
    assert ran.code == 2 and "usage: python -m hpctrain" in ran.err and "__main__" not in ran.err


def test_metrics_shows_the_status(world, tmp_path):
    ran = run_forked(metrics.main, [str(world / "run")], cwd=tmp_path)
    assert ran.code == 0 and ran.out.startswith("status: completed after step 2; loss "), ran.out
    ran = run_forked(metrics.main, [str(world / "nockpt")], cwd=tmp_path)
    assert ran.code == 0 and "no result.json" in ran.out and "no metrics.jsonl yet" in ran.out, ran.out


@pytest.mark.parametrize("module, argv, says", [
    ("bench_moe", ["--experts", "8", "--top-k", "9"], "--top-k 9 must be at most --experts 8"),
    ("bench_moe", ["--experts", "8", "--ep", "3"], "--ep 3 must divide them"),
    ("bench_moe", ["--repeats", "0"], "argument --repeats: 0 must be >= 1"),
    ("bench_moe", ["--threads", "0"], "argument --threads: 0 must be >= 1"),
    ("bench", ["--threads", "0", "--quick"], "argument --threads: 0 must be >= 1"),
    ("bench", ["--repeats", "x"], "argument --repeats: 'x' is not an integer"),
    ("bench_host", ["--ranks", "0"], "--ranks 0: local rank counts of 2 or more"),
    ("bench_eval", ["--docs", "0"], "argument --docs: 0 must be >= 1"),
])
def test_bench_arguments_that_cannot_work_are_one_line(module, argv, says, capsys):
    """A benchmark's bad argument is its usage error, one line, before anything is measured (a traceback before:
    statistics of no repeats, set_num_threads(0), top-k beyond the experts)."""
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"hpctrain.tools.{module}").main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_a_jobs_result_file_is_never_unpickled(tmp_path):
    """cluster.wait=true reads how each job ended from submitit's result pickle: its outcome word only, parsed, never
    unpickled (submitit's reader ran whatever it named: here a shell command)."""
    from types import SimpleNamespace

    import cloudpickle

    from hpctrain.launch.submit import _outcome

    def task(name: str, content: bytes | None):
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        return SimpleNamespace(paths=SimpleNamespace(result_pickle=path))

    marker = tmp_path / "pwned"
    crafted = cloudpickle.dumps(("success", _Exploit(str(marker))))
    assert _outcome(task("crafted", crafted)) == "success" and not marker.exists()
    assert _outcome(task("failed", cloudpickle.dumps(("error", "Traceback ...")))) == "error"
    assert _outcome(task("other", pickle.dumps(_Exploit(str(marker))))) == "unreadable" and not marker.exists()
    assert _outcome(task("garbage", b"\x80\x05not a pickle")) == "unreadable"
    assert _outcome(task("missing", None), wait_s=0) == "missing"
