"""Bad inputs, as a new user or an attacker would type them: every one ends in ONE line naming the fix,
a non-zero exit, no traceback, and nothing changed on disk (the shard sets and the checkpoints of an
existing run are hashed before and after). Commands run forked from this process (see helpers.run_forked):
the real entry points, without a new interpreter's start-up per case.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
from conftest import SMALL_MODEL
from helpers import edit_tokens, run_forked, tree_digest

from data_prep import demo as demo_cli
from data_prep import shards as shards_cli
from hpctrain import checkpoint, cli
from hpctrain.tools import generate
from hpctrain.tools import summary as metrics

BASE = [*SMALL_MODEL, "train.global_batch=8", "train.micro_batch=4", "train.max_steps=2", "train.log_every=1",
        "train.eval_every=0", "logging.trackers=[]", "cluster.num_threads=1"]


class _Exploit:
    """Unpickling this runs a shell command that leaves a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def world(tmp_path_factory, demo_data):
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
    from data_prep.shard_format import read_manifest

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
    return w


# Shard sets whole; of runs, the checkpoints (every invocation rewrites a run's .hydra/ and appends to its log).
WATCHED = ("data", "unfinished", "noval", "altered", "badids", "afile", "run/checkpoints", "evil/checkpoints",
           "badstate/checkpoints", "nockpt")


def _hp(*args):
    return cli.main, ["run_dir={w}/new", "data.path={w}/data", *BASE, *args]


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
    ("huge-global-batch-derived", *_hp("train.global_batch=null", "train.grad_accum=10000000"),
     ["samples", "lower train.global_batch"]),
    ("model-too-big-for-memory", cli.main, ["run_dir={w}/new", "data.path={w}/data", "model=llama_70b", *BASE[7:]],
     ["GiB", "train.micro_batch"]),
    ("model-too-big-for-memory-13b", cli.main, ["run_dir={w}/new", "data.path={w}/data", "model=llama_13b",
                                                *BASE[7:]], ["GiB", "activation_checkpointing"]),
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
    ("eval-every-negative", *_hp("train.eval_every=-2"), ["train.eval_every=-2"]),
    ("grad-clip-negative", *_hp("optim.grad_clip=-1"), ["optim.grad_clip=-1"]),
    ("gpu-mem-negative", *_hp("cluster.gpu_mem_gb=-3"), ["cluster.gpu_mem_gb"]),
    ("export-without-checkpoints", *_hp("train.export_hf_at_end=true", "train.checkpointing=false"),
     ["train.export_hf_at_end=true", "train.checkpointing=false"]),
    ("fused-loss-with-tp", *_hp("train.fused_loss=true", "parallel=tp2"),
     ["train.fused_loss=true needs parallel.tp=1 and parallel.pp=1", "drop train.fused_loss"]),
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
]


# Found only while training (shards are checked as they are read): the run dir stays, its result.json says failed.
STARTED = {"altered-shards", "token-id-beyond-vocab"}


@pytest.mark.parametrize("name,main,argv,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(world, name, main, argv, words):
    argv = [a.replace("{w}", str(world)) for a in argv]
    before = {name: tree_digest(world / name) for name in WATCHED}
    # No Slurm client on PATH here (the cases that need it are in test_slurm.py); a cache of its own, so a demo
    # build would show.
    env = {"PATH": os.path.dirname(os.__file__), "HPCTRAIN_CACHE": str(world / "cache")}
    try:
        ran = run_forked(main, argv, cwd=world, env=env)
        leftovers = [gone for gone in ("new", "shardz", "pwned", "cache", "sweep/0") if (world / gone).exists()]
        if name in STARTED:
            leftovers.remove("new")
            with open(world / "new" / "result.json") as f:
                assert json.load(f)["status"] == "failed"
    finally:  # a case that fails here must not spoil the next ones
        shutil.rmtree(world / "new", ignore_errors=True)
    assert ran.code != 0, ran.out + ran.err
    assert "Traceback" not in ran.out + ran.err, ran.err
    assert len(ran.err_lines) == 1, ran.err
    for w in words:
        assert w.replace("{w}", str(world)) in ran.err_lines[0], (w, ran.err_lines[0])
    assert ran.code == 2, ran.err
    assert {name: tree_digest(world / name) for name in WATCHED} == before
    assert not leftovers  # no run dir, no demo build, no code run



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
