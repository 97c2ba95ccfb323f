"""The per-process pipeline interpreter: one process per (replica, stage, CP rank, op rank)
runs its stage's list of actions, iteration after iteration (an asynchronous schedule's list
spans every iteration of the run, and is walked once). Under context parallelism a rank
feeds its stage this CP rank's chunks of every unit (:func:`tplib.nn.ring.cp_shard`).

Each process builds its shard of its stage of the model (with virtual stages, of each of
its chunks: one module and one executor per chunk), then walks the actions of
:attr:`RunConfig.schedule <tplib.runtime.RunConfig.schedule>` through a dispatch
table from action kind to method (:data:`Worker.DISPATCH`): receive, forward, send and
the same for gradients (under a zero-bubble schedule the backward leaves the weight
gradients to ``W`` actions), through a :class:`~tplib.nn.slicing.SliceExecutor` that keeps each
sequence's K/V context and routes the K/V gradients between token slices; then the
gradient all-reduce (across data-parallel replicas, and between the two copies of a tied
embedding) and the optimizer step. A new kind of action is one method and one table entry.

The step is GPT-3's recipe (:mod:`tplib.runtime.update`); who talks to whom, and how, is
:mod:`tplib.runtime.groups`. Under an asynchronous schedule each forward and backward
first installs the weight version it names (:mod:`tplib.runtime.versions`).

Messages between stages are :mod:`tplib.runtime.messages`'s: posted where the schedule's
posting plan says, so that NCCL cannot deadlock; a send is completed before the
all-reduce, a receive blocks at its own place in the list, with a timeout, until its
tensor arrives. Every action is timed into a trace (:mod:`tplib.runtime.clock`: on a GPU
by CUDA events, read once the iteration is over), and where the rank is goes to a
:class:`~tplib.runtime.rank.Progress` that the pool reports if the rank dies.

Each rank measures its stage's peak memory (:mod:`tplib.runtime.memory`). What each
iteration trains on, and under per-batch plans its schedule, is :mod:`tplib.runtime.batches`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from tplib.nn.bytecount import context_tensors
from tplib.nn.dropout import DropoutKey
from tplib.nn.precision import autocast, param_dtype
from tplib.nn.ring import cp_shard
from tplib.nn.slicing import unit_rows
from tplib.plan import Unit
from tplib.runtime.batches import iteration_batch, on_device
from tplib.runtime.chunk import build_chunks, held_contexts
from tplib.runtime.clock import Mark, PassClock
from tplib.runtime.groups import RankGroups
from tplib.runtime.memory import MemoryMeter, StageMemory, reset_cuda_peak
from tplib.runtime.messages import Messages
from tplib.runtime.rank import TRACE_COLUMNS, Progress, RankResult
from tplib.runtime.runconfig import Hooks, RunConfig
from tplib.runtime.update import Update
from tplib.runtime.versions import WeightVersions
from tplib.schedule import Action, Kind
from tplib.schedule.nccl import posting_plan

__all__ = ["TRACE_COLUMNS", "RankResult", "Worker", "run_worker"]  # results: rank.py


@dataclass
class _Iteration:
    """What the actions of one pass over the schedule (one iteration; every iteration
    of an asynchronous schedule) hand each other."""

    index: int  # the first iteration the pass runs
    tokens: Tensor  # this replica's sequences, iteration after iteration, on the device
    targets: Tensor
    loss: Tensor  # per iteration, the last stage's summed scaled loss, on the device
    # Keyed by the consuming compute action's (kind, b, t, chunk), whatever its weight
    # version: what came in a message, or from the neighbouring chunk on this rank.
    received: dict[tuple[Kind, int, int, int], Tensor] = field(default_factory=dict)
    # Keyed by (chunk, unit): outputs and input gradients awaiting their send.
    outputs: dict[tuple[int, Unit], Tensor] = field(default_factory=dict)


Handler = Callable[["Worker", Action, _Iteration], None]


class Worker:
    """One rank of a run: its stage shard, optimizer, executor and process groups."""

    def __init__(
        self, run: RunConfig, rank: int, hooks: Hooks = Hooks(), progress: Progress | None = None
    ) -> None:
        self.run, self.rank, self.hooks = run, rank, hooks
        self.progress = progress or Progress.local(run.parallelism.world_size)
        self.progress.set(rank, 0, Progress.SETUP)
        self.replica, self.stage_id, self.op_rank, cp_rank = run.parallelism.position(rank)
        self.schedule = run.schedule
        self.plan = self.schedule.plan  # an asynchronous one: every iteration's units
        self.device = torch.device(run.device)
        self.groups = RankGroups(run, rank, self.device)
        self.cp = self.groups.cp_group()  # None without context parallelism
        self.wire_dtype = param_dtype(run.precision)
        self.meter = MemoryMeter()
        self.counting = self.device.type == "cpu" and hooks.count_memory
        self.asynchronous = self.schedule.asynchronous
        self.chunks = build_chunks(
            run,
            self.stage_id,
            self.device,
            op=self.groups.op_group(),
            cp=self.cp,
            hold=self.meter.hold if self.counting else None,
        )
        self.modules = [chunk.module for chunk in self.chunks]
        self.update = Update(run, self.modules, self.groups)
        self.params = self.update.params
        self.meter.exclude(self.params)
        posting = run.posting[self.stage_id]
        self.messages = Messages(
            self.plan, self.stage_id, posting, self.groups, hidden=run.cfg.hidden,
            wire_dtype=self.wire_dtype, device=self.device,
        )  # fmt: skip
        self.versions: WeightVersions | None = None
        self.updates = 0  # optimizer steps made so far
        self.position = 0  # the index of the action running in the stage's list
        if self.asynchronous:  # one chunk per stage: the validator sees to it
            self.versions = WeightVersions(self.modules[0], self.schedule.actions[self.stage_id])
        else:
            # Contexts up front: they are static memory, never counted as activations.
            for b in range(self.plan.n_batch_slices):
                self.meter.exclude(context_tensors([c.executor.context(b) for c in self.chunks]))
        first = (self.modules[0].lo, self.modules[0].hi)  # the first chunk's, with several
        self.result = RankResult(rank, self.stage_id, self.replica, first, self.op_rank)
        self.result.cp_rank = cp_rank

    def _hand_on(self, it: _Iteration, action: Action, step: int, tensor: Tensor) -> None:
        """Pass a forward's output (``step`` +1) or a backward's input gradient (-1) on: to
        the neighbouring chunk when this stage holds it, else to the send."""
        other = self.schedule.neighbour(action, step)
        if other is not None and other[0] == self.stage_id:
            consumer = Kind.F if step > 0 else Kind.B
            it.received[consumer, action.b, action.t, other[1]] = tensor
        else:
            it.outputs[action.chunk, action.unit] = tensor

    # ---- the actions ----------------------------------------------------------------

    def receive(self, action: Action, it: _Iteration) -> None:
        """RA / RG: wait for a unit's activation or gradient (:meth:`Messages.take`),
        for the forward or backward that consumes it."""
        consumer = Kind.F if action.kind is Kind.RA else Kind.B
        it.received[consumer, action.b, action.t, action.chunk] = self.messages.take(action)

    def forward(self, action: Action, it: _Iteration) -> None:
        """F: the unit's forward on its chunk (on its weight version); the model's last
        part adds its scaled loss."""
        unit, chunk = action.unit, self.chunks[action.chunk]
        if self.versions is not None:
            self.versions.use(action.v)
        x = it.received.pop((action.kind, action.b, action.t, action.chunk), None)
        if x is None:  # token ids: this CP rank's chunks of them
            x = cp_shard(unit_rows(self.plan, unit, it.tokens), self.cp)
        last = chunk.module.is_last
        y = cp_shard(unit_rows(self.plan, unit, it.targets), self.cp) if last else None
        if self.asynchronous and self.counting:  # allocated as the unit enters
            self.meter.exclude(context_tensors([chunk.executor.context(unit.b)]))
        out = chunk.executor.forward(unit, x, y)
        if last:
            it.loss[self.schedule.iteration_of(unit.b)] += out.float()
        else:
            self._hand_on(it, action, 1, out)

    def backward(self, action: Action, it: _Iteration) -> None:
        """B: the unit's backward on its chunk (on its forward's weight version); hands the
        input gradient on to the previous part."""
        if self.versions is not None:
            self.versions.use(action.v)
        chunk = self.chunks[action.chunk]
        grad_in = it.received.pop((action.kind, action.b, action.t, action.chunk), None)
        grad = chunk.executor.backward(action.unit, grad_in)
        if not chunk.module.is_first:
            assert grad is not None  # a hidden-state input always has a gradient
            self._hand_on(it, action, -1, grad)

    def weight_grad(self, action: Action, it: _Iteration) -> None:
        """W: the weight gradients a split backward deferred, of the unit or (``W b``)
        of the whole sequence in one product per weight."""
        self.chunks[action.chunk].executor.weight_grad(action.b, action.t)

    def send(self, action: Action, it: _Iteration) -> None:
        """SA / SG: nothing left to do here: the unit's output or input gradient was
        posted with its group (:meth:`Messages.post`, at or before this place); it is
        completed before AR."""

    def allreduce(self, action: Action, it: _Iteration) -> None:
        """AR: complete the sends (a synchronous schedule's), then sum the gradients of the
        tied embedding's two copies and the stage's gradients across its data-parallel
        replicas."""
        if not self.asynchronous:  # in flight, a send may wait on a later receive
            self.messages.complete_sends()
        # Gradient buffers: .grad, or fp16's fp32 main_grad (tplib.runtime.update). The
        # first part's embedding and the last part's head are one parameter of the model:
        # each copy gets the sum of both gradients.
        shared = self.update.tied_grad_buffers()
        if len(shared) == 2:  # both parts on this stage (a V of virtual stages)
            shared[0].add_(shared[1])
            shared[1].copy_(shared[0])
        elif shared and self.groups.tied is not None:
            self.groups.all_reduce(shared[0], self.groups.tied)
        self.update.sum_sequence_shards()  # sequence parallelism's replicated parameters
        # The loss is already scaled by the global batch: summing gives the mean's
        # gradient (with the distributed optimizer, reduce-scattered: each replica's shard).
        self.update.reduce_gradients()

    def step(self, action: Action, it: _Iteration) -> None:
        """OPT: the optimizer step (:class:`~tplib.runtime.update.Update`); under an
        asynchronous schedule the versions still in use are stashed first."""
        index = self.updates  # one update per iteration, in order
        if self.hooks.collect_grads and index == 0:
            scale = self.update.optimizer.loss_scale
            # Update.params' order: chunk by chunk.
            names = [n for m in self.modules for n, _ in m.named_parameters()]
            self.result.grads = {
                n: (g.float() / scale).cpu()
                for n, g in zip(names, self.update.reduced_grads(), strict=True)
            }
        if self.versions is None:
            self.update.step(index)
            self.updates += 1
            return
        self.versions.before_step(self.position)
        self.update.step(index)
        self.updates += 1
        self.versions.after_step()
        if self.counting:  # the home weights may have moved to a new storage
            self.meter.exclude(self.params)
        # Autocast caches a cast of every weight it sees, each version's too: drop them.
        torch.clear_autocast_cache()

    DISPATCH: ClassVar[dict[Kind, Handler]] = {
        Kind.RA: receive,
        Kind.RG: receive,
        Kind.F: forward,
        Kind.B: backward,
        Kind.W: weight_grad,
        Kind.SA: send,
        Kind.SG: send,
        Kind.AR: allreduce,
        Kind.OPT: step,
    }

    # ---- one iteration -------------------------------------------------------------

    def _use_plan(self, index: int) -> None:
        """Under per-batch plans, switch to iteration ``index``'s schedule."""
        schedule = self.run.batch_schedules[index]
        if schedule is self.schedule:
            return
        self.schedule, self.plan = schedule, schedule.plan
        for chunk in self.chunks:
            chunk.executor.replan(self.plan)
        self.messages = Messages(
            self.plan, self.stage_id, posting_plan(schedule)[self.stage_id], self.groups,
            hidden=self.run.cfg.hidden, wire_dtype=self.wire_dtype, device=self.device,
        )  # fmt: skip

    def iteration(self, index: int, record: bool) -> None:
        """One pass over the stage's actions: iteration ``index`` of a synchronous
        schedule, or (``index`` 0) every iteration of an asynchronous one."""
        run = self.run
        n = self.schedule.n_iterations
        # This replica's share of each global batch; the plan cuts it into units.
        batch = iteration_batch(run, index, n, self.replica)
        if run.batch_schedules:
            self._use_plan(index)
        loss = torch.zeros(n, dtype=torch.float32, device=self.device)
        tokens, targets = (
            on_device(batch.tokens, self.device),
            on_device(batch.targets, self.device),
        )
        it = _Iteration(index, tokens, targets, loss)
        for chunk in self.chunks:
            chunk.executor.documents = batch.documents
            chunk.executor.loss_scale = batch.loss_scale
            chunk.executor.grad_scale = self.update.optimizer.loss_scale
            if run.cfg.dropout > 0:  # this replica's sequences start at its row of the batch
                chunk.executor.dropout = DropoutKey.for_iteration(
                    run.seed, index, self.replica * run.pipeline_batch
                )
        self.progress.set(self.rank, index, Progress.BARRIER)
        dist.barrier()
        clock = PassClock(self.device)
        self.messages.begin()
        self._maybe_fault()
        # One autocast region per pass: its cast weights are cached once, not per unit.
        meter = self.meter if self.counting else nullcontext()
        rows: list[tuple[int, Action, Mark, Mark]] = []  # (iteration, action, start, end)
        with autocast(run.precision, self.device.type), meter:
            for position, action in enumerate(self.schedule.actions[self.stage_id]):
                self.position = position
                self.progress.set(self.rank, index, position)
                handler = self.DISPATCH.get(action.kind)
                if handler is None:
                    raise NotImplementedError(
                        f"the runtime has no handler for {action.kind} actions ({action} on "
                        f"stage {self.stage_id}): add a method and a Worker.DISPATCH entry"
                    )
                start = clock.mark()
                self.messages.post(position, it.outputs)
                handler(self, action, it)
                if self.versions is not None:
                    dropped = self.versions.done(self.position)
                    if self.counting:
                        self.meter.include(dropped)
                if record or (self.asynchronous and action.kind is Kind.OPT):
                    rows.append((self._iteration_of(index, action), action, start, clock.mark()))
            self.progress.set(self.rank, index + n - 1, Progress.DRAIN)
            self.messages.complete_sends()
        if self.versions is not None:
            self.versions.restore()
        clock.finish()
        dist.barrier()
        elapsed = clock.elapsed()  # the slowest rank's pass: barrier to barrier
        if not record:
            return
        for i, action, a, b in rows:
            self._trace(i, action, clock.seconds(a), clock.seconds(b))
        if self.asynchronous:
            # Steady state: the time between consecutive updates of the timed iterations.
            updates = [clock.seconds(b) for _, action, _, b in rows if action.kind is Kind.OPT]
            gaps = [b - a for a, b in itertools.pairwise([0.0, *updates])]
            self.result.iteration_s += gaps[run.timing.warmup :]
        else:
            self.result.iteration_s.append(elapsed)
        if self.schedule.placement[-1] == self.stage_id:  # the stage of the loss
            self.result.losses += [float(x) for x in it.loss[run.timing.warmup if n > 1 else 0 :]]

    def _iteration_of(self, index: int, action: Action) -> int:
        """The iteration a traced action belongs to: the pass's, or under an asynchronous
        schedule its unit's (an update's: the updates made before it)."""
        if not self.asynchronous:
            return index
        done = self.updates - (action.kind is Kind.OPT)  # OPT has just counted itself
        return self.schedule.iteration_of(action.b) if action.b >= 0 else done

    def _trace(self, index: int, action: Action, start: float, end: float) -> None:
        self.result.trace.append((
            self.rank, self.stage_id, self.replica, self.op_rank, index - self.run.timing.warmup,
            action.kind.value, action.b, action.t, action.v, action.chunk, start, end,
        ))  # fmt: skip

    def _maybe_fault(self) -> None:
        if self.hooks.fault_rank != self.rank:
            return
        if self.hooks.fault.startswith("raise"):
            raise RuntimeError(f"injected fault on rank {self.rank}")
        time.sleep(10 * self.run.timing.timeout_s)  # "hang": stall until killed or timed out

    def _memory(self) -> StageMemory | None:
        return StageMemory.measure(
            torch.nn.ModuleList(self.modules),
            self.device,
            self.meter if self.counting else None,
            optimizer_state_bytes=self.update.optimizer.state_bytes(),
            contexts=context_tensors(held_contexts(self.chunks, self.asynchronous)),
            stashed=0 if self.versions is None else self.versions.stash_bytes_peak,
        )

    def train(self) -> RankResult:
        if self.device.type == "cuda":
            reset_cuda_peak(self.device)
        if self.asynchronous:  # one pass runs every iteration, without a flush
            self.iteration(0, record=True)
            assert self.versions is not None
            self.result.weight_versions = self.versions.most_held
        else:
            for i in range(self.run.timing.iterations):
                self.iteration(i, record=i >= self.run.timing.warmup)
        self.progress.set(self.rank, self.run.timing.iterations - 1, Progress.RESULTS)
        self.result.memory = self._memory()
        self.result.grad_norms = [float(n) for n in self.update.grad_norms]
        self.result.steps_skipped = self.update.steps_skipped
        if self.hooks.collect_params:
            self.result.params = {
                n: p.detach().float().cpu().clone()
                for m in self.modules
                for n, p in m.named_parameters()
            }
        return self.result


def run_worker(
    run: RunConfig, rank: int, hooks: Hooks = Hooks(), progress: Progress | None = None
) -> RankResult:
    """Train ``run`` as ``rank`` of an initialised default process group, telling
    ``progress`` where it is."""
    run.parallelism.check_world_size(dist.get_world_size())
    return Worker(run, rank, hooks, progress).train()
