"""A run's checkpoint scored on eval.tasks outside its training (`hpctrain eval`): the model built in a layout of its
own (the run's, or another one given), the checkpoint's weights loaded and resharded to it, lm-eval's tasks scored
as in the loop (hpctrain.training.downstream), and the record appended to <run_dir>/evals.jsonl."""

from __future__ import annotations

import json
import os

import torch

from hpctrain.core.errors import BAD_INPUT, TrainingError, say
from hpctrain.core.files import EVALS_FILE, read_evals
from hpctrain.core.shard_format import read_manifest
from hpctrain.evaluation.harness import include_dir
from hpctrain.models import spec_of
from hpctrain.parallel import process_group
from hpctrain.parallel.layout import world_of
from hpctrain.runs.compose import typed
from hpctrain.runs.resolve import resolve
from hpctrain.storage import checkpoint
from hpctrain.training import downstream
from hpctrain.training.model_init import build_model
from hpctrain.training.precision import compute_dtype, setup_precision
from hpctrain.training.step import build_train_step


def score_checkpoint(cfg, run_dir: str, ckpt: str, once: bool = False) -> dict:
    """Every check first (the layout, the tasks, the checkpoint's metadata), then the ranks the layout needs, forked
    here; returns the record (also appended to <run_dir>/evals.jsonl). `once`: a checkpoint scored already with these
    tasks is not scored again (its record returned): an eval job requeued."""
    if once:
        done = [r for r in read_evals(run_dir) if r["step"] == checkpoint.step_of(ckpt)
                and _same_key(r.get("scored_with"), _key(cfg.eval))]
        if done:
            # (a command's line, not a log record: `hpctrain eval` configures no logging)
            say(f"{ckpt} was scored already with these tasks (step {done[-1]['step']} in evals.jsonl): not scored again")
            return done[-1]
    world = process_group.launched_world() or world_of(cfg.parallel, process_group.local_device_count())
    shape = resolve(cfg, world)
    data_dir = os.path.expanduser(cfg.data.path)
    seq_len = shape.seq_len or read_manifest(data_dir).seq_len
    downstream.check(cfg.eval, shape.layout, data_dir, seq_len, cfg.model.max_seq_len)
    downstream.check_scoring_layout(shape.layout)  # (whatever eval.mode the run had: this is where scoring runs)
    checkpoint.check_loadable(ckpt)
    spec = spec_of(cfg.model)
    checkpoint.check_model(ckpt, spec.weights(spec.args(cfg.model)))
    cfg = typed(cfg)
    args = (cfg, run_dir, ckpt, shape, data_dir, seq_len)
    if process_group.launched_world() is None and world > 1:
        from hpctrain.runtime import spawn

        try:
            spawn.spawn(world, _rank_main, args, threads=cfg.cluster.num_threads, quiet=(*BAD_INPUT, KeyboardInterrupt))
        except spawn.LaunchError as e:
            raise TrainingError(str(e)) from None
        # this checkpoint's record with this key, the newest: another eval job may have appended to the file since
        return [r for r in read_evals(run_dir) if r.get("checkpoint") == os.path.abspath(ckpt)
                and _same_key(r.get("scored_with"), _key(cfg.eval))][-1]
    return _rank_main(*args)


def _rank_main(cfg, run_dir: str, ckpt: str, shape, data_dir: str, seq_len: int) -> dict:
    env = process_group.init(cfg.cluster.pg_timeout_s)
    try:
        layout = shape.layout
        mesh = layout.build_mesh(env.device.type, cfg.cluster.pg_timeout_s)
        model = build_model(cfg.model, cfg.parallel, layout, mesh, env.device, compute_dtype(cfg.precision),
                            cfg.train.seed)
        spec = spec_of(cfg.model)
        checkpoint.load_weights(ckpt, model, spec.weights(spec.args(cfg.model)))
        # A step for its forward in the layout (a pipeline's schedule); its optimizer never steps.
        step = build_train_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                setup_precision(cfg.precision, env.device), env.device, mesh, layout, grad_clip=0.0,
                                grad_accum=shape.grad_accum, micro_shape=(shape.micro_batch, seq_len))
        samples = os.path.join(run_dir, "eval_samples") if env.is_main else None
        scoring = downstream.DownstreamEval(cfg.eval, 0, step, layout.batch_mesh(mesh), data_dir, seq_len, None,
                                            samples, cfg.parallel.compile)
        number = checkpoint.step_of(ckpt)
        record = {"step": number, "checkpoint": os.path.abspath(ckpt), "scored_with": _key(cfg.eval),
                  **scoring.score(number)}
        if env.is_main:
            append_record(run_dir, record)
        return record
    finally:
        process_group.shutdown()


def _key(ecfg) -> dict:
    """What a record was scored with (the tasks, where their files were read, how many examples, few-shot, the
    context kept): a checkpoint is scored once per key."""
    return {"tasks": sorted(ecfg.tasks), "include_path": include_dir(ecfg), "limit": ecfg.limit,
            "num_fewshot": ecfg.num_fewshot, "max_length": ecfg.max_length}


def _same_key(recorded, key: dict) -> bool:
    """A record scored with `key`: a field the record does not hold (written before the key had it) matches any."""
    return isinstance(recorded, dict) and all(recorded.get(k, v) == v for k, v in key.items())


def append_record(run_dir: str, record: dict) -> None:
    """One line appended to <run_dir>/evals.jsonl (O_APPEND, one write: records written at once stay whole)."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(os.path.join(run_dir, EVALS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
