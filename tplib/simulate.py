"""Discrete-event simulation: a schedule's iteration latency under per-action costs.

The simulator does not schedule anything itself. It prices every action of a validated
:class:`~tplib.schedule.Schedule` with an :class:`ActionCosts` and lets
:func:`tplib.schedule.replay` order them (a receive waits for its send, a stage runs its
actions in its own order). After a stage's last action it adds the data-parallel gradient
all-reduce (``AR``) and the optimizer step (``OPT``); the iteration ends when the last
stage finishes its step::

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

Output. :class:`SimResult` holds the latency, each stage's busy and idle time, the bubble
fraction and the timeline as a DataFrame with the columns of the runtime's measured
traces (:data:`TIMELINE_COLUMNS`), so :func:`tplib.plots.plot_timeline` draws both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pandas as pd

from tplib.plan import Plan
from tplib.planner import SliceCostModel
from tplib.schedule import (
    COMPUTE,
    RECEIVES,
    SCHEDULES,
    SENDS,
    Action,
    Schedule,
    make_schedule,
    replay,
)

__all__ = [
    "TIMELINE_COLUMNS",
    "ActionCosts",
    "ConstantCosts",
    "SimResult",
    "SliceModelCosts",
    "costs_from_slice_model",
    "simulate",
    "simulate_plan",
]

TIMELINE_COLUMNS = ("rank", "stage", "replica", "kind", "b", "t", "start", "end")
NO_UNIT = -1  # b and t of the per-stage AR and OPT rows, which belong to no unit


class ActionCosts(Protocol):
    """Seconds for each action of a schedule (see the module docstring)."""

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        """A forward (``F``) or backward (``B``) of ``action``'s unit on ``stage``."""
        ...

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        """A send's time on the link, or a receive's own time on the receiving stage."""
        ...

    def allreduce(self, stage: int) -> float:
        """The data-parallel gradient all-reduce after the stage's last backward."""
        ...

    def optimizer(self, stage: int) -> float:
        """The optimizer step after the all-reduce."""
        ...


@dataclass(frozen=True)
class ConstantCosts:
    """The same cost for every unit: ``t_f`` per forward, ``t_b`` per backward, ``t_send``
    per message on the link, ``t_recv`` per receive, plus a per-stage all-reduce and
    optimizer step. The simplest :class:`ActionCosts`, for tests and back-of-envelope use."""

    t_f: float = 1.0
    t_b: float = 2.0
    t_send: float = 0.0
    t_recv: float = 0.0
    t_allreduce: float = 0.0
    t_optimizer: float = 0.0
    blocking_sends: bool = False

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        return self.t_f if action.kind == "F" else self.t_b

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return self.t_send if action.kind in SENDS else self.t_recv

    def allreduce(self, stage: int) -> float:
        return self.t_allreduce

    def optimizer(self, stage: int) -> float:
        return self.t_optimizer


@dataclass
class SliceModelCosts:
    """:class:`ActionCosts` from a planner cost model (fwd+bwd per slice incl. its
    send/receive): the forward takes ``fwd_fraction`` of the slice time, the backward the
    rest, communication is free (the slice time already holds it)."""

    model: SliceCostModel
    fwd_fraction: float = 1 / 3
    t_allreduce: float = 0.0
    t_optimizer: float = 0.0
    blocking_sends: bool = False
    _cache: dict[tuple[int, int, int], float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.fwd_fraction <= 1.0:
            raise ValueError(f"fwd_fraction={self.fwd_fraction} must lie in [0, 1]")

    def slice_time(self, plan: Plan, b: int, t: int) -> float:
        size, length = plan.batch_slices[b], plan.token_slices[b][t]
        key = (size, length, plan.token_offset(b, t))
        if key not in self._cache:
            value = self.model.slice_time(size, np.array([length]), np.array([key[2]]))
            self._cache[key] = float(np.asarray(value).reshape(-1)[0])
        return self._cache[key]

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        share = self.fwd_fraction if action.kind == "F" else 1.0 - self.fwd_fraction
        return share * self.slice_time(plan, action.b, action.t)

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return 0.0

    def allreduce(self, stage: int) -> float:
        return self.t_allreduce

    def optimizer(self, stage: int) -> float:
        return self.t_optimizer


def costs_from_slice_model(
    model: SliceCostModel, fwd_fraction: float = 1 / 3, *, allreduce: float = 0.0,
    optimizer: float = 0.0,
) -> SliceModelCosts:  # fmt: skip
    """Drive the simulator with any planner cost model. The default ``fwd_fraction`` 1/3
    reflects a backward doing twice the forward's matrix products (dX and dW). With it the
    fill-drain latency of a plan equals :func:`tplib.planner.pipeline_latency`."""
    return SliceModelCosts(model, fwd_fraction, allreduce, optimizer)


@dataclass(frozen=True, eq=False)
class SimResult:
    """What :func:`simulate` found. ``busy[k]`` counts the seconds stage k's GPU works
    (compute, its own share of communication, all-reduce, optimizer); ``idle[k]`` is the
    rest of the iteration; the bubble fraction is the idle share of all stage-seconds."""

    schedule: str
    plan: Plan
    latency: float
    busy: np.ndarray
    idle: np.ndarray
    timeline: pd.DataFrame

    @property
    def n_stages(self) -> int:
        return len(self.busy)

    @property
    def bubble_fraction(self) -> float:
        return float(self.idle.sum() / (self.n_stages * self.latency)) if self.latency else 0.0

    def __repr__(self) -> str:
        return (
            f"SimResult({self.schedule} on {self.n_stages} stages, latency={self.latency:.4g} s, "
            f"bubble={self.bubble_fraction:.1%}, plan={self.plan})"
        )


def _bad_cost(value: float, what: str) -> ValueError:
    return ValueError(f"cost of {what} is {value}: costs must be finite, non-negative seconds")


def simulate(
    schedule: Schedule, costs: ActionCosts, *, blocking_sends: bool | None = None
) -> SimResult:
    """Replay ``schedule`` under ``costs`` and add each stage's all-reduce and optimizer
    step. ``blocking_sends`` defaults to ``costs.blocking_sends`` (False if absent).
    Raises :class:`~tplib.schedule.ScheduleError` if the schedule deadlocks."""
    blocking = bool(getattr(costs, "blocking_sends", False) if blocking_sends is None
                    else blocking_sends)  # fmt: skip
    plan, n = schedule.plan, schedule.n_stages
    # Keyed by id(): replay hands back the schedule's own Action objects, and hashing a
    # frozen dataclass per lookup was a third of the simulator's time on big schedules.
    own: dict[int, float] = {}  # the action's own seconds (compute, link or receive time)
    folded: dict[tuple[str, int, int, int], float] = {}  # blocking: send time on its compute
    for k, acts in enumerate(schedule.actions):
        for a in acts:
            is_compute = a.kind in COMPUTE
            cost = float(costs.compute(k, a, plan) if is_compute else costs.transfer(k, a, plan))
            if not 0.0 <= cost < math.inf:  # also catches NaN
                raise _bad_cost(cost, f"{a} on stage {k}")
            own[id(a)] = cost
            if blocking and a.kind in SENDS:
                served = ("F" if a.kind == "SA" else "B", k, a.b, a.t)
                folded[served] = folded.get(served, 0.0) + cost
    dur = dict(own)  # what replay sees
    if blocking:
        for k, acts in enumerate(schedule.actions):
            for a in acts:
                if a.kind in SENDS:
                    dur[id(a)] = 0.0  # its transfer is charged to the compute it follows
                elif (key := (a.kind, k, a.b, a.t)) in folded:
                    dur[id(a)] += folded[key]
    timed = replay(schedule, lambda a: dur[id(a)])

    rows: list[tuple[int, int, int, str, int, int, float, float]] = []
    busy, clock = [0.0] * n, [0.0] * n  # lists: numpy scalar updates are slow here
    for ta in timed:
        a, k = ta.action, ta.stage
        d = own[id(a)]
        if a.kind in COMPUTE:
            rows.append((k, k, 0, a.kind, a.b, a.t, ta.start, ta.start + d))
            busy[k] += ta.end - ta.start
            clock[k] = ta.end
        elif a.kind in RECEIVES:
            # Draw the receive's own work only: the wait before it is idle time.
            rows.append((k, k, 0, a.kind, a.b, a.t, ta.end - d, ta.end))
            busy[k] += d
            clock[k] = ta.end
        elif blocking:
            # It ran at the end of its compute action, which already counted it as busy.
            rows.append((k, k, 0, a.kind, a.b, a.t, ta.start - d, ta.start))
        else:
            rows.append((k, k, 0, a.kind, a.b, a.t, ta.start, ta.end))  # on the link only

    for k in range(n):
        t_ar, t_opt = float(costs.allreduce(k)), float(costs.optimizer(k))
        for value, what in ((t_ar, "the all-reduce"), (t_opt, "the optimizer step")):
            if not 0.0 <= value < math.inf:
                raise _bad_cost(value, f"{what} of stage {k}")
        c = clock[k]
        rows.append((k, k, 0, "AR", NO_UNIT, NO_UNIT, c, c + t_ar))
        rows.append((k, k, 0, "OPT", NO_UNIT, NO_UNIT, c + t_ar, c + t_ar + t_opt))
        clock[k] = c + t_ar + t_opt
        busy[k] += t_ar + t_opt

    latency = max(clock)
    timeline = pd.DataFrame.from_records(rows, columns=list(TIMELINE_COLUMNS))
    timeline = timeline.sort_values(["stage", "start", "end"], kind="stable", ignore_index=True)
    busy_s = np.array(busy)
    return SimResult(schedule.name, plan, latency, busy_s, latency - busy_s, timeline)


def simulate_plan(
    name: str, n_stages: int, plan: Plan, costs: ActionCosts, *, validate: bool = True
) -> SimResult:
    """Build the schedule ``name`` for ``plan`` and :func:`simulate` it. ``validate=False``
    skips :func:`tplib.schedule.validate` (pure Python, tens of microseconds per action:
    seconds for 100k-action schedules); the generators have their own tests, and the
    replay still raises on a deadlock."""
    schedule = make_schedule(name, n_stages, plan) if validate else SCHEDULES[name](n_stages, plan)
    return simulate(schedule, costs)
