"""Stages that share this machine's cores with each other and with other jobs.

The simulator gives each stage a processor of its own. Local pipeline processes do not
have one, and stages computing at the same time slow each other down in two ways:

- where the stages and the other jobs (:func:`tplib.util.machine.busy_cores`) want more cores
  than there are, they share them (processor sharing);
- even with a core each, they share the memory bandwidth and caches: a stage's work
  stretches by its measured contention factor
  (:func:`tplib.perfmodel.contention.measure_contention`) while the others work.

:func:`simulate_shared` stretches each action that occupies its stage's processor
(:data:`~tplib.schedule.LOCAL_WORK`) by both, from how much the other stages work during
it, and simulates the stretched schedule again, to a fixed point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from tplib.plan import Plan
from tplib.schedule import LOCAL_WORK, NO_UNIT, Action, Kind, Schedule
from tplib.schedule.chunks import Placement
from tplib.sim.costs import ActionCosts, place
from tplib.sim.simulate import SimResult, simulate, split_backward_costs

__all__ = ["SharedCores", "simulate_shared"]

Key = tuple[int, str, int, int, int]  # (stage, kind, b, t, chunk) of a timeline row


@dataclass
class SharedCores:
    """``costs`` with each action of :data:`~tplib.schedule.LOCAL_WORK` stretched by its
    own factor, ``scale[(stage, kind, b, t, chunk)]`` (1 when absent):
    :func:`simulate_shared`'s state."""

    costs: ActionCosts
    scale: dict[Key, float] = field(default_factory=dict)

    def placed(self, placement: Placement) -> SharedCores:
        """The same stretches over ``costs`` placed for ``placement`` (virtual stages)."""
        return SharedCores(place(self.costs, placement), self.scale)

    @property
    def blocking_sends(self) -> bool:
        return self.costs.blocking_sends

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        key = (stage, action.kind.value, action.b, action.t, action.chunk)
        return self.costs.compute(stage, action, plan) * self.scale.get(key, 1.0)

    def weight_grad(self, stage: int, action: Action, plan: Plan) -> float:
        """A ``W``, stretched by its own factor; a unit's ``W`` the simulator subtracts
        from that unit's split ``B`` by the ``B``'s, so the ``B`` is stretched whole."""
        costs = split_backward_costs(self.costs, action)
        key = (stage, action.kind.value, action.b, action.t, action.chunk)
        if key not in self.scale:
            key = (stage, Kind.B.value, action.b, action.t, action.chunk)
        return costs.weight_grad(stage, action, plan) * self.scale.get(key, 1.0)

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return self.costs.transfer(stage, action, plan)

    def allreduce(self, stage: int) -> float:
        return self.costs.allreduce(stage)

    def optimizer(self, stage: int) -> float:
        key = (stage, Kind.OPT.value, NO_UNIT, NO_UNIT, 0)
        return self.costs.optimizer(stage) * self.scale.get(key, 1.0)


def _stretch(
    timeline: pd.DataFrame,
    cores: float,
    busy: float,
    threads: int,
    contention: Sequence[float],
    per_stage: int,
) -> dict[Key, float]:
    """Per action of LOCAL_WORK: max(1, demand / cores), where demand counts the cores its
    own stage's ``per_stage`` processes, those of the other stages working meanwhile (n
    stages, time-averaged) and the other jobs want, times 1 + (c - 1) m / (P - 1), with c
    its stage's contention factor measured with all P = K x ``per_stage`` processes
    working and m = per_stage - 1 + per_stage x n of the others working with it."""
    rows = timeline[timeline.kind.isin([k.value for k in LOCAL_WORK])]
    stages = sorted(int(k) for k in rows["stage"].unique())
    spans = {k: rows.loc[rows.stage == k, ["start", "end"]].to_numpy() for k in stages}
    out: dict[Key, float] = {}
    for k, mine in spans.items():
        overlap = np.zeros(len(mine))
        for j, theirs in spans.items():
            if j != k:
                lo = np.maximum(mine[:, :1], theirs[:, 0])
                hi = np.minimum(mine[:, 1:], theirs[:, 1])
                overlap += np.clip(hi - lo, 0.0, None).sum(axis=1)
        others = overlap / np.maximum(mine[:, 1] - mine[:, 0], 1e-12)
        factor = np.maximum(1.0, (threads * per_stage * (1.0 + others) + busy) / cores)
        peers = per_stage * len(contention) - 1
        if contention and peers > 0:
            working = per_stage - 1 + per_stage * others
            factor *= 1.0 + (contention[k] - 1.0) * working / peers
        part = rows[rows.stage == k]
        keys = zip(part.kind, part.b, part.t, part.chunk, strict=True)
        out |= {
            (k, str(kind), int(b), int(t), int(c)): float(f)
            for (kind, b, t, c), f in zip(keys, factor, strict=True)
        }
    return out


def simulate_shared(
    schedule: Schedule,
    costs: ActionCosts,
    *,
    cores: float,
    busy: float = 0.0,
    threads: int = 1,
    contention: Sequence[float] = (),
    processes_per_stage: int = 1,
    rounds: int = 50,
    tol: float = 1e-3,
) -> SimResult:
    """Simulate ``schedule`` on a machine of ``cores`` cores of which other jobs keep
    ``busy`` busy, each stage's process running ``threads`` threads, stage k's work
    stretching by ``contention[k]`` while all the others work (none: no contention).
    ``processes_per_stage``: the processes that run each stage's actions together, in
    step (the #CP ranks of a context-parallel stage, each with ``threads``).

    Stages that work at the same time share the cores the other jobs leave, and with n
    threads wanting C cores each runs at C / n of a core (processor sharing, never
    faster than one core). So each action of LOCAL_WORK is stretched by
    max(1, demand / C), its demand being its own threads, those of the other stages while
    they work during it (time-averaged) and ``busy``, and by its contention, in
    proportion to how many other stages work during it. Overlaps change as actions
    stretch, so this iterates, damped, to a fixed point from the one-core-per-stage
    simulation, which it returns unchanged when there is no contention and the stages
    and ``busy`` fit in ``cores``. ``busy`` NaN (the other jobs' load unknown) counts as
    none."""
    if contention and len(contention) != schedule.n_stages:
        raise ValueError(
            f"contention has {len(contention)} factors for {schedule.n_stages} stages: "
            "give one per stage, or none"
        )
    if any(not c > 0 for c in contention):
        raise ValueError(f"contention={tuple(contention)}: every factor must be positive")
    if processes_per_stage < 1:
        raise ValueError(f"processes_per_stage={processes_per_stage} must be at least 1")
    busy = busy if np.isfinite(busy) else 0.0
    shared = SharedCores(costs)
    sim = simulate(schedule, shared)
    crowded = threads * schedule.n_stages * processes_per_stage + busy > cores
    if not crowded and all(c == 1.0 for c in contention):
        return sim
    for _ in range(rounds):
        target = _stretch(sim.timeline, cores, busy, threads, contention, processes_per_stage)
        change = max((abs(v - shared.scale.get(key, 1.0)) for key, v in target.items()), default=0)
        shared.scale = {key: 0.5 * (shared.scale.get(key, 1.0) + v) for key, v in target.items()}
        sim = simulate(schedule, shared)
        if change < tol:
            break
    return sim
