"""The training loop: build the run from a validated config, then step, log, evaluate, checkpoint.

The loop knows nothing of the parallel layout: it asks the layout for a model and one `TrainStep`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import signal
import time
import warnings
from dataclasses import dataclass

import torch

from hpctrain import checkpoint, distributed, job, rundir
from hpctrain.config import Plan, PrecisionName, layout_world, model_args, resolve, signal_number
from hpctrain.data import DataError, ShardStream, check_compat, choose_lanes, read_manifest
from hpctrain.metrics import MetricsLogger, memory_gb, peak_flops
from hpctrain.model import Llama, flops_per_token, num_params
from hpctrain.optim import build_optimizer, build_scheduler, scaled_lr
from hpctrain.parallelize import parallelize, uses_loss_parallel
from hpctrain.precision import setup_precision
from hpctrain.step import build_train_step, params_finite

log = logging.getLogger("hpctrain")
# The schedule advances on every step, skipped ones included (step s always has lr(s)).
warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")


class TrainingError(RuntimeError):
    """The run cannot continue; the message is one line naming the cause and the fix."""


@dataclass
class RunState:
    """Everything besides tensors a resumed run needs; stored as JSON in each checkpoint."""

    step: int = 0
    samples: int = 0  # global samples consumed: the data position
    tokens: int = 0
    skipped_nonfinite: int = 0
    skipped_overflow: int = 0
    consecutive_nonfinite: int = 0
    last_loss: float | None = None
    last_val_loss: float | None = None
    wall_time_s: float = 0.0
    data_lanes: int | None = None  # fixed for the run's life: it defines the sample order
    tokenizer_sha256: str | None = None  # the token ids the weights were trained on


@dataclass(frozen=True)
class Prepared:
    """A validated run: its plan, its data directory and sequence length."""

    plan: Plan
    data_dir: str
    seq_len: int


def prepare(cfg, world: int | None = None, local: bool = True) -> Prepared:
    """Every check a run makes before it spawns, submits or writes anything; one-line errors.

    `world`: the job's ranks (else this launch's); `local`: the run will use this machine's memory.
    """
    plan = resolve(cfg, world or distributed.launched_world() or layout_world(cfg))
    data_dir, seq_len = prepare_data(cfg, plan)
    _check_resume(cfg.train.resume)
    if local:
        _check_memory(cfg, plan, seq_len)
    return Prepared(plan, data_dir, seq_len)


def _demo_requested(cfg, path: str) -> bool:
    """The demo corpus is only ever built into its own cache directory: a mistyped data.path, or a shard set
    whose merge has not run, must fail naming it, not be replaced by the demo."""
    from data_prep.demo import default_out_dir

    return bool(cfg.data.prepare_demo) and os.path.realpath(path) == os.path.realpath(default_out_dir())


def prepare_data(cfg, plan: Plan) -> tuple[str, int]:
    """Make sure the shards exist and fit the model; return (data dir, seq_len). Runs before any spawn."""
    path = os.path.expanduser(cfg.data.path)
    if _demo_requested(cfg, path):
        from data_prep.demo import build_demo

        build_demo(path)
    manifest = read_manifest(path)
    seq_len = plan.seq_len or manifest.block_len - 1
    if seq_len > cfg.model.max_seq_len:
        raise TrainingError(
            f"the shards in {path} hold {manifest.block_len}-token blocks (seq_len {seq_len}) but "
            f"model.max_seq_len={cfg.model.max_seq_len}: raise model.max_seq_len or re-shard with SEQ_LEN"
        )
    check_compat(manifest, cfg.model.vocab_size, seq_len)
    if cfg.parallel.sequence_parallel and seq_len % plan.tp:
        raise TrainingError(f"seq_len {seq_len} (from the shards in {path}) is not divisible by parallel.tp="
                            f"{plan.tp} with sequence_parallel: set train.seq_len to a multiple of {plan.tp}")
    if plan.global_batch > manifest.num_samples("train"):
        raise DataError(f"train.global_batch={plan.global_batch} is more than the {manifest.num_samples('train')} "
                        f"samples of the train split in {path}: one step would repeat samples; lower "
                        "train.global_batch or use more data")
    # Checks the lane/dp divisibility rules and that every shard is there, before any spawn.
    ShardStream(path, "train", plan.micro_batch, cfg.train.seed, shuffle=cfg.data.shuffle,
                lanes=choose_lanes(cfg.data.lanes, plan.dp, manifest), dp_size=plan.dp,
                global_batch=plan.global_batch, on_corrupt=cfg.data.on_corrupt, prefetch=cfg.data.prefetch)
    if cfg.train.eval_every:
        if manifest.num_samples("val") < plan.micro_batch:
            raise DataError(f"evaluation needs a validation split of at least train.micro_batch={plan.micro_batch} "
                            f"samples, the shards in {path} have {manifest.num_samples('val')}: set "
                            "train.eval_every=0, or rebuild the shards with a validation split (--val-fraction, e.g. 0.01)")
        _val_stream(path, plan.micro_batch, cfg)  # every val shard is there
    return path, seq_len


def _val_stream(data_dir: str, micro_batch: int, cfg) -> ShardStream:
    return ShardStream(data_dir, "val", micro_batch, cfg.train.seed, loop=False, shuffle=False,
                       on_corrupt=cfg.data.on_corrupt)


def _check_resume(resume: str) -> None:
    # Checked once, by the main rank (which may move it aside next) of a job's first start.
    if resume in ("auto", "never") or rundir.requeued() or distributed.launched_rank() != 0:
        return
    path = os.path.expanduser(resume)
    if not os.path.isfile(os.path.join(path, checkpoint.STATE_FILE)):
        raise checkpoint.CheckpointError(
            f"train.resume={resume} is not a complete checkpoint directory (no {checkpoint.STATE_FILE}): pass "
            "a <run_dir>/checkpoints/step-NNNNNNN directory, or train.resume=auto|never")
    checkpoint.check_loadable(path)


def _available_memory() -> float | None:
    """Bytes this machine can still give (MemAvailable), or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(cfg, plan: Plan, seq_len: int) -> None:
    """Refuse a micro-batch that cannot fit. A CPU-only torch trains on the host: against this machine's
    available memory, for all its local ranks; a CUDA build trains on GPUs: against cluster.gpu_mem_gb when
    given. No CUDA call here: a process that asked CUDA anything can no longer fork its ranks. The planner's
    estimate is approximate, so only what exceeds the whole capacity is refused."""
    from hpctrain.plan import worst_stage_bytes

    if torch.backends.cuda.is_built():  # one rank per device
        cap, where, ranks = (cfg.cluster.gpu_mem_gb or 0) * 2**30, f"cluster.gpu_mem_gb={cfg.cluster.gpu_mem_gb}", 1
    else:  # every rank started here shares this machine
        cap, where = _available_memory() or 0, "this machine's available memory"
        ranks = plan.world if distributed.launched_world() is None else 1
    need = worst_stage_bytes(cfg, plan, seq_len) * ranks if cap else 0
    if need > cap:
        raise TrainingError(
            f"train.micro_batch={plan.micro_batch} (seq_len {seq_len}) needs about {need / 2**30:.1f} GiB, more "
            f"than {where} ({cap / 2**30:.1f} GiB; `python -m hpctrain plan ...` shows the parts): lower "
            "train.micro_batch (train.grad_accum keeps the global batch) or set "
            "parallel.activation_checkpointing=full")


def build_model(cfg, env: distributed.Env, mesh) -> torch.nn.Module:
    # Build on the meta device, parallelize, then allocate: each rank only materialises its shard.
    with torch.device("meta"):
        model = Llama(model_args(cfg))
    model = parallelize(model, mesh, cfg.parallel)
    model.to_empty(device=env.device)
    if mesh.size() == 1:
        torch.manual_seed(cfg.train.seed)
        model.init_weights()
        return model.train()
    # Shards drawn locally would not match the one-process weights: rank 0 draws the whole model exactly
    # as one process does (on CPU) and every rank receives its shards. Identical weights for every layout.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.reset_rope_cache()
    model.tie_weights()
    full = {}
    if env.is_main:
        with torch.device("meta"):
            ref = Llama(model_args(cfg))
        ref.to_empty(device="cpu")
        torch.manual_seed(cfg.train.seed)
        ref.init_weights()
        full = ref.state_dict()
    # Every key is broadcast; a pipeline stage keeps its own (rank 0's full dict holds the other stages' too).
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=mesh["pp"].size() == 1))
    return model.train()


def _window_record(state: RunState, result, lr: float, window: dict, tokens_per_step: int,
                   flops_tok: float, peak: float | None, world: int, device) -> dict:
    elapsed = max(window["time"], 1e-9)
    tps = window["steps"] * tokens_per_step / elapsed
    return {
        "step": state.step,
        "loss": result.loss,
        "lr": lr,
        "grad_norm": result.grad_norm,
        "tokens_per_s": tps,
        "mfu": (flops_tok * tps / (peak * world)) if peak else None,
        "data_wait_frac": window["data"] / elapsed,
        "mem_gb": memory_gb(device),
        "step_time_s": elapsed / window["steps"],
        "loss_scale": result.loss_scale,
        "skipped_nonfinite": state.skipped_nonfinite,
        "skipped_overflow": state.skipped_overflow,
    }


def train(cfg, run_dir: str, prepared: Prepared | None = None) -> dict:
    """Run (or resume) training in `run_dir`; return the result also written to result.json.

    Everything is validated first (`prepare`, unless given). A layout needing N > 1 processes, started
    outside torchrun/srun, forks its N local ranks here; each runs `_rank_main`, as every process does
    under torchrun/srun.
    """
    prepared = prepared or prepare(cfg)
    os.makedirs(run_dir, exist_ok=True)
    if distributed.launched_world() is None and prepared.plan.world > 1:
        from hpctrain import launch

        try:
            from hpctrain.errors import bad_input

            launch.spawn(prepared.plan.world, _rank_main, (cfg, run_dir, prepared),
                         threads=cfg.cluster.num_threads, quiet=(*bad_input(), KeyboardInterrupt),
                         ok_codes=(0, job.EXIT_PREEMPTED, job.EXIT_TERMINATED),
                         forward=(signal_number(cfg.cluster.signal), signal.SIGTERM))
        except launch.LaunchError as e:
            raise TrainingError(str(e)) from None
        with open(os.path.join(run_dir, "result.json")) as f:
            result = json.load(f)
        kind = {"preempted": job.PREEMPT, "terminated": job.TERMINATE}.get(result["status"])
        if kind:
            raise job.Stopped(kind, result["steps"], "SIGTERM" if kind == job.TERMINATE else
                              signal_number(cfg.cluster.signal).name)
        return result
    return _rank_main(cfg, run_dir, prepared)


def _rank_main(cfg, run_dir: str, prepared: Prepared) -> dict:
    nccl = distributed.apply_env(cfg.cluster.nccl)
    env = distributed.init(cfg.cluster.pg_timeout_s)
    try:
        # Hydra's default run dir has a timestamp: ranks started apart could disagree; rank 0 decides, also
        # where the run starts from (moving a previous run aside first when it starts over).
        shared = [run_dir, None, None]
        if env.is_main:
            rundir.start_over(run_dir, cfg)  # (done already when launched by the CLI or a submission)
            start = rundir.start_point(run_dir, cfg.train.resume)
            last = checkpoint.latest(run_dir) if start == "auto" else None
            shared[1] = job.record_attempt(run_dir, checkpoint.step_of(last) if last else 0,
                                           cfg.cluster.max_stalled_restarts, nccl)
            shared[2] = start
        if env.world > 1:
            torch.distributed.broadcast_object_list(shared, src=0)
        run_dir, stalled, start = shared
        if stalled:
            raise TrainingError(stalled)
        if env.is_main and env.device.type == "cuda":  # logged once the run dir holds only this run
            log.info("NCCL settings: %s", ", ".join(f"{k}={v}" for k, v in nccl.items()) or "none")
        return _train(cfg, run_dir, prepared, start, env)
    finally:
        distributed.shutdown()


def _train(cfg, run_dir: str, prepared: Prepared, start: str | None, env: distributed.Env) -> dict:
    t, plan, data_dir, seq_len = cfg.train, prepared.plan, prepared.data_dir, prepared.seq_len
    torch.set_flush_denormal(True)  # denormals make CPU fp32 steps ~10× slower late in training
    if cfg.cluster.num_threads:
        torch.set_num_threads(cfg.cluster.num_threads)
    mesh = distributed.build_mesh(env, plan.pp, plan.dp, plan.tp, cfg.cluster.pg_timeout_s)
    model = build_model(cfg, env, mesh)
    precision = setup_precision(cfg.precision, env.device)
    loss_par = uses_loss_parallel(mesh)
    lr = scaled_lr(cfg.optim, plan.global_batch)
    optimizer = build_optimizer(model, cfg.optim, lr)
    scheduler = build_scheduler(optimizer, cfg.optim, t.max_steps)
    train_step = build_train_step(model, optimizer, precision, cfg.optim.grad_clip, env.device, mesh, loss_par,
                                  cfg.parallel)

    state = RunState()
    resume_from, saved = None, None
    if start == "auto":
        resume_from, saved = checkpoint.load_newest(run_dir, model, optimizer) or (None, None)
    elif start:
        resume_from, saved = start, checkpoint.load(start, model, optimizer)
    if saved:
        state = _run_state(saved, resume_from)
        scheduler.load_state_dict(saved["scheduler"])
        if precision.scaler and saved.get("scaler"):
            precision.scaler.load_state_dict(saved["scaler"])
        log.info("resumed from %s at step %d (sample %d)", resume_from, state.step, state.samples)

    n_params = num_params(model)
    flops_tok = flops_per_token(model_args(cfg), seq_len)
    peak = peak_flops(env.device, PrecisionName(cfg.precision.name).value, cfg.cluster.peak_tflops)
    tokens_per_step = plan.global_batch * seq_len
    if env.is_main:
        log.info("model %s: %.2fM parameters, %.3g training FLOPs/token; layout pp×dp×tp=%d×%d×%d; "
                 "global batch %d = micro %d × accum %d × dp %d, seq_len %d; lr %.3g; %d CPU threads/rank; "
                 "run dir %s", cfg.model.name, n_params / 1e6, flops_tok, plan.pp, plan.dp, plan.tp,
                 plan.global_batch, plan.micro_batch, plan.grad_accum, plan.dp, seq_len, lr,
                 torch.get_num_threads(), run_dir)

    manifest = read_manifest(data_dir)
    if state.tokenizer_sha256 not in (None, manifest.tokenizer.sha256):
        raise TrainingError(f"the shards in {data_dir} were tokenised with a different tokenizer than this run's "
                            f"checkpoints (sha256 {manifest.tokenizer.sha256[:12]} vs "
                            f"{state.tokenizer_sha256[:12]}): point data.path at shards built with the run's "
                            "tokenizer, or start a new run_dir")
    state.tokenizer_sha256 = manifest.tokenizer.sha256
    lanes = state.data_lanes or choose_lanes(cfg.data.lanes, plan.dp, manifest)
    if cfg.data.lanes is not None and cfg.data.lanes != lanes:
        raise TrainingError(f"data.lanes={cfg.data.lanes} but this run was trained with {lanes} lanes: drop the "
                            f"override or set data.lanes={lanes} (lanes fix the sample order)")
    state.data_lanes = lanes
    pin = env.device.type == "cuda" if cfg.data.pin_memory is None else cfg.data.pin_memory
    stream = ShardStream(data_dir, "train", plan.micro_batch, t.seed, start_sample=state.samples,
                         shuffle=cfg.data.shuffle, num_workers=cfg.data.num_workers, lanes=lanes,
                         dp_rank=mesh["dp"].get_local_rank(), dp_size=plan.dp, global_batch=plan.global_batch,
                         pin_memory=pin, on_corrupt=cfg.data.on_corrupt, prefetch=cfg.data.prefetch)
    batches = _Timed(iter(stream))
    metrics = MetricsLogger(run_dir, env.is_main, t.tensorboard, t.progress, t.max_steps, state.step)

    def run_eval() -> None:
        val = _val_stream(data_dir, plan.micro_batch, cfg)
        subset = (b for _, b in zip(range(t.eval_batches), val))
        state.last_val_loss = train_step.evaluate(subset)
        metrics.log({"step": state.step, "val_loss": state.last_val_loss,
                     "val_ppl": math.exp(min(state.last_val_loss, 50.0))})

    def save() -> None:
        if not params_finite(model):  # never a checkpoint that resuming would train on from NaN
            raise TrainingError(
                f"the parameters are not finite after step {state.step}; no checkpoint written (the last good one: "
                f"{checkpoint.latest(run_dir) or 'none'}): lower optim.lr or raise optim.warmup_steps, then "
                "resume from it with train.resume=PATH")
        state.wall_time_s += time.time() - started_at[0]
        started_at[0] = time.time()
        saved = {"run": vars(state), "scheduler": scheduler.state_dict(),
                 "scaler": precision.scaler.state_dict() if precision.scaler else None}
        checkpoint.save(run_dir, state.step, model, optimizer, saved, t.ckpt_keep)

    first_step = state.step + 1  # always logged: the loss curve's starting point
    started_at = [time.time()]
    status, error = "running", None
    signals = job.StopSignals(cfg.cluster.signal)
    stop = 0
    window = {"steps": 0, "time": 0.0, "data": 0.0}
    redirect = contextlib.nullcontext()
    if metrics.bar is not None:
        from tqdm.contrib.logging import logging_redirect_tqdm

        redirect = logging_redirect_tqdm()
    try:
        with redirect:
            while state.step < t.max_steps:
                t0 = time.perf_counter()
                # Micro-batches are pulled one at a time as the step consumes them: memory stays one
                # micro-batch whatever the accumulation.
                result = train_step(itertools.islice(batches, plan.grad_accum), tokens_per_step)
                scheduler.step()
                state.step += 1
                state.samples += plan.global_batch
                state.tokens += tokens_per_step
                window["steps"] += 1
                window["data"] += batches.take_wait()
                window["time"] += time.perf_counter() - t0
                if result.status == "ok":
                    state.consecutive_nonfinite = 0
                    state.last_loss = result.loss
                elif result.status == "overflow":
                    state.skipped_overflow += 1
                    log.warning("step %d: fp16 gradients overflowed; step skipped, loss scale now %g",
                                state.step, result.loss_scale)
                else:
                    state.skipped_nonfinite += 1
                    state.consecutive_nonfinite += 1
                    log.warning("step %d: non-finite loss %s / grad norm %s; step skipped (%d in a row)",
                                state.step, result.loss, result.grad_norm, state.consecutive_nonfinite)
                    if state.consecutive_nonfinite >= t.max_nonfinite:
                        raise TrainingError(
                            f"{state.consecutive_nonfinite} consecutive non-finite steps (last at step "
                            f"{state.step}): lower optim.lr, raise optim.warmup_steps or use precision=bf16; "
                            f"resume from the last checkpoint"
                        )
                metrics.advance(loss=result.loss)
                if state.step % t.log_every == 0 or state.step in (first_step, t.max_steps):
                    record = _window_record(state, result, scheduler.get_last_lr()[0], window,
                                            tokens_per_step, flops_tok, peak, env.world, env.device)
                    record["data_corrupt_shards"] = _corrupt_total(stream, mesh)
                    metrics.log(record)
                    window = {"steps": 0, "time": 0.0, "data": 0.0}
                stop = signals.agreed()  # every rank stops after the same step
                # The step's checkpoint first: an evaluation that fails must not cost finished steps.
                checkpointed = stop or (t.ckpt_every and state.step % t.ckpt_every == 0) or state.step == t.max_steps
                if checkpointed:
                    save()
                if stop:
                    break
                if t.eval_every and (state.step % t.eval_every == 0 or state.step == t.max_steps):
                    try:
                        run_eval()
                    except DataError:  # (every rank evaluates the same batches: all of them are here)
                        if not checkpointed:
                            save()
                        raise
        status = "completed" if not stop else "preempted" if stop == job.PREEMPT else "terminated"
    except BaseException as e:
        status, error = ("interrupted" if isinstance(e, KeyboardInterrupt) else "failed"), str(e)
        raise
    finally:
        signals.restore()
        metrics.close()
        state.wall_time_s += time.time() - started_at[0]
        result_doc = {
            "status": status,
            "error": error,
            "final_loss": state.last_loss,
            "final_val_loss": state.last_val_loss,
            "steps": state.step,
            "tokens": state.tokens,
            "samples": state.samples,
            "skipped_nonfinite": state.skipped_nonfinite,
            "skipped_overflow": state.skipped_overflow,
            "data_corrupt_shards": stream.corrupt_shards,
            "wall_time_s": state.wall_time_s,
            "params": n_params,
            "world": env.world,
        }
        if env.is_main:
            _write_json(os.path.join(run_dir, "result.json"), result_doc)
    if stop:
        log.warning("stopped by %s after step %d; checkpoint written", signals.name(stop), state.step)
        if stop == job.PREEMPT and env.is_main:
            signals.requeue()
        raise job.Stopped(stop, state.step, signals.name(stop))
    return result_doc


def _corrupt_total(stream: ShardStream, mesh) -> int:
    """Shards skipped as corrupt on all data-parallel ranks (collective over dp)."""
    n = torch.tensor([stream.corrupt_shards], dtype=torch.int64)
    if mesh["dp"].size() > 1:
        torch.distributed.all_reduce(n, group=mesh["dp"].get_group())
    return int(n.item())


def _write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


class _Timed:
    """An iterator that adds up the time spent waiting in `next` (the loop's data wait)."""

    def __init__(self, it):
        self.it, self.wait = it, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.wait += time.perf_counter() - t0

    def take_wait(self) -> float:
        wait, self.wait = self.wait, 0.0
        return wait


def _run_state(saved: dict, path: str) -> RunState:
    """The run's state from a checkpoint's trainer_state.json (JSON, but maybe not hpctrain's)."""
    try:
        if not isinstance(saved["scheduler"], dict):
            raise TypeError("scheduler is not an object")
        return RunState(**saved["run"])
    except (KeyError, TypeError) as e:
        raise checkpoint.cannot_load(path, f"{checkpoint.STATE_FILE} is not an hpctrain trainer state: "
                                           f"{type(e).__name__}: {e}") from None
