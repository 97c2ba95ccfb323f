"""Pipeline runtime: one process per (stage, replica) interprets its stage's schedule.

Each process builds its stage of the model, then for every iteration walks its list of
actions from :mod:`tplib.schedule`: receive, forward, send, and the same for gradients,
through a :class:`~tplib.slicing.SliceExecutor` that keeps each sequence's K/V context
and routes the K/V gradients between token slices. After the last backward, gradients
are summed across data-parallel replicas (and between the two copies of a tied
embedding), then AdamW steps.

Communication semantics are the ones the schedule validator checks: a send is posted
asynchronously and completed by the end of the iteration; a receive blocks, with a
timeout, until its tensor arrives. Every action is timed into a trace.

This module holds the per-process logic only; :mod:`tplib.launch` starts the processes.
"""

from __future__ import annotations

import datetime
import itertools
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from tplib.config import GPTConfig, get_config
from tplib.data import synthetic_batch
from tplib.model import GPTStage, build_model
from tplib.plan import Plan, Unit
from tplib.schedule import Action, Schedule, make_schedule
from tplib.slicing import SliceExecutor

__all__ = [
    "TRACE_COLUMNS",
    "RankResult",
    "ReferenceResult",
    "RunConfig",
    "balanced_stages",
    "run_worker",
    "train_reference",
]

TRACE_COLUMNS = ("rank", "stage", "replica", "iteration", "kind", "b", "t", "start", "end")


def balanced_stages(n_layer: int, n_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges, as equal as possible (earlier stages take the extra layers)."""
    if not 1 <= n_stages <= n_layer:
        raise ValueError(
            f"n_stages={n_stages} must be between 1 and the model's {n_layer} layers: "
            "every stage needs at least one layer"
        )
    q, r = divmod(n_layer, n_stages)
    bounds = [0]
    for k in range(n_stages):
        bounds.append(bounds[-1] + q + (1 if k < r else 0))
    return tuple(itertools.pairwise(bounds))


@dataclass(frozen=True)
class RunConfig:
    """One training run: the model, the parallel layout, the schedule and the optimiser.

    ``batch`` is the global batch; each of the ``n_replicas`` pipelines trains
    ``batch // n_replicas`` sequences, cut into units by ``plan`` (default: one sequence
    per batch slice, ``n_slices`` equal token slices).
    """

    model: str = "tiny"
    schedule: str = "terapipe"
    n_stages: int = 1
    n_replicas: int = 1
    batch: int = 1
    seq_len: int = 64
    n_slices: int = 1
    plan: Plan | None = None
    stage_layers: tuple[tuple[int, int], ...] | None = None
    steps: int = 1
    warmup: int = 0  # iterations run before the timed ``steps``
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    adam_eps: float = 1e-8
    seed: int = 0  # model initialisation
    data_seed: int = 1  # iteration i trains on synthetic_batch(seed=data_seed + i)
    device: str = "cpu"
    bf16: bool = False  # autocast to bfloat16 (CUDA only)
    timeout_s: float = 180.0
    threads: int = 0  # torch threads per process; 0: share this machine's cores
    collect_grads: bool = False  # return the first iteration's gradients
    collect_params: bool = False  # return the parameters after the last step
    model_overrides: tuple[tuple[str, object], ...] = ()
    # Fault injection for testing failure handling: "raise:RANK" makes that rank raise at
    # its first action, "hang:RANK" makes it stall there until it is killed.
    fault: str = ""

    @property
    def world_size(self) -> int:
        return self.n_stages * self.n_replicas

    @property
    def cfg(self) -> GPTConfig:
        cfg = get_config(self.model)
        return cfg.with_(**dict(self.model_overrides)) if self.model_overrides else cfg

    @property
    def replica_batch(self) -> int:
        return self.batch // self.n_replicas

    def resolved_plan(self) -> Plan:
        if self.plan is not None:
            return self.plan
        return Plan.uniform(self.replica_batch, self.seq_len, n_token_slices=self.n_slices)

    def layers(self) -> tuple[tuple[int, int], ...]:
        if self.stage_layers is not None:
            return self.stage_layers
        return balanced_stages(self.cfg.n_layer, self.n_stages)

    def validate(self) -> Schedule:
        """Check everything that can be checked before a process starts; return the schedule."""
        cfg = self.cfg
        for name in ("n_stages", "n_replicas", "batch", "seq_len", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.batch % self.n_replicas:
            raise ValueError(
                f"batch={self.batch} is not divisible by n_replicas={self.n_replicas}: "
                "every data-parallel replica trains the same number of sequences"
            )
        if self.seq_len > cfg.seq_len:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds the model's context of {cfg.seq_len} tokens"
            )
        if self.fault:
            what, _, rank = self.fault.partition(":")
            if what not in ("raise", "hang") or not rank.isdigit():
                raise ValueError(f"fault={self.fault!r}: expected 'raise:RANK' or 'hang:RANK'")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive")
        if self.bf16 and self.device == "cpu":
            raise ValueError("bf16=True needs device='cuda': autocast to bfloat16 is a GPU path")
        layers = self.layers()
        if len(layers) != self.n_stages:
            raise ValueError(
                f"stage_layers has {len(layers)} ranges for n_stages={self.n_stages}: "
                "give one layer range per stage"
            )
        expected_lo = 0
        for k, (lo, hi) in enumerate(layers):
            if lo != expected_lo or hi <= lo:
                raise ValueError(
                    f"stage {k} covers layers [{lo}, {hi}) but must start at layer {expected_lo} "
                    f"and be non-empty: stage layer ranges {list(layers)} must cover "
                    f"[0, {cfg.n_layer}) contiguously"
                )
            expected_lo = hi
        if expected_lo != cfg.n_layer:
            raise ValueError(
                f"stage layer ranges {list(layers)} end at layer {expected_lo}, not at the "
                f"model's {cfg.n_layer}: they must cover every layer"
            )
        plan = self.resolved_plan()
        plan.check_covers(self.replica_batch, self.seq_len)
        return make_schedule(self.schedule, self.n_stages, plan)


@dataclass
class RankResult:
    """What one process returns: its trace, losses, timings and (optionally) tensors."""

    rank: int
    stage: int
    replica: int
    layers: tuple[int, int]
    trace: list[tuple] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # per timed iteration, last stage only
    iteration_s: list[float] = field(default_factory=list)
    grads: dict[str, Tensor] = field(default_factory=dict)
    params: dict[str, Tensor] = field(default_factory=dict)


class _Groups:
    """Process groups every rank creates in the same order: one per stage across replicas
    (data parallelism) and one per replica joining the first and last stage (tied
    embedding)."""

    def __init__(self, run: RunConfig) -> None:
        k, r = run.n_stages, run.n_replicas
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
    if not stage.cfg.tie_embeddings or (stage.is_first and stage.is_last):
        return None
    if stage.is_first:
        return stage.wte.weight
    if stage.is_last:
        return stage.head.weight
    return None


class _Worker:
    def __init__(self, run: RunConfig, rank: int) -> None:
        self.run, self.rank = run, rank
        self.stage_id, self.replica = rank % run.n_stages, rank // run.n_stages
        self.schedule = run.validate()
        self.plan = self.schedule.plan
        self.device = torch.device(run.device)
        lo, hi = run.layers()[self.stage_id]
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

    # ---- communication -------------------------------------------------------------

    def _peer(self, action: Action) -> int:
        step = 1 if action.kind in ("SA", "RG") else -1
        return self.rank + step

    def _recv(self, action: Action) -> Tensor:
        b, t = action.b, action.t
        shape = (self.plan.batch_slices[b], self.plan.token_slices[b][t], self.run.cfg.hidden)
        buf = torch.empty(shape, dtype=torch.float32, device=self.device)
        work = dist.irecv(buf, self._peer(action))
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            what = "activation from" if action.kind == "RA" else "gradient from"
            raise TimeoutError(
                f"stage {self.stage_id} (rank {self.rank}) waited {self.run.timeout_s:g} s for "
                f"the {what} stage {self.stage_id + (-1 if action.kind == 'RA' else 1)} of "
                f"unit b{b} t{t} ({action}); the peer is stuck or has failed: {exc}"
            ) from exc
        return buf

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

    # ---- one iteration -------------------------------------------------------------

    def _unit_rows(self, unit: Unit, tensor: Tensor) -> Tensor:
        first = self.replica * self.run.replica_batch + self.plan.batch_offset(unit.b)
        lo = self.plan.token_offset(unit.b, unit.t)
        size, length = self.plan.batch_slices[unit.b], self.plan.token_slices[unit.b][unit.t]
        return tensor[first : first + size, lo : lo + length].to(self.device)

    def iteration(self, index: int, record: bool) -> None:
        run = self.run
        tokens, targets = synthetic_batch(
            run.cfg, run.batch, run.seq_len, seed=run.data_seed + index
        )
        received: dict[Action, Tensor] = {}
        outputs: dict[Unit, Tensor] = {}
        pending: list[tuple[dist.Work, Tensor, Action]] = []
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if run.bf16 else nullcontext()
        dist.barrier()
        t0 = time.perf_counter()
        trace = self.result.trace

        def log(kind: str, b: int, t: int, start: float) -> None:
            if record:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                end = time.perf_counter()
                trace.append(
                    (self.rank, self.stage_id, self.replica, index - run.warmup, kind, b, t,
                     start - t0, end - t0)
                )  # fmt: skip

        self._maybe_fault()
        for action in self.schedule.actions[self.stage_id]:
            start = time.perf_counter()
            unit = action.unit
            if action.kind in ("RA", "RG"):
                received[
                    Action("F" if action.kind == "RA" else "B", action.stage, action.b, action.t)
                ] = self._recv(action)
            elif action.kind == "F":
                x = received.pop(action, None)
                if x is None:
                    x = self._unit_rows(unit, tokens)
                y = self._unit_rows(unit, targets) if self.stage.is_last else None
                with autocast:
                    out = self.executor.forward(unit, x, y)
                if self.stage.is_last:
                    loss += out.float()
                else:
                    outputs[unit] = out
            elif action.kind == "B":
                grad_in = received.pop(action, None)
                with autocast:
                    grad = self.executor.backward(unit, grad_in)
                if not self.stage.is_first:
                    outputs[unit] = grad.float()
            else:  # SA or SG: post asynchronously, complete by the end of the iteration
                tensor = outputs.pop(unit).contiguous()
                pending.append((dist.isend(tensor, self._peer(action)), tensor, action))
            log(action.kind, action.b, action.t, start)
        self._wait_sends(pending)

        start = time.perf_counter()
        self._reduce_gradients()
        log("AR", -1, -1, start)
        if run.collect_grads and index == 0:
            self.result.grads = {
                n: p.grad.detach().cpu().clone() for n, p in self.stage.named_parameters()
            }
        start = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        log("OPT", -1, -1, start)
        dist.barrier()
        if record:
            self.result.iteration_s.append(time.perf_counter() - t0)
            if self.stage.is_last:
                self.result.losses.append(float(loss))

    def _maybe_fault(self) -> None:
        if not self.run.fault:
            return
        what, _, rank = self.run.fault.partition(":")
        if int(rank) != self.rank:
            return
        if what == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank}")
        if what == "hang":
            time.sleep(10 * self.run.timeout_s)

    def _reduce_gradients(self) -> None:
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
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def train(self) -> RankResult:
        for i in range(self.run.warmup + self.run.steps):
            self.iteration(i, record=i >= self.run.warmup)
        if self.run.collect_params:
            self.result.params = {
                n: p.detach().cpu().clone() for n, p in self.stage.named_parameters()
            }
        return self.result


def run_worker(run: RunConfig, rank: int) -> RankResult:
    """Train ``run`` as ``rank`` of an initialised default process group."""
    if dist.get_world_size() != run.world_size:
        raise ValueError(
            f"world size {dist.get_world_size()} is not n_stages x n_replicas = "
            f"{run.n_stages} x {run.n_replicas} = {run.world_size}"
        )
    return _Worker(run, rank).train()


@dataclass
class ReferenceResult:
    """A single-process, whole-batch, unsliced run: what every pipeline must reproduce."""

    losses: list[float]
    grads: dict[str, Tensor]  # after the first iteration
    params: dict[str, Tensor]  # after the last step


def train_reference(run: RunConfig) -> ReferenceResult:
    """Train ``run``'s model on one device with whole sequences and the full batch."""
    run.validate()
    model = build_model(run.cfg, seed=run.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=run.lr,
        betas=run.betas,
        weight_decay=run.weight_decay,
        eps=run.adam_eps,
    )
    losses, grads = [], {}
    for i in range(run.warmup + run.steps):
        tokens, targets = synthetic_batch(run.cfg, run.batch, run.seq_len, seed=run.data_seed + i)
        loss = model(tokens, targets=targets) / targets.numel()
        loss.backward()
        if i >= run.warmup:
            losses.append(loss.item())
        if i == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return ReferenceResult(losses, grads, params)
