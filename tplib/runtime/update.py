"""One rank's optimizer step (the ``OPT`` action): GPT-3's recipe over a pipeline.

The gradients are clipped to a global norm computed as one device computes it over the
whole model: each gradient counted once, whichever ranks hold copies of it, in one
all-reduce over the world. Then AdamW steps with the learning rate :mod:`tplib.nn.lr` gives
the iteration (fp16: on the fp32 master weights, skipped by every rank together when any
gradient overflowed, and then not clipped), and the gradients, which stay allocated, are
zeroed.

Where a parameter's gradient accumulates is its *gradient buffer*
(:meth:`Update.grad_buffers`): ``.grad`` in fp32 and bf16, the fp32 ``main_grad`` in fp16
(:mod:`tplib.nn.precision`). The data-parallel and tied-embedding all-reduces sum those,
and under sequence parallelism so does the #Op group's sum of the replicated parameters'
gradients (:meth:`Update.sum_sequence_shards`). Under context parallelism each CP rank's
gradients are those of its tokens' share of the loss: the data-parallel reduction runs
over #Data x #CP ranks (as Megatron's), so every rank steps with the whole batch's.

With the distributed optimizer (``Parallelism.distributed_optimizer``) the buffers are
views of one flat buffer: after the tied all-reduce they are reduce-scattered over #Data
instead of all-reduced, each replica clips and steps its own shard
(:class:`~tplib.nn.sharded_optimizer.ShardedOptimizer`), counting its shard in the norm,
and the updated parameters are all-gathered (the shards are over #Data x #CP under
context parallelism); an fp16 skip is still taken by every rank together, and then
nothing is gathered, since no shard moved. The reduction is not
overlapped with the last backward: it starts at ``AR``, as the all-reduce does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from tplib.nn.model import GPTStage
from tplib.nn.oppart import shard_spec
from tplib.nn.optimizer import DECAY_RULES, MixedPrecisionOptimizer, PlainOptimizer, make_optimizer
from tplib.nn.sharded_optimizer import ShardedOptimizer, flat_views
from tplib.nn.wgrad import grad_buffer
from tplib.runtime.groups import RankGroups, shared_weight
from tplib.runtime.parts import Optim
from tplib.runtime.runconfig import RunConfig

__all__ = ["Update", "stage_optimizer"]


def stage_optimizer(
    params: list[torch.nn.Parameter], precision: str, optim: Optim
) -> MixedPrecisionOptimizer | PlainOptimizer:
    """The optimizer a run's stage steps with, on ``optim``'s AdamW options (a run's, or
    the defaults), its gradient buffers allocated once and kept between steps, as
    the memory model assumes (fp16: each parameter's fp32 main_grad, attached here)."""
    optimizer = make_optimizer(
        params,
        precision,
        lr=optim.lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
        eps=optim.adam_eps,
        decay=DECAY_RULES[optim.weight_decay_params],
    )
    for p in params:
        if grad_buffer(p) is None:
            p.grad = torch.zeros_like(p)
    return optimizer


class Update:
    """The optimizer of one rank's stage shard and how it steps: of its one stage module,
    or with virtual stages of all its chunks' modules together."""

    def __init__(
        self, run: RunConfig, stage: GPTStage | Sequence[GPTStage], groups: RankGroups
    ) -> None:
        self.run, self.groups = run, groups
        self.stages = [stage] if isinstance(stage, GPTStage) else list(stage)
        self.params = [p for s in self.stages for p in s.parameters()]
        self.optimizer: MixedPrecisionOptimizer | PlainOptimizer | ShardedOptimizer
        if run.parallelism.distributed_optimizer:  # this replica's shard of #Data
            optim = run.optim
            n_shards = run.parallelism.n_data * run.parallelism.n_cp
            self.optimizer = ShardedOptimizer(
                self.params, run.precision, shard=groups.reduce_index, n_shards=n_shards,
                lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay,
                eps=optim.adam_eps, decay=DECAY_RULES[optim.weight_decay_params],
            )  # fmt: skip
        else:
            self.optimizer = stage_optimizer(self.params, run.precision, run.optim)
        self.lr_schedule = run.lr_schedule
        # This rank's copies of a tied embedding: none, one (the other is on another
        # stage), or both (a V of virtual stages puts the first and last parts here).
        self.tied = [w for s in self.stages if (w := shared_weight(s)) is not None]
        self.counted = self._counted()
        self.grad_norms: list[Tensor] = []  # per timed step, on the device: no sync per step
        self.steps_skipped = 0

    def grad_buffers(self) -> list[Tensor]:
        """Each parameter's gradient buffer, in ``self.params`` order: its fp32
        ``main_grad`` (fp16) or ``.grad``. Allocated once and kept: what the all-reduces
        sum and :meth:`step` zeroes."""
        buffers = [grad_buffer(p) for p in self.params]
        assert all(b is not None for b in buffers)  # allocated in __init__
        return [b for b in buffers if b is not None]

    def tied_grad_buffers(self) -> list[Tensor]:
        """The gradient buffers of this rank's copies of the tied embedding: what the tied
        all-reduce (one copy here) or the local sum (both here) adds up."""
        buffers = [grad_buffer(w) for w in self.tied]
        return [b for b in buffers if b is not None]

    def sum_sequence_shards(self) -> None:
        """Under sequence parallelism, sum the gradients of the parameters replicated over
        #Op (LayerNorms, the position embedding, the row-parallel biases) over the #Op
        group: each rank's holds only its shard of the tokens' part, and the sum is the
        whole model's gradient, the same on every op rank. Nothing to do otherwise."""
        if not self.run.parallelism.sequence_parallel or self.groups.op is None:
            return
        stage_names = [n for s in self.stages for n, _ in s.named_parameters()]
        replicated = [
            g
            for name, g in zip(stage_names, self.grad_buffers(), strict=True)
            if shard_spec(name) is None
        ]
        if replicated:
            self.groups.all_reduce_flat(replicated, self.groups.op)

    def reduce_gradients(self) -> None:
        """Sum the stage's gradient buffers across its data-parallel replicas and CP ranks
        (after the tied embedding's sum): all-reduced, or with the distributed optimizer
        reduce-scattered, each getting the sum of its own shard."""
        data = self.groups.data
        if data is None:
            return
        if isinstance(self.optimizer, ShardedOptimizer):
            self.groups.reduce_scatter_flat(
                self.optimizer.flat_grads, self.optimizer.grad_shard, data
            )
        else:
            self.groups.all_reduce_flat(self.grad_buffers(), data)

    def reduced_grads(self) -> list[Tensor]:
        """After :meth:`reduce_gradients`, each parameter's gradient summed over the
        replicas: its buffer, or with the distributed optimizer a copy gathered from
        every replica's shard (for the ``collect_grads`` hook; a collective over #Data)."""
        opt, data = self.optimizer, self.groups.data
        if not isinstance(opt, ShardedOptimizer) or data is None:
            return self.grad_buffers()
        flat = opt.flat_grads.clone()
        lo, hi = opt.layout.shard(self.groups.reduce_index)
        self.groups.all_gather_flat(flat, flat[lo:hi], data)
        return flat_views(flat, [p.shape for p in self.params], opt.layout)

    def _counted(self) -> list[bool]:
        """Whether this rank adds each of its gradients (the optimizer's ``grads()``, in
        order: per parameter, or with the distributed optimizer per piece of its shard)
        to the global norm: every gradient of the model exactly once.

        Data-parallel replicas and CP ranks hold equal gradients after the all-reduce:
        replica 0's CP rank 0 counts them; with the distributed optimizer each replica holds the sum of its
        own shard only, and counts that. Replicated parameters (shard_spec None) are
        equal on every op rank: op rank 0 counts them; every op rank counts its shard of
        a partitioned one (vocabulary padding rows have zero gradient). The tied
        embedding's two copies hold the same summed gradient after the tied all-reduce:
        the first part's (the embedding, not the head) counts it.
        """
        g = self.groups
        counted = []
        for stage in self.stages:
            head = shared_weight(stage) if stage.is_last else None
            for name, p in stage.named_parameters():  # the order of self.params
                mine = g.op_rank == 0 or shard_spec(name) is not None
                counted.append(mine and p is not head)
        assert len(counted) == len(self.params)
        if isinstance(self.optimizer, ShardedOptimizer):
            return [counted[piece.param] for piece in self.optimizer.pieces]
        return [c and g.reduce_index == 0 for c in counted]

    def step(self, index: int) -> None:
        """Iteration ``index``'s update: clip, set the learning rate, step, zero."""
        found_inf = self.optimizer.unscale_grads()
        if self.run.precision == "fp16":  # all ranks skip together or none does
            self.groups.all_reduce(found_inf, None, dist.ReduceOp.MAX)
        skip = bool(found_inf.item())
        if self.run.optim.grad_clip > 0:
            # A skipped step's gradients are garbage: neither clipped nor counted.
            norm = torch.full((), float("nan")) if skip else self._clip()
            if index >= self.run.timing.warmup:
                self.grad_norms.append(norm)
        self.optimizer.set_lr(self.lr_schedule.lr_at(index))
        if not self.optimizer.step(skip):
            self.steps_skipped += 1
        elif isinstance(opt := self.optimizer, ShardedOptimizer) and self.groups.data is not None:
            self.groups.all_gather_flat(opt.flat_params, opt.param_shard, self.groups.data)
        for g in self.grad_buffers():
            g.zero_()

    def _clip(self) -> Tensor:
        """Scale the gradients the step will use (fp16: the unscaled fp32 main grads) by
        ``min(1, grad_clip / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does,
        where ``norm`` is the whole model's gradient norm; return that norm (0-d)."""
        grads = self.optimizer.grads()
        mine = [g for g, c in zip(grads, self.counted, strict=True) if c and g is not None]
        device = self.params[0].device
        squares = torch.zeros((), dtype=torch.float32, device=device)
        if mine:
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in mine])
            squares = norms.square().sum()
        self.groups.all_reduce(squares, None)  # every rank of the world, the same sum on each
        norm = squares.sqrt()
        coef = torch.clamp(self.run.optim.grad_clip / (norm + 1e-6), max=1.0)
        for g in grads:
            if g is not None:
                g.mul_(coef.to(g.dtype))
        return norm
