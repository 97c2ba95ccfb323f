"""Steady-state throughput of any schedule: the time per iteration once the pipeline is full.

A synchronous schedule (``gpipe``, ``terapipe``, ``1f1b``) flushes the pipeline at the
end of every iteration, so every iteration is the same and its time is the flushed
latency that :func:`tplib.sim.simulate.simulate` returns. An asynchronous one (``pipedream``,
``2bw``) never flushes: the first iterations fill the pipeline, the last ones drain it,
and in between each iteration costs less than a flushed one would. Its latency over N
iterations divided by N mixes the three; the steady state is the slope in between::

    T_i = when iteration i's update (OPT) has ended on every stage

    T |                                  ____ drain
      |                          ____----
      |                  ____----            slope = time per iteration
      |          ____----                    over the window [a, b]
      |   ..-----  fill
      +---------------------------------------- i
              a                   b

:func:`steady_state` simulates enough iterations that a window of ``window`` iterations
lies clear of both ends (:func:`steady_window`: K + M units of margin on each side, K
stages and M token slices per sequence, so a few iterations when an iteration has many
units and about 3K in all when it has one) and returns the slope (T_b - T_a) / (b - a).
Its bubble fraction is the idle share of all stage-seconds inside the window, from the
timeline: a stage is busy while it computes, receives (its own share), all-reduces,
steps, and, with blocking sends, sends. :func:`update_ends` reads T_i off any timeline
with the simulator's columns, so a measured trace of the runtime gives the measured
slope the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from tplib.plan import Plan
from tplib.schedule import Kind, Schedule, make_schedule, registered
from tplib.sim.costs import ActionCosts
from tplib.sim.simulate import SimResult, simulate

__all__ = [
    "Steady",
    "slope",
    "steady_bubble",
    "steady_of",
    "steady_state",
    "steady_window",
    "update_ends",
]

# What occupies a stage in a timeline; sends only when they block their stage.
_BUSY_KINDS = frozenset(k.value for k in (Kind.F, Kind.B, Kind.RA, Kind.RG, Kind.AR, Kind.OPT))


@dataclass(frozen=True, eq=False)
class Steady:
    """A schedule in steady state: ``iteration_time`` seconds per iteration, measured
    over iterations ``window`` = (a, b) of ``n_iterations`` simulated, with the idle
    share ``bubble_fraction`` of the stages inside it. ``update_ends[i]`` is T_i;
    ``spread`` is how much the per-iteration times inside the window differ (max - min
    over their mean: 0 when the window is periodic iteration by iteration)."""

    schedule: str
    n_iterations: int
    iteration_time: float
    bubble_fraction: float
    window: tuple[int, int]
    update_ends: np.ndarray
    spread: float
    sim: SimResult

    @property
    def iterations_per_second(self) -> float:
        return 1.0 / self.iteration_time

    def __repr__(self) -> str:
        a, b = self.window
        return (
            f"Steady({self.schedule}: {self.iteration_time:.4g} s per iteration over "
            f"iterations {a}..{b} of {self.n_iterations}, bubble {self.bubble_fraction:.1%})"
        )


def steady_window(n_stages: int, plan: Plan, window: int = 4) -> tuple[int, int, int]:
    """(N, a, b): iterations to simulate and the window [a, b] to measure, for an
    asynchronous schedule of ``plan`` per iteration on ``n_stages`` stages. The margin on
    each side spans K + M units (and one iteration more): the 1F1B warm-up keeps at most
    K + M - 2 units of one stage in flight, so after that many the first backwards have
    come back and every stage alternates; the drain touches only the last that many.
    The window is at least ``window`` iterations and at least the margin wide."""
    if window < 1:
        raise ValueError(f"window={window}: measure over at least one iteration")
    units = plan.n_units
    depth = n_stages + max(len(t) for t in plan.token_slices)
    margin = math.ceil(depth / units) + 1
    # The steady state may repeat only every few iterations (as many as it keeps in
    # flight): a window as wide as the margin spans at least one such period.
    width = max(window, margin)
    return 2 * margin + width, margin, margin + width


def update_ends(timeline: pd.DataFrame) -> np.ndarray:
    """T_i for every iteration i of a timeline (the simulator's, or a runtime trace):
    the i-th update (``OPT``) of each rank is iteration i's, and T_i is the latest of
    their ends."""
    opt = timeline[timeline["kind"] == Kind.OPT.value]
    per_rank = [np.sort(g["end"].to_numpy(dtype=float)) for _, g in opt.groupby("rank")]
    if not per_rank or len({len(e) for e in per_rank}) != 1:
        raise ValueError(
            "the timeline's ranks do not all update the same number of times: "
            f"{[len(e) for e in per_rank]} updates; a steady state needs whole iterations"
        )
    return np.max(np.stack(per_rank), axis=0)


def steady_bubble(
    timeline: pd.DataFrame, start: float, end: float, *, blocking_sends: bool = False
) -> float:
    """The idle share of all ranks' time within [start, end] of ``timeline``: one minus
    the overlap of each busy row (:data:`_BUSY_KINDS`, and ``SA``/``SG`` when sends
    block) with the window, over ranks x window."""
    if not end > start:
        raise ValueError(f"window [{start}, {end}] is empty")
    kinds = _BUSY_KINDS | ({Kind.SA.value, Kind.SG.value} if blocking_sends else set())
    busy = timeline[timeline["kind"].isin(kinds)]
    overlap = np.clip(
        np.minimum(busy["end"].to_numpy(float), end)
        - np.maximum(busy["start"].to_numpy(float), start),
        0.0,
        None,
    )
    n_ranks = timeline["rank"].nunique()
    return float(1.0 - overlap.sum() / (n_ranks * (end - start)))


def _steady_from_schedule(
    schedule: Schedule, costs: ActionCosts, window: tuple[int, int] | None = None
) -> Steady:
    """Simulate ``schedule`` under ``costs`` and read its steady state
    (:func:`steady_of`)."""
    return steady_of(schedule, simulate(schedule, costs), window, costs.blocking_sends)


def _default_window(schedule: Schedule) -> tuple[int, int]:
    """The window :func:`steady_window` gives ``schedule``'s plan per iteration, or, when
    the schedule has fewer iterations than that needs, all but the first and last."""
    n, m = schedule.n_iterations, schedule.batch_slices_per_iteration
    one = Plan(schedule.plan.batch_slices[:m], schedule.plan.token_slices[:m])
    need, a, b = steady_window(schedule.n_stages, one)
    if need <= n:
        return a, b
    return (1, n - 2) if n >= 4 else (0, n - 1)


def steady_of(
    schedule: Schedule,
    sim: SimResult,
    window: tuple[int, int] | None = None,
    blocking_sends: bool = False,
) -> Steady:
    """The steady state of ``schedule`` from its simulation ``sim``: the flushed latency
    for a synchronous schedule, the slope of T_i over ``window`` (iterations a..b;
    default :func:`_default_window`) for an asynchronous one."""
    if not schedule.asynchronous:
        ends = np.array([sim.latency])
        return Steady(schedule.name, 1, sim.latency, sim.bubble_fraction, (0, 1), ends, 0.0, sim)
    n = schedule.n_iterations
    a, b = _default_window(schedule) if window is None else window
    if not 0 <= a < b < n:
        raise ValueError(f"window={(a, b)} must satisfy 0 <= a < b < n_iterations={n}")
    ends = update_ends(sim.timeline)
    time, spread = slope(ends, (a, b))
    bubble = steady_bubble(
        sim.timeline, float(ends[a]), float(ends[b]), blocking_sends=blocking_sends
    )
    return Steady(schedule.name, n, time, bubble, (a, b), ends, spread, sim)


def slope(ends: np.ndarray, window: tuple[int, int]) -> tuple[float, float]:
    """(time per iteration, spread) of update times ``ends`` over iterations a..b: the
    slope (T_b - T_a) / (b - a), and (max - min) / mean of the steps between."""
    a, b = window
    steps = np.diff(np.asarray(ends, dtype=float)[a : b + 1])
    return float((ends[b] - ends[a]) / (b - a)), float((steps.max() - steps.min()) / steps.mean())


def steady_state(
    name: str,
    n_stages: int,
    plan: Plan,
    costs: ActionCosts,
    *,
    window: int = 4,
    vertical_sync: bool = False,
    validate: bool = False,
) -> Steady:
    """The steady state of schedule ``name`` running ``plan`` every iteration (see the
    module docstring): one simulated iteration when it is synchronous, N of them
    (:func:`steady_window`) when it is asynchronous. ``validate`` checks the schedule
    first (slow on big ones: the generators have their own tests)."""
    if not registered(name).asynchronous:
        schedule = make_schedule(name, n_stages, plan, validate=validate)
        return _steady_from_schedule(schedule, costs)
    n, a, b = steady_window(n_stages, plan, window)
    schedule = make_schedule(
        name, n_stages, plan, n_iterations=n, vertical_sync=vertical_sync, validate=validate
    )
    return _steady_from_schedule(schedule, costs, (a, b))
