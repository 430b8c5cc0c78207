"""`hpctrain plan --search --gpus N`: the layouts of a model on N GPUs that fit memory, fastest first.

Every combination of tp (inside a node), pp (with its schedules), cp, ep, the ZeRO stage, the micro-batch and
activation checkpointing that splits the config's global batch is timed by the step-time model (step_time.py, a
few microseconds each); then, fastest first, each is checked as a run would be (runs/resolve: what hpctrain can run)
and against memory (the planner's estimate, the worst stage against 90 % of cluster.gpu_mem_gb) until `top` fit.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from dataclasses import dataclass, replace

from omegaconf import OmegaConf

from hpctrain.core.config import ActCkpt, ConfigError
from hpctrain.parallel.layout import Layout
from hpctrain.training import step_time

ZERO_STAGES = (0, 2, 3)
MICRO_BATCHES = (1, 2, 4, 8)
CHECKPOINTING = (("none", 1), ("selective", 2), ("full", 1))  # (mode, ac_every): selective = every 2nd block
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    zero_stage: int
    micro_batch: int
    grad_accum: int
    ac: str
    ac_every: int = 1

    def parallel_keys(self) -> dict:
        lay = self.layout
        return {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "pp_schedule": lay.pp_schedule,
                "pp_virtual_stages": lay.pp_virtual_stages, "zero_stage": self.zero_stage,
                "sequence_parallel": lay.tp > 1, "activation_checkpointing": self.ac, "ac_every": self.ac_every}

    def overrides(self) -> list[str]:
        return ([f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.parallel_keys().items()]
                + [f"train.micro_batch={self.micro_batch}", "train.grad_accum=null"])

    def describe(self) -> str:
        lay = self.layout
        sched = "" if lay.pp == 1 else f" {lay.pp_schedule}" + (f"×{lay.pp_virtual_stages}" if lay.pp_virtual_stages
                                                                  > 1 else "")
        return (f"{lay.describe()}{sched} zero{self.zero_stage} mb{self.micro_batch}×{self.grad_accum} "
                f"ckpt={self.ac}" + (f"/{self.ac_every}" if self.ac_every > 1 else ""))


def _divisors(n: int, up_to: int) -> list[int]:
    return [d for d in range(1, min(n, up_to) + 1) if n % d == 0]


def candidates(args, gpus: int, global_batch: int, seq_len: int, gpus_per_node: int):
    """Every layout of `gpus` ranks that splits `global_batch` (no memory check yet)."""
    experts = getattr(getattr(args, "moe", None), "num_experts", 0) or 0
    kv = getattr(args, "kv_heads", args.n_heads)
    for tp in _divisors(gpus, gpus_per_node):
        # (ranks are placed node by node: over several nodes a group of tp ranks stays in one only if tp divides them)
        if kv % tp or args.n_heads % tp or seq_len % tp or (gpus > gpus_per_node and gpus_per_node % tp):
            continue
        for pp in _divisors(gpus // tp, args.n_layers):
            for cp in _divisors(gpus // (tp * pp), 16):
                if seq_len % (2 * cp) and cp > 1:
                    continue
                dp = gpus // (tp * pp * cp)
                for ep in [e for e in _divisors(dp, dp) if experts and experts % e == 0] or [1]:
                    for (sched, v), zero, mb, (ac, every) in itertools.product(
                            SCHEDULES if pp > 1 else (("1f1b", 1),), ZERO_STAGES, MICRO_BATCHES, CHECKPOINTING):
                        if global_batch % (mb * dp) or (zero and dp * cp == 1) or args.n_layers < pp * v:
                            continue
                        accum = global_batch // (mb * dp)
                        layout = Layout(pp=pp, dp=dp, tp=tp, pp_schedule=sched, pp_virtual_stages=v, ep=ep, cp=cp)
                        try:  # the schedule's micro-batches, as a run checks them
                            layout.check_microbatches(accum)
                        except ConfigError:
                            continue
                        yield Candidate(layout, zero, mb, accum, ac, every)


@dataclass
class Found:
    candidate: Candidate
    prediction: step_time.Prediction
    memory_gib: float


class Searcher:
    """The search over one model, GPU count, batch and cluster (a composed config)."""

    def __init__(self, cfg, gpus: int):
        from hpctrain.runs.compose import typed
        from hpctrain.training import planner

        self.hw = step_time.hardware_of(cfg.cluster, cfg.precision.name)
        if self.hw is None or not cfg.cluster.gpu_mem_gb:
            raise ConfigError(f"plan --search needs cluster.gpu_type ({', '.join(step_time.HARDWARE)}) and "
                              "cluster.gpu_mem_gb")
        if cfg.train.global_batch is None or cfg.train.seq_len is None:
            raise ConfigError("plan --search needs train.global_batch and train.seq_len (the batch every layout "
                              "splits)")
        self.cfg, self.gpus = cfg, gpus
        _check_base(cfg, gpus)
        self.base = step_time.StepInputs.of(cfg.model, cfg.parallel, cfg.precision, _single(cfg), cfg.train.seq_len,
                                             document_mask=cfg.train.document_mask)
        self.typed = typed(cfg)  # (the schema's dataclasses: the memory estimate reads them ten times faster)
        self.usable = cfg.cluster.gpu_mem_gb * planner.HEADROOM * planner.GiB
        self._stages = {}
        self._meta = None  # the model on the meta device, built once for every split checked
        self.refusals: Counter[str] = Counter()  # why the checked ones were refused (their first words)

    def predict(self, c: Candidate) -> step_time.Prediction:
        x = replace(self.base, layout=c.layout, micro_batch=c.micro_batch, grad_accum=c.grad_accum,
                    zero_stage=c.zero_stage, sequence_parallel=c.layout.tp > 1, ac=c.ac, ac_every=c.ac_every)
        return step_time.predict(x, self.hw)

    def check(self, c: Candidate) -> tuple[float | None, str]:
        """(GiB per GPU, "") when hpctrain can run `c` and it fits; else (None, why not)."""
        from hpctrain.runs.resolve import RunShape, resolve
        from hpctrain.training import planner

        lay, base = c.layout, self.base
        try:  # the layout rules a run checks first (runs/resolve), then all of them for one that fits
            base.spec.check_layout(base.args, lay, lay.tp > 1)
        except ConfigError as e:
            return None, str(e)
        key = (lay.pp, lay.pp_virtual_stages, lay.ep)
        if key not in self._stages:
            self._meta = base.spec.meta(base.args) if self._meta is None else self._meta
            self._stages[key] = planner.stage_params(base.args, lay.pp, lay.pp_virtual_stages, base.spec, lay.ep,
                                                     self._meta)
        seq_len = self.cfg.train.seq_len
        plan = RunShape(lay, self.cfg.train.global_batch, c.micro_batch, c.grad_accum, seq_len)
        rows = planner.estimate(_with(self.typed, c), plan, seq_len, self._stages[key])["rows"]
        worst = max(planner.total(r, c.ac) for r in rows)
        if worst > self.usable:
            return None, f"needs {worst / planner.GiB:.1f} GiB per GPU, over {self.usable / planner.GiB:.1f} usable"
        try:
            resolve(OmegaConf.merge(self.cfg, OmegaConf.from_dotlist(c.overrides())), self.gpus)
        except ConfigError as e:
            return None, str(e)
        return worst / planner.GiB, ""

    def search(self, top: int = 5) -> tuple[list[Found], int, int, float]:
        """The `top` fastest layouts that hpctrain can run and that fit memory; (found, candidates timed, checked,
        seconds taken)."""
        started = time.perf_counter()
        timed = sorted(((self.predict(c), c) for c in candidates(
            self.base.args, self.gpus, self.cfg.train.global_batch, self.cfg.train.seq_len, self.hw.gpus_per_node)),
            key=lambda t: t[0].step_s)
        found, checked = [], 0
        for prediction, c in timed:
            if len(found) == top:
                break
            checked += 1
            gib, why = self.check(c)
            if gib is not None:
                found.append(Found(c, prediction, gib))
            else:
                self.refusals[why.split(":")[0]] += 1
        return found, len(timed), checked, time.perf_counter() - started


def _check_base(cfg, gpus: int) -> None:
    """What is wrong whatever the layout, said once before the search (else every candidate is refused for it, and
    the search ends advising more GPUs): the config as one rank runs it; and, with cluster.gpus_per_node, `gpus` as
    a Slurm job places them (whole nodes, cluster.nodes)."""
    from hpctrain.runs.resolve import resolve

    single = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 0, "pp_schedule": "1f1b",
              "pp_virtual_stages": 1, "sequence_parallel": False, "cpu_offload": False}  # (the layout's own keys)
    one = OmegaConf.merge(cfg, {"parallel": single, "train": {"micro_batch": 1, "grad_accum": None}})
    resolve(one, 1)
    per_node, nodes = cfg.cluster.gpus_per_node, cfg.cluster.nodes
    if per_node and gpus > per_node and gpus % per_node:
        raise ConfigError(f"--gpus {gpus} does not fill whole nodes of {per_node} (cluster.gpus_per_node), as a Slurm "
                          f"job places them: search a multiple of {per_node}")
    if per_node and nodes and nodes != -(-gpus // per_node):
        raise ConfigError(f"--gpus {gpus} is {-(-gpus // per_node)} node(s) of {per_node}, cluster.nodes={nodes}: "
                          f"search {nodes * per_node} GPUs, or drop cluster.nodes")


def _with(cfg, c: Candidate):
    """The typed config with the candidate's layout and batch split."""
    parallel = replace(cfg.parallel, **{**c.parallel_keys(), "activation_checkpointing": ActCkpt(c.ac)})
    return replace(cfg, parallel=parallel, train=replace(cfg.train, micro_batch=c.micro_batch, grad_accum=None))


def _single(cfg):
    """A one-rank RunShape: StepInputs' model part (the layout is replaced per candidate)."""
    from hpctrain.runs.resolve import RunShape

    return RunShape(Layout(), cfg.train.global_batch, cfg.train.global_batch, 1, cfg.train.seq_len)


def report(cfg, gpus: int, top: int = 5) -> tuple[str, list[Found]]:
    searcher = Searcher(cfg, gpus)
    found, timed, checked, took = searcher.search(top)
    why = searcher.refusals.most_common(1)[0][0] if searcher.refusals else ""
    out = [f"search: {timed} layouts of {gpus} GPUs timed, {checked} checked against hpctrain's rules and "
           f"{cfg.cluster.gpu_mem_gb:g} GB per GPU in {took:.1f} s; the fastest that fit:"]
    if not found:
        out.append("  none fits or is allowed: more GPUs, a smaller train.global_batch per GPU, a larger "
                   "cluster.gpu_mem_gb" + (f"; the commonest refusal: {why}" if why else ""))
    for i, f in enumerate(found, 1):
        p = f.prediction
        out.append(f"{i}. {f.candidate.describe()}: {p.step_s:.3g} s/step, {p.tokens_per_s_per_gpu:,.0f} tokens/s "
                   f"per GPU, MFU {p.mfu:.1%}, {f.memory_gib:.1f} GiB per GPU")
        out.append("  " + p.breakdown().strip())
        out.append("  overrides: " + " ".join(f.candidate.overrides()))
    return "\n".join(out), found


def write_parallel(path: str, found: Found, parallel) -> None:
    """The chosen layout as a `parallel=` config file: the run's `parallel` group (every key: choosing the file
    replaces the group) with the layout's keys. A new file: an existing one is never overwritten."""
    c = found.candidate
    keys = {**OmegaConf.to_container(parallel, resolve=True, enum_to_str=True), **c.parallel_keys(),
            "name": os.path.splitext(os.path.basename(path))[0]}
    text = (f"# hpctrain plan --search: {c.describe()} ({found.prediction.line().removeprefix('predicted: ')})\n"
            f"# with train.micro_batch={c.micro_batch}\n" + OmegaConf.to_yaml(keys))
    with open(path, "x") as f:
        f.write(text)
