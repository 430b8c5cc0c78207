"""Checkpoint safety: atomic directories, `latest` handling, retention, no code run by loading, damaged checkpoints
as one line, and resuming with fallback to older checkpoints."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from contextlib import suppress

import pytest
import torch
from helpers import WarningLines, one_line

from hpctrain.storage import checkpoint
from hpctrain.training.run import train


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.fixture
def run_with_ckpts(make_cfg, tmp_path):
    run = tmp_path / "run"
    train(make_cfg("train.max_steps=4", "train.ckpt_every=1", "train.ckpt_keep=3", "train.eval_every=0"),
          str(run))
    return run


def test_retention_and_latest(run_with_ckpts):
    names = sorted(os.listdir(run_with_ckpts / "checkpoints"))
    assert names == ["latest", "step-0000002", "step-0000003", "step-0000004"]
    assert checkpoint.latest(str(run_with_ckpts)).endswith("step-0000004")


def test_incomplete_and_stale_checkpoints_are_ignored(run_with_ckpts):
    ck = run_with_ckpts / "checkpoints"
    # A crash mid-save leaves a hidden temporary directory; a crash before the rename leaves no step dir.
    shutil.copytree(ck / "step-0000004", ck / ".tmp-step-0000005")
    # A step directory without trainer_state.json is not complete.
    shutil.copytree(ck / "step-0000004", ck / "step-0000006")
    os.remove(ck / "step-0000006" / checkpoint.STATE_FILE)
    assert checkpoint.latest(str(run_with_ckpts)).endswith("step-0000004")
    # `latest` pointing at a vanished directory falls back to the newest complete one.
    shutil.rmtree(ck / "step-0000004")
    assert checkpoint.latest(str(run_with_ckpts)).endswith("step-0000003")


def test_resume_from_an_explicit_checkpoint(make_cfg, run_with_ckpts, tmp_path):
    other = tmp_path / "other"
    result = train(make_cfg("train.max_steps=4", "train.eval_every=0",
                            f"train.resume={run_with_ckpts}/checkpoints/step-0000002"), str(other))
    assert result["steps"] == 4
    with open(other / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [3, 4]


def test_loading_refuses_a_malicious_bytes_entry(tmp_path):
    """Non-tensor entries go through torch.load(weights_only=True): code objects are refused."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(2, 2)

    dcp.save({"model": model.state_dict(), "evil": _Exploit()}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    (tmp_path / "c" / checkpoint.STATE_FILE).write_text("{}")
    os.chdir(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="Weights only load failed"):
        checkpoint._dcp_load({"evil": None}, str(tmp_path / "c"), no_dist=True)
    assert not (tmp_path / "pwned").exists()


# --- Crafted .metadata pickles, built opcode by opcode: each one creates ./pwned if it runs. ---------------------

DCP_FS = "torch.distributed.checkpoint.filesystem"  # an allowed module: it imports os
PROTO_4 = pickle.PROTO + b"\x04"  # the protocol under which find_class walks dotted names


def _str(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _stack_global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + pickle.STACK_GLOBAL


def _call(func: bytes, *args: str) -> bytes:
    """func(*args) by REDUCE."""
    return PROTO_4 + func + pickle.MARK + b"".join(map(_str, args)) + pickle.TUPLE + pickle.REDUCE + pickle.STOP


def _inst(module: str, name: str, arg: str, proto: bytes = b"") -> bytes:
    """module.name(arg) by INST, the protocol 0 opcode that names and calls in one."""
    return proto + pickle.MARK + _str(arg) + pickle.INST + f"{module}\n{name}\n".encode() + pickle.STOP


def _build(target: bytes, state: bytes) -> bytes:
    """BUILD: set attributes of `target` (any object the pickle holds, a class too) from `state`."""
    return PROTO_4 + target + state + pickle.BUILD + pickle.STOP


def _dict(key: str, value: bytes) -> bytes:
    return pickle.EMPTY_DICT + _str(key) + value + pickle.SETITEM


RUNS_CODE = {
    # (a) a dotted name through an allowed module reaches os.system, as GLOBAL and as STACK_GLOBAL
    "dotted_global": _call(_global(DCP_FS, "os.system"), "touch pwned"),
    "dotted_stack_global": _call(_stack_global(DCP_FS, "os.system"), "touch pwned"),
    # (b) a function (not a class) of a DCP module: loads ./state.pt and writes a DCP checkpoint to ./pwned
    "dcp_function": _call(_stack_global("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp"),
                          "state.pt", "pwned"),
    # (c) the interpreter itself
    "eval": _call(_global("builtins", "eval"), "__import__('os').system('touch pwned')"),
    "exec": _call(_stack_global("builtins", "exec"), "import pathlib; pathlib.Path('pwned').touch()"),
    # (d) protocol 0 INST and OBJ, and INST with a dotted name through an allowed module
    "inst": _inst("os", "system", "touch pwned"),
    "obj": pickle.MARK + _global("os", "system") + b"S'touch pwned'\n" + pickle.OBJ + pickle.STOP,
    "dotted_inst": _inst(DCP_FS, "os.system", "touch pwned", proto=PROTO_4),
}
# (e) what the allowed names can be made to do: a layout lookup by an attacker's string, a Path in place of the
# metadata, and BUILD on an allowed function or class (which would patch it for every later load in the process).
ABUSES_ALLOWED = {
    "layout_lookup": _call(_stack_global("torch.serialization", "_get_layout"), "touch pwned"),
    "path_not_metadata": _call(_stack_global("pathlib", "PosixPath"), "pwned"),
    "build_on_function": _build(_stack_global("torch.serialization", "_get_layout"),
                                _dict("cache", _dict("torch.strided", _str("touch pwned")))),
    "build_on_class": _build(_stack_global(DCP_FS, "_StorageInfo"),
                             pickle.NONE + _dict("__eq__", pickle.NONE) + pickle.TUPLE2),
    # attributes outside vars(): a function's or a class's __qualname__ (slot state, set with setattr)
    "qualname_of_function": _build(_stack_global("torch.serialization", "_get_layout"),
                                   pickle.NONE + _dict("__qualname__", _str("pwned")) + pickle.TUPLE2),
    "qualname_of_class": _build(_stack_global(DCP_FS, "_StorageInfo"),
                                pickle.NONE + _dict("__qualname__", _str("pwned")) + pickle.TUPLE2),
    # a process-wide singleton the pickle can reach: an Enum member, looked up by its value
    "build_on_enum_member": _build(_stack_global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
                                   + pickle.MARK + pickle.BININT1 + b"\x00" + pickle.TUPLE + pickle.REDUCE,
                                   pickle.NONE + _dict("note", _str("pwned")) + pickle.TUPLE2),
}
# (f) damaged files
DAMAGED = {
    "not_a_pickle": b"not a pickle\n",
    "empty": b"",
    "json": b'{"state_dict_metadata": {}}',
}


def _linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save_steps(run: str, model, optimizer, steps=(2, 3, 4)) -> None:
    for step in steps:  # each checkpoint's weights hold its step: which one was loaded shows in them
        with torch.no_grad():
            model.weight.fill_(step)
        checkpoint.save(run, step, model, optimizer, {"step": step}, keep=3)


@pytest.fixture(scope="module")
def small_saved(tmp_path_factory):
    """Checkpoints at steps 2, 3, 4 of a small model with AdamW state, written by checkpoint.save."""
    run = tmp_path_factory.mktemp("small") / "run"
    _save_steps(str(run), *_linear())
    return run


@pytest.fixture
def small_run(small_saved, tmp_path, monkeypatch):
    """A private copy of `small_saved`; the working directory is an empty one, where ./pwned would appear."""
    run = tmp_path / "run"
    shutil.copytree(small_saved, run, symlinks=True)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    torch.save({"w": torch.zeros(1)}, "state.pt")  # what the dcp_function payload would load
    return run


def _step(run, n: int) -> str:
    return str(run / "checkpoints" / f"step-{n:07d}")


def _refused_by_both_loaders(ckpt: str, *words: str) -> None:
    """What resuming (load) and generate/export (load_model) call: the same one-line CheckpointError."""
    for attempt in (lambda: checkpoint.load(ckpt, *_linear()), lambda: checkpoint.load_model(ckpt, _linear()[0])):
        with pytest.raises(checkpoint.CheckpointError) as e:
            attempt()
        one_line(e, ckpt, "train.resume=never", *words)
    assert not os.path.exists("pwned")


@pytest.mark.parametrize("name", list(RUNS_CODE))
def test_crafted_payloads_do_run_code_under_plain_pickle(name, tmp_path, monkeypatch):
    """Control: each payload is live; a loader that lets it through creates ./pwned."""
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.zeros(1)}, "state.pt")
    with suppress(Exception):  # only the side effect matters
        pickle.loads(RUNS_CODE[name])
    assert os.path.exists("pwned")


@pytest.mark.parametrize("name", list(RUNS_CODE))
def test_crafted_metadata_cannot_run_code(small_run, name):
    _refused_by_both_loaders(_with_metadata(small_run, RUNS_CODE[name]), "is not allowed in checkpoint metadata")


def _with_metadata(run: str, data: bytes) -> str:
    """The run's step-4 checkpoint, its .metadata replaced by `data`."""
    ckpt = _step(run, 4)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(data)
    return ckpt


@pytest.mark.parametrize("name", list(ABUSES_ALLOWED))
def test_allowed_names_cannot_be_abused(small_run, name):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.serialization import _get_layout

    eq, cache = _StorageInfo.__eq__, _get_layout.cache
    names = _StorageInfo.__qualname__, _get_layout.__qualname__
    _refused_by_both_loaders(_with_metadata(small_run, ABUSES_ALLOWED[name]), "bad .metadata")
    # Nothing a BUILD would change is changed: the next load (a fallback to an older checkpoint) sees the real ones.
    assert _StorageInfo.__eq__ is eq and _get_layout.cache is cache and _get_layout("torch.strided") is torch.strided
    assert (_StorageInfo.__qualname__, _get_layout.__qualname__) == names


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(small_run):
    ckpt = _step(small_run, 4)
    metadata = checkpoint._SafeReader(ckpt).metadata
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    _refused_by_both_loaders(ckpt, "outside the checkpoint")


@pytest.mark.parametrize("name", list(DAMAGED))
def test_metadata_that_is_not_metadata_is_one_line(small_run, name):
    _refused_by_both_loaders(_with_metadata(small_run, DAMAGED[name]), "bad .metadata")


def test_truncated_or_missing_metadata_is_one_line(small_run):
    ckpt = _step(small_run, 4)
    md = os.path.join(ckpt, ".metadata")
    os.truncate(md, os.path.getsize(md) // 2)
    _refused_by_both_loaders(ckpt, "bad .metadata")
    os.remove(md)
    _refused_by_both_loaders(ckpt, "No such file or directory", ".metadata")


# A cut .distcp: an entry cut short (torch.load's EOFError) or one whose zip directory is gone.
TRUNCATED = ("EOFError: a file ends early (truncated)", "RuntimeError: PytorchStreamReader failed reading zip archive")


def _cut_half(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage,words", [
    (_cut_half, ["EOFError", "truncated"]),
    (os.remove, ["No such file or directory", "__0_0.distcp"]),
])
def test_damaged_data_file_is_one_line(small_run, damage, words):
    ckpt = _step(small_run, 4)
    damage(os.path.join(ckpt, "__0_0.distcp"))
    _refused_by_both_loaders(ckpt, *words)


def test_data_file_missing_its_last_bytes_is_one_line(small_run):
    """The file's last entry is the RNG state: resuming needs it, exporting the weights does not."""
    ckpt = _step(small_run, 4)
    storage = checkpoint._SafeReader(ckpt).metadata.storage_data
    assert max(storage, key=lambda index: storage[index].offset).fqn == "rng.cpu_rank0"
    data = os.path.join(ckpt, "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) - 1)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(ckpt, *_linear())
    one_line(e, ckpt, "a file ends early (truncated): __0_0.distcp", "rng.cpu_rank0", "train.resume=never")
    model = torch.nn.Linear(4, 4)
    checkpoint.load_model(ckpt, model)
    assert torch.all(model.weight == 4)


@pytest.mark.parametrize("content,words", [
    ("{\"step\": 4", ["bad trainer_state.json", "JSONDecodeError"]),
    ("[4]", ["bad trainer_state.json", "not a JSON object"]),
    (b"\xff\xfe", ["bad trainer_state.json", "UnicodeDecodeError"]),
])
def test_damaged_trainer_state_is_one_line(small_run, content, words):
    ckpt = _step(small_run, 4)
    mode = "wb" if isinstance(content, bytes) else "w"
    with open(os.path.join(ckpt, checkpoint.STATE_FILE), mode) as f:
        f.write(content)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(ckpt, *_linear())
    one_line(e, ckpt, "train.resume=never", *words)


@pytest.fixture
def warnings_logged():
    handler = WarningLines()
    logging.getLogger("hpctrain").addHandler(handler)
    yield handler.messages
    logging.getLogger("hpctrain").removeHandler(handler)


def test_load_newest_loads_the_newest(small_run, warnings_logged):
    model, optimizer = _linear()
    path, state = checkpoint.load_newest(str(small_run), model, optimizer)
    assert path == os.path.realpath(_step(small_run, 4)) and state == {"step": 4}
    assert torch.all(model.weight == 4) and warnings_logged == []


def test_load_newest_without_checkpoints_is_none(tmp_path):
    assert checkpoint.load_newest(str(tmp_path / "new"), *_linear()) is None


def test_load_newest_falls_back_to_an_older_checkpoint(run_with_ckpts, make_cfg, warnings_logged):
    """A real training run's checkpoints (steps 2, 3, 4): step 4's data file is cut to half its size."""
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import Llama
    from hpctrain.training.optimizer import build_optimizer

    cfg = make_cfg()

    def fresh():
        model = Llama(model_args(cfg.model))
        return model, build_optimizer(model, cfg.optim, cfg.optim.lr)

    run = run_with_ckpts
    _cut_half(os.path.join(_step(run, 4), "__0_0.distcp"))
    path, state = checkpoint.load_newest(str(run), *fresh())
    assert path == _step(run, 3) and state["run"]["step"] == 3
    assert len(warnings_logged) == 1, warnings_logged
    line = warnings_logged[0]
    assert "\n" not in line and line.startswith(f"checkpoint {os.path.realpath(_step(run, 4))} cannot be loaded (")
    assert line.endswith(f"falling back to {_step(run, 3)}")
    assert any(w in line for w in TRUNCATED), line  # which entry DCP reads first decides which

    for n in (2, 3):
        _cut_half(os.path.join(_step(run, n), "__0_0.distcp"))
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_newest(str(run), *fresh())
    msg = one_line(e, os.path.realpath(_step(run, 4)), "train.resume=PATH", "new run_dir")
    assert any(w in msg for w in TRUNCATED), msg
    assert len(warnings_logged) == 3


def test_load_newest_skips_a_checkpoint_with_bad_trainer_state(small_run, warnings_logged):
    with open(os.path.join(_step(small_run, 4), checkpoint.STATE_FILE), "w") as f:
        f.write("{")
    model, optimizer = _linear()
    assert checkpoint.load_newest(str(small_run), model, optimizer) == (_step(small_run, 3), {"step": 3})
    assert torch.all(model.weight == 3) and "bad trainer_state.json" in warnings_logged[0]


def _two_ranks_fall_back(run: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = _linear()
    _save_steps(run, model, optimizer)
    if rank == 0:  # spoil only what rank 1 reads: its RNG state in step 4 (rank 0 reads nothing of it)
        step4 = os.path.join(run, "checkpoints", "step-0000004")
        (info,) = [v for k, v in checkpoint._SafeReader(step4).metadata.storage_data.items()
                   if k.fqn == "rng.cpu_rank1"]
        with open(os.path.join(step4, info.relative_path), "r+b") as f:
            f.seek(info.offset)
            f.write(b"\0" * info.length)
    dist.barrier()
    path, state = checkpoint.load_newest(run, model, optimizer)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump([os.path.basename(path), state["step"], model.weight.mean().item()], f)
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_load_newest_falls_back_on_every_rank_when_one_rank_fails(tmp_path):
    """DCP raises a rank's read failure on all ranks: both ranks fall back to step 3 together (no hang)."""
    from hpctrain.runtime.spawn import spawn

    spawn(2, _two_ranks_fall_back, (str(tmp_path / "run"), str(tmp_path)), threads=1)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results == [["step-0000003", 3, 3.0]] * 2


def test_real_checkpoints_load(run_with_ckpts, make_cfg):
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import Llama
    from hpctrain.training.optimizer import build_optimizer

    model = Llama(model_args(make_cfg().model))
    path, state = checkpoint.load_newest(str(run_with_ckpts), model, build_optimizer(model, make_cfg().optim, 0.1))
    assert path.endswith("step-0000004") and state["run"]["step"] == 4
    exported = Llama(model_args(make_cfg().model))
    checkpoint.load_model(path, exported)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), exported.state_dict().values()))


@pytest.mark.multiproc
def test_a_multi_rank_checkpoint_loads_in_one_process(make_cfg, tmp_path):
    """Saved by 2 ranks (FSDP, DTensor shards in two files per rank: train.ckpt_write_threads=2): resumed and exported
    by one process."""
    from hpctrain.models import model_args
    from hpctrain.models.llama.model import Llama
    from hpctrain.training.optimizer import build_optimizer

    cfg = make_cfg("parallel=fsdp", "parallel.dp=2", "train.max_steps=2", "train.ckpt_every=2",
                   "train.eval_every=0", "cluster.num_threads=1")
    train(cfg, str(tmp_path / "run"))
    ckpt = _step(tmp_path / "run", 2)
    assert sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp")) == [
        "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
    model = Llama(model_args(cfg.model))
    path, state = checkpoint.load_newest(str(tmp_path / "run"), model, build_optimizer(model, cfg.optim, 0.1))
    assert path == os.path.realpath(ckpt) and state["run"]["step"] == 2
    checkpoint.load_model(ckpt, Llama(model_args(cfg.model)))


def test_rotation_keeps_what_it_just_wrote_and_cut_short_leaves_no_stray(small_run):
    """Saving step 3 again after falling back past step 4 (keep=1): the new step 3 stays, the newer step 4 is not
    counted (not removed either); an old checkpoint whose removal was cut short (renamed first) is no stray, and a
    stray older than the newest complete checkpoint does not refuse a start."""
    run = str(small_run)
    model, optimizer = _linear()
    checkpoint.save(run, 3, model, optimizer, {"step": 3}, keep=1)
    names = sorted(os.listdir(checkpoint.root(run)))
    assert "step-0000003" in names and "step-0000004" in names and "step-0000002" not in names, names
    assert checkpoint.latest(run).endswith("step-0000003")
    assert not [n for n in names if n.startswith(checkpoint.REMOVING)], names
    os.makedirs(os.path.join(checkpoint.root(run), "step-0000001"))  # e.g. a removal by hand cut short
    checkpoint.check_no_strays(run)
    os.makedirs(os.path.join(checkpoint.root(run), "step-0000009"))  # a copy the user may expect to continue from
    with pytest.raises(checkpoint.CheckpointError, match="step-0000009 is not a complete checkpoint"):
        checkpoint.check_no_strays(run)


def test_a_save_that_the_time_limits_warning_leaves_no_time_for_is_warned():
    """Under Slurm a save at the time limit's warning must finish within cluster.signal_lead_s. At worst the signal
    finds a periodic save under way and an evaluation to run, then two steps go by before the stop, then its own save
    is written: 2 steps (the longest after the first) + the longest evaluation + 2 writes. Said at the first save
    that can tell; warned once, with the lead to submit with, where it would not fit (the save would be killed and the
    requeue lose its steps); nothing outside Slurm (no lead) or on ranks other than the main one."""
    from hpctrain.training.save_resume import SignalLead

    logger = logging.getLogger("hpctrain")
    handler, level = WarningLines(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        fits, tight, off, other = (SignalLead(120, "USR2", True), SignalLead(20, "USR1", True),
                                   SignalLead(None, "USR2", True), SignalLead(1, "USR2", False))
        for lead in (fits, tight, off, other):
            lead.after_step(60.0)  # (the first: not counted)
            lead.after_write(5.0)  # no step timed yet: nothing to say
            lead.after_step(3.0), lead.after_step(2.0)
        fits.after_write(5.0), fits.after_write(6.0)
        tight.after_eval(0.0), tight.after_eval(4.0), tight.after_eval(1.0)
        tight.after_write(5.0), tight.after_write(50.0)
        off.after_write(500.0), other.after_write(500.0)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert handler.messages == [
        "a save at the time limit's warning signal needs at most about 16.0 s (two steps of 3.00 s, and two writes of "
        "5.00 s: one the signal may find under way, then its own) of the 120 s cluster.signal_lead_s gives",
        "a save at the time limit's warning signal needs at most about 20.0 s (two steps of 3.00 s, an evaluation of "
        "4.00 s, and two writes of 5.00 s: one the signal may find under way, then its own) of the 20 s "
        "cluster.signal_lead_s gives",
        "a save at the time limit's warning signal could need about 110 s (two steps of 3.00 s, an evaluation of "
        "4.00 s, and two writes of 50.00 s: one the signal may find under way, then its own), more than "
        "cluster.signal_lead_s=20: it would be killed and the requeued run resume from the checkpoint before; submit "
        "with cluster.signal_lead_s=140 (an sbatch template: --signal=USR1@140)"]
