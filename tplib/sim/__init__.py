"""Costs and simulation: what any cost model answers, and what a schedule's iteration takes
under it. One mechanism per module:

- :mod:`~tplib.sim.costs`: the cost protocols (the planner's :class:`SliceCostModel`, the
  simulator's :class:`ActionCosts`), the per-unit cost cache, the ring all-reduce;
- :mod:`~tplib.sim.simulate`: the discrete-event simulation of a schedule with costs;
- :mod:`~tplib.sim.throughput`: steady-state time per iteration of any schedule.

No torch anywhere in it.
"""
