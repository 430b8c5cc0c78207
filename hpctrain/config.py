"""Typed config schema (Hydra structured configs) and the semantic checks run before anything starts.

The schema makes Hydra reject unknown keys and wrong types with its own message; `resolve()` checks
what types cannot (batch arithmetic, lengths, divisibility) and raises `ConfigError` with one line
that names the numbers and the fix.
"""

from __future__ import annotations

import difflib
import math
import os
import signal
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from hpctrain.model import ModelArgs


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the numbers and the fix."""


class PrecisionName(str, Enum):
    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"
    fp16 = "fp16"


class OptimName(str, Enum):
    adamw = "adamw"
    adafactor = "adafactor"
    sgd = "sgd"


class LrScaling(str, Enum):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class Decay(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class OnCorrupt(str, Enum):
    error = "error"
    skip = "skip"


class ActCkpt(str, Enum):
    none = "none"
    full = "full"
    selective = "selective"


@dataclass
class ModelConfig(ModelArgs):
    name: str = "custom"


@dataclass
class ParallelConfig:
    name: str = "single"
    dp: Any = 1  # int, or "auto" = world / (tp * pp)
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_virtual_stages: int = 1
    zero_stage: int = 0
    activation_checkpointing: ActCkpt = ActCkpt.none
    ac_every: int = 1  # selective: checkpoint every N-th block
    compile: bool = False
    cpu_offload: bool = False


@dataclass
class PrecisionConfig:
    name: PrecisionName = PrecisionName.fp32
    loss_scale_init: float = 65536.0  # fp16 only
    loss_scale_growth_interval: int = 2000


@dataclass
class OptimConfig:
    name: OptimName = OptimName.adamw
    lr: float = 3e-4
    weight_decay: float = 0.1  # decoupled; never applied to norms or biases
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # sgd
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    warmup_steps: int = 100
    decay: Decay = Decay.cosine
    decay_steps: int | None = None  # None: until train.max_steps
    min_lr_ratio: float = 0.1
    lr_scaling: LrScaling = LrScaling.none
    ref_global_batch: int = 256  # global batch (samples) at which `lr` was tuned


@dataclass
class DataConfig:
    name: str = "custom"
    path: str = MISSING  # directory with manifest.json and the tar shards
    num_workers: int = 0
    shuffle: bool = True
    # Data lanes fix the sample order (elastic over any dp dividing it); None: min(8, shards) rounded
    # to a multiple of dp. Saved in checkpoints and kept on resume.
    lanes: int | None = None
    pin_memory: bool | None = None  # None: when training on CUDA
    prefetch: int = 2  # shard reads in flight per loader worker
    on_corrupt: OnCorrupt = OnCorrupt.error  # error | skip (replace an unreadable shard, warn, count in metrics)
    prepare_demo: bool = False  # build the stdlib demo shards when `path` is the demo cache and has none


@dataclass
class TrainConfig:
    global_batch: int | None = None  # samples per optimizer step, all ranks
    micro_batch: int | None = None  # samples per forward/backward per data-parallel rank
    grad_accum: int | None = None
    seq_len: int | None = None  # None: from the shard manifest (block_len - 1)
    max_steps: int = 200
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 100  # 0 disables
    eval_batches: int = 8
    ckpt_every: int = 100  # 0: only at the end
    ckpt_keep: int = 2
    resume: str = "auto"  # auto | never | path of a checkpoint directory
    max_nonfinite: int = 5  # consecutive skipped non-finite steps before the run stops
    progress: bool | None = None  # progress bar; None: only on a terminal
    tensorboard: bool = True


def _nccl_defaults() -> dict[str, str | None]:
    # Exported before the process group starts (None: leave the environment as it is). IB_TIMEOUT 22
    # (~17 s per retry) rides out fabric hiccups that the default 18 (~1 s) turns into hard failures.
    return {"NCCL_IB_TIMEOUT": "22", "NCCL_IB_HCA": None, "NCCL_SOCKET_IFNAME": None,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": None}


@dataclass
class ClusterConfig:
    gpus_per_node: int = 0
    tasks_per_node: int = 1  # ranks per node without GPUs (with GPUs: one rank per GPU)
    nodes: int | None = None  # None: dp·tp·pp / ranks per node; required with parallel.dp=auto
    cpus_per_task: int | None = None
    num_threads: int | None = None  # torch intra-op threads per rank; None: torch's default (local ranks: cores/N)
    pg_timeout_s: float = 600.0  # every process group, sub-groups included: a dead or stalled rank fails the rest
    mem_gb: int | None = None
    time_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    sbatch_extra: dict[str, Any] = field(default_factory=dict)  # more #SBATCH options: +cluster.sbatch_extra.exclusive=true
    signal: str = "USR2"  # preemption/time-limit warning; not USR1, which NCCL claims
    signal_lead_s: int = 120  # seconds before the time limit (Slurm may send it up to 60 s earlier)
    max_timeouts: int = 10  # requeues after hitting the time limit (submitit's max_num_timeout)
    max_stalled_restarts: int = 3  # requeues in a row that reach no new checkpoint before the run gives up
    wait: bool = False  # hydra/launcher=slurm|local single run: block until the job ends
    nccl: dict[str, str | None] = field(default_factory=_nccl_defaults)
    peak_tflops: float | None = None  # per device; for MFU where the device is not in the table
    gpu_mem_gb: float | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run_dir: str = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"


def register() -> None:
    """Make the schema and the `${demo_data_dir:}` resolver known to Hydra (idempotent)."""
    from data_prep.demo import default_out_dir

    ConfigStore.instance().store(name="base_config", node=Config)
    if not OmegaConf.has_resolver("demo_data_dir"):
        OmegaConf.register_new_resolver("demo_data_dir", default_out_dir)
    if not OmegaConf.has_resolver("hpctrain_slurm"):
        from hpctrain.launcher import resolver

        OmegaConf.register_new_resolver("hpctrain_slurm", resolver)


def conf_dir() -> str:
    """The config groups: `conf/` beside the package in a checkout (an editable install), or the copy a wheel
    installs inside it (`hpctrain/conf/`)."""
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "conf")
    return installed if os.path.isdir(installed) else os.path.abspath(os.path.join(here, os.pardir, "conf"))


def compose(overrides: list[str]):
    """The config a run with these overrides gets, composed as `python -m hpctrain` does (no run directory)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def signal_number(name: str) -> signal.Signals:
    """`cluster.signal` (USR2, SIGUSR2, usr2) as a signal."""
    try:
        return signal.Signals["SIG" + str(name).upper().removeprefix("SIG")]
    except KeyError:
        raise ConfigError(f"cluster.signal={name!r} is not a signal name: use e.g. USR2") from None


def model_args(cfg) -> ModelArgs:
    return ModelArgs(**{f.name: cfg.model[f.name] for f in fields(ModelArgs)})


@dataclass(frozen=True)
class Plan:
    """The numbers a run is built from, after derivation and checks."""

    world: int
    dp: int
    tp: int
    pp: int
    global_batch: int
    micro_batch: int
    grad_accum: int
    seq_len: int | None  # None until the data manifest is known


def _batch(global_batch, micro_batch, grad_accum, dp) -> tuple[int, int, int]:
    fix = "set two of train.global_batch / train.micro_batch / train.grad_accum and let the third be derived"
    for name, v in (("global_batch", global_batch), ("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        if v is not None and v < 1:
            raise ConfigError(f"train.{name}={v} must be >= 1")
    if micro_batch is None and grad_accum is None:
        grad_accum = 1
    if global_batch is None:
        if micro_batch is None:
            raise ConfigError(f"train.global_batch and train.micro_batch are both unset: {fix}")
        return micro_batch * (grad_accum or 1) * dp, micro_batch, grad_accum or 1
    if micro_batch is None:
        if global_batch % (grad_accum * dp):
            raise ConfigError(
                f"train.global_batch={global_batch} is not divisible by grad_accum×dp={grad_accum}×{dp}: "
                f"choose a global_batch that is a multiple of {grad_accum * dp}"
            )
        return global_batch, global_batch // (grad_accum * dp), grad_accum
    if grad_accum is None:
        if global_batch % (micro_batch * dp):
            raise ConfigError(
                f"train.global_batch={global_batch} is not divisible by micro_batch×dp={micro_batch}×{dp}: "
                f"choose a global_batch that is a multiple of {micro_batch * dp}, or another micro_batch"
            )
        return global_batch, micro_batch, global_batch // (micro_batch * dp)
    if micro_batch * grad_accum * dp != global_batch:
        raise ConfigError(
            f"train.global_batch={global_batch} != micro_batch×grad_accum×dp={micro_batch}×{grad_accum}×{dp}"
            f"={micro_batch * grad_accum * dp}: {fix}"
        )
    return global_batch, micro_batch, grad_accum


def layout_world(cfg) -> int:
    """Processes a layout needs when started alone: dp·tp·pp, with dp=auto filling this node's GPUs (or 1)."""
    p = cfg.parallel
    if p.dp == "auto":
        import torch

        per_node = torch.cuda.device_count() if torch.cuda.is_available() else 1
        return max(1, per_node // (p.tp * p.pp)) * p.tp * p.pp if p.tp >= 1 and p.pp >= 1 else 1
    try:
        return int(p.dp) * p.tp * p.pp
    except ValueError:
        return 1  # resolve() names the bad value


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
_PP_INTERLEAVED = ("interleaved_1f1b", "zero_bubble")


def _check_pipeline(m, p) -> int:
    """Pipeline rules (schedule, stages, microbatches); return the pipeline microbatch count."""
    pp, v, sched = p.pp, p.pp_virtual_stages, p.pp_schedule
    if sched not in PP_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={sched!r} is not one of {', '.join(PP_SCHEDULES)}")
    n_mb = p.pp_microbatches if p.pp_microbatches is not None else pp
    if pp == 1:
        return n_mb
    if sched in _PP_INTERLEAVED and v < 2:
        raise ConfigError(f"parallel.pp_schedule={sched} needs parallel.pp_virtual_stages >= 2 (got {v}): "
                          "raise it or use pp_schedule=1f1b")
    if sched not in _PP_INTERLEAVED and v != 1:
        raise ConfigError(f"parallel.pp_schedule={sched} runs one stage per rank: parallel.pp_virtual_stages={v} "
                          "must be 1, or use pp_schedule=interleaved_1f1b")
    if m.n_layers % (pp * v):
        raise ConfigError(f"model.n_layers={m.n_layers} is not divisible by parallel.pp×pp_virtual_stages={pp}×{v}"
                          f"={pp * v} pipeline stages: choose pp and virtual stages that divide the layers")
    if m.tie_embeddings:
        raise ConfigError(f"model.tie_embeddings=true with parallel.pp={pp}: embedding and output head live on "
                          "different pipeline stages: set model.tie_embeddings=false")
    if n_mb < 1 or (sched != "gpipe" and n_mb < pp):
        raise ConfigError(f"parallel.pp_microbatches={n_mb} must be >= parallel.pp={pp} for pp_schedule={sched} "
                          "(>= 1 for gpipe)")
    if sched in _PP_INTERLEAVED and n_mb % pp:
        raise ConfigError(f"parallel.pp_microbatches={n_mb} must be a multiple of parallel.pp={pp} for "
                          f"pp_schedule={sched}")
    return n_mb


def unknown_keys(cfg, schema: type = Config, prefix: str = "") -> list[str]:
    """Keys of `cfg` the schema does not have. Hydra's `+key=value` (and `++`) adds keys to a structured
    config without complaint, so a typo would otherwise be ignored silently."""
    known = {f.name: f for f in fields(schema)}
    bad = []
    for key in cfg:
        if key == "hydra" and not prefix:  # Hydra's own node, in the configs a launcher composes
            continue
        f = known.get(key)
        if f is None:
            bad.append(f"{prefix}{key}")
        elif is_dataclass(f.default_factory) and cfg[key] is not None:  # a group: dict-typed fields are free
            bad += unknown_keys(cfg[key], f.default_factory, f"{prefix}{key}.")
    return bad


def _all_keys(schema: type = Config, prefix: str = "") -> list[str]:
    out = []
    for f in fields(schema):
        out += _all_keys(f.default_factory, f"{prefix}{f.name}.") if is_dataclass(f.default_factory) else [
            f"{prefix}{f.name}"]
    return out


def unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, _all_keys(), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown config key {key}{hint}: fix the spelling or drop it (`python -m hpctrain --cfg job` lists every key)"


def check_keys(cfg) -> None:
    bad = unknown_keys(cfg)
    if bad:
        raise ConfigError(unknown_key_message(bad[0]))


# Allowed ranges of numeric keys: (low, low included, high, high included), high None: unbounded. Keys set to
# null (where the schema allows it) are not checked; every float must also be finite.
_AT_LEAST_1, _AT_LEAST_0, _POSITIVE, _FRACTION = (1, True, None, False), (0, True, None, False), \
    (0, False, None, False), (0, True, 1, False)
_RANGES = {
    **dict.fromkeys(("model.vocab_size", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                     "model.ffn_hidden", "model.max_seq_len", "parallel.tp", "parallel.pp", "parallel.pp_microbatches",
                     "parallel.pp_virtual_stages", "parallel.ac_every", "precision.loss_scale_growth_interval",
                     "optim.ref_global_batch", "data.lanes", "data.prefetch", "train.seq_len", "train.max_steps",
                     "train.log_every", "train.eval_batches", "train.ckpt_keep", "train.max_nonfinite",
                     "cluster.tasks_per_node", "cluster.nodes", "cluster.cpus_per_task", "cluster.num_threads",
                     "cluster.mem_gb", "cluster.time_min"), _AT_LEAST_1),
    **dict.fromkeys(("optim.weight_decay", "optim.grad_clip", "optim.warmup_steps", "optim.decay_steps",
                     "data.num_workers", "train.seed", "train.eval_every", "train.ckpt_every", "cluster.gpus_per_node",
                     "cluster.signal_lead_s", "cluster.max_timeouts", "cluster.max_stalled_restarts"), _AT_LEAST_0),
    **dict.fromkeys(("model.rope_theta", "model.norm_eps", "model.init_std", "precision.loss_scale_init",
                     "optim.eps", "cluster.pg_timeout_s", "cluster.peak_tflops", "cluster.gpu_mem_gb"), _POSITIVE),
    **dict.fromkeys(("optim.beta1", "optim.beta2", "optim.momentum"), _FRACTION),
    "optim.min_lr_ratio": (0, True, 1, True),
    "optim.lr": (0, False, 1e3, True),  # far above any real LR; near fp32's max Adam's first step crashes
}
# What a key's zero or null means, where users may expect another value to mean it.
_HINTS = {"train.seq_len": "null takes it from the shards", "train.eval_every": "0 disables evaluation",
          "train.ckpt_every": "0 saves only at the end", "optim.grad_clip": "0 disables clipping"}


def _interval(low, low_in, high, high_in) -> str:
    if high is None:
        return f"{'>=' if low_in else '>'} {low}"
    return f"within {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def check_values(cfg) -> None:
    """Every numeric key in its range and finite (`optim.lr=inf` would train to NaN weights)."""
    for key, (low, low_in, high, high_in) in _RANGES.items():
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        bad = isinstance(value, float) and not math.isfinite(value)
        bad = bad or (low is not None and (value < low if low_in else value <= low))
        bad = bad or (high is not None and (value > high if high_in else value >= high))
        if bad:
            hint = f" ({_HINTS[key]})" if key in _HINTS else ""
            kind = "a finite number " if isinstance(value, float) else ""
            raise ConfigError(f"{key}={value} must be {kind}{_interval(low, low_in, high, high_in)}{hint}")


def resolve(cfg, world: int = 1) -> Plan:
    """Derive and check the numbers a run needs; raise ConfigError on the first problem."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    check_keys(cfg)
    check_values(cfg)
    signal_number(cfg.cluster.signal)
    if m.dim % m.n_heads:
        raise ConfigError(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={kv}")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"head_dim = model.dim/n_heads = {m.dim // m.n_heads} must be even for RoPE")
    tp, pp = p.tp, p.pp
    if p.dp == "auto":
        if world % (tp * pp):
            raise ConfigError(f"parallel.dp=auto: world size {world} is not divisible by tp×pp={tp}×{pp}")
        dp = world // (tp * pp)
    else:
        try:
            dp = int(p.dp)
        except ValueError:
            raise ConfigError(f"parallel.dp={p.dp!r} must be a positive integer or 'auto'") from None
    if dp < 1:
        raise ConfigError(f"parallel.dp={dp} must be >= 1")
    if dp * tp * pp != world:
        raise ConfigError(f"parallel dp×tp×pp={dp}×{tp}×{pp}={dp * tp * pp} does not match world size {world}")
    pp_mb = _check_pipeline(m, p)
    if pp > 1 and p.pp_schedule == "zero_bubble" and dp > 1 and p.zero_stage == 3:
        # Measured: its split weight-gradient pass does not match one process with parameters resharded.
        raise ConfigError("parallel.pp_schedule=zero_bubble with parallel.zero_stage=3 and dp > 1 gives wrong "
                          "gradients: use zero_stage=2 (or 0), or pp_schedule=interleaved_1f1b")
    if p.zero_stage not in (0, 2, 3):
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} must be 0 (replicate), 2 (shard gradients and "
                          "optimizer state) or 3 (shard parameters too)")
    if p.cpu_offload and (p.zero_stage != 3 or dp == 1):
        raise ConfigError(f"parallel.cpu_offload needs parallel.zero_stage=3 and dp > 1 (got zero_stage="
                          f"{p.zero_stage}, dp={dp}): set parallel=fsdp or parallel.cpu_offload=false")
    if p.sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1: set parallel.tp or drop it")
    for what, n in (("model.n_heads", m.n_heads), ("model.n_kv_heads", kv), ("model.vocab_size", m.vocab_size),
                    ("model.ffn_hidden", m.ffn_hidden)):
        if n % tp:
            raise ConfigError(f"{what}={n} is not divisible by parallel.tp={tp}: choose a tp that divides it")
    if p.sequence_parallel and t.seq_len is not None and t.seq_len % tp:
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by parallel.tp={tp} with "
                          "sequence_parallel: choose a seq_len that is a multiple of tp")
    if world > 1 and cfg.precision.name == PrecisionName.fp16:
        raise ConfigError(f"precision=fp16 (loss scaling) is not available with multi-process layouts "
                          f"(world {world}) yet: use precision=bf16")
    gb, mb, ga = _batch(t.global_batch, t.micro_batch, t.grad_accum, dp)
    if pp > 1 and mb % pp_mb:
        raise ConfigError(f"local micro batch train.micro_batch={mb} is not divisible by parallel.pp_microbatches="
                          f"{pp_mb}: the pipeline splits each micro-batch into pp_microbatches chunks")
    if t.seq_len is not None and t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: lower train.seq_len "
            f"or raise model.max_seq_len"
        )
    return Plan(world, dp, tp, pp, gb, mb, ga, t.seq_len)
