"""A cache of plans for packed batches, keyed by the batch's length pattern.

Planning a packed batch (:func:`~tplib.planner.packed.plan_packed`) takes a DP per batch,
while batches of a training run repeat their shape: the same rows and row length, with
documents where the packer put them. :class:`PlanCache` keys a plan by the batch's length
pattern: each row's document boundaries rounded to a step (the planning grid, or a coarser
``bucket`` of tokens), those that round to the row's ends dropped, repeats merged. A batch
with the same pattern gets the stored plan, and no DP.

A cached plan is always *valid* for any batch of the same shape (rows x tokens): every
slicing computes the same attention, whatever the documents (:mod:`tplib.documents`);
only its *speed* depends on them. So the step trades plan quality for hits: at the
planning grid a hit is (nearly) the plan the DP would make, while at a bucket of ``L``
tokens every batch shares the first batch's plan. ``scripts/bench_planner_packed.py``
measures both sides, the hit rate and the latency of the plans used.

A stored plan's ``latency`` is its objective on the batch it was planned for; price it
on another with :func:`~tplib.planner.packed_cost.packed_latency`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from tplib.documents import Documents
from tplib.plan import Plan

__all__ = ["PlanCache"]

Key = tuple[int, tuple[tuple[int, ...], ...]]


class PlanCache:
    """Plans by length pattern (see the module docstring): boundaries rounded to
    ``bucket`` tokens (default: ``granularity``, the planning grid; a bucket is never
    finer), at most ``maxsize`` plans (least recently used dropped; None: no limit)."""

    def __init__(
        self, *, granularity: int = 8, bucket: int | None = None, maxsize: int | None = None
    ) -> None:
        step = granularity if bucket is None else bucket
        if granularity < 1 or step < granularity:
            raise ValueError(
                f"granularity={granularity}, bucket={bucket}: the grid is >= 1 token and a "
                "bucket no finer than the grid"
            )
        if maxsize is not None and maxsize < 1:
            raise ValueError(f"maxsize={maxsize}: a cache holds at least one plan (or None)")
        self.step, self.maxsize = step, maxsize
        self.hits = self.misses = 0
        self._plans: OrderedDict[Key, Plan] = OrderedDict()

    def key(self, documents: Documents) -> Key:
        """The batch's length pattern: row length, and per row its rounded inner
        boundaries."""
        return documents.seq_len, documents.rounded_boundaries(self.step)

    def get_or_plan(self, documents: Documents, plan_fn: Callable[[Documents], Plan]) -> Plan:
        """The stored plan of ``documents``' pattern, or ``plan_fn(documents)``, stored."""
        key = self.key(documents)
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return plan
        self.misses += 1
        plan = plan_fn(documents)
        plan.check_covers(documents.batch, documents.seq_len)
        self._plans[key] = plan
        if self.maxsize is not None and len(self._plans) > self.maxsize:
            self._plans.popitem(last=False)
        return plan

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (0 before any)."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def __len__(self) -> int:
        return len(self._plans)
