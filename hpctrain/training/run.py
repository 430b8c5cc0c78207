"""Starting a run: every check before anything is spawned or written (`prepare`), the local ranks forked when
the layout needs several processes (`train`), and each rank's set-up around the Trainer (`_rank_main`)."""

from __future__ import annotations

import glob
import logging
import os
import signal
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from hpctrain.core.config import signal_number
from hpctrain.core.errors import BAD_INPUT, CheckpointError, TrainingError
from hpctrain.core.files import RESULT_FILE, RUNNING, free_bytes, nearest_dir, read_json, write_json
from hpctrain.core.host import memory_headroom
from hpctrain.data.loader import DataError, ShardStream, check_compat, choose_lanes, read_manifest
from hpctrain.models import init_source
from hpctrain.monitoring.hang import HANG_DIR, apply_flight_recorder
from hpctrain.monitoring.monitor import check_monitor
from hpctrain.monitoring.prometheus import check_prometheus
from hpctrain.monitoring.trackers import check_trackers
from hpctrain.parallel import process_group
from hpctrain.parallel.layout import world_of
from hpctrain.runs import rundir
from hpctrain.runs.compose import typed
from hpctrain.runs.resolve import RunShape, check_cp_seq_len, resolve
from hpctrain.runtime import job
from hpctrain.storage import checkpoint
from hpctrain.training import downstream, eval_jobs
from hpctrain.training.feed import ValSplit, check_bound, check_mixture
from hpctrain.training.save_resume import check_trainer_state
from hpctrain.training.trainer import Trainer

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class Prepared:
    """A validated run: its shape (layout and batch split), its data directory and sequence length, and the
    planner's memory estimate for a device of each pipeline stage (bytes)."""

    shape: RunShape
    data_dir: str
    seq_len: int
    planned: tuple[float, ...]
    checkpoint: float = 0.0  # a checkpoint's bytes on disk (0: the run writes none)


def prepare(cfg, world: int | None = None, local: bool = True, per_node: int | None = None,
            run_dir: str | None = None) -> Prepared:
    """Every check a run makes before it spawns, submits or writes anything; one-line errors.

    `world`: the job's ranks (else this launch's); `local`: the run will use this machine's memory, else (submitting)
    its nodes' requested memory for `per_node` ranks each; `run_dir`: where it runs (a run that resumes there does
    not read model.init_from: a fine-tune whose source checkpoint has been rotated away since still resumes).
    """
    world = world or process_group.launched_world() or world_of(cfg.parallel, process_group.local_device_count())
    shape = resolve(cfg, world)
    check_monitor(cfg.monitor, cfg.train.checkpointing)
    check_trackers(cfg.logging, local)
    check_prometheus(cfg.monitor, local)
    data_dir, seq_len = prepare_data(cfg, shape)
    _check_resume(cfg)
    if not rundir.resumes(run_dir, cfg.train.resume):
        _check_init_from(cfg, data_dir, run_dir)
    downstream.check(cfg.eval, shape.layout, data_dir, seq_len, cfg.model.max_seq_len)
    eval_jobs.check(cfg.eval, cfg.train, cfg.train.checkpointing, cfg.cluster, cfg.parallel)
    from hpctrain.training.planner import disk_bytes, stage_bytes

    stages = stage_bytes(cfg, shape, seq_len)
    planned = tuple(device for device, _ in stages)
    node = NodeMemory.here(shape.world) if local else NodeMemory.requested(cfg.cluster, per_node) if per_node else None
    if node is not None:
        _check_memory(cfg, shape, seq_len, stages, node)
    return Prepared(shape, data_dir, seq_len, planned, disk_bytes(cfg, shape))


def check_checkpoint_space(needs: list[float], run_dir: str, keep: int, resume: str = "auto") -> None:
    """Refuse runs whose first checkpoints cannot fit in what `run_dir`'s filesystem has free (`needs`: a checkpoint's
    bytes for each run writing there: one, or a sweep's points): found before the queue wait and the hours before the
    first save, not by them. A warning where the train.ckpt_keep checkpoints each keeps, and the one being written
    beside them, may not fit. A run directory that does not exist on a filesystem of its own here (its nearest
    existing directory is /: a node-local path seen from a login node) is not checked."""
    need, free = sum(needs), free_space(checkpoint.root(run_dir)) if any(needs) else None
    if free is None:
        return
    where = f"free on the filesystem of {run_dir} ({_size(free)})"
    if need > free:
        what = f"a checkpoint of this run is about {_size(need)}" if len(needs) == 1 else (
            f"the first checkpoints of the sweep's {len(needs)} points are about {_size(need)}")
        raise TrainingError(f"{what} (fp32 weights and optimizer state), more than is {where}: free space there, "
                            "choose a run_dir on a larger filesystem, or train.checkpointing=false")
    kept = 0 if resume == "never" or len(needs) > 1 else len(checkpoint.complete_checkpoints(run_dir))
    more = max(1, keep + 1 - kept) * need
    if more > free and process_group.launched_rank() == 0:
        log.warning("train.ckpt_keep=%d: the checkpoints still to be written (%s) may not fit in what is %s; a save "
                    "that finds the disk full stops the run", keep, _size(more), where)


def free_space(path: str) -> float | None:
    """What the filesystem of `path` has free (core.files.free_bytes), with the partial checkpoints a killed save
    left counted as free (the next save removes them first); None where there is no telling (above)."""
    free = free_bytes(path)
    if free is None or (not os.path.exists(path) and nearest_dir(path) == "/"):
        return None
    for partial in glob.glob(os.path.join(path, ".tmp-step-*")):
        for top, _, files in os.walk(partial):
            free += sum(os.lstat(os.path.join(top, f)).st_size for f in files)
    return free


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _demo_requested(cfg, path: str) -> bool:
    """The demo corpus is only ever built into its own cache directory: a mistyped data.path, or a shard set
    whose merge has not run, must fail naming it, not be replaced by the demo."""
    from data_prep.demo import default_out_dir

    return bool(cfg.data.prepare_demo) and os.path.realpath(path) == os.path.realpath(default_out_dir())


def prepare_data(cfg, shape: RunShape) -> tuple[str, int]:
    """Make sure the shards exist and fit the model; return (data dir, seq_len). Runs before any spawn."""
    path = os.path.expanduser(cfg.data.path)
    if _demo_requested(cfg, path):
        from data_prep.demo import build_demo

        build_demo(path)
    manifest = read_manifest(path)
    seq_len = shape.seq_len or manifest.seq_len
    if seq_len > cfg.model.max_seq_len:
        raise TrainingError(
            f"the shards in {path} hold {manifest.block_len}-token blocks (seq_len {seq_len}) but "
            f"model.max_seq_len={cfg.model.max_seq_len}: raise model.max_seq_len or re-shard with SEQ_LEN"
        )
    init = init_source(cfg.model)
    if init and init[0] and manifest.vocab_size > cfg.model.vocab_size:  # the vocabulary is the model's
        raise DataError(f"the shards in {path} were made with a {manifest.vocab_size}-token tokenizer but "
                        f"model.init_from={cfg.model.init_from} has a {cfg.model.vocab_size}-token vocabulary: build "
                        f"the shards with its tokenizer (hpctrain prep shards --tokenizer {init[1]} ...)")
    check_compat(manifest, cfg.model.vocab_size, seq_len)
    if cfg.parallel.sequence_parallel and seq_len % shape.tp:
        raise TrainingError(f"seq_len {seq_len} (from the shards in {path}) is not divisible by parallel.tp="
                            f"{shape.tp} with sequence_parallel: set train.seq_len to a multiple of {shape.tp}")
    check_cp_seq_len(seq_len, shape.layout, cfg.parallel.sequence_parallel, f"seq_len (from the shards in {path})")
    if cfg.data.sources:  # a mixture: data.path gives only the tokenizer and the validation split
        check_mixture(cfg.data, shape, cfg.train, path, manifest)
    elif shape.global_batch > manifest.num_samples("train"):
        raise DataError(f"train.global_batch={shape.global_batch} is more than the {manifest.num_samples('train')} "
                        f"samples of the train split in {path}: one step would repeat samples; lower "
                        "train.global_batch or use more data")
    else:  # checks the lane/dp divisibility rules and that every shard is there, before any spawn
        ShardStream(path, "train", shape.micro_batch, cfg.train.seed, shuffle=cfg.data.shuffle,
                    lanes=choose_lanes(cfg.data.lanes, shape.dp, manifest), dp_size=shape.dp,
                    global_batch=shape.global_batch, on_corrupt=cfg.data.on_corrupt, prefetch=cfg.data.prefetch)
    if cfg.train.eval_every:
        need = shape.micro_batch * shape.dp
        if manifest.num_samples("val") < need:
            raise DataError(f"evaluation needs a validation split of at least train.micro_batch x dp = {need} "
                            f"samples, the shards in {path} have {manifest.num_samples('val')}: set "
                            "train.eval_every=0, or rebuild the shards with a validation split (--val-fraction, e.g. 0.01)")
        ValSplit.of(path, shape, cfg.data, cfg.train).stream()  # every val shard is there
    return path, seq_len


def _check_resume(cfg) -> None:
    """train.resume=PATH: a checkpoint of this model whose trainer state holds (a directory a run continues in is
    checked by `start`, on its main rank). Checked once, by the main rank (which may move it aside next) of a
    job's first start."""
    resume = cfg.train.resume
    if resume in ("auto", "never") or rundir.requeued() or process_group.launched_rank() != 0:
        return
    path = os.path.expanduser(resume)
    if not os.path.isfile(os.path.join(path, checkpoint.STATE_FILE)):
        raise CheckpointError(
            f"train.resume={resume} is not a complete checkpoint directory (no {checkpoint.STATE_FILE}): pass "
            "a <run_dir>/checkpoints/step-NNNNNNN directory, or train.resume=auto|never")
    saved = checkpoint.check_loadable(path)
    check_trainer_state(path, saved)
    checkpoint.check_model(path, _weights(cfg))
    step = saved["run"].get("step")
    if isinstance(step, int) and step >= cfg.train.max_steps:  # (the run would end at once, with no checkpoint)
        raise CheckpointError(f"train.resume={resume} is at step {step}, train.max_steps={cfg.train.max_steps}: "
                              "nothing would be trained: raise train.max_steps above it")


def _weights(cfg) -> dict:
    from hpctrain.models import spec_of

    spec = spec_of(cfg.model)
    return spec.weights(spec.args(cfg.model))


def _check_init_from(cfg, data_dir: str, run_dir: str | None) -> None:
    from hpctrain.models import HF_PREFIX
    from hpctrain.training.model_init import check_init_from

    init, model = init_source(cfg.model), cfg.model
    where = init and run_dir and rundir.moved(init[1], run_dir)
    if where and where != os.path.realpath(init[1]):
        # set aside with the run it belonged to (a start-over, by the submission or by rank 0): read there
        model = OmegaConf.merge(cfg.model, {"init_from": (HF_PREFIX if init[0] else "") + where})
    try:
        tokenizer = read_manifest(data_dir).tokenizer
        check_init_from(model, tokenizer.sha256, os.path.join(data_dir, tokenizer.path))
    except (ValueError, OSError) as e:  # config.json unreadable or not this model
        raise TrainingError(f"model.init_from={cfg.model.init_from}: {e}") from None
    except CheckpointError as e:
        fix = e.fix or "name a <run_dir>/checkpoints/step-N directory, or hf:/path for a transformers model"
        raise TrainingError(f"model.init_from={cfg.model.init_from}: {e.reason}: {fix}") from None


@dataclass(frozen=True)
class NodeMemory:
    """What a node gives the run's ranks on it: how many share it, the bytes they may hold together (None: unknown)
    and what bounds them, and whether each trains on a GPU (its device memory apart from the node's)."""

    ranks: int
    cap: float | None
    where: str
    gpus: bool

    @classmethod
    def here(cls, world: int) -> NodeMemory:
        """This machine: the local ranks forked here, or the launcher's ranks on this node (torchrun's, the srun
        step's), each checking for all of them: they check before the process group starts, so before any holds
        its model. They train on GPUs with a CUDA build and a GPU driver, else on the host."""
        cap, where = memory_headroom()
        ranks = world if process_group.launched_world() is None else process_group.launched_local_world() or 1
        return cls(ranks, cap, where, _trains_on_gpus())

    @classmethod
    def requested(cls, cluster, per_node: int) -> NodeMemory:
        """A node of the job about to be submitted: cluster.mem_gb (sbatch --mem, per node) for its tasks."""
        gib = cluster.mem_gb
        return cls(per_node, gib * 2**30 if gib else None, f"cluster.mem_gb={gib}, a node's --mem",
                   bool(cluster.gpus_per_node))


# A GPU driver's device files: NVIDIA's, ROCm's, WSL's. (The default pip wheel of torch is a CUDA build, also on
# nodes without a GPU, where it trains on the CPU.)
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def _trains_on_gpus() -> bool:
    """Whether this machine's ranks will train on GPUs, asked without a CUDA call (a process that made one can no
    longer fork its ranks): a CUDA (or ROCm) build of torch and a GPU driver's device file."""
    return torch.backends.cuda.is_built() and any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def _check_memory(cfg, shape: RunShape, seq_len: int, stages: list[tuple[float, float]], node: NodeMemory) -> None:
    """Refuse a micro-batch that cannot fit: on a GPU against cluster.gpu_mem_gb when given; on the host, what all the
    node's ranks hold there (on a CPU their devices; train.ckpt_async's copies either way) against the node's memory.
    No CUDA call here: a process that asked CUDA anything can no longer fork its ranks. The planner's estimate
    (`stages`: a device's bytes and a rank's host memory besides, per pipeline stage) is approximate, so only what
    exceeds the whole capacity is refused."""
    from hpctrain.training.planner import node_bytes

    gib, worst = cfg.cluster.gpu_mem_gb, max(device for device, _ in stages)
    if node.gpus and gib and worst > gib * 2**30:  # one rank per device
        _refuse_micro_batch(cfg, shape, seq_len, f"{worst / 2**30:.1f} GiB", f"cluster.gpu_mem_gb={gib}", gib, "")
    need, ranks, unequal = node_bytes(stages, node.gpus, shape.world, node.ranks)
    if node.cap is None or need <= node.cap:  # (an unknown capacity refuses nothing)
        return
    each = " on average" if unequal else ""
    need_text = f"{need / 2**30:.1f} GiB" + (f" ({ranks} ranks × {need / ranks / 2**30:.1f} GiB{each})" if ranks > 1
                                             else "")
    if node.gpus:
        raise TrainingError(
            f"train.ckpt_async=true keeps a host copy of each rank's checkpoint shard: a node's ranks need about "
            f"{need_text} of host memory, more than {node.where} ({node.cap / 2**30:.1f} GiB): "
            "train.ckpt_async=false, more host memory per node (cluster.mem_gb), or fewer ranks per node")
    host = max(host for _, host in stages)
    hint = f", or train.ckpt_async=false (its host copy: {host / 2**30:.1f} GiB per rank)" if host else ""
    _refuse_micro_batch(cfg, shape, seq_len, need_text, node.where, node.cap / 2**30, hint)


def _refuse_micro_batch(cfg, shape: RunShape, seq_len: int, need: str, where: str, cap_gib: float, hint: str):
    from hpctrain.training.planner import largest_part

    what, size, fix = largest_part(cfg, shape, seq_len)
    raise TrainingError(
        f"train.micro_batch={shape.micro_batch} (seq_len {seq_len}) needs about {need}, more than {where} "
        f"({cap_gib:.1f} GiB; `python -m hpctrain plan ...` shows the parts); the largest part is {what}, "
        f"{size / 2**30:.1f} GiB per device: {fix}{hint}")


def train(cfg, run_dir: str, prepared: Prepared | None = None) -> dict:
    """Run (or resume) training in `run_dir`; return the result also written to result.json.

    Everything is validated first (`prepare`, unless given). A layout needing N > 1 processes, started
    outside torchrun/srun, forks its N local ranks here; each runs `_rank_main`, as every process does
    under torchrun/srun.
    """
    if prepared is None:  # (the command line prepares, and checks, before it claims the run directory)
        prepared = prepare(cfg, run_dir=run_dir)
        check_checkpoint_space([prepared.checkpoint], run_dir, cfg.train.ckpt_keep, cfg.train.resume)
    cfg = typed(cfg)  # from here on, each component is built from its group's dataclass
    with rundir.claimed(run_dir):  # (the main rank; re-entered when the CLI holds it already)
        os.makedirs(run_dir, exist_ok=True)
        if process_group.launched_world() is None:  # the ranks forked here start as decided here, before the fork
            start(cfg, run_dir, prepared.shape.dp)
        return _launch(cfg, run_dir, prepared)


def start(cfg, run_dir: str, dp: int | None = None) -> str | None:
    """The main rank's decisions before a run begins (before its config is recorded or a rank forked): a previous
    run moved aside when it starts over, then where it starts ("auto", a checkpoint, None). Refused (one line) when
    it would continue over checkpoint directories that are not its own, or from the checkpoints of another model
    (the newest's entries against this model's; a damaged one is left to the fallback of `load_newest`)."""
    rundir.start_over(run_dir, cfg)  # (a no-op once done)
    begin = rundir.start_point(run_dir, cfg.train.resume)
    if begin == "auto":
        checkpoint.check_no_strays(run_dir)
        newest = checkpoint.latest(run_dir)
        try:
            if newest:
                checkpoint.check_model(newest, _weights(cfg))
                run = checkpoint.check_loadable(newest).get("run")
                if isinstance(run, dict):
                    check_bound(run, cfg.data, cfg.train.seed, os.path.expanduser(cfg.data.path), dp=dp)
        except CheckpointError as e:
            if e.fix:
                raise
    return begin


def _mark_running(run_dir: str) -> None:
    """An earlier attempt's result no longer says how the run stands (a finished run continued, then killed, read
    "completed" in summary and the report until this attempt wrote its own): `running` from here. After
    `job.record_attempt`, which reads whether the previous attempt stopped cleanly from it."""
    if os.path.exists(os.path.join(run_dir, RESULT_FILE)):
        write_json(os.path.join(run_dir, RESULT_FILE), {"status": RUNNING})


def _launch(cfg, run_dir: str, prepared: Prepared) -> dict:
    if process_group.launched_world() is None and prepared.shape.world > 1:
        from hpctrain.runtime import spawn

        try:
            spawn.spawn(prepared.shape.world, _rank_main, (cfg, run_dir, prepared),
                        threads=cfg.cluster.num_threads, quiet=(*BAD_INPUT, KeyboardInterrupt),
                        ok_codes=(0, job.EXIT_PREEMPTED, job.EXIT_TERMINATED),
                        forward=(signal_number(cfg.cluster.signal), signal.SIGTERM))
        except spawn.LaunchError as e:
            raise TrainingError(str(e)) from None
        result = read_json(os.path.join(run_dir, RESULT_FILE))
        kind = {stop.status.value: stop for stop in job.Stop if stop}.get(result["status"])
        if kind:
            by = {job.Stop.TERMINATE: "SIGTERM", job.Stop.ALERT: f"alert {result.get('stopped_by')}"}
            raise job.Stopped(kind, result["steps"], by.get(kind, signal_number(cfg.cluster.signal).name))
        return result
    return _rank_main(cfg, run_dir, prepared)


def _rank_main(cfg, run_dir: str, prepared: Prepared) -> dict:
    nccl = process_group.apply_env(cfg.cluster.nccl)
    if torch.cuda.is_available():  # NCCL's flight recorder, dumped into <run_dir>/hang/ on a collective timeout
        nccl.update(apply_flight_recorder(run_dir))
    env = process_group.init(cfg.cluster.pg_timeout_s)
    try:
        # Hydra's default run dir has a timestamp: ranks started apart could disagree; rank 0 decides, also
        # where the run starts from (moving a previous run aside first when it starts over).
        shared = [run_dir, None, None]
        if env.is_main:
            try:
                begin = start(cfg, run_dir, prepared.shape.dp)  # (done already when this process forked the ranks)
                last = checkpoint.latest(run_dir) if begin == "auto" else None
                shared[1] = job.record_attempt(run_dir, checkpoint.step_of(last) if last else 0,
                                               cfg.cluster.max_stalled_restarts, nccl)
                _mark_running(run_dir)
                shared[2] = begin
            except BAD_INPUT as e:  # refused on every rank, not on this one alone
                shared[1] = str(e)
            except Exception as e:  # a rename or write failing (a full disk): no rank left waiting in the broadcast
                if env.world == 1:
                    raise
                shared[1] = f"the main rank failed before training: {type(e).__name__}: {e}"
        if env.world > 1:
            torch.distributed.broadcast_object_list(shared, src=0)
        run_dir, refused, begin = shared
        if refused:
            raise TrainingError(refused)
        if env.device.type == "cuda":  # where the flight recorder dumps (after a previous run moved aside)
            os.makedirs(os.path.join(run_dir, HANG_DIR), exist_ok=True)
        if env.is_main and env.device.type == "cuda":  # logged once the run dir holds only this run
            log.info("NCCL settings: %s", ", ".join(f"{k}={v}" for k, v in nccl.items()) or "none")
        return Trainer(cfg, run_dir, prepared, env, begin).fit()
    finally:
        process_group.shutdown()
