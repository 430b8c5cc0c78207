"""What a careless or hostile input must never do, beyond one line (tests/test_bad_inputs.py): delete or overwrite
what hpctrain did not make, run code from a data directory, take a node's memory, or leave something half-written
looking complete. Each test fails on hpctrain before these guards (issue 26), by the class number of that issue.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import SMALL_MODEL
from helpers import WarningLines, last_step, read, records, run_forked, tree_digest, until

from data_prep import shards as shards_cli
from hpctrain import cli
from hpctrain.core.files import FileCheckError, lines, read_json
from hpctrain.runs import rundir
from hpctrain.storage import checkpoint
from hpctrain.tools import summary as summary_cli

BASE = [*SMALL_MODEL, "train.global_batch=8", "train.micro_batch=4", "train.log_every=1", "train.eval_every=0",
        "logging.trackers=[]", "cluster.num_threads=1", "optim.warmup_steps=2", "optim.lr=1e-2"]


def _cli(run_dir, demo_data, *extra) -> list[str]:
    return [f"run_dir={run_dir}", f"data.path={demo_data}", "data.prepare_demo=false", *BASE, *extra]


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def _peak_growth(setup: str, work: str) -> tuple[float, object]:
    """(MiB the resident set grew at its peak above its size at the start of `work` (an expression), its value),
    in a new interpreter that ran `setup` first (imports, warm-up): its peak is reset (clear_refs 5) right before
    `work`, so only what `work` held counts."""
    code = f"""import json, os, sys
{setup}
def _kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
start = _kib("VmRSS")
result = {work}
print(json.dumps([(_kib("VmHWM") - start) / 1024, result]))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    growth, result = json.loads(p.stdout.strip().splitlines()[-1])
    return growth, result


# --- 1. data_prep never deletes what it cannot prove it made ------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "raw").mkdir()
    for i in range(4):
        (tmp_path / "raw" / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 400)
    return str(tmp_path / "raw" / "*.txt")


def _prep(corpus, out, *extra, **forked):
    return run_forked(shards_cli.main, ["--corpus", corpus, "--out", str(out), "--vocab-size", "300", "--seq-len",
                                        "16", "--shard-mb", "0.01", "--workers", "1", *extra], cwd=os.getcwd(),
                      **forked)


def test_an_unfinished_build_is_finished_or_refused_never_wiped(corpus, tmp_path):
    """A build killed before its merge (shards, tokenizer and journal; no manifest): another build into it is refused
    and every byte stays; the same build finishes it, keeping its shards; --overwrite replaces it."""
    out = tmp_path / "shards"
    assert _prep(corpus, out).code == 0
    os.remove(out / "manifest.json")  # as a killed build leaves it
    before = tree_digest(out)
    other = _prep(corpus, out, "--seq-len", "32")
    assert other.code == 2 and "holds an unfinished build" in other.err and "--overwrite" in other.err, other.err
    assert tree_digest(out) == before
    same = _prep(corpus, out)
    assert same.code == 0 and "already done, skipped" in same.out, same.out
    assert (out / "manifest.json").exists()
    assert _prep(corpus, out, "--seq-len", "32", "--overwrite").code == 0
    assert json.loads((out / "manifest.json").read_text())["block_len"] == 33


def test_a_directory_of_someone_else_is_never_written_into(corpus, tmp_path):
    """A non-empty directory without a build of hpctrain's (a user's shards of another tool, say) stays as it is,
    --overwrite or not; a tokenizer already there is never replaced."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "train-000000.tar").write_bytes(b"their shard")
    (theirs / "notes.txt").write_text("keep\n")
    before = tree_digest(theirs)
    for extra in ((), ("--overwrite",)):
        ran = _prep(corpus, theirs, *extra)
        assert ran.code == 2 and "holds no shard build" in ran.err, ran.err
        assert tree_digest(theirs) == before
    from data_prep import tokenizer as tokenizer_cli

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    ran = run_forked(tokenizer_cli.main, ["--corpus", corpus, "--vocab", "300", "--out", str(tmp_path / "tok")],
                     cwd=tmp_path)
    assert ran.code == 2 and "never overwritten" in ran.err and (tmp_path / "tok" / "tokenizer.json").read_text() == "{}"


# --- 2. checkpoints/step-N that no run completed ------------------------------------------------------------------


def test_a_stray_checkpoint_directory_is_never_replaced(demo_data, tmp_path):
    """A step-N directory without trainer_state.json (a copy cut short, a backup by hand) in a run's checkpoints:
    the run refuses to continue over it; started over, the old run (the stray included) moves aside whole."""
    run = tmp_path / "run"
    assert run_forked(cli.main, _cli(run, demo_data, "train.max_steps=2", "train.ckpt_every=1"), cwd=tmp_path).code == 0
    stray = run / "checkpoints" / "step-0000003"
    stray.mkdir()
    (stray / "my-notes.txt").write_text("a half copy I still need\n")
    before = tree_digest(run / "checkpoints")
    ran = run_forked(cli.main, _cli(run, demo_data, "train.max_steps=4", "train.ckpt_every=1"), cwd=tmp_path)
    assert ran.code == 2 and len(ran.err_lines) == 1 and "step-0000003 is not a complete checkpoint" in ran.err
    assert tree_digest(run / "checkpoints") == before
    ran = run_forked(cli.main, _cli(run, demo_data, "train.max_steps=4", "train.ckpt_every=1", "train.resume=never"),
                     cwd=tmp_path)
    assert ran.code == 0, ran.err
    (moved,) = (run / "previous").iterdir()
    assert (moved / "checkpoints" / "step-0000003" / "my-notes.txt").read_text() == "a half copy I still need\n"


# --- 3. code in a data directory --------------------------------------------------------------------------------


def test_a_tokenizer_directory_never_runs_its_code(demo_data, tmp_path):
    """A tokenizer directory mapping its class to its own Python (auto_map): transformers would ask "trust remote
    code? [y/N]" and, answered y (here on stdin), run it. hpctrain never asks: one line, nothing run."""
    evil = tmp_path / "evil_tok"
    evil.mkdir()
    shutil.copy(os.path.join(demo_data, "tokenizer", "tokenizer.json"), evil / "tokenizer.json")
    (evil / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
    (evil / "evil.py").write_text(f"import pathlib\npathlib.Path({str(tmp_path / 'pwned')!r}).touch()\n"
                                  "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    (tmp_path / "raw.txt").write_text("some text\n" * 100)
    p = subprocess.run([sys.executable, "-m", "data_prep.shards", "--corpus", str(tmp_path / "raw.txt"), "--out",
                        str(tmp_path / "out"), "--tokenizer", str(evil), "--seq-len", "16"], input="y\ny\n",
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert not (tmp_path / "pwned").exists(), "the tokenizer directory's code ran"
    assert p.returncode == 2 and "asks to run its own Python code" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()


# --- 4, 5, 7: memory bounded or counted --------------------------------------------------------------------------


def test_the_planner_counts_the_rope_tables_and_building_them_makes_no_copy(make_cfg):
    """model.max_seq_len's RoPE tables (cos and sin, fp32) are in the estimate; they are filled in place, so the
    build holds no temporary of their size (49 MB of tables: the peak grows by them, not by several of them)."""
    from hpctrain.runs.resolve import resolve
    from hpctrain.training.planner import stage_bytes

    def planned(n: int) -> float:
        cfg = make_cfg(f"model.max_seq_len={n}", "train.seq_len=64")
        return stage_bytes(cfg, resolve(cfg), 64)[0][0]

    head_dim = 64 // 4
    assert planned(2**20) - planned(64) == pytest.approx(2 * 4 * head_dim * (2**20 - 64))
    setup = f"""import torch
torch.set_num_threads(1)
sys.path.insert(0, "tests")
from conftest import SMALL_MODEL
from hpctrain.runs.compose import compose
from hpctrain.models import build_model
small = {SMALL_MODEL!r} + ["data.path=/unused"]
build_model(compose(small).model)  # warm-up: lazy imports and first allocations
cfg = compose(small + ["model.max_seq_len=400000"])"""
    growth, _ = _peak_growth(setup, "build_model(cfg.model) and None")
    table = 2 * 4 * head_dim * 400_000 / 2**20  # 48.8 MiB: both tables
    assert table <= growth < table + 35, growth  # (measured: +18 MiB; filled whole as transformers does, +62)


def test_a_long_jsonl_document_reaches_the_tokenizer_in_segments(tmp_path):
    """A 12.5 MB one-line document: tokenised in segments of at most a million characters, memory stays a few times
    the line (whole, the tokenizer held ~40 bytes a character: 500 MB here)."""
    (tmp_path / "raw").mkdir()
    with open(tmp_path / "raw" / "one.jsonl", "w") as f:
        f.write(json.dumps({"text": "word " * 2_500_000}) + "\n")
        f.write(json.dumps({"text": "def f(x):\n    return x\n" * 500}) + "\n")
    (tmp_path / "tok").mkdir()
    from data_prep.tokenizer import train_tokenizer

    (tmp_path / "small.txt").write_text("word def return x f\n" * 200)
    tok = train_tokenizer([str(tmp_path / "small.txt")], 300, str(tmp_path / "tok"))

    setup = "from data_prep.shards import build_from_files"
    work = (f"build_from_files([{str(tmp_path / 'raw' / 'one.jsonl')!r}], {str(tmp_path / 'out')!r}, 64, "
            f"tokenizer={tok!r}, val_fraction=0.0).num_tokens('train')")
    growth, tokens = _peak_growth(setup, work)
    assert tokens > 2_000_000 and growth < 300, (growth, tokens)


def test_a_notify_command_that_prints_without_end_costs_no_memory(tmp_path):
    """monitor.notify_cmd's output: its stdout is discarded, the tail of its stderr kept; 200 MB printed grow this
    process by little (captured, they were all held), and a command that never ends is stopped at the timeout."""
    spam = [sys.executable, "-c", "import sys\nfor _ in range(200): sys.stdout.write('y' * 2**20); "
            "sys.stderr.write('e' * 2**19)\nsys.exit(3)"]
    setup = f"""import torch
from omegaconf import OmegaConf
from hpctrain.core.config import MonitorConfig
from hpctrain.monitoring.monitor import AlertSink, Context
mcfg = OmegaConf.structured(MonitorConfig)
mcfg.rules = {{"hot": {{"metric": "loss", "threshold": 1.0, "when": "above", "for_s": 0.0}}}}
mcfg.notify_cmd = {spam!r}
sink = AlertSink({str(tmp_path)!r}, mcfg, Context(torch.device("cpu"), 1))"""
    growth, _ = _peak_growth(setup, 'sink.write({"step": 1, "loss": 9.0})')
    assert read(tmp_path / "alerts.jsonl").count("firing") == 1 and growth < 60, growth
    from hpctrain.monitoring.monitor import run_bounded

    code, tail = run_bounded(spam, b"", timeout=60)
    assert code == 3 and 0 < len(tail) <= 500
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_bounded(["yes"], b"", timeout=1)
    assert time.monotonic() - t0 < 30  # the 1 s limit held: `yes` alone never ends (loose: shared cores)


# --- 6, 13: a run directory is a run's, one run's at a time -------------------------------------------------------


def test_a_users_directory_keeps_its_files(demo_data, tmp_path):
    """Someone's directory holding their metrics.jsonl and result.json: never truncated, rewritten or moved; adopted
    by its lock file (an hpctrain run older than that file), it is a run directory like any other."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text('{"step": 7, "loss": 1.5}\n{"step": 8, "loss": 1.4}\n')
    (mine / "result.json").write_text('{"mine": true}\n')
    before = tree_digest(mine)
    for extra in ((), ("train.resume=never",)):
        ran = run_forked(cli.main, _cli(mine, demo_data, "train.max_steps=2", *extra), cwd=tmp_path)
        assert ran.code == 2 and "that no hpctrain run wrote" in ran.err and len(ran.err_lines) == 1, ran.err
        assert tree_digest(mine) == before
    (mine / rundir.LOCK_FILE).touch()
    ran = run_forked(cli.main, _cli(mine, demo_data, "train.max_steps=2", "train.resume=never"), cwd=tmp_path)
    assert ran.code == 0, ran.err
    (moved,) = (mine / "previous").iterdir()
    assert (moved / "result.json").read_text() == '{"mine": true}\n'


def test_a_run_of_an_older_hpctrain_resumes(demo_data, tmp_path):
    """A run directory written before the lock file existed (its config record and complete checkpoints) resumes."""
    run = tmp_path / "run"
    assert run_forked(cli.main, _cli(run, demo_data, "train.max_steps=2"), cwd=tmp_path).code == 0
    os.remove(run / rundir.LOCK_FILE)
    ran = run_forked(cli.main, _cli(run, demo_data, "train.max_steps=3"), cwd=tmp_path)
    assert ran.code == 0 and "resumed from" in read(run / "train.log"), ran.err
    assert read_json(run / "result.json")["steps"] == 3


@pytest.mark.multiproc
def test_one_run_per_run_directory_and_a_killed_one_leaves_no_lock(demo_data, tmp_path):
    """A second run started in the directory of a live one stops at once, naming it, and the first one's checkpoints
    stay; once the first is killed (-9), the directory is free again: the kernel dropped its lock."""
    from hpctrain.runs.compose import compose
    from hpctrain.training.run import train

    run = tmp_path / "run"
    cfg = compose(_cli(run, demo_data, "train.max_steps=100000", "train.ckpt_every=1", "train.ckpt_keep=100"))
    first = mp.get_context("fork").Process(target=train, args=(cfg, str(run)))
    first.start()
    try:
        until("the first run's checkpoints", lambda: len(checkpoint.complete_checkpoints(str(run))) >= 2, 120)
        ran = run_forked(cli.main, _cli(run, demo_data, "train.max_steps=3", "train.resume=never"), cwd=tmp_path)
        assert ran.code == 2 and f"is in use by another run (pid {first.pid} on" in ran.err, ran.err
        assert first.is_alive() and not (run / "previous").exists()
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.join()
    ran = run_forked(cli.main, _cli(run, demo_data, "train.max_steps=3", "train.resume=never"), cwd=tmp_path)
    assert ran.code == 0, ran.err
    assert read_json(run / "result.json")["status"] == "completed"


# --- 8. files read from a run are what they claim -----------------------------------------------------------------


def test_summary_of_a_metrics_file_that_is_a_device_is_one_line(demo_data, tmp_path):
    """metrics.jsonl pointing at /dev/zero: summary says so at once (read whole, it exhausted memory)."""
    run = tmp_path / "run"
    assert run_forked(cli.main, _cli(run, demo_data, "train.max_steps=2"), cwd=tmp_path).code == 0
    os.remove(run / "metrics.jsonl")
    os.symlink("/dev/zero", run / "metrics.jsonl")
    ran = run_forked(summary_cli.main, [str(run)], cwd=tmp_path, timeout=30)
    assert ran.code == 0 and "is a character device" in ran.out and "status: completed" in ran.out, ran.out
    os.remove(run / "metrics.jsonl")  # ... or damaged: half a record and bytes that are no JSON
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 5.2}\n{"step": 2, "lo\n\xff\xfe{not json\n')
    ran = run_forked(summary_cli.main, [str(run)], cwd=tmp_path, timeout=30)
    assert ran.code == 0 and not ran.err and "status: completed" in ran.out, (ran.out, ran.err)
    assert len(ran.out.splitlines()) == 1, ran.out
    (tmp_path / "long.jsonl").write_bytes(b"x" * (5 * 2**20) + b"\n")
    with pytest.raises(FileCheckError, match="line 1 is longer than"):
        list(lines(str(tmp_path / "long.jsonl")))


# --- 11. a changed setting on resume applies, said in the log -------------------------------------------------------


def test_a_changed_setting_on_resume_applies_or_is_refused(demo_data, tmp_path):
    """optim.lr (and the optimizer's other settings) given on the command line of a resumed run apply from the
    resumed step: the checkpoint's schedule gives only the step (its own rate used to win, silently). What fixes
    the order of the samples (train.seed, data.shuffle) is refused in one line instead."""
    run = tmp_path / "run"
    common = ("optim.decay=constant", "train.ckpt_every=2")
    assert run_forked(cli.main, _cli(run, demo_data, "train.max_steps=4", *common), cwd=tmp_path).code == 0
    ran = run_forked(cli.main, _cli(run, demo_data, "train.max_steps=6", "optim.lr=2e-3", "optim.beta2=0.99", *common),
                     cwd=tmp_path)
    assert ran.code == 0, ran.err
    lrs = {r["step"]: r["lr"] for r in records(run) if "lr" in r}
    assert lrs[4] == pytest.approx(1e-2) and lrs[5] == pytest.approx(2e-3) and lrs[6] == pytest.approx(2e-3), lrs
    log = read(run / "train.log")
    assert "optim.lr: 0.01 in the checkpoint, 0.002 now: the new one applies from step 4" in log
    assert "betas (0.9, 0.95) -> (0.9, 0.99)" in log
    for changed in ("train.seed=7", "data.shuffle=false"):
        ran = run_forked(cli.main, _cli(run, demo_data, "train.max_steps=8", changed, *common), cwd=tmp_path)
        assert ran.code == 2 and len(ran.err_lines) == 1 and "fixes the order of its samples" in ran.err, ran.err
        assert f"{changed.split('=')[0]}=" in ran.err
    assert read_json(run / "result.json")["steps"] == 6


# --- A full disk, Ctrl-C --------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs mounted at <run>/checkpoints: room for one checkpoint of the small model (1.9 MB), not two."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / rundir.LOCK_FILE).touch()  # (the run directory is this test's)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(run / "checkpoints")],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"a small filesystem cannot be mounted here ({p.stderr.strip() or p.returncode}): needs root")
    yield run
    subprocess.run(["umount", "-l", str(run / "checkpoints")], capture_output=True)


@pytest.mark.parametrize("ckpt_async", [False, True])
def test_a_full_disk_leaves_the_last_checkpoint_and_one_line(demo_data, small_disk, ckpt_async):
    """The second checkpoint does not fit: one line saying "no space left on device" with the path, the partial
    checkpoint removed, the first one complete and `latest`; the run failed, never completed."""
    run = small_disk
    ran = run_forked(cli.main, _cli(run, demo_data, "train.max_steps=4", "train.ckpt_every=1",
                                    f"train.ckpt_async={ckpt_async}"), cwd=run.parent)
    assert ran.code != 0 and len(ran.err_lines) == 1 and "Traceback" not in ran.err, ran.err
    assert "could not be written (no space left on device in" in ran.err and str(run / "checkpoints") in ran.err
    assert os.listdir(run / "checkpoints") == ["step-0000001", "latest"] or sorted(
        os.listdir(run / "checkpoints")) == ["latest", "step-0000001"]
    assert checkpoint.latest(str(run)).endswith("step-0000001")
    checkpoint.check_loadable(checkpoint.latest(str(run)))
    assert read_json(run / "result.json")["status"] == "failed"


def _at_step(run, step: int):
    return lambda: last_step(run) >= step


def _sampling_until_interrupted(started):
    """`hpctrain generate`'s main, its sampler marking `started` and never meeting an end-of-text (so it samples
    until the Ctrl-C comes, whatever the model draws)."""
    from hpctrain.tools import generate

    def main(argv):
        real = generate.sample

        def sample(model, prompt, max_new_tokens, temperature, top_k, eos_id, generator):
            started.touch()
            return real(model, prompt, max_new_tokens, temperature, top_k, None, generator)

        generate.sample = sample  # (in the forked child only)
        return generate.main(argv)

    return main


def _exporting_until_interrupted(started):
    """`hpctrain export-hf`'s main, stopping once the weights are written (before the tokenizer and config.json),
    `started` marked, until the Ctrl-C comes."""
    from hpctrain.weights import export_hf

    def main(argv):
        def copy_tokenizer(data_path, manifest, dest):
            started.touch()
            time.sleep(120)

        export_hf._copy_tokenizer = copy_tokenizer  # (in the forked child only)
        return export_hf.main(argv)

    return main


def test_ctrl_c_ends_a_run_a_generation_or_an_export_in_one_line(demo_data, tmp_path):
    """SIGINT (Ctrl-C) during training: "hpctrain: interrupted", exit 130, no traceback; the run's result says
    interrupted and its complete checkpoints stay complete. During `generate`'s sampling: its own line, 130,
    nothing printed as if it were the answer. During `export-hf`'s writing: its line, 130, nothing of OUT (not
    even the partial directory)."""
    run = tmp_path / "run"
    ran = run_forked(cli.main, _cli(run, demo_data, "train.max_steps=100000", "train.ckpt_every=2"), cwd=tmp_path,
                     timeout=240, interrupt_when=_at_step(run, 3))
    assert ran.code == 130 and ran.err_lines == ["hpctrain: interrupted"], ran.err
    assert read_json(run / "result.json")["status"] == "interrupted"
    assert checkpoint.complete_checkpoints(str(run))
    for ck in checkpoint.complete_checkpoints(str(run)):
        checkpoint.check_loadable(ck)

    started = tmp_path / "sampling"
    ran = run_forked(_sampling_until_interrupted(started), [f"run_dir={run}", "max_new_tokens=100000"],
                     cwd=tmp_path, timeout=240, interrupt_when=started.exists)
    assert ran.code == 130 and ran.err_lines == ["hpctrain generate: interrupted"] and not ran.out.strip(), ran

    started, out = tmp_path / "exporting", tmp_path / "hf"
    ran = run_forked(_exporting_until_interrupted(started), [str(run), str(out)], cwd=tmp_path, timeout=240,
                     interrupt_when=started.exists)
    assert ran.code == 130 and ran.err_lines == ["hpctrain export-hf: interrupted (nothing of OUT was left)"], ran
    assert sorted(os.listdir(tmp_path)) == ["exporting", "run", "sampling"]


def test_ctrl_c_ends_a_shard_build_in_one_line_and_the_same_command_finishes_it(corpus, tmp_path):
    """SIGINT during `data_prep.shards`, after its first work unit (each document is a unit): one line, exit 130, no manifest (the set is
    not usable as if complete); the same command then finishes the build, keeping the finished units."""
    from data_prep import verify
    from data_prep.build import BUILD_DIR, DELAY_ENV, UNITS_DIR

    out = tmp_path / "out"
    units = out / BUILD_DIR / UNITS_DIR
    ran = _prep(corpus, out, "--unit-mb", "0.005", env={DELAY_ENV: "60"},
                interrupt_when=lambda: units.is_dir() and any(p.suffix == ".json" for p in units.iterdir()))
    assert ran.code == 130 and len(ran.err_lines) == 1 and ran.err.startswith("interrupted: "), ran.err
    assert not (out / "manifest.json").exists()
    done = sorted(os.listdir(units))
    # A record being written when Ctrl-C came leaves no temporary behind (core/files.atomic_write).
    assert done and not [n for n in done if n.endswith(".tmp")], done
    again = _prep(corpus, out, "--unit-mb", "0.005")
    assert again.code == 0, again.err
    assert set(done) < set(os.listdir(units)) and (out / "manifest.json").exists()
    assert run_forked(verify.main, [str(out)], cwd=tmp_path).code == 0
    # `prep verify` interrupted while it reads the shards: its own line, 130, no traceback.
    started = tmp_path / "verifying"
    ran = run_forked(_verifying_until_interrupted(started), [str(out)], cwd=tmp_path, interrupt_when=started.exists)
    assert ran.code == 130 and ran.err_lines == ["interrupted (verify only reads: nothing changed)"], ran


def _verifying_until_interrupted(started):
    """`hpctrain prep verify`'s main, its shard check marking `started` and waiting for the Ctrl-C."""
    from data_prep import verify

    def main(argv):
        def check_shard(*args):
            started.touch()
            time.sleep(60)

        verify.check_shard = check_shard  # (in the forked child only)
        return verify.main(argv)

    return main


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """The write fails at its last step (the target is a non-empty directory, so the rename is refused): what was
    there stays, and the temporary it made is gone; a temporary name it did not make is never removed."""
    from hpctrain.core.files import atomic_write

    target = tmp_path / "record.json"
    target.mkdir()
    (target / "theirs").write_text("kept")
    with pytest.raises(OSError):
        atomic_write(str(target), "new")
    assert sorted(os.listdir(tmp_path)) == ["record.json"] and (target / "theirs").read_text() == "kept"
    theirs = tmp_path / f"other.json.{os.getpid()}.tmp"
    theirs.mkdir()  # open() of the temporary fails: nothing of ours to remove, and theirs stays
    with pytest.raises(OSError):
        atomic_write(str(tmp_path / "other.json"), "new")
    assert theirs.is_dir()


@pytest.fixture
def small_filesystem(tmp_path):
    """A 4 MiB tmpfs mounted for the test (root only), unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small filesystem")
    path = tmp_path / "small"
    path.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True, text=True,
                       timeout=30)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()[:200]}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=True, timeout=30)


def test_a_checkpoint_larger_than_the_run_dirs_free_space_is_refused_before_the_run(small_filesystem, demo_data,
                                                                                    make_cfg, tmp_path):
    """A run whose checkpoint (fp32 weights and Adam's state: 34.7 MiB here) cannot fit in what its run directory's
    filesystem has free (4 MiB) is one line before it starts, and a submission before sbatch, not a failed save
    after the queue wait and the steps before it; so is a sweep whose points' first checkpoints together cannot
    (3 × 1.43 MiB); nothing is written. Where one fits but not train.ckpt_keep of them beside the one being written, a
    warning. A killed save's partial checkpoint counts as free (the next save removes it first); a run directory
    under nothing but / here (a node-local path seen from a login node) is not checked."""
    from hpctrain.training.run import check_checkpoint_space, prepare

    bigger = ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.ffn_hidden=688"]
    env = {"PATH": os.path.dirname(os.__file__)}  # (no sbatch: the submission is refused before it is looked for)
    sweep = [f"hydra.sweep.dir={small_filesystem / 'sweep'}", "optim.lr=1e-3,2e-3,3e-3", "-m"]
    for launcher, words in (([], "a checkpoint of this run is about 34.7 MiB"),
                            (["hydra/launcher=slurm"], "a checkpoint of this run is about 34.7 MiB"),
                            (["hydra/launcher=slurm", *sweep], "the first checkpoints of the sweep's 3 points are "
                                                               "about 4.3 MiB")):
        model = bigger if "-m" not in launcher else []
        argv = [*_cli(small_filesystem / "run", demo_data, *model), *launcher]
        ran = run_forked(cli.main, argv[-1:] + argv[:-1] if "-m" in launcher else argv, cwd=tmp_path, env=env)
        assert ran.code == 2 and len(ran.err_lines) == 1, ran.err
        assert words in ran.err_lines[0] and "(fp32 weights and optimizer state), more than is free on the " \
            f"filesystem of {small_filesystem / ('sweep' if '-m' in launcher else 'run')} (4.0 MiB)" \
            in ran.err_lines[0], ran.err_lines[0]
        made = [os.path.relpath(os.path.join(top, f), small_filesystem) for top, _, fs in os.walk(small_filesystem)
                for f in fs]
        assert made == (["sweep/multirun.yaml"] if "-m" in launcher else []), made  # (Hydra's record of a sweep)
    # `hpctrain check --dir` (what sbatch/sweep.sbatch runs before it submits its array) on the same grid.
    ran = run_forked(cli.main, ["check", "--dir", str(small_filesystem / "grid"), "optim.lr=1e-3,2e-3,3e-3", "--",
                                f"data.path={demo_data}", "data.prepare_demo=false", *BASE], cwd=tmp_path, env=env)
    assert ran.code == 2 and len(ran.err_lines) == 1, ran.err
    assert "the first checkpoints of the sweep's 3 points are about 4.3 MiB" in ran.err_lines[0], ran.err_lines[0]
    # The tests' small model: 1.4 MiB a checkpoint; 4 MiB free hold the one kept and the one being written, not six.
    prepared, logger = prepare(make_cfg()), logging.getLogger("hpctrain")
    run = small_filesystem / "run"
    for keep, warned in ((1, False), (5, True)):
        said = WarningLines()
        logger.addHandler(said)
        try:
            check_checkpoint_space([prepared.checkpoint], str(run), keep)
        finally:
            logger.removeHandler(said)
        assert bool(said.messages) == warned and all(
            f"train.ckpt_keep={keep}: the checkpoints still to be written" in m for m in said.messages), said.messages
    partial = run / "checkpoints" / ".tmp-step-0000005"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"\0" * 3 * 2**20)  # 1 MiB left free
    check_checkpoint_space([prepared.checkpoint], str(run), 1)
    shutil.rmtree(run)
    check_checkpoint_space([2.0**60], "/hpctrain-no-such-scratch/run", 1)
