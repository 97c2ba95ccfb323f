"""Discrete-event simulation: a schedule's iteration latency under per-action costs.

The simulator does not schedule anything itself. It prices every action of a validated
:class:`~tplib.schedule.Schedule` with an :class:`~tplib.sim.costs.ActionCosts` and lets
:func:`tplib.schedule.replay` order them (a receive waits for its send, a stage runs its
actions in its own order). Each stage ends with its gradient all-reduce (``AR``) and
optimizer step (``OPT``), actions of the schedule like any other; the iteration ends
when the last stage finishes its step::

    stage 0 | F F F F . . . . . . B B B B AR OPT
    stage 1 |   F F F F . . . . B B B B   AR OPT        latency = max over stages of
    stage 2 |     F F F F . . B B B B     AR OPT        the end of OPT
    stage 3 |       F F F F B B B B       AR OPT

Costs. ``compute`` prices a forward or backward of unit (b, t) on a stage (it sees the
plan, so the batch slice size, the token slice length and its context, the token
offset). ``transfer`` prices communication: for a send, the time its message spends on
the link; for a receive, the time the receiving stage itself is occupied (0 when a
posted receive costs nothing). With ``blocking_sends`` the sender's stream is busy for
the whole transfer, as when the send runs on the compute stream (the paper's NCCL
implementation); otherwise the sender goes on and the message lands ``transfer`` later.
A zero-bubble schedule's ``W`` is priced by ``weight_grad``
(:class:`~tplib.sim.costs.SplitBackwardCosts`), and each of its ``B`` as the backward less
the weight gradients of the same unit and chunk. A schedule with virtual stages is priced
by the costs placed on its placement (:func:`~tplib.sim.costs.place`): each chunk's work
as its own layers, each message on the link between the ranks of the neighbouring parts.

Output. :class:`SimResult` holds the latency, each stage's busy and idle time, the bubble
fraction and the timeline as a DataFrame with the columns of the runtime's measured
traces (:data:`TIMELINE_COLUMNS`, and the chunk each action runs on), so
:func:`tplib.tables.timeline.plot_timeline` draws both. With virtual stages a row's
``stage`` is the rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from tplib.plan import Plan
from tplib.schedule import (
    RECEIVES,
    SENDS,
    UPDATE,
    WORK,
    Action,
    Kind,
    Schedule,
    covered_slices,
    make_schedule,
    replay,
)
from tplib.schedule.chunks import Placement, identity
from tplib.sim.costs import (
    ActionCosts,
    Parts,
    SliceCostModel,
    SplitBackwardCosts,
    memo,
    place,
    unit_shape,
)

__all__ = [
    "TIMELINE_COLUMNS",
    "SimResult",
    "SliceModelCosts",
    "action_cost",
    "costs_from_slice_model",
    "simulate",
    "simulate_schedule",
    "split_backward_costs",
]

TIMELINE_COLUMNS = ("rank", "stage", "replica", "kind", "b", "t", "chunk", "start", "end")


@dataclass(frozen=True)
class SliceModelCosts:
    """:class:`~tplib.sim.costs.ActionCosts` from a planner cost model (fwd+bwd per slice incl.
    its send/receive): the forward takes ``fwd_fraction`` of the slice time, the backward
    the rest, communication is free (the slice time already holds it). With ``n_chunks``
    v chunks per stage (:meth:`placed`) a chunk's share is 1/v of the stage's."""

    model: SliceCostModel
    fwd_fraction: float = 1 / 3
    t_allreduce: float = 0.0
    t_optimizer: float = 0.0
    blocking_sends: bool = False
    wgrad_fraction: float = 1 / 3  # W's share of a slice: one of the backward's 2 products
    n_chunks: int = 1

    def __post_init__(self) -> None:
        if self.n_chunks < 1:
            raise ValueError(f"n_chunks={self.n_chunks}: a stage holds at least one chunk")
        if not 0.0 <= self.fwd_fraction <= 1.0:
            raise ValueError(f"fwd_fraction={self.fwd_fraction} must lie in [0, 1]")
        if not 0.0 <= self.wgrad_fraction <= 1.0:
            raise ValueError(f"wgrad_fraction={self.wgrad_fraction} must lie in [0, 1]")

    def weight_grad(self, stage: int, action: Action, plan: Plan) -> float:
        """The weight-gradient share of each covered slice (no gain from fusing: a slice
        cost model knows nothing of products)."""
        if self.wgrad_fraction > 1.0 - self.fwd_fraction:
            raise ValueError(
                f"wgrad_fraction={self.wgrad_fraction} with fwd_fraction={self.fwd_fraction}: "
                "the weight gradients are part of the backward, at most 1 - fwd_fraction"
            )
        ts = covered_slices(plan, action.b, action.t)
        units = (Action(Kind.B, stage, action.b, t) for t in ts)
        whole = sum(self.wgrad_fraction * self._slice_time(*unit_shape(plan, u)) for u in units)
        return whole / self.n_chunks

    @memo
    def _slice_time(self, size: int, length: int, context: int) -> float:
        value = self.model.slice_time(size, np.array([length]), np.array([context]))
        return float(np.asarray(value).reshape(-1)[0])

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        share = self.fwd_fraction if action.kind is Kind.F else 1.0 - self.fwd_fraction
        return share * self._slice_time(*unit_shape(plan, action)) / self.n_chunks

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return 0.0

    def placed(self, placement: Placement) -> SliceModelCosts:
        """A chunk of v: 1/v of the stage's slice time (the slice model prices a stage)."""
        return replace(self, n_chunks=Parts(placement).n_chunks)

    def allreduce(self, stage: int) -> float:
        return self.t_allreduce

    def optimizer(self, stage: int) -> float:
        return self.t_optimizer


def costs_from_slice_model(
    model: SliceCostModel,
    fwd_fraction: float = 1 / 3,
    *,
    allreduce: float = 0.0,
    optimizer: float = 0.0,
) -> SliceModelCosts:
    """Drive the simulator with any planner cost model. The default ``fwd_fraction`` 1/3
    reflects a backward doing twice the forward's matrix products (dX and dW). With it the
    fill-drain latency of a plan equals :func:`tplib.planner.pipeline_latency`."""
    return SliceModelCosts(model, fwd_fraction, allreduce, optimizer)


# Which member of ActionCosts prices each kind of action.
_PRICE: dict[Kind, Callable[[ActionCosts, int, Action, Plan], float]] = {
    Kind.F: lambda c, k, a, p: c.compute(k, a, p),
    Kind.B: lambda c, k, a, p: c.compute(k, a, p),
    Kind.SA: lambda c, k, a, p: c.transfer(k, a, p),
    Kind.RA: lambda c, k, a, p: c.transfer(k, a, p),
    Kind.SG: lambda c, k, a, p: c.transfer(k, a, p),
    Kind.RG: lambda c, k, a, p: c.transfer(k, a, p),
    Kind.AR: lambda c, k, a, p: c.allreduce(k),
    Kind.OPT: lambda c, k, a, p: c.optimizer(k),
    Kind.W: lambda c, k, a, p: split_backward_costs(c, a).weight_grad(k, a, p),
}

_WHAT = {Kind.AR: "the all-reduce", Kind.OPT: "the optimizer step"}


def split_backward_costs(costs: ActionCosts, action: Action) -> SplitBackwardCosts:
    """``costs`` as :class:`~tplib.sim.costs.SplitBackwardCosts`, or a ValueError naming
    ``action`` if they cannot price a ``W``."""
    if not callable(getattr(costs, "weight_grad", None)):
        raise ValueError(
            f"{type(costs).__name__} cannot price {action} of a split-backward schedule: "
            "it has no weight_grad (see tplib.sim.costs.SplitBackwardCosts)"
        )
    return costs  # type: ignore[return-value]


def action_cost(
    costs: ActionCosts, action: Action, plan: Plan, *, split_backward: bool = False
) -> float:
    """The seconds ``costs`` gives ``action``; ValueError unless finite and >= 0. In a
    ``split_backward`` schedule a ``B`` is the backward less its unit's weight gradients."""
    k = action.stage
    if action.kind not in _PRICE:
        raise ValueError(f"the simulator cannot price {action.kind} actions: no cost for it")
    cost = float(_PRICE[action.kind](costs, k, action, plan))
    if split_backward and action.kind is Kind.B:
        w = Action(Kind.W, k, action.b, action.t, chunk=action.chunk)
        cost -= float(split_backward_costs(costs, w).weight_grad(k, w, plan))
    if not 0.0 <= cost < math.inf:  # also catches NaN
        what = (
            f"{_WHAT[action.kind]} of stage {k}"
            if action.kind in UPDATE
            else f"{action} on stage {k}"
        )
        raise ValueError(f"cost of {what} is {cost}: costs must be finite, non-negative seconds")
    return cost


@dataclass(frozen=True, eq=False)
class SimResult:
    """What :func:`simulate` found. ``busy[k]`` counts the seconds stage (rank) k's GPU
    works (compute, its own share of communication, all-reduce, optimizer); ``idle[k]``
    is the rest of the iteration; the bubble fraction is the idle share of all
    stage-seconds. ``placement``: the rank of each model part (one per stage without
    virtual stages)."""

    schedule: str
    plan: Plan
    latency: float
    busy: np.ndarray
    idle: np.ndarray
    timeline: pd.DataFrame
    placement: Placement = field(default=())

    def __post_init__(self) -> None:
        if not self.placement:
            object.__setattr__(self, "placement", identity(len(self.busy)))

    @property
    def n_stages(self) -> int:
        return len(self.busy)

    @property
    def n_chunks(self) -> int:
        """v: the chunks (virtual stages) each stage held."""
        return len(self.placement) // self.n_stages

    @property
    def bubble_fraction(self) -> float:
        return float(self.idle.sum() / (self.n_stages * self.latency)) if self.latency else 0.0

    def __repr__(self) -> str:
        chunks = f" x {self.n_chunks} chunks" if self.n_chunks > 1 else ""
        return (
            f"SimResult({self.schedule} on {self.n_stages} stages{chunks}, "
            f"latency={self.latency:.4g} s, "
            f"bubble={self.bubble_fraction:.1%}, plan={self.plan})"
        )


def simulate(
    schedule: Schedule, costs: ActionCosts, *, blocking_sends: bool | None = None
) -> SimResult:
    """Replay ``schedule`` under ``costs`` (placed on its placement: see the module
    docstring). ``blocking_sends`` defaults to ``costs.blocking_sends``. Raises
    :class:`~tplib.schedule.ScheduleError` if the schedule deadlocks."""
    costs = place(costs, schedule.placement)
    blocking = costs.blocking_sends if blocking_sends is None else blocking_sends
    plan, n = schedule.plan, schedule.n_stages
    split = schedule.split_backward
    # Keyed by id(): replay hands back the schedule's own Action objects, and hashing a
    # frozen dataclass per lookup was a third of the simulator's time on big schedules.
    own: dict[int, float] = {}  # the action's own seconds (compute, link, receive, update)
    # Blocking: each send's time on the compute of the same unit and chunk it sends from.
    folded: dict[tuple[Kind, int, int, int, int], float] = {}
    for k, acts in enumerate(schedule.actions):
        for a in acts:
            cost = action_cost(costs, a, plan, split_backward=split)
            own[id(a)] = cost
            if blocking and a.kind in SENDS:
                served = (Kind.F if a.kind is Kind.SA else Kind.B, k, a.b, a.t, a.chunk)
                folded[served] = folded.get(served, 0.0) + cost
    dur = dict(own)  # what replay sees
    if blocking:
        for k, acts in enumerate(schedule.actions):
            for a in acts:
                if a.kind in SENDS:
                    dur[id(a)] = 0.0  # its transfer is charged to the compute it follows
                elif (key := (a.kind, k, a.b, a.t, a.chunk)) in folded:
                    dur[id(a)] += folded[key]
    timed = replay(schedule, lambda a: dur[id(a)])

    rows: list[tuple[int, int, int, str, int, int, int, float, float]] = []
    busy, clock = [0.0] * n, [0.0] * n  # lists: numpy scalar updates are slow here
    update = [0.0] * n  # each stage's AR + OPT seconds, counted as busy once, at the end
    for ta in timed:
        a, k = ta.action, ta.stage
        d = own[id(a)]
        kind, c = a.kind.value, a.chunk
        if a.kind in WORK:
            rows.append((k, k, 0, kind, a.b, a.t, c, ta.start, ta.start + d))
            busy[k] += ta.end - ta.start
        elif a.kind in RECEIVES:
            # Draw the receive's own work only: the wait before it is idle time.
            rows.append((k, k, 0, kind, a.b, a.t, c, ta.end - d, ta.end))
            busy[k] += d
        elif a.kind in UPDATE:
            rows.append((k, k, 0, kind, a.b, a.t, c, ta.start, ta.end))
            update[k] += d
        elif blocking:
            # It ran at the end of its compute action, which already counted it as busy.
            rows.append((k, k, 0, kind, a.b, a.t, c, ta.start - d, ta.start))
        else:
            rows.append((k, k, 0, kind, a.b, a.t, c, ta.start, ta.end))  # on the link only
        if a.kind not in SENDS:
            clock[k] = ta.end
    for k in range(n):
        busy[k] += update[k]

    latency = max(clock)
    timeline = pd.DataFrame.from_records(rows, columns=list(TIMELINE_COLUMNS))
    timeline = timeline.sort_values(["stage", "start", "end"], kind="stable", ignore_index=True)
    busy_s = np.array(busy)
    return SimResult(
        schedule.name, plan, latency, busy_s, latency - busy_s, timeline, schedule.placement
    )


def simulate_schedule(
    schedule: str,
    n_stages: int,
    plan: Plan,
    costs: ActionCosts,
    *,
    n_iterations: int = 1,
    n_chunks: int | None = None,
    validate: bool = True,
) -> SimResult:
    """Build the registered schedule named ``schedule`` for ``plan`` (an asynchronous one
    over ``n_iterations`` iterations; one with virtual stages with ``n_chunks`` per stage,
    None: its default) and :func:`simulate` it. ``validate=False`` skips
    :func:`tplib.schedule.validate` (pure Python, tens of microseconds per action: seconds
    for 100k-action schedules); the generators have their own tests, and the replay still
    raises on a deadlock."""
    made = make_schedule(
        schedule,
        n_stages,
        plan,
        n_iterations=n_iterations,
        n_chunks=n_chunks,
        validate=validate,
    )
    return simulate(made, costs)
