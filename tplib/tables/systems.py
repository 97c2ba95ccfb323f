"""The pipeline systems the PipeDream-2BW table compares, as data: each one's schedule,
the plan it runs and its recomputation, and what follows from the schedule alone (how
stale its weights are, whether it can run a plan at all).

Both modes of the table read them: :mod:`tplib.tables.pipeline_systems` on the cluster
model (its docstring lists the systems and why PipeDream's minibatch is the whole batch)
and :mod:`tplib.tables.systems_measure` on this machine's processes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tplib.plan import Plan
from tplib.schedule import NO_VERSION, Kind, Schedule, registered
from tplib.schedule.asynchronous import min_microbatches

__all__ = [
    "MEASURED",
    "SYSTEMS",
    "System",
    "check_systems",
    "delay",
    "infeasible",
    "system_plan",
]

# Schedules whose order walks the units in groups of K through the chunks.
_GROUPS_OF_K = frozenset({"interleaved-1f1b", "terapipe-interleaved"})


@dataclass(frozen=True)
class System:
    """A pipeline system: a schedule, the plan it runs (``"microbatches"`` of one
    sequence, the ``"minibatch"`` as one batch slice, or the ``"terapipe"`` DP plan),
    the recomputation and the chunks (virtual stages) per stage."""

    name: str
    schedule: str
    plan: str
    recompute: str = "none"
    n_chunks: int = 1

    @property
    def asynchronous(self) -> bool:
        """Whether its schedule runs many iterations without a flush."""
        return registered(self.schedule).asynchronous


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("GPipe", "gpipe", "microbatches"),
        System("GPipe+recompute", "gpipe", "microbatches", "full"),
        System("PipeDream", "pipedream", "minibatch"),
        System("PipeDream-Flush", "1f1b", "microbatches"),
        System("PipeDream-2BW", "2bw", "microbatches"),
        System("TeraPipe", "terapipe", "terapipe"),
        System("TeraPipe+1F1B", "1f1b", "terapipe"),
        System("TeraPipe+2BW", "2bw", "terapipe"),
        System("Interleaved 1F1B", "interleaved-1f1b", "microbatches", n_chunks=2),
        System("TeraPipe+interleaved", "terapipe-interleaved", "terapipe", n_chunks=2),
        System("ZB-V", "zbv", "microbatches", n_chunks=2),
        System("TeraPipe+ZB-V", "terapipe-zbv", "terapipe", n_chunks=2),
    )
}


# What measure mode runs unless asked for more: the systems of one chunk per stage, since
# the shared-cores simulation beside each run (tplib.measure.shared) prices no chunks yet.
MEASURED = tuple(name for name, system in SYSTEMS.items() if system.n_chunks == 1)


def check_systems(systems: Iterable[str]) -> None:
    """Refuse names that are not in :data:`SYSTEMS`, listing those that are."""
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"unknown systems {unknown}: choose from {list(SYSTEMS)}")


def system_plan(system: System, batch: int, seq_len: int, terapipe: Plan) -> Plan:
    """The plan ``system`` runs for ``batch`` sequences of ``seq_len`` tokens per
    iteration; ``terapipe`` is the DP's."""
    if system.plan == "microbatches":
        return Plan.gpipe(batch, seq_len, microbatch=1)
    if system.plan == "minibatch":
        return Plan((batch,), ((seq_len,),))
    return terapipe


def delay(schedule: Schedule) -> int:
    """The most updates a forward's weights lag behind its iteration's: 0 for the
    synchronous schedules, 1 for 2BW, K-1 for PipeDream (stage 0)."""
    lags = [
        schedule.iteration_of(a.b) - a.v
        for acts in schedule.actions
        for a in acts
        if a.kind is Kind.F and a.v != NO_VERSION
    ]
    return max(lags, default=0)


def infeasible(
    system: System, n_stages: int, plan: Plan, layers_per_stage: int | None = None
) -> str:
    """Why ``system`` cannot run ``plan`` on ``n_stages`` stages of ``layers_per_stage``
    layers (None: not checked) ("" when it can)."""
    v = system.n_chunks
    if v > 1 and layers_per_stage is not None and layers_per_stage % v:
        return (
            f"{v} chunks per stage need layers per stage divisible by {v}: a stage has "
            f"{layers_per_stage}"
        )
    if system.schedule in _GROUPS_OF_K and v > 1 and plan.n_units < n_stages:
        return (
            f"interleaving needs >= {n_stages} units per iteration on {n_stages} stages "
            f"(Megatron's rule); this plan has {plan.n_units}"
        )
    if system.schedule != "2bw":
        return ""
    need = min_microbatches(n_stages, plan.token_slices[0])
    if plan.n_batch_slices >= need:
        return ""
    return (
        f"2BW needs m >= {need} microbatches of {len(plan.token_slices[0])} token slices per "
        f"iteration on {n_stages} stages; this batch has {plan.n_batch_slices}"
    )
