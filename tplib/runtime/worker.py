"""The per-process pipeline interpreter: one process per (stage, replica) runs its stage's
list of actions, iteration after iteration.

Each process builds its stage of the model, then walks the actions of
:attr:`RunConfig.schedule_data <tplib.runtime.RunConfig.schedule_data>` through a dispatch
table from action kind to method (:data:`Worker.DISPATCH`): receive, forward, send and
the same for gradients, through a :class:`~tplib.slicing.SliceExecutor` that keeps each
sequence's K/V context and routes the K/V gradients between token slices; then the
gradient all-reduce (across data-parallel replicas, and between the two copies of a tied
embedding) and the AdamW step. A new kind of action is one method and one table entry.

Communication semantics are the ones the schedule validator checks: a send is posted
asynchronously and completed before the all-reduce; a receive blocks, with a timeout,
until its tensor arrives. Every action is timed into a trace.

Ranks follow the paper's layout: rank = replica x #Pipe + stage.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from tplib.data import synthetic_batch
from tplib.model import GPTStage, build_model
from tplib.plan import Unit
from tplib.runtime.config import Hooks, RunConfig
from tplib.schedule import Action, Kind
from tplib.slicing import SliceExecutor, unit_rows

__all__ = ["TRACE_COLUMNS", "RankResult", "Worker", "run_worker"]

TRACE_COLUMNS = ("rank", "stage", "replica", "iteration", "kind", "b", "t", "start", "end")
TraceRow = tuple[int, int, int, int, str, int, int, float, float]


@dataclass
class RankResult:
    """What one process returns: its trace, losses, timings and (optionally) tensors."""

    rank: int
    stage: int
    replica: int
    layers: tuple[int, int]
    trace: list[TraceRow] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # per timed iteration, last stage only
    iteration_s: list[float] = field(default_factory=list)
    grads: dict[str, Tensor] = field(default_factory=dict)
    params: dict[str, Tensor] = field(default_factory=dict)


class _Groups:
    """Process groups every rank creates in the same order: one per stage across replicas
    (data parallelism) and one per replica joining the first and last stage (tied
    embedding)."""

    def __init__(self, run: RunConfig) -> None:
        k, r = run.n_stages, run.n_data
        self.data: dict[int, dist.ProcessGroup | None] = {}
        for stage in range(k):
            ranks = [rep * k + stage for rep in range(r)]
            self.data[stage] = dist.new_group(ranks) if r > 1 else None
        self.tied: dict[int, dist.ProcessGroup | None] = {}
        for rep in range(r):
            ranks = [rep * k, rep * k + k - 1]
            tie = run.cfg.tie_embeddings and k > 1
            self.tied[rep] = dist.new_group(ranks) if tie else None


def _shared_weight(stage: GPTStage) -> Tensor | None:
    """This stage's copy of the tied embedding, if another stage holds the other copy."""
    if not stage.cfg.tie_embeddings or (stage.is_first and stage.is_last):
        return None
    if stage.is_first:
        return stage.wte.weight
    if stage.is_last:
        return stage.head.weight
    return None


@dataclass
class _Iteration:
    """What one iteration's actions hand each other."""

    index: int
    tokens: Tensor  # this replica's sequences
    targets: Tensor
    loss: Tensor  # the last stage's summed scaled loss, on the device: no sync per unit
    received: dict[Action, Tensor] = field(default_factory=dict)  # keyed by the consumer
    outputs: dict[Unit, Tensor] = field(default_factory=dict)  # awaiting their send
    pending: list[tuple[dist.Work, Tensor, Action]] = field(default_factory=list)


Handler = Callable[["Worker", Action, _Iteration], None]


class Worker:
    """One rank of a run: its stage, optimizer, executor and process groups."""

    def __init__(self, run: RunConfig, rank: int, hooks: Hooks = Hooks()) -> None:
        self.run, self.rank, self.hooks = run, rank, hooks
        self.stage_id, self.replica = rank % run.n_stages, rank // run.n_stages
        self.schedule = run.schedule_data
        self.plan = run.plan
        self.device = torch.device(run.device)
        lo, hi = run.ranges[self.stage_id]
        self.stage = build_model(run.cfg, lo, hi, seed=run.seed, device=self.device)
        self.optimizer = torch.optim.AdamW(
            self.stage.parameters(),
            lr=run.lr,
            betas=run.betas,
            weight_decay=run.weight_decay,
            eps=run.adam_eps,
        )
        self.executor = SliceExecutor(
            self.stage, self.plan, loss_scale=1.0 / (run.batch * run.seq_len)
        )
        self.groups = _Groups(run)
        self.timeout = datetime.timedelta(seconds=run.timeout_s)
        self.result = RankResult(rank, self.stage_id, self.replica, (lo, hi))
        self.autocast: AbstractContextManager[object] = (
            torch.autocast("cuda", dtype=torch.bfloat16) if run.bf16 else nullcontext()
        )

    # ---- the actions ----------------------------------------------------------------

    def _peer(self, action: Action) -> int:
        step = 1 if action.kind in (Kind.SA, Kind.RG) else -1
        return self.rank + step

    def receive(self, action: Action, it: _Iteration) -> None:
        """RA / RG: wait (with the run's timeout) for a unit's activation or gradient."""
        b, t = action.b, action.t
        shape = (self.plan.batch_slices[b], self.plan.token_slices[b][t], self.run.cfg.hidden)
        buf = torch.empty(shape, dtype=torch.float32, device=self.device)
        work = dist.irecv(buf, self._peer(action))
        assert work is not None  # point-to-point ops always return their Work
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            activation = action.kind is Kind.RA
            raise TimeoutError(
                f"stage {self.stage_id} (rank {self.rank}) waited {self.run.timeout_s:g} s for "
                f"the {'activation' if activation else 'gradient'} from stage "
                f"{self.stage_id + (-1 if activation else 1)} of unit b{b} t{t} ({action}); "
                f"the peer is stuck or has failed: {exc}"
            ) from exc
        consumer = Kind.F if action.kind is Kind.RA else Kind.B
        it.received[Action(consumer, action.stage, b, t)] = buf

    def forward(self, action: Action, it: _Iteration) -> None:
        """F: the unit's forward; the last stage adds its scaled loss."""
        unit = action.unit
        x = it.received.pop(action, None)
        if x is None:
            x = unit_rows(self.plan, unit, it.tokens).to(self.device)  # token ids
        y = unit_rows(self.plan, unit, it.targets).to(self.device) if self.stage.is_last else None
        with self.autocast:
            out = self.executor.forward(unit, x, y)
        if self.stage.is_last:
            it.loss += out.float()
        else:
            it.outputs[unit] = out

    def backward(self, action: Action, it: _Iteration) -> None:
        """B: the unit's backward; keeps the input gradient for the previous stage."""
        grad_in = it.received.pop(action, None)
        with self.autocast:
            grad = self.executor.backward(action.unit, grad_in)
        if not self.stage.is_first:
            assert grad is not None  # a hidden-state input always has a gradient
            it.outputs[action.unit] = grad.float()

    def send(self, action: Action, it: _Iteration) -> None:
        """SA / SG: post the unit's output or input gradient; completed before AR."""
        tensor = it.outputs.pop(action.unit).contiguous()
        work = dist.isend(tensor, self._peer(action))
        assert work is not None  # point-to-point ops always return their Work
        it.pending.append((work, tensor, action))

    def allreduce(self, action: Action, it: _Iteration) -> None:
        """AR: complete the sends, then sum the gradients of the tied embedding's two copies
        and the stage's gradients across its data-parallel replicas."""
        self._wait_sends(it.pending)
        shared = _shared_weight(self.stage)
        tied = self.groups.tied[self.replica]
        if shared is not None and tied is not None:
            # The first stage's embedding and the last stage's head are one parameter of
            # the model: each copy gets the sum of both gradients.
            if shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            dist.all_reduce(shared.grad, group=tied)
        group = self.groups.data[self.stage_id]
        if group is None:
            return
        # The loss is already scaled by the global batch: summing gives the mean's gradient.
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def step(self, action: Action, it: _Iteration) -> None:
        """OPT: the AdamW step on this stage's parameters, then zero the gradients."""
        if self.hooks.collect_grads and it.index == 0:
            self.result.grads = {
                n: p.grad.detach().cpu().clone()
                for n, p in self.stage.named_parameters()
                if p.grad is not None
            }
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    DISPATCH: ClassVar[dict[Kind, Handler]] = {
        Kind.RA: receive,
        Kind.RG: receive,
        Kind.F: forward,
        Kind.B: backward,
        Kind.SA: send,
        Kind.SG: send,
        Kind.AR: allreduce,
        Kind.OPT: step,
    }

    # ---- one iteration -------------------------------------------------------------

    def _wait_sends(self, pending: list[tuple[dist.Work, Tensor, Action]]) -> None:
        for work, _, action in pending:
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as exc:
                raise TimeoutError(
                    f"stage {self.stage_id} (rank {self.rank}) could not complete {action} to "
                    f"rank {self._peer(action)} within {self.run.timeout_s:g} s: {exc}"
                ) from exc
        pending.clear()

    def iteration(self, index: int, record: bool) -> None:
        run = self.run
        tokens, targets = synthetic_batch(
            run.cfg, run.batch, run.seq_len, seed=run.data_seed + index
        )
        # This replica's share of the global batch; the plan cuts it into units.
        mine = slice(self.replica * run.pipeline_batch, (self.replica + 1) * run.pipeline_batch)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        it = _Iteration(index, tokens[mine], targets[mine], loss)
        dist.barrier()
        t0 = time.perf_counter()
        self._maybe_fault()
        for action in self.schedule.actions[self.stage_id]:
            handler = self.DISPATCH.get(action.kind)
            if handler is None:
                raise NotImplementedError(
                    f"the runtime has no handler for {action.kind} actions ({action} on "
                    f"stage {self.stage_id}): add a method and a Worker.DISPATCH entry"
                )
            start = time.perf_counter()
            handler(self, action, it)
            if record:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.result.trace.append(
                    (
                        self.rank,
                        self.stage_id,
                        self.replica,
                        index - run.warmup,
                        action.kind.value,
                        action.b,
                        action.t,
                        start - t0,
                        time.perf_counter() - t0,
                    )
                )
        dist.barrier()
        if record:
            self.result.iteration_s.append(time.perf_counter() - t0)
            if self.stage.is_last:
                self.result.losses.append(float(it.loss))

    def _maybe_fault(self) -> None:
        if self.hooks.fault_rank != self.rank:
            return
        if self.hooks.fault.startswith("raise"):
            raise RuntimeError(f"injected fault on rank {self.rank}")
        time.sleep(10 * self.run.timeout_s)  # "hang": stall until killed or timed out

    def train(self) -> RankResult:
        for i in range(self.run.warmup + self.run.steps):
            self.iteration(i, record=i >= self.run.warmup)
        if self.hooks.collect_params:
            self.result.params = {
                n: p.detach().cpu().clone() for n, p in self.stage.named_parameters()
            }
        return self.result


def run_worker(run: RunConfig, rank: int, hooks: Hooks = Hooks()) -> RankResult:
    """Train ``run`` as ``rank`` of an initialised default process group."""
    if dist.get_world_size() != run.world_size:
        raise ValueError(
            f"world size {dist.get_world_size()} is not n_stages x n_data = "
            f"{run.n_stages} x {run.n_data} = {run.world_size}"
        )
    return Worker(run, rank, hooks).train()
