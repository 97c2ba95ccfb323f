"""The DP planner: how to cut a batch into pipeline units (paper §3.3-3.4, Algorithm 1).

Plans: :func:`token_dp` (one batch-slice size), :func:`paper_joint` (§3.4: the token DP
for every batch-slice size, then a knapsack over the batch split), :func:`exact_joint`
(one ``t_max`` shared by all units: the true fill-drain latency) and the ablation
baseline :func:`uniform` / :func:`best_uniform`; :func:`plan_slices` is the entry point. Any
:class:`~tplib.sim.costs.SliceCostModel` prices the slices. One mechanism per module:

- :mod:`~tplib.planner.cost_table`: the cost grid the DP reads, and :class:`TableCost`;
- :mod:`~tplib.planner.dp`: Algorithm 1 vectorised and the ``t_max`` window search;
- :mod:`~tplib.planner.knapsack`: the joint search (t_max windows x batch split) on a
  cost grid;
- :mod:`~tplib.planner.joint`: joint batch x token plans, and :func:`plan_slices`;
- :mod:`~tplib.planner.memory`: what the memory-aware planner asks of a memory model
  (:class:`SliceMemory`) and the peak it holds plans to (:func:`peak_bytes`);
- :mod:`~tplib.planner.memory_joint`: the fastest plan whose peak fits a capacity;
- :mod:`~tplib.planner.evaluate`: :func:`pipeline_latency` of any plan, the uniform
  baseline;
- :mod:`~tplib.planner.seq1f1b`: Seq1F1B's equal-FLOP slicing, and the DP beside it;
- :mod:`~tplib.planner.packed_cost`: slice times on packed rows (:class:`PackedCost`),
  priced per document by attention pairs, and :func:`packed_latency`;
- :mod:`~tplib.planner.packed`: plans for a packed batch (:func:`plan_packed`, the exact
  joint DP over contiguous batch slices; :func:`snap_uniform`, the cheap rule);
- :mod:`~tplib.planner.plan_cache`: :class:`PlanCache`, plans by a batch's length pattern.
"""

from tplib.planner.cost_table import TableCost, slice_time_table
from tplib.planner.dp import TokenSlicing, algorithm1, token_dp
from tplib.planner.evaluate import best_uniform, pipeline_latency, uniform
from tplib.planner.joint import exact_joint, paper_joint, plan_slices
from tplib.planner.memory import NothingFitsError, SliceMemory, peak_bytes
from tplib.planner.packed import plan_packed, snap_uniform
from tplib.planner.packed_cost import PackedCost, packed_latency
from tplib.planner.plan_cache import PlanCache
from tplib.planner.seq1f1b import (
    FlopModel,
    best_seq1f1b,
    compare_with_dp,
    equal_flop_slices,
    seq1f1b_plan,
)
from tplib.sim.costs import SliceCostModel

__all__ = [
    "FlopModel",
    "NothingFitsError",
    "PackedCost",
    "PlanCache",
    "SliceCostModel",
    "SliceMemory",
    "TableCost",
    "TokenSlicing",
    "algorithm1",
    "best_seq1f1b",
    "best_uniform",
    "compare_with_dp",
    "equal_flop_slices",
    "exact_joint",
    "packed_latency",
    "paper_joint",
    "peak_bytes",
    "pipeline_latency",
    "plan_packed",
    "plan_slices",
    "seq1f1b_plan",
    "slice_time_table",
    "snap_uniform",
    "token_dp",
    "uniform",
]
