"""The Trainer: builds a run's components from a validated config, then sequences them step by step.

Each component owns its cadence and its state: the step (one optimizer step for any layout), the feed
(micro-batches at the run's data position), the metrics (what is logged when, to which sinks), the
checkpointer (when to save, what a checkpoint holds, where to resume from), the evaluator, and the stop
agreement (preemption and termination signals, the same decision on every rank). The loop knows nothing
of the parallel layout, and a new feature is a component, not a branch in the loop.
"""

from __future__ import annotations

import logging
import os
import time
import warnings

import torch

from hpctrain.core.config import Config, ParallelConfig, PrecisionName, SpikeAction
from hpctrain.core.errors import TrainingError
from hpctrain.core.files import METRICS_FILE, RESULT_FILE, no_space, read_metrics, write_json
from hpctrain.data.loader import DataError, read_manifest
from hpctrain.models import spec_of
from hpctrain.models.packing import DocumentMask
from hpctrain.monitoring.comm_sample import CommSampler
from hpctrain.monitoring.energy import EnergyMeter
from hpctrain.monitoring.hang import HangWatch
from hpctrain.monitoring.memory import MemoryProbe, Peaks
from hpctrain.monitoring.metrics import Metrics, Throughput, peak_flops, run_sinks
from hpctrain.monitoring.monitor import Context
from hpctrain.monitoring.profiling import MemorySnapshot, StepProfiler
from hpctrain.monitoring.trackers import resolved_config
from hpctrain.runs.resolve import scaled_lr
from hpctrain.runtime import bad_nodes, job
from hpctrain.runtime.job import RunStatus, Stop
from hpctrain.storage import checkpoint
from hpctrain.training.downstream import DownstreamEval
from hpctrain.training.eval_jobs import EvalJobs
from hpctrain.training.evaluator import Evaluator
from hpctrain.training.expert_balance import ExpertBalance
from hpctrain.training.feed import TrainFeed, ValSplit
from hpctrain.training.gc_schedule import GcSchedule
from hpctrain.training.model_init import build_model, load_initial_weights
from hpctrain.training.optimizer import build_optimizer, build_scheduler, step_passes
from hpctrain.training.precision import compute_dtype, setup_precision
from hpctrain.training.save_resume import Checkpointer, SignalLead
from hpctrain.training.spikes import LossSpikeGuard, Rollback
from hpctrain.training.state import RunState
from hpctrain.training.step import StepStatus, build_train_step, params_finite

log = logging.getLogger("hpctrain")

# The schedule advances on every step, skipped ones included (step s always has lr(s)).
warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")


def logged_evaluations(run_dir: str, step: int) -> tuple[bool, bool]:
    """Whether metrics.jsonl holds `step`'s validation loss, and its downstream scores."""
    path = os.path.join(run_dir, METRICS_FILE)
    records = [r for r in read_metrics(run_dir, lenient=True) if r.get("step") == step] if os.path.exists(path) else []
    return any("val_loss" in r for r in records), any(str(k).startswith("eval/") for r in records for k in r)


class Trainer:
    def __init__(self, cfg: Config, run_dir: str, prepared, env, start: str | None):
        """`prepared`: the run's checked shape and data (`run.prepare`); `start`: what to resume from ("auto",
        a checkpoint directory, or None). The builds, in the order they depend on each other."""
        self.cfg, self.run_dir, self.env, self.shape = cfg, run_dir, env, prepared.shape
        self.tokens_per_step = prepared.shape.global_batch * prepared.seq_len
        _set_threads(cfg.cluster.num_threads)
        self.spec = spec_of(cfg.model)
        self._build_model()  # the mesh, the model on it, precision, optimizer and schedule
        self._build_step(prepared)  # the layout's step and the loss-spike guard it reports to
        self._build_checkpointer(start)  # the run state, what a checkpoint holds, the weights to start from
        self.feed = TrainFeed(cfg.data, cfg.train.seed, prepared.data_dir, self.shape, self.state, env.device,
                              self.shape.layout.batch_mesh(self.mesh))
        self._build_monitoring(prepared)  # throughput, sinks and alerts, metrics, evaluation, memory, profiling
        self.rollback = Rollback(self.checkpointer, self.state, self.feed, self.metrics, self.alerts, run_dir,
                                 cfg.monitor.loss_spike.max_rollbacks)
        self.signals = job.StopSignals(cfg.cluster.signal)
        self.gc = GcSchedule(cfg.train.gc_every)
        # last: its thread is stopped by fit(); a rank lost before its first heartbeat is named so
        m = cfg.monitor
        self.hang = HangWatch(run_dir, env.rank, env.world, m.hang_s or 0.9 * cfg.cluster.pg_timeout_s, m.heartbeat_s,
                              cfg.cluster.bad_nodes)
        self.memory.reset()
        self._log_start(prepared.seq_len)

    def _build_model(self) -> None:
        cfg, env, layout = self.cfg, self.env, self.shape.layout
        self.mesh = layout.build_mesh(env.device.type, cfg.cluster.pg_timeout_s)
        self.memory = MemoryProbe(env.device)  # before the model: its peak counts the build
        built = time.perf_counter()
        self.model = build_model(cfg.model, cfg.parallel, layout, self.mesh, env.device, compute_dtype(cfg.precision),
                                 cfg.train.seed)
        self.init_s = time.perf_counter() - built
        self.precision = setup_precision(cfg.precision, env.device)
        self.lr = scaled_lr(cfg.optim, self.shape.global_batch)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.lr)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.max_steps)

    def _build_step(self, prepared) -> None:
        cfg, t = self.cfg, self.cfg.train
        documents = DocumentMask(read_manifest(prepared.data_dir).eos_id, t.restart_positions) \
            if t.document_mask else None
        self.step = build_train_step(self.model, self.optimizer, self.precision, self.env.device, self.mesh,
                                     self.shape.layout, grad_clip=cfg.optim.grad_clip, grad_accum=self.shape.grad_accum,
                                     reduce_every_microbatch=sharded_gradients(cfg.parallel),
                                     fused_loss=t.fused_loss, passes=step_passes(self.optimizer), documents=documents,
                                     micro_shape=(self.shape.micro_batch, prepared.seq_len))
        self.balance = ExpertBalance(self.model, self.spec.args(cfg.model).moe, cfg.model.n_layers, self.env.device,
                                     copies=self.shape.layout.tp)
        spike = cfg.monitor.loss_spike
        self.spikes = LossSpikeGuard(spike.factor, spike.window, spike.action)
        self.step.check_losses(self.spikes.drop_update if self.spikes.enabled else None,
                               undo=SpikeAction(spike.action) == SpikeAction.skip_batch)

    def _build_checkpointer(self, start: str | None) -> None:
        self.state = RunState()
        self.lead = SignalLead.of(self.cfg.cluster, self.env.is_main)
        spec = self.spec
        self.checkpointer = Checkpointer(self.run_dir, self.cfg.train, self.model, self.optimizer,
                                         {"run": self.state, "scheduler": self.scheduler},
                                         {"scaler": self.precision.scaler, "loss_spike": self.spikes},
                                         self.cfg.cluster.pg_timeout_s, spec.weights(spec.args(self.cfg.model)),
                                         self._node_mtbf_h() * 3600 / job.job_nodes(), self.lead)
        self._start_weights(start)

    def _node_mtbf_h(self) -> float:
        """cluster.node_mtbf_h, or learned from the bad-node list (cluster.learn_mtbf): for train.ckpt_every=auto."""
        c = self.cfg.cluster
        if str(self.cfg.train.ckpt_every) != "auto" or not (c.learn_mtbf and c.bad_nodes):
            return c.node_mtbf_h
        hours, how = bad_nodes.node_mtbf_h(c.bad_nodes, c.node_mtbf_h)
        if self.env.is_main:
            log.info("node MTBF for the checkpoint cadence: %s", how)
        return hours

    def _build_monitoring(self, prepared) -> None:
        cfg, env, shape, t, m, spec = self.cfg, self.env, self.shape, self.cfg.train, self.cfg.monitor, self.spec
        self.n_params = spec.num_params(self.model)
        self.flops_per_token = spec.flops_per_token(spec.args(cfg.model), prepared.seq_len)
        self.peak = peak_flops(env.device, PrecisionName(cfg.precision.name).value, cfg.cluster.peak_tflops)
        throughput = Throughput(self.tokens_per_step, self.flops_per_token, self.peak.flops, env.world, env.device)
        self.energy = EnergyMeter(env.device, env.local_rank, self.state.tokens, m.energy_price_per_kwh,
                                  m.co2_g_per_kwh)
        self.sampler = CommSampler(m.sample_every, m.straggler_frac, env.world, env.device,
                                   t.profile_steps and tuple(t.profile_steps),
                                   cfg.cluster.bad_nodes if env.is_main else None, self.run_dir)
        ctx = Context(env.device, env.world, self.sampler.every,
                      job.node_failures(self.run_dir) if env.is_main else None, m.failure_window_s,
                      scores=bool(cfg.eval.tasks), moe=bool(cfg.model.moe.num_experts))
        sinks, self.alerts = run_sinks(cfg.logging, m, self.run_dir, self.state.step, t.max_steps, ctx,
                                       resolved_config(cfg, self.run_dir)) if env.is_main else ([], None)
        self.metrics = Metrics.for_run(t, sinks, self.state.step, throughput, self.feed.figures, self.feed.source_names)
        dp_rank = shape.layout.batch_mesh(self.mesh).get_local_rank()
        val = ValSplit.of(prepared.data_dir, shape, cfg.data, t)
        by_source = ValSplit.per_source(shape, cfg.data, t) if t.eval_every else {}
        self.evaluator = Evaluator(t.eval_every, t.max_steps, lambda: val.share(dp_rank), self.step, self.metrics,
                                   val.text_bytes if env.is_main else None,
                                   {name: (lambda v=v: v.share(dp_rank)) for name, v in by_source.items()})
        self.downstream = DownstreamEval(cfg.eval, t.max_steps, self.step, shape.layout.batch_mesh(self.mesh),
                                         prepared.data_dir, prepared.seq_len, self.metrics,
                                         os.path.join(self.run_dir, "eval_samples") if env.is_main else None,
                                         cfg.parallel.compile)
        self.eval_jobs = EvalJobs(cfg.eval, cfg.cluster, cfg.parallel, self.run_dir, self.metrics, t.max_steps,
                                  env.is_main)
        self.peaks = Peaks(self.memory.peak(), prepared.planned[self.mesh["pp"].get_local_rank()],
                           min(self.state.step + 2, t.max_steps))
        self.profiler = StepProfiler(self.run_dir, t.profile_steps and tuple(t.profile_steps), env.rank, env.device)
        self.snapshot = MemorySnapshot(self.run_dir, t.memory_snapshot, env.rank, env.device)

    def fit(self) -> dict:
        """Train to train.max_steps (or a stop signal); return the result, also written to result.json."""
        status, error, stop = RunStatus.running, None, Stop.NONE
        self.state.started_at = time.time()  # wall time counts training, not building
        self.start_step = self.state.step
        self.applied = self.overflowed = 0  # steps of this session applied, and skipped by fp16's loss scaling
        try:
            with self.metrics.redirect(), self.gc:
                self._evaluate_missed()
                while self.state.step < self.cfg.train.max_steps:
                    self.hang.begin(self.state.step + 1)  # the whole iteration: step, checkpoint, evaluation
                    if self._train_step():  # rolled back to the last checkpoint: nothing to save or evaluate
                        self.hang.end()
                        continue
                    stop = self.signals.agreed()  # every rank stops after the same step
                    self.checkpointer.poll()  # the outcome of a background write, the same on every rank
                    # The step's checkpoint first: an evaluation that fails must not cost finished steps.
                    saved = self.checkpointer.due(self.state.step, bool(stop)) or self.signals.checkpoint_agreed
                    if saved:
                        self.checkpointer.save(self.state.step)
                    if stop:
                        break
                    self._evaluate(saved)
                    self.hang.end()
            self.checkpointer.close()
            self._check_applied()
            if not stop:
                self._export_hf()
            self.eval_jobs.finish(wait=not stop)  # after every collective: the main rank alone may wait
            status = stop.status
        except BaseException as e:
            hung = self.hang.explain(e)
            status = RunStatus.interrupted if isinstance(e, KeyboardInterrupt) else RunStatus.failed
            error = hung or str(e)
            try:
                self.snapshot.close(e)
            except Exception as snap:  # noqa: BLE001 - never hide the run's own error behind the dump's
                log.error("the memory snapshot could not be written: %s", snap)
            self.checkpointer.close(failed=True)
            if hung:
                raise TrainingError(hung) from e
            full = no_space(e, self.run_dir) if isinstance(e, OSError) else None
            if full:  # a metrics line or a log: the run cannot go on, and one line says why
                raise TrainingError(f"{full} (writing {e.filename}): free space, then resume (train.resume=auto)") from e
            raise
        finally:
            self.hang.close()
            self.sampler.close()
            self.profiler.close()
            self.snapshot.close(None)
            result = self._finish(status, error)
        if stop:
            self._stopped(stop)
        return result

    def _train_step(self) -> bool:
        """One step, accounted and logged; whether it spiked and the run rolled back."""
        self.profiler.before_step(self.state.step + 1)
        self.sampler.before_step(self.state.step + 1)
        t0 = time.perf_counter()
        result = self.step(self.feed.next_step(), self.tokens_per_step, self.feed.step_groups(self.state.samples))
        self.scheduler.step()
        self.state.advance(self.shape.global_batch, self.tokens_per_step)
        step_time = time.perf_counter() - t0
        self.lead.after_step(step_time)
        self.profiler.after_step(self.state.step)
        sample = self.sampler.after_step(self.state.step, step_time)
        if sample:
            self.metrics.note(sample.metrics())
        self.metrics.note(self.balance.after_step(result.status == StepStatus.ok))
        self.metrics.note(self.gc.after_step(self.state.step))
        rollback = self._account(result)
        if self.state.step == self.peaks.at_step:
            self.peaks.report(self.memory.peak(), self.env.world)
        self.metrics.note(self.energy.after_step(self.state.tokens, self.metrics.due(self.state.step)))
        self.metrics.after_step(self.state, result, self.scheduler.get_last_lr()[0], step_time, self.feed.take_wait())
        for rule, action in self.alerts.take_actions() if self.alerts else ():
            log.warning("alert %s: %s", rule, "a checkpoint at the next step boundary" if action == "checkpoint"
                        else "the run stops at the next step boundary, after a checkpoint")
            self.signals.ask(action.value, rule)
        return rollback and self.rollback(self.spikes.last)

    def _account(self, result) -> bool:
        """Count a skipped step; too many non-finite ones in a row end the run. Whether the run must roll back."""
        s = self.state
        spike = self.spikes.last
        if spike and self.alerts:  # logged by the main rank: every rank saw the same spike
            log.warning("step %d: loss spike, %.4g above %g × %.4g (the median of the last %d steps): %s", s.step,
                        spike.loss, spike.factor, spike.median, self.spikes.window,
                        {"warn": "applied", "skip_batch": "step skipped",
                         "rollback": "rolling back to the last checkpoint"}[spike.action])
            self.alerts.record(spike.event(s.step))
        if result.status == StepStatus.spike:
            s.skipped_spike += 1
            return spike.action == SpikeAction.rollback.value
        if result.status == StepStatus.ok:
            s.consecutive_nonfinite = 0
            s.last_loss = result.loss
            self.applied += 1
        elif result.status == StepStatus.overflow:
            s.skipped_overflow += 1
            self.overflowed += 1
            log.warning("step %d: fp16 gradients overflowed; step skipped, loss scale now %g", s.step,
                        result.loss_scale)
        else:
            s.skipped_nonfinite += 1
            s.consecutive_nonfinite += 1
            log.warning("step %d: non-finite loss %s / grad norm %s; step skipped (%d in a row)", s.step, result.loss,
                        result.grad_norm, s.consecutive_nonfinite)
            if s.consecutive_nonfinite >= self.cfg.train.max_nonfinite:
                if not self.applied and s.last_loss is None:  # never a finite step: not the learning rate's doing
                    raise TrainingError(f"the loss was not finite from the first step on ({s.consecutive_nonfinite} "
                                        "steps): the starting weights or the data, not the learning rate; check "
                                        f"model.init_std={self.cfg.model.init_std}, model.init_from and the shards")
                raise TrainingError(f"{s.consecutive_nonfinite} consecutive non-finite steps (last at step {s.step}): "
                                    "lower optim.lr, raise optim.warmup_steps or use precision=bf16; resume from the "
                                    "last checkpoint")
        return False

    def _start_weights(self, start: str | None) -> None:
        """The checkpoint `start` restored (a resumed run continues its own weights), or on a fresh start
        model.init_from's weights loaded; checked finite (collective)."""
        self.resumed_from = self.checkpointer.restore(start)
        self.init_from = None if self.resumed_from else load_initial_weights(self.model, self.cfg.model, self.run_dir)
        self._check_start_finite()

    def _check_start_finite(self) -> None:
        """Never a run that starts from non-finite weights (collective)."""
        if params_finite(self.model):
            return
        if self.resumed_from:
            raise TrainingError(f"checkpoint {self.resumed_from} holds non-finite weights: resume from an earlier one "
                                "(train.resume=PATH)")
        origin = f"model.init_from={self.init_from}" if self.init_from else \
            f"drawn with model.init_std={self.cfg.model.init_std}"
        raise TrainingError(f"the starting weights are not finite ({origin}): start from finite weights")

    def _check_applied(self) -> None:
        """A run that trained steps but applied none of them (every one skipped) did not train: never "completed".
        (Only fp16 overflows is the loss scale still calibrating, as in the first steps of any fp16 run.)"""
        s, ran = self.state, self.state.step - self.start_step
        if ran > 0 and not self.applied and self.overflowed < ran:
            raise TrainingError(f"none of this run's {ran} steps was applied: every one was skipped ({s.skipped_nonfinite} "
                                f"non-finite, {s.skipped_overflow} fp16 overflows, {s.skipped_spike} loss spikes in all): "
                                f"check model.init_std={self.cfg.model.init_std}, model.init_from, optim.lr and "
                                "precision")

    def _export_hf(self) -> None:
        """train.export_hf_at_end: the final checkpoint as a transformers model, by the main rank, file by file."""
        if not self.cfg.train.export_hf_at_end or not self.env.is_main:
            return
        from hpctrain.weights.export_hf import export

        ckpt = checkpoint.latest(self.run_dir)
        if ckpt is None:  # (none was written: nothing to export)
            log.warning("train.export_hf_at_end: no checkpoint in %s to export", self.run_dir)
            return
        out = os.path.join(self.run_dir, "hf", os.path.basename(ckpt))
        if os.path.isdir(out):  # a finished run started again
            log.info("%s is exported already (%s)", ckpt, out)
            return
        os.makedirs(os.path.dirname(out), exist_ok=True)
        log.info("exported %s as a transformers model to %s", ckpt, export(self.cfg.model, self.cfg.data.path, ckpt, out))

    def _evaluate_missed(self) -> None:
        """The step a run resumes at, evaluated where it was due and nothing of it was logged: a step's checkpoint is
        written before its evaluation, so a stop there (preemption, a time limit) or a failed evaluation left it
        unscored. Every rank takes the main rank's reading of metrics.jsonl."""
        step = self.state.step
        due = self.evaluator.due(step), self.downstream.due(step)
        if not step or not any(due):
            return
        logged = [logged_evaluations(self.run_dir, step) if self.env.is_main else None]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(logged, src=0)
        missed = [d and not done for d, done in zip(due, logged[0])]
        if any(missed):
            log.info("step %d's evaluation did not run before the run stopped: evaluating it first", step)
            self.hang.begin(step)
            if missed[0]:
                self.evaluator.run(self.state)
            if missed[1]:
                self.downstream.run(self.state)
            self.hang.end()

    def _evaluate(self, saved: bool) -> None:
        t0 = time.perf_counter()
        if self.evaluator.due(self.state.step):
            try:
                self.evaluator.run(self.state)
            except DataError:  # (every rank evaluates the same batches: all of them are here)
                if not saved:
                    self.checkpointer.save(self.state.step)
                raise
        if self.downstream.due(self.state.step):
            self.downstream.run(self.state)
        if self.evaluator.due(self.state.step) or self.downstream.due(self.state.step):
            self.lead.after_eval(time.perf_counter() - t0)
        if saved and self.eval_jobs.due(self.state.step):  # eval.mode=job: the checkpoint just written
            self.eval_jobs.submit(self.state.step, checkpoint.latest(self.run_dir))
        self.eval_jobs.poll()

    def _finish(self, status: RunStatus, error: str | None) -> dict:
        failed = status in (RunStatus.failed, RunStatus.interrupted)
        if not failed:  # (a stopped run's handlers stay until it has requeued: _stopped)
            self.signals.restore(handlers=status == RunStatus.completed)
        self.metrics.close()
        s = self.state
        result = {"status": status.value, "error": error, "final_loss": s.last_loss, "final_val_loss": s.last_val_loss,
                  "steps": s.step, "tokens": s.tokens, "samples": s.samples, "skipped_nonfinite": s.skipped_nonfinite,
                  "skipped_overflow": s.skipped_overflow, "skipped_spike": s.skipped_spike,
                  "skipped_data": s.skipped_data, "stragglers": self.sampler.straggled,
                  "monitor_overhead_s": round(self.sampler.spent_s, 4), "stopped_by": self.signals.alert,
                  "data_corrupt_shards": self.feed.corrupt_shards,
                  "wall_time_s": s.elapsed_s(), "params": self.n_params, "world": self.env.world,
                  "memory": self.peaks.gathered, "checkpoints": self.checkpointer.summary(), "lost": self.hang.lost,
                  "energy": self.energy.summary()}
        if self._writes_result():
            try:
                write_json(os.path.join(self.run_dir, RESULT_FILE), result)
            except OSError as e:  # a full disk: the run's own error, if any, is the one to report
                if status == RunStatus.completed:
                    raise
                log.error("%s could not be written (%s): the run %s", RESULT_FILE, e, status.value)
        if self._adds_exposure() and job.in_slurm_job():  # the exposure a learned MTBF counts failures against
            bad_nodes.add_node_hours(self.cfg.cluster.bad_nodes, job.step_nodes() * s.elapsed_s() / 3600)
        if failed:  # only now: when a peer died, srun's SIGTERM (--kill-on-bad-exit) must not cut off result.json
            self.signals.restore(drain=False)
        return result

    def _next_node_rank(self) -> int:
        """The first rank on the node after rank 0's (the step's nodes: a supervised step leaves spares out), or the
        last rank of a one-node step."""
        return min(self.env.world - 1, max(1, self.env.world // job.step_nodes()))

    def _writes_result(self) -> bool:
        """Rank 0; when rank 0 was lost, the ranks that could be on rank 0's node or the next one's first (one of them
        survives a node's loss; each writes the same verdict)."""
        env = self.env
        return env.is_main or (self.hang.lost_rank0 and 1 <= env.rank <= self._next_node_rank())

    def _adds_exposure(self) -> bool:
        """Rank 0; when rank 0 was lost, the first rank of the next node (it survives rank 0's node's loss). Once per
        run: a failure left out of the node-hours would bias the learned MTBF low."""
        return self.env.is_main or (self.hang.lost_rank0 and self.env.rank == self._next_node_rank())

    def _stopped(self, stop: Stop):
        """Log the stop, requeue the job (the main rank, on the preemption signal), then put the previous signal
        handlers back. Only then: a rank's own copy of the signal can come after the ranks agreed to stop on
        another's (seen under load, 25 ms after the checkpoint), and submitit's handler, back in place, would have
        requeued the job itself and exited, without the bad-node list's ExcNodeList."""
        try:
            log.warning("stopped by %s after step %d; %s", self.signals.name(stop), self.state.step,
                        "checkpoint written" if self.checkpointer.enabled else "no checkpoint (train.checkpointing=false)")
            if stop == Stop.PREEMPT and self.env.is_main:
                self.signals.requeue(bad_nodes.leave_out(self.cfg.cluster.bad_nodes, self.cfg.cluster.bad_node_expiry_h))
        finally:
            self.signals.restore(drain=False)
        raise job.Stopped(stop, self.state.step, self.signals.name(stop), main=self.env.is_main)

    def _log_start(self, seq_len: int) -> None:
        if self.resumed_from:
            log.info("resumed from %s at step %d (sample %d)", self.resumed_from, self.state.step, self.state.samples)
        if not self.env.is_main:
            return
        sh = self.shape
        log.info("model %s: %.2fM parameters, %.3g training FLOPs/token; layout %s; global batch %d = micro %d × "
                 "accum %d × dp %d, seq_len %d; lr %.3g; %d CPU threads/rank; run dir %s", self.cfg.model.name,
                 self.n_params / 1e6, self.flops_per_token, sh.layout.describe(), sh.global_batch, sh.micro_batch,
                 sh.grad_accum, sh.dp, seq_len, self.lr, torch.get_num_threads(), self.run_dir)
        log.info("model built and initialised in %.2f s (each rank draws only its own shards)", self.init_s)
        active = " a token goes through: MoE layers' router, k routed and shared experts" \
            if self.cfg.model.moe.num_experts else ""
        log.info("%s; %.3g FLOPs per token = 6·N + 12·L·H·Q·T (N: matmul weights%s, output head included; full "
                 "attention)", self.peak.describe(), self.flops_per_token, active)
        if self.init_from:
            log.info("weights loaded from model.init_from=%s", self.init_from)
        if not self.checkpointer.enabled:
            log.warning("train.checkpointing=false: no checkpoint will be written; this run cannot be resumed")


def sharded_gradients(p: ParallelConfig) -> bool:
    """Whether gradients stay sharded through accumulation (ZeRO-2/3 with parallel.sharded_accumulation)."""
    return p.zero_stage >= 2 and p.sharded_accumulation


def _set_threads(num_threads: int | None) -> None:
    torch.set_flush_denormal(True)  # denormals make CPU fp32 steps ~10× slower late in training
    if num_threads:
        torch.set_num_threads(num_threads)
