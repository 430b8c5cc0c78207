"""End-to-end training runs on real shards: outputs, accumulation, precision, skips, resume."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import Forked, run_forked, until

from hpctrain import cli
from hpctrain.training.run import TrainingError, train

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "mfu", "data_wait_frac",
               "mem_gb", "step_time_s"}


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def read_text(path) -> str:
    with open(path) as f:
        return f.read()


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in read_text(os.path.join(run_dir, "metrics.jsonl")).splitlines()]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def test_run_writes_metrics_tensorboard_checkpoints_result(make_cfg, tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run)
    result = train(make_cfg("train.ckpt_every=2", "train.ckpt_keep=2"), run)
    recs = records(run)
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert r.keys() >= METRIC_KEYS
        assert r["mfu"] is None  # CPU without cluster.peak_tflops
        assert r["tokens_per_s"] > 0 and 0 <= r["data_wait_frac"] < 1 and r["mem_gb"] > 0
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6]
    assert steps[-1]["loss"] < steps[0]["loss"]
    # Bits per byte: the evaluation's nats over the bytes of its targets' text, decoded here by the tokenizer
    # (train.eval_batches=2 global batches of 8: the val split's first 16 samples).
    import math

    from data_prep.tokenizer import load_tokenizer
    from hpctrain.data.loader import ShardStream

    data = make_cfg().data.path
    stream = ShardStream(data, "val", 16, 0, loop=False, shuffle=False)
    tok = load_tokenizer(os.path.join(data, stream.manifest.tokenizer.path))
    targets = next(iter(stream))[:, 1:]
    text = sum(len(tok.decode(row.tolist(), skip_special_tokens=True).encode()) for row in targets)
    for r in (r for r in recs if "val_loss" in r):
        assert r["val_bpb"] == pytest.approx(r["val_loss"] * targets.numel() / (math.log(2) * text), rel=1e-9)

    doc = read_json(os.path.join(run, "result.json"))
    assert doc == result and doc["status"] == "completed" and doc["steps"] == 6
    assert doc["final_loss"] == steps[-1]["loss"] and doc["tokens"] == 6 * 8 * 64

    ckpts = sorted(os.listdir(os.path.join(run, "checkpoints")))
    assert ckpts == ["latest", "step-0000004", "step-0000006"]  # keep the last 2, no temporaries
    assert os.readlink(os.path.join(run, "checkpoints", "latest")) == "step-0000006"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(os.path.join(run, "tb"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert len(ea.Scalars("val/loss")) == 2


def test_tensorboard_drops_what_an_attempt_logged_past_the_start(tmp_path):
    """A requeued job that had written no checkpoint starts at step 0 again: TensorBoard, like metrics.jsonl, shows
    the new attempt's steps only (as after a resume from step N: those past N)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpctrain.monitoring.metrics import TensorBoardSink

    for start, steps in ((0, range(1, 6)), (0, range(1, 3)), (1, range(2, 4))):
        sink = TensorBoardSink(str(tmp_path), start)
        for step in steps:
            sink.write({"step": step, "loss": float(start * 10 + step)})
        sink.close()
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("train/loss")] == [(1, 1.0), (2, 12.0), (3, 13.0)]


def test_mfu_with_peak_tflops(make_cfg, tmp_path):
    import logging

    from helpers import WarningLines

    logger, lines = logging.getLogger("hpctrain"), WarningLines(logging.INFO)
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        train(make_cfg("train.max_steps=2", "train.eval_every=0", "cluster.peak_tflops=1.0"), str(tmp_path))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    r = records(tmp_path)[-1]
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import flops_per_token

    cfg = make_cfg()
    assert r["mfu"] == pytest.approx(flops_per_token(model_args(cfg.model), 64) * r["tokens_per_s"] / 1e12)
    assert r["tokens_per_s_per_device"] == r["tokens_per_s"]  # one device
    assert any(m.startswith("MFU against 1 TFLOP/s per device (cluster.peak_tflops); ") for m in lines.messages)


def test_peak_named_per_device():
    """The peak MFU divides by: the device's dense figure for the precision (never the sparse one), and the reason
    when there is none."""
    from hpctrain.monitoring.metrics import PEAK_TFLOPS, peak_flops

    assert PEAK_TFLOPS["H100"]["bf16"] == PEAK_TFLOPS["H200"]["bf16"] == 989.0
    assert (PEAK_TFLOPS["A100"]["bf16"], PEAK_TFLOPS["B200"]["bf16"]) == (312.0, 2250.0)
    cpu = peak_flops(torch.device("cpu"), "bf16", None)
    assert cpu.flops is None and cpu.describe() == ("MFU not reported: no peak known for a cpu device (set "
                                                    "cluster.peak_tflops to the device's dense peak)")
    assert peak_flops(torch.device("cpu"), "bf16", 989.0).flops == 989e12


def test_accumulation_8x1_equals_1x8(make_cfg, tmp_path):
    """Loss is the mean over all tokens of the global batch, so accumulation does not change it."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = ("optim=sgd", "optim.lr=0.5", "train.global_batch=8", "train.max_steps=4", "train.eval_every=0")
    train(make_cfg(*common, "train.micro_batch=8"), a)
    train(make_cfg(*common, "train.micro_batch=1"), b)
    la, lb = losses(a), losses(b)
    assert la.keys() == lb.keys() == {1, 2, 3, 4}
    for s in la:
        assert abs(la[s] - lb[s]) <= 1e-6, (s, la[s], lb[s])


@pytest.mark.parametrize("optim", ["adamw", "adafactor", "sgd"])
def test_each_optimizer_lowers_the_loss(make_cfg, tmp_path, optim):
    lr = {"adamw": 1e-2, "adafactor": 0.1, "sgd": 0.5}[optim]
    result = train(make_cfg(f"optim={optim}", f"optim.lr={lr}", "train.max_steps=8", "train.eval_every=0"),
                   str(tmp_path))
    ls = losses(tmp_path)
    assert result["status"] == "completed" and ls[8] < ls[1] - 0.1, ls


def test_activation_checkpointing_is_exact(make_cfg, tmp_path):
    common = ("train.max_steps=3", "train.eval_every=0")
    train(make_cfg(*common), str(tmp_path / "a"))
    train(make_cfg(*common, "parallel.activation_checkpointing=full"), str(tmp_path / "b"))
    train(make_cfg(*common, "parallel.activation_checkpointing=selective", "parallel.ac_every=2"),
          str(tmp_path / "c"))
    la, lb, lc = losses(tmp_path / "a"), losses(tmp_path / "b"), losses(tmp_path / "c")
    assert all(abs(la[s] - lb[s]) <= 1e-6 and abs(la[s] - lc[s]) <= 1e-6 for s in la)


def test_bf16_and_tf32_track_fp32(make_cfg, tmp_path):
    common = ("train.max_steps=3", "train.eval_every=0")
    ref = losses(train(make_cfg(*common), str(tmp_path / "a")) and tmp_path / "a")
    for name in ("bf16", "tf32"):
        got = losses(train(make_cfg(*common, f"precision={name}"), str(tmp_path / name)) and tmp_path / name)
        assert all(abs(ref[s] - got[s]) < 0.05 for s in ref), (name, ref, got)


def test_fp16_overflow_is_skipped_and_logged(make_cfg, tmp_path):
    # 2**40 overflows fp16 gradients at once: steps are skipped and the scale halves until it fits.
    cfg = make_cfg("precision=fp16", "precision.loss_scale_init=1099511627776", "train.max_steps=8",
                   "train.eval_every=0")
    result = train(cfg, str(tmp_path))
    recs = records(tmp_path)
    scales = [r["loss_scale"] for r in recs]
    assert result["status"] == "completed" and result["skipped_overflow"] >= 1
    assert scales[0] == 2.0**39 and scales == sorted(scales, reverse=True)
    assert recs[-1]["skipped_overflow"] == result["skipped_overflow"]


def test_fp16_skipped_step_leaves_weights_untouched(make_cfg):
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import Llama
    from hpctrain.training.optimizer import build_optimizer
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import TrainStep

    cfg = make_cfg("precision=fp16", "precision.loss_scale_init=1099511627776")
    torch.manual_seed(0)
    model = Llama(model_args(cfg.model))
    opt = build_optimizer(model, cfg.optim, 1e-2)
    step = TrainStep(model, opt, setup_precision(cfg.precision, torch.device("cpu")), 1.0, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = step([torch.randint(0, 512, (2, 65))])
    assert r.status == "overflow" and r.loss_scale == 2.0**39
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # AdamW never stepped: the fused kernel, told of the overflow by the scaler, creates its state but leaves it
    # at zero (step counts included); foreach is not even called.
    for state in opt.state.values():
        assert all(not torch.is_tensor(t) or not t.any() for t in state.values()), state


def test_nonfinite_steps_are_skipped_then_stop_the_run(make_cfg, tmp_path):
    # An absurd SGD learning rate without clipping blows the weights up within a few steps.
    cfg = make_cfg("optim=sgd", "optim.lr=1e3", "model.init_std=1.0", "optim.grad_clip=0", "optim.warmup_steps=0",
                   "train.max_nonfinite=2", "train.max_steps=50", "train.eval_every=0")
    with pytest.raises(TrainingError, match="2 consecutive non-finite steps") as e:
        train(cfg, str(tmp_path))
    assert "lower optim.lr" in str(e.value)
    doc = read_json(tmp_path / "result.json")
    assert doc["status"] == "failed" and doc["skipped_nonfinite"] == 2 and doc["steps"] < 50


def test_nonfinite_step_does_not_touch_weights(make_cfg):
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import Llama
    from hpctrain.training.optimizer import build_optimizer
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import TrainStep

    cfg = make_cfg()
    model = Llama(model_args(cfg.model))
    with torch.no_grad():
        model.layers["0"].attention.wq.weight[0, 0] = float("nan")
    opt = build_optimizer(model, cfg.optim, 1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = TrainStep(model, opt, setup_precision(cfg.precision, torch.device("cpu")), 1.0, torch.device("cpu"))(
        [torch.randint(0, 512, (2, 65))])
    assert r.status == "nonfinite"
    assert all(torch.equal(before[k], v) or k.endswith("wq.weight") for k, v in model.state_dict().items())
    assert not opt.state


def _args(run_dir, demo_data, *extra) -> list[str]:
    """`python -m hpctrain`'s arguments of a small run (for `cli.main` in a forked child: `run_forked`)."""
    from conftest import SMALL_MODEL

    return [f"run_dir={run_dir}", f"data.path={demo_data}",
            "data.prepare_demo=false", *SMALL_MODEL, "train.global_batch=8", "train.micro_batch=4",
            "train.log_every=1", "train.eval_every=0", "train.ckpt_every=2", "logging.trackers=[]",
            "cluster.num_threads=1", *extra]


@pytest.mark.slow
def test_resume_after_kill_equals_uninterrupted(demo_data, tmp_path):
    """SIGKILL a run right after a checkpoint; rerunning in the same directory continues exactly."""
    steps = "train.max_steps=40"
    ref, run = tmp_path / "ref", tmp_path / "run"
    # (Each run is the CLI in a forked child of this process: torch imported, and the killed one a process apart.)
    assert run_forked(cli.main, _args(ref, demo_data, steps), cwd=tmp_path, timeout=300).code == 0
    latest = run / "checkpoints" / "latest"
    with Forked(cli.main, _args(run, demo_data, steps), tmp_path) as proc:
        until("the first checkpoint", lambda: latest.exists() or proc.poll() is not None, 240, every=0.02)
        proc.kill()  # SIGKILL, reaped
    resumed_from = read_json(latest / "trainer_state.json")["run"]["step"]
    assert resumed_from < 40, "the run finished before it could be killed"
    p = run_forked(cli.main, _args(run, demo_data, steps), cwd=tmp_path, timeout=300)
    assert p.code == 0, p.err
    assert "resumed from" in read_text(run / "train.log")
    lr, lrun = losses(ref), losses(run)
    assert sorted(lrun) == list(range(1, 41))  # each step logged once, even those redone
    for s in range(resumed_from + 1, 41):
        assert lrun[s] == pytest.approx(lr[s], abs=1e-6), s
    assert read_json(run / "result.json")["final_loss"] == pytest.approx(
        read_json(ref / "result.json")["final_loss"], abs=1e-6)


def test_completed_run_is_not_retrained(make_cfg, tmp_path):
    cfg = make_cfg("train.max_steps=2", "train.eval_every=0")
    first = train(cfg, str(tmp_path))
    again = train(cfg, str(tmp_path))
    assert again["status"] == "completed" and again["final_loss"] == first["final_loss"]
    assert len(losses(tmp_path)) == 2


def test_resume_on_shards_of_another_tokenizer_is_refused(make_cfg, tmp_path, demo_data):
    import shutil

    train(make_cfg("train.max_steps=2", "train.eval_every=0"), str(tmp_path / "run"))
    other = tmp_path / "other_shards"
    shutil.copytree(demo_data, other)
    manifest = read_json(other / "manifest.json")
    manifest["tokenizer"]["sha256"] = "0" * 64
    with open(other / "manifest.json", "w") as f:
        json.dump(manifest, f)
    with pytest.raises(TrainingError, match="different tokenizer"):
        train(make_cfg("train.max_steps=4", "train.eval_every=0", f"data.path={other}"), str(tmp_path / "run"))


def test_generate_cli(make_cfg, tmp_path, demo_data):
    cfg = make_cfg("train.max_steps=2", "train.eval_every=0")
    train(cfg, str(tmp_path))
    from omegaconf import OmegaConf

    os.makedirs(tmp_path / ".hydra")
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")  # as the CLI records it
    from hpctrain.tools import generate

    p = run_forked(generate.main, [f"run_dir={tmp_path}", "prompt=def ", "max_new_tokens=12", "seed=1"], cwd=tmp_path)
    assert p.code == 0, p.err
    assert p.out.startswith("def ") and len(p.out.strip()) > len("def")


def test_sample_greedy_is_deterministic(make_cfg):
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import Llama
    from hpctrain.tools.generate import sample

    torch.manual_seed(0)
    model = Llama(model_args(make_cfg().model)).eval()
    a = sample(model, [1, 2, 3], 8, temperature=0)
    b = sample(model, [1, 2, 3], 8, temperature=0)
    assert a == b and len(a) == 8
    logits = model(torch.tensor([[1, 2, 3]]))[0, -1]
    assert a[0] == int(logits.argmax())


def test_micro_batches_are_pulled_as_the_step_consumes_them(make_cfg):
    """Accumulation streams: the step holds one micro-batch (plus one looked ahead), never the whole global batch."""
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import Llama
    from hpctrain.training.optimizer import build_optimizer
    from hpctrain.training.precision import setup_precision
    from hpctrain.training.step import TrainStep

    cfg = make_cfg()
    torch.manual_seed(0)
    model = Llama(model_args(cfg.model))
    events = []
    model.register_forward_pre_hook(lambda *_: events.append("forward"))
    batches = [torch.randint(0, 512, (2, 65)) for _ in range(6)]

    def stream():
        for b in batches:
            events.append("pull")
            yield b

    step = TrainStep(model, build_optimizer(model, cfg.optim, 1e-2), setup_precision(cfg.precision, torch.device("cpu")),
                     1.0, torch.device("cpu"))
    streamed = step(stream(), n_tokens=6 * 2 * 64)
    assert events == ["pull", "pull"] + ["forward", "pull"] * 4 + ["forward", "forward"]
    # ... and it is the same step as on the list.
    torch.manual_seed(0)
    ref_model = Llama(model_args(cfg.model))
    ref = TrainStep(ref_model, build_optimizer(ref_model, cfg.optim, 1e-2),
                    setup_precision(cfg.precision, torch.device("cpu")), 1.0, torch.device("cpu"))(batches)
    assert streamed.loss == pytest.approx(ref.loss, abs=1e-6) and streamed.grad_norm == pytest.approx(ref.grad_norm)


def _checkpoint_with_nan_weight(make_cfg, tmp_path) -> str:
    """A step-2 checkpoint in tmp_path/nan-ckpt holding one NaN weight, as an older version or a flipped bit would
    leave it; returns its directory."""
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import Llama
    from hpctrain.storage import checkpoint
    from hpctrain.training.optimizer import build_optimizer, build_scheduler

    cfg = make_cfg("train.max_steps=2", "train.eval_every=0", "train.ckpt_every=2")
    train(cfg, str(tmp_path / "good"))
    model = Llama(model_args(cfg.model))
    optimizer = build_optimizer(model, cfg.optim, 1e-2)
    build_scheduler(optimizer, cfg.optim, 2)  # the schedule's initial_lr is part of the optimizer state
    state = checkpoint.load(checkpoint.latest(str(tmp_path / "good")), model, optimizer)
    with torch.no_grad():
        model.layers["0"].attention.wq.weight[0, 0] = float("nan")
    checkpoint.save(str(tmp_path / "nan-ckpt"), 2, model, optimizer, state, keep=2)
    return checkpoint.latest(str(tmp_path / "nan-ckpt"))


def _poison_after_start(monkeypatch) -> None:
    """Weights that turn non-finite once the run has started (a flipped bit, a kernel's bug): the run's start check
    (which refuses non-finite starting weights) poisons one weight instead, so the later guards are what is tested."""
    from hpctrain.training.trainer import Trainer

    def poison(self):
        with torch.no_grad():
            next(self.model.parameters()).view(-1)[0] = float("nan")

    monkeypatch.setattr(Trainer, "_check_start_finite", poison)


@pytest.mark.parametrize("ckpt_async", [False, True])
def test_nonfinite_parameters_are_never_saved(make_cfg, tmp_path, ckpt_async, monkeypatch):
    """A run whose weights are not finite at a checkpoint fails: no checkpoint, status failed (here: a weight turned
    NaN after the start, resumed from a good step-2 checkpoint). Written in the background, the host copy is what is
    checked."""
    from hpctrain.storage import checkpoint

    train(make_cfg("train.max_steps=2", "train.eval_every=0", "train.ckpt_every=2"), str(tmp_path / "run"))
    _poison_after_start(monkeypatch)
    with pytest.raises(TrainingError, match="not finite after step 3; no checkpoint written") as e:
        train(make_cfg("train.max_steps=3", "train.eval_every=0", "train.max_nonfinite=5",
                       f"train.ckpt_async={ckpt_async}"), str(tmp_path / "run"))
    assert "lower optim.lr" in str(e.value) and "\n" not in str(e.value)
    assert read_json(tmp_path / "run" / "result.json")["status"] == "failed"
    assert [os.path.basename(p) for p in checkpoint.complete_checkpoints(str(tmp_path / "run"))] == ["step-0000002"]


def test_a_checkpoint_with_nonfinite_weights_is_refused_at_the_start(make_cfg, tmp_path):
    """Resuming (or starting with model.init_from) from non-finite weights stops before the first step, naming the
    checkpoint: every step of such a run would be skipped."""
    nan = _checkpoint_with_nan_weight(make_cfg, tmp_path)
    for how in (f"train.resume={nan}", f"model.init_from={nan}"):
        with pytest.raises(TrainingError) as e:
            train(make_cfg("train.max_steps=3", "train.eval_every=0", how), str(tmp_path / how.split("=")[0]))
        assert "holds non-finite weights" in str(e.value) or "starting weights are not finite" in str(e.value)
        assert str(nan) in str(e.value) and "\n" not in str(e.value)


def test_checkpointing_off_writes_nothing_but_still_refuses_nonfinite_weights(make_cfg, tmp_path, monkeypatch):
    """train.checkpointing=false (benchmarks): no checkpoint at ckpt_every or at the end; the run reports its memory
    peaks; and weights that are not finite where a save was due still fail the run."""
    from hpctrain.storage import checkpoint

    result = train(make_cfg("train.max_steps=3", "train.eval_every=0", "train.ckpt_every=1",
                            "train.checkpointing=false"), str(tmp_path / "off"))
    assert result["status"] == "completed" and checkpoint.complete_checkpoints(str(tmp_path / "off")) == []
    assert set(result["memory"]) == {"startup_gib", "step_gib", "planned_gib"}
    assert result["memory"]["step_gib"][0] > 0 and result["memory"]["planned_gib"][0] > 0
    _poison_after_start(monkeypatch)
    with pytest.raises(TrainingError, match="not finite after step 3"):
        train(make_cfg("train.max_steps=3", "train.eval_every=0", "train.max_nonfinite=5", "train.checkpointing=false",
                       "train.ckpt_every=3"), str(tmp_path / "nan"))
    assert read_json(tmp_path / "nan" / "result.json")["status"] == "failed"


def test_garbage_is_collected_every_gc_every_steps_and_never_automatically_in_between(make_cfg, tmp_path):
    """train.gc_every=2: automatic collection is off while the run trains, generation-1 collections run after steps
    2 and 4 (their seconds in those steps' records), and collection is automatic again afterwards. With
    train.gc_every=0 the same run's allocations trigger Python's automatic collections."""
    import gc

    def collections(every: int) -> list[tuple[int, bool]]:
        seen = []

        def note(phase, info):  # (gc.isenabled() is False only inside the schedule: collections there are its own)
            if phase == "start":
                seen.append((info["generation"], gc.isenabled()))

        gc.callbacks.append(note)
        try:
            result = train(make_cfg("train.max_steps=4", "train.eval_every=0", "train.ckpt_every=0",
                                    f"train.gc_every={every}"), str(tmp_path / f"every{every}"))
        finally:
            gc.callbacks.remove(note)
        assert result["status"] == "completed" and gc.isenabled()
        return seen

    scheduled = [c for c in collections(2) if not c[1]]
    assert scheduled == [(1, False), (1, False)], scheduled
    gc_s = {r["step"]: r.get("gc_s") for r in records(tmp_path / "every2") if "loss" in r}
    assert [s for s, v in gc_s.items() if v is not None] == [2, 4] and all(gc_s[s] >= 0 for s in (2, 4)), gc_s
    automatic = collections(0)
    assert automatic and all(enabled for _, enabled in automatic), automatic
    assert not any("gc_s" in r for r in records(tmp_path / "every0"))


def test_a_new_process_imports_torch_with_the_collector_paused_and_frozen_after():
    """What a rank imports is never walked by Python's collector (a quarter of a small run's CPU, docs/training.md):
    no collection while importing, the objects frozen and collection on again after; a process that has torch
    already is left as it was."""
    import subprocess
    import sys

    code = ("import gc\nfrom hpctrain.training.gc_schedule import importing\n"
            "starts = []\ngc.callbacks.append(lambda phase, info: starts.append(info['generation']) if phase == 'start' "
            "else None)\n"
            "with importing():\n    import torch, torch.distributed.tensor\n    paused = gc.isenabled()\n"
            "print(starts, paused, gc.get_freeze_count() > 100_000, gc.isenabled())\n"
            "with importing():\n    print(gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.join(os.path.dirname(__file__), os.pardir))
    assert out.stdout.splitlines() == ["[] False True True", "True"], out.stdout


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_fused_and_foreach_optimizers_agree(make_cfg, tmp_path, optim):
    """optim.implementation: the fused kernel (default; no parameter-sized temporary) and the grouped foreach
    kernels take the same steps."""
    runs = {impl: train(make_cfg(f"optim={optim}", f"optim.implementation={impl}", "train.max_steps=4",
                                 "train.eval_every=0"), str(tmp_path / impl)) for impl in ("fused", "foreach")}
    a, b = losses(tmp_path / "fused"), losses(tmp_path / "foreach")
    assert runs["fused"]["status"] == runs["foreach"]["status"] == "completed"
    assert all(abs(a[s] - b[s]) <= 1e-5 for s in a), (a, b)


def test_resume_never_moves_the_previous_run_aside(make_cfg, tmp_path):
    """Starting over in a used run dir: the old run's checkpoints, metrics and result move to previous/<time>/;
    the new run's rotation and `latest` see only its own checkpoints, and resuming continues the new run."""
    from hpctrain.storage import checkpoint

    run = tmp_path / "run"
    train(make_cfg("train.max_steps=4", "train.eval_every=0", "train.ckpt_every=2"), str(run))
    old_losses = losses(run)
    train(make_cfg("train.max_steps=2", "train.eval_every=0", "train.ckpt_every=1", "train.ckpt_keep=1",
                   "train.resume=never", "train.seed=7"), str(run))
    (previous,) = (run / "previous").iterdir()
    assert sorted(os.listdir(previous / "checkpoints")) == ["latest", "step-0000002", "step-0000004"]
    assert losses(previous) == old_losses
    assert sorted(losses(run)) == [1, 2] and losses(run)[1] != old_losses[1]
    assert checkpoint.latest(str(run)) == str(run / "checkpoints" / "step-0000002")
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step-0000002"]
    resumed = train(make_cfg("train.max_steps=3", "train.eval_every=0", "train.seed=7"), str(run))
    assert resumed["steps"] == 3 and sorted(losses(run)) == [1, 2, 3]
    assert "step-0000004" not in os.listdir(run / "checkpoints")


def test_a_rerun_with_nothing_to_resume_sets_the_previous_run_aside(make_cfg, tmp_path):
    """train.resume=auto in a directory whose run left no checkpoint (train.checkpointing=false, or killed before its
    first): that run moves to previous/ with its scores (hpctrain eval's evals.jsonl), not cut and overwritten."""
    run, plain = tmp_path / "run", ("train.eval_every=0", "train.checkpointing=false")
    train(make_cfg("train.max_steps=3", *plain), str(run))
    (run / "evals.jsonl").write_text('{"step": 3, "eval/t/acc": 0.5}\n')  # (as `hpctrain eval` appends them)
    old = losses(run)
    assert train(make_cfg("train.max_steps=2", "train.seed=7", *plain), str(run))["steps"] == 2
    (previous,) = (run / "previous").iterdir()
    assert losses(previous) == old and sorted(losses(run)) == [1, 2] and losses(run)[1] != old[1]
    assert json.loads((previous / "result.json").read_text())["steps"] == 3
    assert (previous / "evals.jsonl").is_file() and not (run / "evals.jsonl").exists()


def test_a_stop_between_a_checkpoints_rename_and_latest_resumes_from_that_checkpoint(make_cfg, tmp_path):
    """kill -9 after step 4's rename, before `latest` moved: the run resumes from step 4, not 2 (it redid steps 3-4
    and moved the complete step 4 out of the rotation as step-0000004.replaced, kept for good); a link re-pointed
    after step 4 was written (a fallback past a checkpoint that did not load) still names the run's newest."""
    from hpctrain.storage import checkpoint

    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    train(make_cfg("train.max_steps=4", "train.eval_every=0", "train.ckpt_every=2"), str(run))
    os.remove(ck / "latest")
    os.symlink("step-0000002", ck / "latest")
    written = os.path.getmtime(ck / "step-0000004" / checkpoint.STATE_FILE)
    os.utime(ck / "latest", (written + 10, written + 10), follow_symlinks=False)  # re-pointed after step 4
    assert checkpoint.latest(str(run)).endswith("step-0000002")
    os.utime(ck / "latest", (written - 10, written - 10), follow_symlinks=False)  # as the stop leaves it
    assert checkpoint.latest(str(run)).endswith("step-0000004")
    resumed = train(make_cfg("train.max_steps=6", "train.eval_every=0", "train.ckpt_every=2"), str(run))
    assert resumed["steps"] == 6 and sorted(os.listdir(ck)) == ["latest", "step-0000004", "step-0000006"]


def test_a_continued_run_reads_running_until_it_ends(demo_data, tmp_path):
    """A finished run continued (train.max_steps raised) and killed: result.json says running from the attempt's
    start, so summary and the report read "running or never finished", not the earlier attempt's "completed"."""
    from helpers import last_step

    from hpctrain.launch.sweep import point_status
    from hpctrain.tools.summary import summarize

    run = tmp_path / "run"
    assert run_forked(cli.main, _args(run, demo_data, "train.max_steps=2"), cwd=tmp_path, timeout=300).code == 0
    assert summarize(str(run)).startswith("status: completed after step 2")
    with Forked(cli.main, _args(run, demo_data, "train.max_steps=2000"), tmp_path) as proc:
        until("step 4", lambda: last_step(run) >= 4 or proc.poll() is not None, 240, every=0.02)
        proc.kill()  # SIGKILL, reaped
    assert summarize(str(run)).startswith("status: running or never finished")
    assert point_status(json.loads((run / "result.json").read_text()), None, True, True) == "running"


def test_a_supervised_restart_continues_its_own_run(make_cfg, tmp_path, monkeypatch):
    """A step restarted inside its allocation (cluster.spare_nodes: HPCTRAIN_RESTART, SLURM_RESTART_COUNT still 0)
    continues its run as a requeued job does: nothing set aside before its first checkpoint (the job's own .submitit/
    and slurm.json went to previous/), and train.resume=never does not start it over."""
    from hpctrain.runs.rundir import RESTART_ENV

    run, plain = tmp_path / "run", ("train.eval_every=0", "logging.trackers=[]")
    train(make_cfg(*plain, "train.max_steps=2", "train.checkpointing=false"), str(run))
    monkeypatch.setenv(RESTART_ENV, "1")
    train(make_cfg(*plain, "train.max_steps=2", "train.checkpointing=false"), str(run))
    assert not (run / "previous").exists()
    monkeypatch.delenv(RESTART_ENV)
    train(make_cfg(*plain, "train.max_steps=2", "train.ckpt_every=2"), str(run))  # (sets the first run aside)
    monkeypatch.setenv(RESTART_ENV, "2")
    assert train(make_cfg(*plain, "train.max_steps=4", "train.resume=never"), str(run))["steps"] == 4
    assert sorted(losses(run)) == [1, 2, 3, 4] and len(os.listdir(run / "previous")) == 1


def test_resume_from_an_older_checkpoint_of_the_same_run_starts_a_new_timeline(make_cfg, tmp_path):
    """train.resume=<this run's step 2> while step 4 exists: the old timeline moves aside (the path is followed
    there), so the new step-4 checkpoint never overwrites or mixes with the old one."""
    run = tmp_path / "run"
    train(make_cfg("train.max_steps=4", "train.eval_every=0", "train.ckpt_every=2", "train.ckpt_keep=3"), str(run))
    result = train(make_cfg("train.max_steps=4", "train.eval_every=0", "train.ckpt_every=2",
                            f"train.resume={run}/checkpoints/step-0000002"), str(run))
    assert result["steps"] == 4 and sorted(losses(run)) == [3, 4]
    (previous,) = (run / "previous").iterdir()
    assert "step-0000004" in os.listdir(previous / "checkpoints")


@pytest.mark.parametrize("ckpt_async", [False, True])
def test_an_evaluation_failure_keeps_the_steps_checkpoint(make_cfg, tmp_path, demo_data, ckpt_async):
    """The step's checkpoint is written before its evaluation: a validation shard found corrupt at step 2 costs
    no finished step (written in the background: it is finished and published before the run ends)."""
    import shutil

    from hpctrain.core.shard_format import read_manifest
    from hpctrain.data.loader import DataError
    from hpctrain.storage import checkpoint

    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    for shard in read_manifest(str(data)).splits["val"]:
        with open(data / shard.name, "r+b") as f:
            f.seek(600)
            f.write(b"\xff" * 64)  # tokens changed: the checksum no longer matches
    with pytest.raises(DataError, match="checksum"):
        train(make_cfg(f"data.path={data}", "train.max_steps=4", "train.eval_every=2", "train.ckpt_every=2",
                       f"train.ckpt_async={ckpt_async}"), str(tmp_path / "run"))
    assert checkpoint.latest(str(tmp_path / "run")).endswith("step-0000002")


@pytest.mark.slow
def test_cli_start_over_moves_the_old_config_and_log_too(demo_data, tmp_path):
    """From the command line the old run's .hydra/ and train.log move aside with it, before the new run writes."""
    run = tmp_path / "run"
    for extra in (["train.seed=1"], ["train.seed=2", "train.resume=never"]):
        p = run_forked(cli.main, _args(run, demo_data, "train.max_steps=2", *extra), cwd=tmp_path, timeout=240)
        assert p.code == 0, p.err
    (previous,) = (run / "previous").iterdir()
    assert "train.seed=1" in read_text(previous / ".hydra" / "overrides.yaml").replace("- ", "")
    assert "train.seed=2" in read_text(run / ".hydra" / "overrides.yaml").replace("- ", "")
    assert "moved to" not in read_text(previous / "train.log") and "moved to" in read_text(run / "train.log")
    assert sorted(losses(previous)) == sorted(losses(run)) == [1, 2]


def test_a_requeued_job_continues_its_own_run(make_cfg, tmp_path, monkeypatch):
    """SLURM_RESTART_COUNT > 0: train.resume=never or a path never starts over again; before its first checkpoint
    a requeued job starts where its first attempt did, following a path that attempt moved aside."""
    from hpctrain.runs import rundir

    run = tmp_path / "run"
    train(make_cfg("train.max_steps=4", "train.eval_every=0", "train.ckpt_every=2"), str(run))
    first = make_cfg("train.max_steps=3", "train.eval_every=0", "train.ckpt_every=0",
                     f"train.resume={run}/checkpoints/step-0000002")
    rundir.start_over(str(run), first)  # the first attempt moved the old run aside, then was preempted
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    requeued = make_cfg("train.max_steps=3", "train.eval_every=0", "train.ckpt_every=0",
                        f"train.resume={run}/checkpoints/step-0000002")
    assert train(requeued, str(run))["steps"] == 3 and sorted(losses(run)) == [3]
    result = train(make_cfg("train.max_steps=4", "train.eval_every=0", "train.resume=never"), str(run))
    assert result["steps"] == 4 and sorted(losses(run)) == [3, 4]  # continued, not started over
    assert len(list((run / "previous").iterdir())) == 1
