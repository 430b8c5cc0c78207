"""Typed config schema (Hydra structured configs) and the checks of single keys: names and ranges.

The schema makes Hydra reject unknown keys and wrong types with its own message; `check_keys` catches the
keys `+key=value` adds without complaint, `check_values` the numbers out of range. What relates several
keys (batch arithmetic, layout, the model's divisibility rules) is `hpctrain.runs.resolve`'s. A leaf: it imports
nothing of hpctrain, so every module may read the schema.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import signal
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any

from omegaconf import MISSING, OmegaConf


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the numbers and the fix."""


MAX_LOSS_SCALE = 2.0**64  # fp16 loss scale: far beyond any useful one, and scale × loss stays finite in fp32
MAX_LR = 1e3  # the peak learning rate, after lr_scaling: far above any real one
MAX_TIMEOUT_S = 30 * 86400.0  # timeouts: 30 days (torch turns them into a C integer of milliseconds)


class PrecisionName(str, Enum):
    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"
    fp16 = "fp16"


class OptimName(str, Enum):
    adamw = "adamw"
    adafactor = "adafactor"
    sgd = "sgd"
    lamb = "lamb"
    sophia = "sophia"


class OptimImpl(str, Enum):
    foreach = "foreach"  # grouped kernels; one parameter-sized temporary in the step (AdamW, SGD momentum)
    fused = "fused"  # one kernel per group, no temporary (AdamW and SGD)


class ReduceDtype(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"  # half the bytes; 8 bits of mantissa
    fp16 = "fp16"  # half the bytes; 11 bits of mantissa, a narrower range


class GradCompression(str, Enum):
    none = "none"
    powersgd = "powersgd"  # a low-rank approximation of each gradient matrix, with error feedback
    topk = "topk"  # the largest entries only, with error feedback


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


class RopeType(str, Enum):
    default = "default"  # plain RoPE
    linear = "linear"  # positions / factor
    dynamic = "dynamic"  # NTK: theta grows with a sequence longer than original_max_seq_len
    llama3 = "llama3"  # Llama 3.1: low frequencies / factor, high ones kept, a smooth band between


@dataclass
class RopeScaling:
    """RoPE frequency scaling as transformers defines it (`rope_scaling` / `rope_parameters` in config.json)."""

    type: RopeType = RopeType.default
    factor: float = 1.0
    original_max_seq_len: int | None = None  # the context it was pretrained at (llama3, dynamic)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3


class RouterKind(str, Enum):
    softmax = "softmax"  # softmax over the experts, then the top k (Mixtral, Qwen3-MoE, OLMoE)
    sigmoid = "sigmoid"  # each expert's sigmoid; the top k of score + bias (DeepSeek-V3)


@dataclass
class MoEDims:
    """Mixture-of-experts feed-forward layers (hpctrain.models.moe): dropless token-choice routing to `top_k` of
    `num_experts` SwiGLU experts. num_experts=0: every layer dense."""

    num_experts: int = 0
    top_k: int = 2
    expert_hidden: int | None = None  # each expert's hidden width (Qwen3's moe_intermediate_size); None: ffn_hidden
    shared_experts: int = 0  # experts every token goes through too, summed (DeepSeek): width shared·expert_hidden
    router: RouterKind = RouterKind.softmax
    norm_topk: bool = True  # the k chosen weights renormalised to sum to 1 (Mixtral: always; Qwen3: its config's)
    route_scale: float = 1.0  # the combine weights scaled (DeepSeek-V3's routed_scaling_factor)
    every: int = 1  # layer i sparse when (i + 1) % every == 0 (Qwen's decoder_sparse_step), ...
    dense_layers: list[int] = field(default_factory=list)  # ... and not listed here (mlp_only_layers, first_k_dense)
    aux_loss_coef: float = 0.0  # load-balancing loss (E · Σ_i f_i·P_i per sparse layer and sequence)
    z_loss_coef: float = 0.0  # router z-loss (mean logsumexp² of the router logits)
    # Auxiliary-loss-free balancing (DeepSeek-V3): after each step each expert's routing bias moves by this much
    # toward the mean load (counted over the step on every data-parallel rank); 0: no bias
    bias_update_rate: float = 0.0


@dataclass
class TransformerDims:
    """The dimensions of a decoder-only transformer, defined once: the `model` group's schema (ModelConfig) and
    the decoder's own arguments (hpctrain.models.llama.ModelArgs) both extend it. sliding_window is a family option
    (a family's ModelSpec names the options it has)."""

    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: n_heads
    ffn_hidden: int = 688
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    head_dim: int | None = None  # None: dim / n_heads
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None  # attend to the last N positions only (Mistral); None: all before
    moe: MoEDims = field(default_factory=MoEDims)  # a family option (Mixtral, Qwen3-MoE)


@dataclass
class ModelConfig(TransformerDims):
    """The `model` group: a family's dimensions; `family` picks the code (hpctrain.models), which reads the
    fields it has."""

    family: str = "llama"
    name: str = "custom"
    # Start from these weights instead of a random draw (not when resuming): hf:/path (a local transformers
    # directory: config.json + safetensors) or an hpctrain checkpoint directory (weights only).
    init_from: str | None = None


@dataclass
class ParallelConfig:
    name: str = "single"
    dp: Any = 1  # int, or "auto" = world / (tp * pp)
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    ep: int = 1  # expert parallel: data-parallel ranks sharing each MoE layer's experts (divides dp)
    cp: int = 1  # context parallel: ranks sharing each sequence (hpctrain.parallel.context)
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    zero_stage: int = 0
    # ZeRO-2/3 with train.grad_accum > 1: reduce-scatter after every micro-batch, so gradients stay the 1/dp
    # share (true); false accumulates full-size gradients and reduces once per step (less traffic, 4 bytes per
    # parameter more on every rank).
    sharded_accumulation: bool = True
    activation_checkpointing: ActCkpt = ActCkpt.none
    ac_every: int = 1  # selective: checkpoint every N-th block
    compile: bool = False
    cpu_offload: bool = False
    # The dtype gradients are summed over dp in (FSDP2's reduce dtype, every ZeRO stage); cast back after.
    grad_reduce_dtype: ReduceDtype = ReduceDtype.fp32
    # ZeRO-0 only: the dp gradient sum compressed (hpctrain.parallel.compression), with error feedback.
    grad_compression: GradCompression = GradCompression.none
    powersgd_rank: int = 4  # the approximation's rank per gradient matrix
    topk_fraction: float = 0.01  # the share of each bucket's entries a rank sends
    compression_start_step: int = 10  # plain all-reduce before this step: early gradients are the sensitive ones


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
    max_trust: float = 10.0  # lamb: the largest trust ratio ‖w‖/‖update‖
    rho: float = 0.04  # sophia: the curvature's weight in the clipped update
    update_every: int = 10  # sophia: steps between curvature estimates
    implementation: OptimImpl = OptimImpl.fused  # foreach: grouped kernels and one parameter-sized temporary
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    warmup_steps: int = 100
    decay: Decay = Decay.cosine
    decay_steps: int | None = None  # the step the decay reaches min_lr_ratio × lr (> warmup_steps); None: max_steps
    min_lr_ratio: float = 0.1
    lr_scaling: LrScaling = LrScaling.none
    ref_global_batch: int = 256  # global batch (samples) at which `lr` was tuned


@dataclass
class SourceConfig:
    """One shard set of a training mixture (`data.sources`)."""

    name: str = MISSING
    path: str = MISSING
    weight: float = 1.0  # its share of the samples: weights are normalised, read as exact decimals (0.7 = 7/10)


@dataclass
class PhaseConfig:
    """From optimizer step `step` on, the mixture's weights (a source not named: 0); each source continues from its
    own position."""

    step: int = MISSING
    weights: dict[str, float] = field(default_factory=dict)


class OnMaxEpochs(str, Enum):
    error = "error"
    warn = "warn"


@dataclass
class DataConfig:
    name: str = "custom"
    path: str = MISSING  # directory with manifest.json and the tar shards (with `sources`: validation and tokenizer)
    # A training mixture: [{name, path, weight}, ...], each source within one sample of its share in every prefix of
    # the stream (hpctrain.data.mixture); empty: train on `path`.
    sources: list[SourceConfig] = field(default_factory=list)
    schedule: list[PhaseConfig] = field(default_factory=list)  # the mixture's later phases (e.g. an annealing one)
    # The most epochs a mixture's source may give over train.max_steps (null: any): beyond, error or warn.
    max_epochs: float | None = None
    on_max_epochs: OnMaxEpochs = OnMaxEpochs.error
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
    eval_batches: int = 8  # global batches of the validation split per evaluation, split over dp
    # steps between checkpoints; 0: only at the end; auto: from the measured save stall, step time and the job's
    # failure rate (cluster.node_mtbf_h), by Young/Daly's rule (hpctrain.training.cadence)
    ckpt_every: int | str = 100
    ckpt_keep: int = 2
    ckpt_async: bool = False  # write checkpoints in the background: training pauses only for a copy to host memory
    ckpt_write_threads: int = 2  # files each rank writes at once (DCP's thread_count): 2 were ~2x faster than 1
    checkpointing: bool = True  # false: no checkpoint is written (benchmarks); the run cannot resume
    export_hf_at_end: bool = False  # the final checkpoint also as a transformers model in <run_dir>/hf/step-N
    resume: str = "auto"  # auto | never | path of a checkpoint directory
    max_nonfinite: int = 5  # consecutive skipped non-finite steps before the run stops
    # Python's garbage collector off during training, run every N steps on every rank (hpctrain.training.gc_schedule);
    # 0: automatic collection
    gc_every: int = 50
    # The loss computed with the output projection, chunk by chunk: the [tokens, vocab] logits are never held
    # whole (hpctrain.models.cross_entropy). Not with pipeline or tensor parallelism.
    fused_loss: bool = False
    # Documents packed in one block attend only within themselves (the EOS the shards hold marks where each ends):
    # hpctrain.models.packing. restart_positions: RoPE's positions restart at 0 at each document.
    document_mask: bool = False
    restart_positions: bool = False
    profile_steps: list[int] | None = None  # [first, last]: the torch profiler over these steps, on every rank
    memory_snapshot: bool = False  # CUDA: the allocator's history, dumped on out-of-memory and at the end
    progress: bool | None = None  # progress bar; None: only on a terminal


class AlertWhen(str, Enum):
    above = "above"
    below = "below"


class AlertAction(str, Enum):
    warn = "warn"  # alerts.jsonl, the log, notify_cmd, the trackers
    checkpoint = "checkpoint"  # and a checkpoint at the next step boundary
    stop = "stop"  # and a checkpoint, then the run stops (status "stopped"; not requeued)


@dataclass
class AlertRule:
    metric: str = "loss"  # see hpctrain.monitoring.monitor.METRICS
    threshold: float = 0.0
    when: AlertWhen = AlertWhen.above
    for_s: float = 60.0  # wall-time seconds past the threshold before it fires
    action: AlertAction = AlertAction.warn


class SpikeAction(str, Enum):
    none = "none"
    warn = "warn"
    skip_batch = "skip_batch"  # drop that global batch's update
    rollback = "rollback"  # reload the last checkpoint, skip the data since it


@dataclass
class LossSpikeConfig:
    # A step's loss above factor × the median loss of the last `window` steps (hpctrain.training.spikes).
    factor: float = 3.0
    window: int = 100
    action: SpikeAction = SpikeAction.warn
    max_rollbacks: int = 3  # rollbacks in one run before a spike stops it instead


@dataclass
class MonitorConfig:
    # name -> {metric, threshold, when, for_s} (conf/monitor/default.yaml); plain mappings, so that a command line
    # can add one (+monitor.rules.x={...}); checked as AlertRule by hpctrain.monitoring.monitor.parse_rules
    rules: dict[str, Any] = field(default_factory=dict)
    notify_cmd: list[str] | None = None  # argument list run with each alert as JSON on stdin (never a shell)
    # Hang forensics (hpctrain.monitoring.hang): an iteration running longer than hang_s (None: 90 % of
    # cluster.pg_timeout_s) writes every rank's stacks to <run_dir>/hang/ and names the ranks that stopped; each
    # rank sends a heartbeat every heartbeat_s (a peer that went away is named once its beat is 2 intervals old).
    hang_s: float | None = None
    heartbeat_s: float = 2.0
    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    # One step in sample_every runs under the profiler on every rank: communication overhead, synchronisation
    # time and stragglers (ranks whose compute time is above (1 + straggler_frac) × the median), named with their
    # node (hpctrain.monitoring.comm_sample). 0: never.
    sample_every: int = 100
    straggler_frac: float = 0.2
    failure_window_s: float = 3600.0  # node_failure_rate counts the node failures of this much time
    # Energy (hpctrain.monitoring.energy, where NVML or RAPL reports it): the run's cost and CO₂ in result.json
    energy_price_per_kwh: float | None = None
    co2_g_per_kwh: float | None = None
    # A Prometheus scrape target on the main rank (hpctrain.monitoring.prometheus): null off, 0 any free port.
    prometheus_port: int | None = None
    prometheus_addr: str = "0.0.0.0"


class Tracker(str, Enum):
    tensorboard = "tensorboard"
    mlflow = "mlflow"
    wandb = "wandb"


class WandbMode(str, Enum):
    offline = "offline"  # written under <run_dir>/wandb; `wandb sync` uploads it later
    online = "online"  # needs `wandb login` (or WANDB_API_KEY) and the network from the main rank


@dataclass
class LoggingConfig:
    # Where metrics go besides metrics.jsonl and the console (hpctrain.monitoring.metrics); [] for none.
    trackers: list[Tracker] = field(default_factory=lambda: [Tracker.tensorboard])
    # MLflow and W&B (hpctrain.monitoring.trackers). The tracking URI: a server (http://host:5000), a database
    # (sqlite:///path/mlflow.db, postgresql://...); None: $MLFLOW_TRACKING_URI, else a SQLite store in
    # <sweep_dir>/mlflow (a sweep point) or <run_dir>/mlflow.
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str | None = None  # None: the sweep dir for a sweep point, "hpctrain" for a single run
    wandb_project: str = "hpctrain"
    wandb_mode: WandbMode = WandbMode.offline


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
    num_threads: int | None = None  # torch intra-op threads per rank; None: torch's (local ranks: usable CPUs/N)
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
    # The GPU type `hpctrain plan` predicts step time for (A100, H100, H200: hpctrain.training.step_time), and what
    # `hpctrain preflight` measured on the cluster in place of the type's defaults: GEMM TFLOP/s, all-reduce bus
    # bandwidth inside a node and per GPU across nodes (GB/s).
    gpu_type: str | None = None
    gemm_tflops: float | None = None
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    # A node's mean time between failures, for train.ckpt_every=auto (the job's is this over its node count). The
    # default is Llama 3's 405B training: 419 unexpected interruptions in 54 days on 2,048 nodes of 8 H100s.
    node_mtbf_h: float = 6335.0
    # Learn it from the bad-node list (cluster.bad_nodes): the nodes that died or hung in its runs over the node-hours
    # they trained, node_mtbf_h counting as one prior failure (hpctrain.runtime.bad_nodes.node_mtbf_h).
    learn_mtbf: bool = True
    # Nodes that lost a rank, hung, failed preflight or straggled in two runs (hpctrain.runtime.bad_nodes): left out of
    # the next submissions for this long; `hpctrain nodes` lists and clears them. null: no list.
    bad_nodes: str | None = "${oc.env:HPCTRAIN_BAD_NODES,'~/.hpctrain/bad_nodes.json'}"
    bad_node_expiry_h: float = 72.0
    # Nodes asked for beyond the layout's: when a rank dies or a node is lost the run restarts inside the allocation
    # on the others plus a spare, from the latest checkpoint, instead of requeueing (hpctrain.launch.supervise).
    spare_nodes: int = 0
    # With parallel.dp=auto: when nodes fail and no spare is left, go on on as few as this many healthy nodes of the
    # allocation (dp shrinks, the checkpoint reshards, the global batch stays: accumulation grows) instead of
    # requeueing. null: the layout's node count (no shrinking).
    min_nodes: int | None = None
    max_restarts: int = 3  # such restarts per job before it fails
    # hydra/launcher=slurm sweeps: this many points per job, each an srun step of its own inside the one allocation
    # (small trials packed onto large nodes), each in its own run directory (hpctrain.launch.supervise.PackedRuns)
    pack: int = 1


class EvalMode(str, Enum):
    loop = "loop"  # the training ranks score, at the step
    job = "job"  # a Slurm job per checkpoint scores it (hpctrain.training.eval_jobs)


@dataclass
class EvalConfig:
    """Downstream evaluation with lm-evaluation-harness (hpctrain.evaluation): its tasks scored by the run's model."""

    tasks: list[str] = field(default_factory=list)  # lm-eval task (or group) names; none: no downstream evaluation
    every: int = 0  # steps between evaluations (and at the last step); 0: at the last step only
    limit: float | None = None  # examples per task (a count, or a fraction below 1): lm-eval's --limit
    num_fewshot: int | None = None  # lm-eval's --num_fewshot (None: each task's own)
    include_path: str | None = None  # a directory of task YAML files (local tasks): lm-eval's --include_path
    batch_size: int = 8  # requests scored at once per data-parallel rank
    # tokens of context + continuation a request keeps (from the right); None: the run's train.seq_len
    max_length: int | None = None
    log_samples: bool = False  # every request and its answer in <run_dir>/eval_samples/step-N/<task>.jsonl
    mode: EvalMode = EvalMode.loop
    # eval.mode=job: the run's `cluster` keys the eval jobs change (partition, time_min, gpus_per_node, ...), and
    # more arguments of their `hpctrain eval` (another layout: [parallel=fsdp])
    cluster: dict[str, Any] = field(default_factory=dict)
    job_args: list[str] = field(default_factory=list)
    wait_min: float = 0.0  # eval.mode=job: at its end the run waits this long for its eval jobs still going


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run_dir: str = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"


def signal_number(name: str) -> signal.Signals:
    """`cluster.signal` (USR2, SIGUSR2, usr2) as a signal."""
    try:
        return signal.Signals["SIG" + str(name).upper().removeprefix("SIG")]
    except KeyError:
        raise ConfigError(f"cluster.signal={name!r} is not a signal name: use e.g. USR2") from None


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
                     "model.ffn_hidden", "model.max_seq_len", "model.head_dim", "model.sliding_window",
                     "model.rope_scaling.original_max_seq_len", "parallel.tp", "parallel.pp", "parallel.ep", "parallel.cp",
                     "parallel.pp_virtual_stages", "parallel.ac_every", "model.moe.top_k", "model.moe.expert_hidden",
                     "model.moe.every", "parallel.powersgd_rank",
                     "optim.update_every", "precision.loss_scale_growth_interval",
                     "optim.ref_global_batch", "data.lanes", "train.seq_len", "train.max_steps", "optim.decay_steps",
                     "train.log_every", "train.eval_batches", "train.ckpt_keep", "train.max_nonfinite",
                     "train.ckpt_write_threads", "monitor.loss_spike.window",
                     "cluster.tasks_per_node", "cluster.nodes", "cluster.cpus_per_task", "cluster.num_threads",
                     "cluster.mem_gb", "cluster.time_min", "cluster.pack", "cluster.min_nodes"), _AT_LEAST_1),
    **dict.fromkeys(("optim.weight_decay", "optim.grad_clip", "optim.warmup_steps",
                     "data.num_workers", "train.seed", "train.eval_every", "train.ckpt_every", "train.gc_every",
                     "cluster.gpus_per_node",
                     "cluster.signal_lead_s", "cluster.max_timeouts", "cluster.max_stalled_restarts",
                     "cluster.spare_nodes", "cluster.max_restarts",
                     "monitor.loss_spike.max_rollbacks", "monitor.sample_every",
                     "parallel.compression_start_step", "model.moe.num_experts", "model.moe.shared_experts",
                     "model.moe.aux_loss_coef", "model.moe.z_loss_coef", "model.moe.bias_update_rate"), _AT_LEAST_0),
    **dict.fromkeys(("model.rope_theta", "model.norm_eps", "model.init_std", "model.rope_scaling.factor",
                     "data.max_epochs", "model.rope_scaling.low_freq_factor", "model.rope_scaling.high_freq_factor",
                     "precision.loss_scale_init", "model.moe.route_scale",
                     "optim.eps", "optim.max_trust", "optim.rho", "cluster.pg_timeout_s", "cluster.peak_tflops",
                     "cluster.gpu_mem_gb", "cluster.node_mtbf_h", "cluster.bad_node_expiry_h",
                     "monitor.hang_s", "monitor.heartbeat_s", "monitor.straggler_frac",
                     "monitor.failure_window_s", "monitor.energy_price_per_kwh", "monitor.co2_g_per_kwh"), _POSITIVE),
    **dict.fromkeys(("optim.beta1", "optim.beta2", "optim.momentum"), _FRACTION),
    "optim.min_lr_ratio": (0, True, 1, True),
    "monitor.prometheus_port": (0, True, 65535, True),
    "parallel.topk_fraction": (0, False, 1, True),
    "monitor.loss_spike.factor": (1, False, None, False),
    "optim.lr": (0, False, MAX_LR, True),  # far above any real LR; near fp32's max Adam's first step crashes
    # Bounds of the numbers that become sizes, timeouts or seeds elsewhere (a C integer, a timedelta, threads)
    "train.seed": (0, True, 2**63 - 1, True),
    "precision.loss_scale_init": (0, False, MAX_LOSS_SCALE, True),
    "cluster.pg_timeout_s": (0, False, MAX_TIMEOUT_S, True),
    "monitor.hang_s": (0, False, MAX_TIMEOUT_S, True),
    "monitor.heartbeat_s": (0, False, MAX_TIMEOUT_S, True),
    "monitor.failure_window_s": (0, False, 366 * 86400, True),
    "data.num_workers": (0, True, 256, True),
    "data.prefetch": (1, True, 256, True),
    "train.ckpt_write_threads": (1, True, 64, True),
    "cluster.num_threads": (1, True, 4096, True),
}
# Numeric keys that also take a word.
_WORDS = {"train.ckpt_every": ("auto",)}
# What a key's zero or null means, where users may expect another value to mean it.
_HINTS = {"train.seq_len": "null takes it from the shards", "train.eval_every": "0 disables evaluation",
          "train.ckpt_every": "0 saves only at the end", "optim.grad_clip": "0 disables clipping",
          "train.gc_every": "0 leaves garbage collection automatic"}


def _interval(low, low_in, high, high_in) -> str:
    if high is None:
        return f"{'>=' if low_in else '>'} {low}"
    return f"within {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


SBATCH_TEXT = ("partition", "account", "qos", "constraint")  # cluster keys that become #SBATCH lines
# sbatch's short options by their long names: a one-letter key of cluster.sbatch_extra is refused, naming the long one
# (submitit writes --KEY), except x, which joins the bad-node list's --exclude.
_SBATCH_SHORT = {"A": "account", "C": "constraint", "G": "gpus", "N": "nodes", "a": "array",
                 "c": "cpus-per-task", "e": "error", "n": "ntasks", "o": "output", "p": "partition", "q": "qos",
                 "t": "time", "x": "exclude"}
# The options hpctrain writes into the job script itself, and the keys that set them (or, in parentheses, why it
# writes them). submitit writes cluster.sbatch_extra over them, unseen by the checks and plans made from these keys
# (the partition's limits, the requeues, the time limit's warning).
_LOGS = "(submitit reads the job's result from its logs in <run_dir>/.submitit/<job id>/)"
_SBATCH_OWN = {"time": "cluster.time_min", "partition": "cluster.partition", "qos": "cluster.qos",
               "account": "cluster.account", "constraint": "cluster.constraint",
               "nodes": "the layout (parallel.*), cluster.nodes and cluster.spare_nodes",
               "ntasks": "the layout (parallel.*) and cluster.tasks_per_node",
               "ntasks-per-node": "cluster.tasks_per_node", "gpus-per-node": "cluster.gpus_per_node",
               "gpus": "cluster.gpus_per_node", "cpus-per-task": "cluster.cpus_per_task", "mem": "cluster.mem_gb",
               "signal": "cluster.signal and cluster.signal_lead_s",
               "no-requeue": "(a requeued job resumes from its latest checkpoint)",
               "array": "a sweep (-m) and cluster.pack", "output": _LOGS, "error": _LOGS, "open-mode": _LOGS}
# Options that change sbatch's answer to the submission, not the job (submitit reads the job's id from sbatch's
# `Submitted batch job N` when it returns), or the environment the job starts in: (what they would do and the fix,
# the values in the way; None: any). Measured on the local cluster: with --parsable the job was queued, unread, and
# failed at its start.
_SBATCH_ANSWER = {"parsable": ("sbatch would print the job's id alone, which submitit cannot read, and the job would "
                               "fail as it starts, its files never put in place: leave it out", None),
                  "test-only": ("sbatch would submit no job: leave it out", None),
                  "wait": ("sbatch would not return until the job ends: set cluster.wait=true instead", None),
                  "export": ("the job would not start in the environment it is submitted from, which it needs: "
                             "leave it out (ALL) or add ALL to it", lambda v: not exports_all(v))}


def exports_all(value) -> bool:
    """Whether an --export value (sbatch_extra.export, $SBATCH_EXPORT) passes the submitting environment on: ALL as
    one of its comma-separated words, as Slurm reads it."""
    return "ALL" in {word.strip().upper() for word in str(value).split(",")}


def sbatch_option(key: str) -> str:
    """The long name of the #SBATCH option a key of cluster.sbatch_extra writes (`t`, `time`; `cpus_per_task` is
    written as submitit does, `--cpus-per-task`)."""
    return _SBATCH_SHORT.get(key, key.replace("_", "-"))


def check_sbatch_text(cluster, where: str = "cluster", options: bool = True) -> None:
    """The cluster keys written into a job script's #SBATCH lines: one line of printable text each (a newline would
    add a line of its own to the script); cluster.sbatch_extra's keys sbatch option names and, with `options` (the
    run's job, not an eval job, which gets no sbatch_extra), none of the options hpctrain sets from other keys, nor
    one that would change sbatch's answer or the job's environment (_SBATCH_ANSWER), whole or abbreviated (sbatch
    reads an unambiguous start of an option's name as the option), nor a one-letter key (submitit writes --KEY).
    One-line ConfigError."""
    get = cluster.get if hasattr(cluster, "get") else functools.partial(getattr, cluster)
    for key in SBATCH_TEXT:
        value = get(key, None)
        if isinstance(value, str) and not value.isprintable():
            raise ConfigError(f"{where}.{key}={value!r} holds a newline or control character: one line of text only")
    for key, value in (get("sbatch_extra", None) or {}).items():
        name = f"{where}.sbatch_extra.{key}"
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", str(key)) or not str(value).isprintable():
            raise ConfigError(f"{name}={value!r}: the key must be an sbatch option's name and the value one line of "
                              "printable text")
        option = sbatch_option(key)
        if value is False:
            raise ConfigError(f"{name}=false would write --{option}=False: an #SBATCH flag takes no value; leave the "
                              "key out not to set it")
        if not options or option == "mem" and get("mem_gb", None) is None:
            continue  # (mem: no --mem is written then, and no node memory checked: --mem=0, all of it, is the user's)
        if len(str(key)) == 1 and option != "exclude":  # (x joins the bad-node list's --exclude: runs.compose)
            long = f"--{option}" + (f", {_written(option)}" if option in _SBATCH_OWN else "") if key in _SBATCH_SHORT \
                else "its long name"
            raise ConfigError(f"{name}: submitit writes it as --{key}, which sbatch does not read as -{key} (measured: "
                              f"unrecognized or ambiguous): use {long}")
        begun = sorted(own for own in (*_SBATCH_OWN, *_SBATCH_ANSWER) if own.startswith(option) and own != option)
        if option not in _SBATCH_OWN and option not in _SBATCH_ANSWER and begun:
            raise ConfigError(f"{name}: sbatch takes the start of an option's name for the option where only one "
                              f"begins so, and refuses it where several do (--{begun[0]}, {_written(begun[0])}): write "
                              "an option's whole name")
        answer, in_the_way = _SBATCH_ANSWER.get(option, (None, None))
        if answer and (in_the_way is None or in_the_way(value)):
            raise ConfigError(f"{name}{'' if value is True else f'={value}'}: {answer}")
        if option in _SBATCH_OWN:
            how = "leave it out" if _SBATCH_OWN[option].startswith("(") else "set that instead"
            raise ConfigError(f"{name} would replace the job's --{option.removeprefix('no-')}, {_written(option)}: "
                              f"{how}")


def _written(option: str) -> str:
    if option in _SBATCH_ANSWER:
        return _SBATCH_ANSWER[option][0].split(":")[0]
    owner = _SBATCH_OWN[option]
    return f"which hpctrain writes itself {owner}" if owner.startswith("(") else f"which hpctrain writes from {owner}"


def check_values(cfg, prefix: str = "") -> None:
    """Every numeric key (under `prefix`) in its range and finite (`optim.lr=inf` would train to NaN weights)."""
    for key, (low, low_in, high, high_in) in _RANGES.items():
        if not key.startswith(prefix):
            continue
        value = OmegaConf.select(cfg, key)
        if value is None or (key in _WORDS and value in _WORDS[key]):
            continue
        if isinstance(value, str):
            raise ConfigError(f"{key}={value} must be a number {_interval(low, low_in, high, high_in)}"
                              f"{''.join(f' or {w}' for w in _WORDS.get(key, ()))}")
        bad = isinstance(value, float) and not math.isfinite(value)
        bad = bad or (low is not None and (value < low if low_in else value <= low))
        bad = bad or (high is not None and (value > high if high_in else value >= high))
        if bad:
            hint = f" ({_HINTS[key]})" if key in _HINTS else ""
            kind = "a finite number " if isinstance(value, float) else ""
            raise ConfigError(f"{key}={value} must be {kind}{_interval(low, low_in, high, high_in)}{hint}")
