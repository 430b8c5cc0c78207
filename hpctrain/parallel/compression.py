"""parallel.grad_compression for ZeRO-0: the data-parallel gradient sum, compressed, with error feedback.

The compressors are DDP communication hooks (`hook(state, bucket) -> Future[Tensor]`, the bucket's mean over the
group): PowerSGD is PyTorch's own (`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`, Vogels et al.
2019: a rank-r approximation of each gradient matrix, warm-started, with error feedback); top-k is `topk_hook`
below. `GradExchange` runs them on the model's gradients once per step, at the end of the last micro-batch's
backward, in buckets of whole gradients (what DDP hands a hook), instead of DDP's reducer: hpctrain's model stays
the plain module every other layout trains, and the exchange keeps its own state for checkpoints.

It does not overlap the exchange with backward as DDP does: compression is for links slow enough that the bytes,
not the overlap, decide.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from hpctrain.core.config import GradCompression
from hpctrain.core.memory import Term
from hpctrain.parallel.norms import all_finite

log = logging.getLogger("hpctrain")

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def memory_terms(params: int, largest_grad: int, undo: bool) -> dict[str, Term]:
    """Each rank's residual (4·P fp32, kept between steps, so held at every moment; 8·P when a skipped batch can be
    undone: the previous one kept too) and, at backward's end, three buckets (a bucket: 25 MB of whole gradients,
    or one larger gradient, `largest_grad` bytes): its flat buffer, PowerSGD's copy, the new residual."""
    residual = (2 if undo else 1) * 4 * params
    return {"grads": Term.held(residual),
            "reducing": Term(reduced=3 * min(max(BUCKET_BYTES, largest_grad), 4 * params))}


def saved_bytes(params: int, replicas: int) -> float:
    """What the compressor adds to a checkpoint: each data-parallel replica's residuals (4·P fp32 each: every rank
    saves its own). PowerSGD's warm-start factors are small and not counted."""
    return 4 * params * replicas


class Bucket:
    """The `GradBucket` interface DDP's communication hooks read: one flat buffer and its gradients as views."""

    def __init__(self, index: int, params: list[torch.Tensor], last: bool):
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])
        self._views = [v.view_as(p) for v, p in zip(self._buffer.split([p.numel() for p in params]), params)]

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer.copy_(buffer)


class TopKState:
    """top-k sparsification with error feedback (Stich et al. 2018, "Sparsified SGD with Memory"; Lin et al. 2018,
    "Deep Gradient Compression"): each rank sends the `fraction` of its bucket's entries largest in magnitude
    (gradient plus the residual of earlier steps) as (index, value) pairs and keeps the rest as its residual."""

    def __init__(self, process_group, fraction: float, start_iter: int):
        self.process_group, self.fraction, self.start_iter = process_group, fraction, start_iter
        self.iter = 0
        self.error_dict: dict[int, torch.Tensor] = {}


def topk_hook(state: TopKState, bucket) -> torch.futures.Future:
    """A DDP communication hook: the mean over the group of every rank's top-k entries (all-gathered int32
    indices and values), error feedback kept per bucket. Before `start_iter` steps, a plain all-reduce."""
    group = state.process_group or dist.group.WORLD
    world = group.size()
    buffer = bucket.buffer()
    fut = torch.futures.Future()
    if state.iter < state.start_iter:
        dist.all_reduce(buffer, group=group)
    else:
        i = bucket.index()
        if i in state.error_dict:
            buffer.add_(state.error_dict[i])
        k = max(1, int(state.fraction * buffer.numel()))
        index = buffer.abs().topk(k, sorted=False).indices
        values = buffer[index]
        residual = buffer.clone()
        residual[index] = 0
        state.error_dict[i] = residual
        indices = [torch.empty_like(index, dtype=torch.int32) for _ in range(world)]
        gathered = [torch.empty_like(values) for _ in range(world)]
        dist.all_gather(indices, index.to(torch.int32), group=group)
        dist.all_gather(gathered, values, group=group)
        buffer.zero_()
        buffer.index_add_(0, torch.cat(indices).long(), torch.cat(gathered))
    if bucket.is_last():
        state.iter += 1
    fut.set_result(buffer.div_(world))
    return fut


def _buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets, size = [[]], 0
    for p in params:
        if buckets[-1] and size + p.numel() * p.element_size() > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


class GradExchange:
    """Sums the gradients over `group` with a compression hook at the end of backward, when gradient sync is on
    (`set_requires_gradient_sync`, FSDP2's name: the step turns it on for the last micro-batch only)."""

    def __init__(self, model: nn.Module, group, method: GradCompression, rank: int, fraction: float,
                 start_step: int, seed: int = 0):
        self.model, self.group, self.method = model, group, GradCompression(method)
        self.world, self.approx_rank, self.fraction = group.size(), rank, fraction
        # Whether a step's effect on the compressor can be taken back (`undo`): a loss spike's skip_batch drops
        # updates after the exchange. It keeps the previous residuals until the next exchange (4 bytes per parameter).
        self.undoable = False
        if self.method == GradCompression.powersgd:
            self.state = powersgd.PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=start_step,
                                                random_seed=seed)
            self.hook = powersgd.powerSGD_hook
        else:
            self.state = TopKState(group, fraction, start_step)
            self.hook = topk_hook
        self.sync, self._queued, self._params, self._plan, self._undo = True, False, None, None, None
        # Bound at the first forward: parallelize runs on the meta device, whose parameters are replaced later.
        model.register_forward_pre_hook(self._bind)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.sync = sync

    def _bind(self, module, args) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self._params is not None and len(params) == len(self._params) and all(
                a is b for a, b in zip(params, self._params)):
            return
        self._params, self._plan = params, _buckets(params)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, param) -> None:
        if self.sync and not self._queued:  # once per backward, after every gradient has been accumulated
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._exchange)

    def _exchange(self) -> None:
        self._queued = False
        params = self._params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        if not all_finite(grads, self.group):
            # An overflow or NaN: summed plainly (the step skips it), the compressor's state left as it was.
            for g in grads:
                dist.all_reduce(g, group=self.group)
            self._undo = None
            return
        self._snapshot()
        for i, bucket_params in enumerate(self._plan):  # one bucket's flat buffer at a time
            bucket = Bucket(i, bucket_params, i == len(self._plan) - 1)
            self.hook(self.state, bucket).wait().mul_(self.world)  # the hooks average; hpctrain sums over dp
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                p.grad.copy_(g)

    # --- a dropped step (a loss spike's skip_batch): the compressor as it was before the step's exchange ---

    def _snapshot(self) -> None:
        if not self.undoable:
            return
        s = self.state
        # The residuals are replaced by new tensors at each exchange (kept here by reference); PowerSGD's factors
        # are updated in place (small: copied).
        self._undo = (s.iter, dict(s.error_dict), *(
            ({i: t.clone() for i, t in s.p_memory_dict.items()}, {i: t.clone() for i, t in s.q_memory_dict.items()},
             s.rng.get_state()) if self.method == GradCompression.powersgd else ()))

    def undo(self) -> None:
        """Forget the last exchange's effect on the compressor (its update was not applied): the residuals, step
        count and factors go back to what they were, so a dropped batch leaks nothing into later steps."""
        if self._undo is None:
            return
        s = self.state
        s.iter, s.error_dict = self._undo[0], self._undo[1]
        if self.method == GradCompression.powersgd:
            s.p_memory_dict, s.q_memory_dict = self._undo[2], self._undo[3]
            s.rng.set_state(self._undo[4])
        self._undo = None

    # --- checkpoints: "shared" (the same on every rank: step count, PowerSGD's factors and random state, the
    # settings) and "rank<r>" (this rank's residuals) ---

    def _tag(self) -> torch.Tensor:
        """The settings the state belongs to: the method and its own parameter."""
        powersgd = self.method == GradCompression.powersgd
        return torch.tensor([list(GradCompression).index(self.method), self.approx_rank if powersgd else 0,
                             0 if powersgd else self.fraction], dtype=torch.float64)

    def state_dict(self, rank: int) -> dict[str, torch.Tensor]:
        s = self.state
        out = {"shared.settings": self._tag(), "shared.iter": torch.tensor(s.iter, dtype=torch.int64)}
        out.update({f"rank{rank}.error.{i}": e for i, e in s.error_dict.items()})
        if self.method == GradCompression.powersgd:
            out.update({f"shared.p.{i}": t for i, t in s.p_memory_dict.items()})
            out.update({f"shared.q.{i}": t for i, t in s.q_memory_dict.items()})
            _, keys, pos, has_gauss, gauss = s.rng.get_state()
            out.update({"shared.rng.keys": torch.from_numpy(keys.astype(np.int64)),
                        "shared.rng.rest": torch.tensor([pos, has_gauss, gauss], dtype=torch.float64)})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], rank: int) -> None:
        """What `state_dict` saved (the shared part, and this rank's residuals if it had this rank). None of it, or
        another method or setting: the compressor starts afresh on every rank alike (the shared part is the same
        on all), plain all-reduce steps included; a rank the checkpoint did not have starts without residuals."""
        s = self.state
        if "shared.settings" not in state or not torch.equal(state["shared.settings"], self._tag()):
            log.info("parallel.grad_compression: the checkpoint holds no compressor state for these settings; the "
                     "compressor starts afresh")
            return
        device = next(self.model.parameters()).device

        def indexed(prefix: str) -> dict[int, torch.Tensor]:
            return {int(k[len(prefix):]): v.to(device) for k, v in state.items() if k.startswith(prefix)}

        s.iter = int(state["shared.iter"])
        s.error_dict = indexed(f"rank{rank}.error.")
        if self.method == GradCompression.powersgd:
            s.p_memory_dict, s.q_memory_dict = indexed("shared.p."), indexed("shared.q.")
            pos, has_gauss, gauss = state["shared.rng.rest"].tolist()
            s.rng.set_state(("MT19937", state["shared.rng.keys"].numpy().astype(np.uint32), int(pos), int(has_gauss),
                             gauss))


def apply_grad_compression(model: nn.Module, dp_mesh, method: GradCompression, rank: int, fraction: float,
                           start_step: int) -> None:
    """ZeRO-0 with parallel.grad_compression: the model stays plain (replicated) and a GradExchange sums its
    gradients over `dp_mesh`; the step finds it through `set_requires_gradient_sync`, as it finds FSDP2's."""
    if dp_mesh.size() == 1:
        return
    exchange = GradExchange(model, dp_mesh.get_group(), method, rank, fraction, start_step)
    model.grad_exchange = exchange
    model.set_requires_gradient_sync = exchange.set_requires_gradient_sync


def grad_exchange(model: nn.Module) -> GradExchange | None:
    """The model's compressed gradient exchange, if it has one (its state goes into checkpoints)."""
    return getattr(model, "grad_exchange", None)
