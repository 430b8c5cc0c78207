"""One optimizer step over the micro-batches of a global batch; the layout supplies it to the loop."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hpctrain.models.cross_entropy import IGNORE_INDEX
from hpctrain.models.moe import moe_layers, set_loss_weight
from hpctrain.models.packing import DocumentMask
from hpctrain.parallel.compression import grad_exchange
from hpctrain.parallel.context import SequenceSplit
from hpctrain.parallel.layout import PP_SCHEDULES, Layout, dp_mesh
from hpctrain.parallel.norms import all_finite, local, square_sums
from hpctrain.training.precision import Precision

log = logging.getLogger("hpctrain")


class StepStatus(str, Enum):
    ok = "ok"  # applied
    overflow = "overflow"  # fp16's loss scale backed off: skipped
    nonfinite = "nonfinite"  # a non-finite loss or gradient norm: skipped
    spike = "spike"  # the loss check (train's loss-spike guard) said so: skipped


@dataclass
class StepResult:
    loss: float  # mean over every token of the global batch
    grad_norm: float
    status: StepStatus
    loss_scale: float | None = None
    groups: list[float] | None = None  # with `Groups`: each group's summed loss, then each one's target tokens (global)


@dataclass(frozen=True)
class Groups:
    """The group (a mixture's source) of each of this rank's samples in a step, in micro-batch order, of `n`: the
    step then also sums the loss and the target tokens of each group, from its own forward (loss/<source>)."""

    ids: torch.Tensor  # [this rank's samples of the step] int64
    n: int


class SampleLosses:
    """Each sample's summed token loss and its target count, kept (detached) as the step's forward computes them."""

    def __init__(self):
        self.losses: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []

    def add(self, per_token: torch.Tensor) -> None:
        """[B, T] token losses (loss parallel's are replicated DTensors: read locally)."""
        per_token = local(per_token.detach()).float()
        self.losses.append(per_token.sum(1))
        self.tokens.append(torch.full_like(self.losses[-1], per_token.shape[1]))

    def keep_last(self, n: int) -> None:
        """Only the last `n` micro-batches' (a pipeline schedule's first run also calls its loss to infer shapes)."""
        self.losses, self.tokens = self.losses[len(self.losses) - n:], self.tokens[len(self.tokens) - n:]

    def by_group(self, groups: Groups, device: torch.device) -> torch.Tensor:
        """[2·n]: each group's summed loss, then its target tokens; zeros where no loss was computed (a pipeline's
        stages before the last)."""
        out = torch.zeros(2 * groups.n, device=device)
        if self.losses:
            ids = groups.ids.to(device)
            out[:groups.n].index_add_(0, ids, torch.cat(self.losses))
            out[groups.n:].index_add_(0, ids, torch.cat(self.tokens))
        return out


WHOLE = SequenceSplit()  # every token of each sequence on this rank (no context parallelism)


def token_loss_sum(model: nn.Module, batch: torch.Tensor, fused: bool = False, samples: SampleLosses | None = None,
                   documents: DocumentMask | None = None, split: SequenceSplit = WHOLE) -> torch.Tensor:
    """Summed next-token cross entropy of a [B, T+1] block of tokens. `fused`: the model computes it with its
    output projection, chunk by chunk (train.fused_loss: the logits are never held whole). `samples`: each sample's
    loss is also kept there. `documents`: each packed document attends only within itself (train.document_mask).
    `split`: this rank's tokens of each sequence (context parallelism), whose targets' loss is summed."""
    inputs, targets, given = split(batch[:, :-1], batch[:, 1:], documents)
    if fused:
        if samples is None:
            return model(inputs, targets, **given)
        total, per_token = model(inputs, targets, per_token=True, **given)
        samples.add(per_token)
        return total
    return cross_entropy_sum(model(inputs, **given), targets, samples)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, samples: SampleLosses | None = None) -> torch.Tensor:
    """Summed cross entropy of [B, T, vocab] logits (targets of -100 count nothing); `samples`: each sample's kept."""
    if samples is None:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    samples.add(per_token.view(targets.shape))
    return per_token.sum()


def token_scores(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B, 2] float64: each sample's summed log-probability of its scored targets (those not -100), and 1 where every
    one of them is the most likely token (lm-eval's loglikelihood answer); vocab-sharded logits (loss parallel) too."""
    keep = targets != IGNORE_INDEX
    logp = F.log_softmax(logits.float(), dim=-1)
    picked = -F.nll_loss(logp.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    best = logp.amax(-1)
    picked, best = (t.full_tensor() if isinstance(t, DTensor) else t for t in (picked, best))
    greedy = ((picked >= best) | ~keep).all(1)
    return torch.stack([picked.masked_fill(~keep, 0).sum(1).double(), greedy.double()], 1)


def _with_last(items: Iterable) -> Iterator[tuple[object, bool]]:
    """(item, is_last) pairs, looking one item ahead (FSDP reduces gradients only after the last)."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield current, False
        current = nxt
    yield current, True


def settle_pending_sums(params: list[torch.Tensor]) -> None:
    """Gradients left as a pending sum over tp (sequence-parallel norm weights) completed, placed as their
    parameter: what the norm and the optimizers read."""
    for p in params:
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=p.placements)


def grad_norm(params: list[torch.Tensor], mesh=None) -> torch.Tensor:
    """Global L2 norm of the gradients, whatever mesh and placement each one has (`norms.square_sums`), summed
    over pipeline stages, which hold disjoint parameters. Equals the one-process norm; `clip_grad_norm_` cannot
    mix meshes or DTensor and Tensor."""
    settle_pending_sums(params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = square_sums(grads).sum()
    if mesh is not None and mesh["pp"].size() > 1:
        dist.all_reduce(total, group=mesh["pp"].get_group())
    return total.sqrt()


def params_finite(model: nn.Module) -> bool:
    """Whether every rank's parameters are all finite (collective when distributed: every rank calls it)."""
    return all_finite([p.detach() for p in model.parameters()])


def clip_grads(params: list[torch.Tensor], max_norm: float, norm: float) -> None:
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        grads = [local(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)


class StepPass(Protocol):
    """An optimizer's own forward/backward before a step, when `due()`: `run(step, micro_batches, n_tokens)` may use
    the step's `_forward_backward` with another loss; the gradients it leaves are cleared after it."""

    def due(self) -> bool: ...

    def run(self, step: TrainStep, micro_batches: list[torch.Tensor], n_tokens: int) -> None: ...


class TrainStep:
    """One optimizer step; the same code for every layout.

    `mesh` (optional for one process) gives the groups: the loss is normalised by the tokens of all the ranks
    the batch is split over (`batch_mesh`, default the "dp" dim) and the loss shares are summed over `sum_mesh`
    (dp, or dp×cp when each sequence is split too: `split`), as the gradients are, so every layout computes the
    one-process gradients. `loss_parallel`: the model yields vocab-sharded logits (tensor
    parallel). `reduce_every_microbatch`: FSDP reduces (reduce-scatters) the gradients after each micro-batch
    instead of once after the last, so sharded gradients are never held whole. `fused_loss`: the model computes
    the loss with its output projection (`token_loss_sum`). `loss_check(loss)`, when set: whether a finite step
    must not be applied (a loss spike: the loss is the global mean, so every rank answers the same).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                 grad_clip: float, device: torch.device, mesh=None, loss_parallel: bool = False, batch_mesh=None,
                 reduce_every_microbatch: bool = False, fused_loss: bool = False):
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.grad_clip, self.device, self.mesh = grad_clip, device, mesh
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.norm_params = self.params  # what the gradient norm counts: each Parameter once
        self.loss_parallel, self.fused_loss = loss_parallel, fused_loss
        self.loss_ctx = loss_parallel_ctx(loss_parallel)
        self.batch_mesh = batch_mesh if batch_mesh is not None or mesh is None else dp_mesh(mesh)
        self.dp = self.batch_mesh.size() if self.batch_mesh is not None else 1
        self.sum_mesh, self.split = self.batch_mesh, WHOLE  # context parallelism: dp×cp, this rank's tokens
        # FSDP2 (any ZeRO stage): reduce gradients only after the last micro-batch, unless asked every time.
        self.grad_sync = None if reduce_every_microbatch else getattr(model, "set_requires_gradient_sync", None)
        self.loss_check = None
        self.exchange = grad_exchange(model)  # parallel.grad_compression
        self.passes: list[StepPass] = []  # the optimizer's passes before each step (`optimizer.step_passes`)
        self.samples: SampleLosses | None = None  # each sample's loss, in a step given Groups
        self.documents: DocumentMask | None = None  # train.document_mask
        self.moe = moe_layers(model)  # MoE layers: told each micro-batch's weight for their auxiliary losses

    def check_losses(self, check, undo: bool = False) -> None:
        """`check(loss)`: whether a finite step must not be applied (a loss spike); `undo`: such a dropped step's
        effect on a compressed gradient exchange is taken back (skip_batch; a rollback reloads it instead)."""
        self.loss_check = check
        if self.exchange is not None:
            self.exchange.undoable = undo and check is not None

    def __call__(self, micro_batches: Iterable[torch.Tensor], n_tokens: int | None = None,
                 groups: Groups | None = None) -> StepResult:
        """One step over `micro_batches` (an iterator is consumed lazily: one micro-batch in memory at a time);
        `n_tokens`: target tokens of the global batch, all dp ranks (computed from a list when not given); `groups`:
        the loss of each group of samples is summed too (`StepResult.groups`)."""
        scaler = self.precision.scaler
        # Normalise by the global batch's token count, not per micro-batch: 8×1 accumulation then
        # yields exactly the gradients of 1×8.
        if n_tokens is None:  # every dp rank holds an equal share of the global batch
            micro_batches = list(micro_batches)
            n_tokens = sum(b.shape[0] * (b.shape[1] - 1) for b in micro_batches) * self.dp
        self.optimizer.zero_grad(set_to_none=True)
        self.samples = None
        due = [p for p in self.passes if p.due()]
        if due:  # an optimizer's own forward/backward (Sophia's curvature) over the same batch
            micro_batches = list(micro_batches)
            for extra in due:
                extra.run(self, micro_batches, n_tokens)
                self.optimizer.zero_grad(set_to_none=True)
            for _, layer in self.moe:  # (its routing is not the step's: counted once, by the step's own pass)
                layer.reset_stats()
        self.samples = SampleLosses() if groups is not None else None
        figures = self._forward_backward(micro_batches, n_tokens).view(1)
        if groups is not None:  # reduced with the loss: no collective of its own
            figures = torch.cat([figures, self.samples.by_group(groups, figures.device)])
        self._reduce(figures)
        total = figures[0]
        if scaler:
            scaler.unscale_(self.optimizer)
        norm = grad_norm(self.norm_params, self.mesh)
        loss_value, norm_value = total.item(), norm.item()
        if self.grad_clip > 0 and math.isfinite(norm_value):
            clip_grads(self.params, self.grad_clip, norm_value)
        if not math.isfinite(loss_value) or (self.loss_check is not None and self.loss_check(loss_value)):
            status = StepStatus.nonfinite if not math.isfinite(loss_value) else StepStatus.spike
            if self.exchange is not None:
                self.exchange.undo()  # the compressor forgets the dropped batch
            if scaler:
                scaler.update()  # closes this iteration's unscale_; backs off if grads overflowed
        elif scaler:
            scale = scaler.get_scale()
            scaler.step(self.optimizer)  # skips the update itself when grads hold inf/nan
            scaler.update()
            status = StepStatus.overflow if scaler.get_scale() < scale else StepStatus.ok
        elif not math.isfinite(norm_value):
            status = StepStatus.nonfinite
        else:
            self.optimizer.step()
            status = StepStatus.ok
        return StepResult(loss_value, norm_value, status, scaler.get_scale() if scaler else None,
                          figures[1:].tolist() if groups is not None else None)

    def _reduce(self, figures: torch.Tensor) -> None:
        """Sum this rank's share of the loss (and of the groups') over the ranks the batch is split over; tensor-
        parallel ranks hold the same (replicated) loss already."""
        self._sum_over_replicas(figures)

    def _sum_over_replicas(self, t: torch.Tensor) -> None:
        """Sum `t` in place over `sum_mesh` (the ranks whose shares make the step's)."""
        if self.sum_mesh is not None and self.sum_mesh.size() > 1:
            dist.all_reduce(t, group=self.sum_mesh.get_group())

    def _forward_backward(self, micro_batches: Iterable[torch.Tensor], n_tokens: int, loss_sum=None) -> torch.Tensor:
        """Accumulate the gradients of all micro-batches; return this rank's share of the loss. `loss_sum(batch)`:
        another summed loss than the next-token cross entropy."""
        scaler = self.precision.scaler
        # another loss (Sophia's curvature pass) is not the training objective: no balancing losses in its gradients
        objective = loss_sum is None
        loss_sum = loss_sum or (lambda b: token_loss_sum(self.model, b, self.fused_loss, self.samples,
                                                              self.documents, self.split))
        total = torch.zeros((), device=self.device)
        for batch, last in _with_last(micro_batches):
            if self.grad_sync is not None:
                self.grad_sync(last)
            batch = batch.to(self.device, non_blocking=True)
            if self.moe:  # (get_scale: a host sync, only where it is needed)
                set_loss_weight(self.moe, (scaler.get_scale() if scaler else 1.0) / n_tokens if objective else 0.0)
            with self.loss_ctx():
                with self.precision.autocast():
                    loss = loss_sum(batch) / n_tokens
                (scaler.scale(loss) if scaler else loss).backward()
            total += local(loss.detach()).float()
        return total

    def evaluate(self, batches) -> float:
        """Mean token loss over every data-parallel rank's `batches` (each rank its own share)."""
        total, n = token_loss_total(self.model, batches, self.precision, self.device, self.loss_parallel,
                                    self.fused_loss, self.documents, self.split)
        return self._mean_over_replicas(total, n)

    def score_rows(self, wanted: int) -> int:
        """The rows a `score` batch holds (`wanted`: any number)."""
        return wanted

    @torch.no_grad()
    def score(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`token_scores` of one batch ([B, T] inputs, targets with -100 where nothing is scored), in eval mode and
        the run's precision; the same on every tensor-parallel rank. Every rank holding a part of the model calls it."""
        return self._evaluated(inputs, lambda logits: token_scores(logits, targets.to(self.device))).cpu()

    @torch.no_grad()
    def next_tokens(self, inputs: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """[B] the most likely token after position `last[b]` of each row of `inputs` [B, T] (greedy generation);
        the same on every tensor-parallel rank."""
        def pick(logits):
            if isinstance(logits, DTensor):  # vocab-sharded: the rows' whole vocabulary
                logits = logits.full_tensor()
            return logits[torch.arange(inputs.shape[0]), last.to(logits.device)].argmax(-1)

        return self._evaluated(inputs, pick).cpu()

    def _evaluated(self, inputs: torch.Tensor, use):
        """use(logits) of `inputs` [B, T], in eval mode (then back) and the run's precision, under loss parallel."""
        was_training = self.model.training
        self.model.eval()
        with self.loss_ctx(), self.precision.autocast():
            out = use(self.model(inputs.to(self.device)))
        self.model.train(was_training)
        return out

    def _mean_over_replicas(self, total: torch.Tensor, n: int) -> float:
        both = torch.stack([total, torch.tensor(float(n), dtype=torch.float64, device=total.device)])
        self._sum_over_replicas(both)
        return (both[0] / both[1].clamp(min=1)).item()


class PipelineTrainStep(TrainStep):
    """pp > 1: the same step, with forward/backward run by a pipeline schedule over this rank's stages.

    Gradient accumulation is the pipeline's own: the step's grad_accum micro-batches (of micro_batch samples per
    dp rank) go through ONE schedule run as its micro-batches, so the bubble is paid once per step:
    (pp−1)/(grad_accum·v + pp−1). The last stage's loss is the summed token cross entropy over the GLOBAL token
    count, gradients are not rescaled by the schedule and are summed over dp: exactly the one-process
    gradients. The loss is summed from the last stage over pp (other stages contribute 0) and over dp, so every
    rank logs the global mean.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                 grad_clip: float, device: torch.device, mesh, loss_parallel: bool, schedule: str,
                 n_microbatches: int, batch_mesh=None, micro_shape: tuple[int, int] = (1, 1)):
        """`micro_shape`: (samples, tokens) of a micro-batch, the shape the stages are built for."""
        from torch.distributed.pipelining import PipelineStage, schedules

        super().__init__(model, optimizer, precision, grad_clip, device, mesh, loss_parallel, batch_mesh)
        self.grad_sync = None  # the schedule runs FSDP's gradient reduction after its last microbatch
        copies = {id(p) for p in model.tied_copies}  # a tied embedding's copy on the last stage: counted once
        self.norm_params = [p for p in self.params if id(p) not in copies]
        group = mesh["pp"].get_group()
        stages = [PipelineStage(chunk, s, model.n_stages, device, group=group)
                  for chunk, s in zip(model.chunks, model.stages)]
        self.has_first, self.has_last = 0 in model.stages, model.n_stages - 1 in model.stages
        name, multi = PP_SCHEDULES[schedule]
        self.n_microbatches = n_microbatches
        self.schedule = getattr(schedules, name)(stages if multi else stages[0], n_microbatches,
                                                 loss_fn=self._loss, scale_grads=False)
        self._denom, self._scale = 1.0, 1.0
        self._scores: list[torch.Tensor] | None = None
        self._keep = token_scores  # what `_loss` keeps of each micro-batch while scoring or generating
        self.micro_shape = micro_shape

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Called for each micro-batch in order (the schedule's `losses` are in that order too).
        if self._scores is not None:  # scoring (`score`) or generating (`next_tokens`): kept, nothing to backpropagate
            self._scores.append(self._keep(logits, targets))
            return torch.zeros((), device=self.device)
        return cross_entropy_sum(logits, targets, self.samples) / self._denom * self._scale

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, forward_only: bool,
             documents: DocumentMask | None = None) -> torch.Tensor:
        """One schedule run over n_microbatches micro-batches stacked along dim 0 (`documents`: instead of the
        step's)."""
        # Every stage is given the documents and positions (keyword inputs reach all of them, split per micro-batch
        # as the inputs).
        inputs, targets, given = self.split(inputs.to(self.device, non_blocking=True), targets,
                                            documents or self.documents)
        args = (inputs,) if self.has_first else ()
        target = targets.to(self.device, non_blocking=True) if self.has_last else None
        losses: list[torch.Tensor] = []
        run = self.schedule.eval if forward_only else self.schedule.step
        with self.loss_ctx(), self.precision.autocast():
            run(*args, target=target, losses=losses, return_outputs=False, **given)
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += local(loss.detach()).float()
        return total

    def _forward_backward(self, micro_batches: Iterable[torch.Tensor], n_tokens: int) -> torch.Tensor:
        self._denom = float(n_tokens)
        # fp16: the schedule backpropagates the loss it is given, so the scale goes in there (a power of two:
        # exact); scale() also sets the scaler up on the stages without a loss, which unscale too.
        scaler = self.precision.scaler
        self._scale = scaler.scale(torch.ones((), device=self.device)).item() if scaler else 1.0
        batch = torch.cat(list(micro_batches))  # token ids: the step's whole local batch is small
        set_loss_weight(self.moe, self._scale / n_tokens)
        total = self._run(batch[:, :-1], batch[:, 1:], forward_only=False) / self._scale
        if self.samples is not None and self.samples.losses:
            self.samples.keep_last(self.n_microbatches)
        for _, layer in self.moe:  # (the same: the first run's shape inference forwards once more)
            layer.keep_last(self.n_microbatches)
        self.model.sync_tied_grads()
        return total

    def _reduce(self, figures: torch.Tensor) -> None:
        dist.all_reduce(figures, group=self.mesh["pp"].get_group())  # only the last stage holds the loss
        super()._reduce(figures)

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Validation batches go through the schedule n_microbatches at a time, as training's micro-batches do;
        a short last group (or batch) is padded with samples whose targets count nothing."""
        self._denom, self._scale, self.samples = 1.0, 1.0, None
        self.model.eval()
        total, n = torch.zeros((), device=self.device, dtype=torch.float64), 0
        group: list[torch.Tensor] = []
        for batch in batches:
            group.append(batch)
            n += self.split.tokens(batch.shape[0] * (batch.shape[1] - 1))
            if len(group) == self.n_microbatches:
                total += self._run(*_padded(group, self.n_microbatches), forward_only=True).double()
                group = []
        if group:
            total += self._run(*_padded(group, self.n_microbatches), forward_only=True).double()
        dist.all_reduce(total, group=self.mesh["pp"].get_group())  # the last stage's sum, on every stage
        self.model.train()
        return self._mean_over_replicas(total, n)


    def score_rows(self, wanted: int) -> int:
        return self.n_microbatches * self.micro_shape[0]  # the schedule's shape

    @torch.no_grad()
    def next_tokens(self, inputs: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """As TrainStep.next_tokens, through the schedule at its training shape: the one target set per row marks
        the position whose most likely next token the last stage keeps (as a float, summed over pp)."""
        targets = torch.full(inputs.shape, IGNORE_INDEX, dtype=torch.int64)
        targets[torch.arange(inputs.shape[0]), last] = 0

        def pick(logits, marked):
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            at = (marked != IGNORE_INDEX).int().argmax(1)
            best = logits[torch.arange(logits.shape[0], device=logits.device), at].argmax(-1)
            return torch.stack([best.double(), torch.zeros_like(best, dtype=torch.float64)], 1)

        return self._through_schedule(inputs, targets, pick)[:, 0].long()

    @torch.no_grad()
    def score(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """As TrainStep.score, through the schedule: the batch padded to its n_microbatches micro-batches of the
        training shape ([rows, T] with rows <= n_microbatches × micro_batch and T the training length: the stages'
        buffers are sized for it); the last stage's scores are summed over pp, so every stage returns them."""
        rows, length = self.n_microbatches * self.micro_shape[0], self.micro_shape[1]
        if inputs.shape[0] > rows or inputs.shape[1] > length:
            raise ValueError(f"a pipeline scores batches of at most {rows} rows of {length} tokens, got "
                             f"{list(inputs.shape)}")
        return self._through_schedule(inputs, targets, token_scores)

    def _through_schedule(self, inputs: torch.Tensor, targets: torch.Tensor, keep) -> torch.Tensor:
        """[rows, 2] float64 of `keep(logits, targets)` over the padded batch, from the last stage, on every stage."""
        rows, length = self.n_microbatches * self.micro_shape[0], self.micro_shape[1]
        padded_in = torch.zeros((rows, length), dtype=inputs.dtype)
        padded_t = torch.full((rows, length), IGNORE_INDEX, dtype=targets.dtype)
        padded_in[:inputs.shape[0], :inputs.shape[1]] = inputs
        padded_t[:targets.shape[0], :targets.shape[1]] = targets
        self.model.eval()
        self._scores, self._keep = [], keep
        try:
            # a masked model's stages take documents: each row is one (the same keyword inputs as training)
            self._run(padded_in, padded_t, True, self.documents and self.documents.one_per_row())
            scores = torch.cat(self._scores[len(self._scores) - self.n_microbatches:]) if self._scores else \
                torch.zeros((rows, 2), dtype=torch.float64, device=self.device)
        finally:
            self._scores = None
            self.model.train()
        dist.all_reduce(scores, group=self.mesh["pp"].get_group())  # only the last stage scored
        return scores[:inputs.shape[0]].cpu()


def _padded(group: list[torch.Tensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of `n` micro-batches shaped like the group's first: missing samples repeat
    its first sample with every target -100, so they add no loss."""
    first = group[0]
    rows = first.shape[0]
    inputs, targets = [], []
    for i in range(n):
        batch = group[i] if i < len(group) else first[:0]
        pad = rows - batch.shape[0]
        inputs.append(torch.cat([batch[:, :-1], first[:1, :-1].expand(pad, -1)]))
        targets.append(torch.cat([batch[:, 1:], torch.full((pad, first.shape[1] - 1), -100, dtype=first.dtype)]))
    return torch.cat(inputs), torch.cat(targets)


def build_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, device: torch.device,
                     mesh, layout: Layout, *, grad_clip: float, grad_accum: int = 1,
                     reduce_every_microbatch: bool = False, fused_loss: bool = False,
                     passes: Sequence[StepPass] = (), documents: DocumentMask | None = None,
                     micro_shape: tuple[int, int] = (1, 1)) -> TrainStep:
    """The layout's step, chosen here once: the loop only calls it (and its `evaluate`). A pipelined step runs
    its `grad_accum` micro-batches as one schedule, which reduces once after the last of them. `fused_loss`
    (train.fused_loss) is refused with pipelines and tensor parallelism before this (`resolve`)."""
    if layout.pipelined:
        step = PipelineTrainStep(model, optimizer, precision, grad_clip, device, mesh, layout.loss_parallel,
                                 layout.pp_schedule, grad_accum, layout.batch_mesh(mesh), micro_shape)
    else:
        step = TrainStep(model, optimizer, precision, grad_clip, device, mesh, layout.loss_parallel,
                         layout.batch_mesh(mesh), reduce_every_microbatch, fused_loss)
    step.passes, step.documents = list(passes), documents
    if layout.cp > 1:
        step.sum_mesh, step.split = layout.reduce_mesh(mesh), SequenceSplit(layout.cp, mesh["cp"].get_local_rank())
    return step


def loss_parallel_ctx(enabled: bool):
    return loss_parallel if enabled else contextlib.nullcontext


@torch.no_grad()
def token_loss_total(model: nn.Module, batches, precision: Precision, device: torch.device,
                     loss_parallel: bool = False, fused: bool = False, documents: DocumentMask | None = None,
                     split: SequenceSplit = WHOLE) -> tuple[torch.Tensor, int]:
    """(summed token loss in float64, target tokens) over the given batches (this rank's tokens of them: `split`),
    in eval mode."""
    was_training = model.training
    model.eval()
    total, n = torch.zeros((), device=device, dtype=torch.float64), 0
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        with loss_parallel_ctx(loss_parallel)(), precision.autocast():
            total += local(token_loss_sum(model, batch, fused, documents=documents, split=split)).double()
        n += split.tokens(batch.shape[0] * (batch.shape[1] - 1))
    model.train(was_training)
    return total, n
