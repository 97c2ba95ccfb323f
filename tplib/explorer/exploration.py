"""Plan a :class:`~tplib.explorer.scenario.Scenario` and set the plan beside its baselines.

:func:`explore` returns an :class:`Exploration`: the DP plan in the paper's notation and
its predicted latency, Seq1F1B's equal-FLOP slicing at its best #slices
(:mod:`tplib.planner.seq1f1b`), every uniform slicing (#slices = 1, 2, 4, ... up to
L / g) beside Seq1F1B's at the same #slices, all under the same cost model, the
simulated timelines of the DP plan, of Seq1F1B's and of the best uniform slicing (each
as the ``terapipe`` schedule, so that only the slicing differs), the GPipe ("w/o
TeraPipe") baseline and, on the cluster model, the memory per GPU.

"Predicted" latencies are the planner's objective ``sum t + (K - 1) max t`` (Eq. 5)
under the cost model's slice times; "simulated" ones replay the schedule in
:func:`tplib.sim.simulate.simulate`, which on the cluster model also prices the pipeline's
sends and each stage's all-reduce (``AR``) and optimizer step (``OPT``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from tplib.cluster import ClusterCostModel, MemoryEstimate
from tplib.explorer.scenario import Scenario, cost_model
from tplib.nn.configs import get_config
from tplib.perfmodel import Profile
from tplib.plan import Plan
from tplib.planner import (
    FlopModel,
    best_seq1f1b,
    pipeline_latency,
    plan_slices,
    seq1f1b_plan,
    uniform,
)
from tplib.sim.costs import ActionCosts, SliceCostModel, memo
from tplib.sim.simulate import SimResult, costs_from_slice_model, simulate_schedule

__all__ = ["MAX_SIM_ACTIONS", "Exploration", "explore"]

# Beyond this many compute actions (2 x units x K) the simulation takes seconds; such a
# scenario still gets its plan and uniform curve, just no timeline.
MAX_SIM_ACTIONS = 100_000


class _CachedSliceTimes:
    """``cost`` with its slice times cached per distinct call: the cluster model's
    slice_time takes milliseconds, and an exploration asks for the same slices often."""

    def __init__(self, cost: SliceCostModel) -> None:
        self.cost = cost

    @property
    def max_batch_slice_size(self) -> int | None:
        return self.cost.max_batch_slice_size

    @memo
    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        return np.asarray(self.cost.slice_time(batch_slice_size, length, context), float)


@dataclass(frozen=True, eq=False)
class Exploration:
    """What :func:`explore` found for ``scenario`` (latencies in seconds)."""

    scenario: Scenario
    plan: Plan  # the DP's plan
    predicted: float  # its fill-drain latency under the planner's cost model (Eq. 5)
    objective: float  # the method's objective (= predicted for "exact"; sum of T_b for "paper")
    plan_seconds: float  # wall time of the planner
    # Uniform slicings of one-sequence batch slices: n_slices, plan, predicted, t_max and,
    # on the cluster model, memory_gib and fits_memory per GPU.
    uniform: pd.DataFrame
    gpipe_predicted: float  # GPipe (microbatches of one sequence) under the planner's model
    sim: SimResult | None  # the DP plan as the terapipe schedule (None: too big to simulate)
    gpipe: SimResult | None  # GPipe, simulated
    best_uniform_sim: SimResult | None = None  # the best uniform slicing, simulated
    memory: MemoryEstimate | None = None  # cluster only: peak memory per GPU, DP plan
    gpipe_memory: MemoryEstimate | None = None
    notes: tuple[str, ...] = field(default=())
    # Seq1F1B's equal-FLOP slicing at its best #slices (one-sequence batch slices), its
    # predicted latency (Eq. 5), its simulation (as terapipe) and memory per GPU.
    seq1f1b: Plan | None = None
    seq1f1b_predicted: float = np.nan
    seq1f1b_sim: SimResult | None = None
    seq1f1b_memory: MemoryEstimate | None = None

    @property
    def best_uniform(self) -> pd.Series:
        """The row of :attr:`uniform` with the lowest predicted latency."""
        return self.uniform.iloc[int(self.uniform["predicted"].argmin())]

    def summary(self) -> pd.DataFrame:
        """DP vs best uniform vs GPipe: predicted and simulated latency, speedup over GPipe
        (predicted and simulated) and, on the cluster model, memory per GPU."""
        best = self.best_uniform
        sim = self.sim.latency if self.sim else np.nan
        g_sim = self.gpipe.latency if self.gpipe else np.nan
        gib = [m.total / 2**30 if m else np.nan for m in (self.memory, self.gpipe_memory)]
        fits = [m.fits if m else None for m in (self.memory, self.gpipe_memory)]
        gpipe = Plan.gpipe(self.scenario.pipeline_batch, self.scenario.seq_len).to_paper()
        u_sim = self.best_uniform_sim.latency if self.best_uniform_sim else np.nan
        rows = [
            ("DP (TeraPipe)", self.plan.to_paper(), self.predicted, sim, gib[0], fits[0]),
            *self._seq1f1b_row(),
            (
                f"best uniform (#slices={best['n_slices']})",
                best["plan"],
                best["predicted"],
                u_sim,
                best["memory_gib"],
                best["fits_memory"],
            ),
            ("GPipe (w/o TeraPipe)", gpipe, self.gpipe_predicted, g_sim, gib[1], fits[1]),
        ]
        columns = ["algorithm", "plan", "predicted_s", "simulated_s", "memory_gib", "fits_memory"]
        df = pd.DataFrame(rows, columns=columns)
        df.insert(4, "speedup_predicted", self.gpipe_predicted / df["predicted_s"])
        df.insert(5, "speedup_simulated", g_sim / df["simulated_s"])
        return df.set_index("algorithm")

    def _seq1f1b_row(self) -> list[tuple[object, ...]]:
        if self.seq1f1b is None:
            return []
        m = self.seq1f1b_memory
        return [
            (
                f"Seq1F1B (equal FLOPs, #slices={self.seq1f1b.n_token_slices(0)})",
                self.seq1f1b.to_paper(),
                self.seq1f1b_predicted,
                self.seq1f1b_sim.latency if self.seq1f1b_sim else np.nan,
                m.total / 2**30 if m else np.nan,
                m.fits if m else None,
            )
        ]

    def describe(self) -> str:
        """The plan and its numbers as text."""
        sc, p = self.scenario, self.plan
        lengths = [s for ts in p.token_slices for s in ts]
        lines = [
            sc.label,
            f"DP plan: {p.to_paper()}",
            f"  {p.n_batch_slices} batch slice(s) of {sorted(set(p.batch_slices))} "
            f"sequence(s), {p.n_units} units; token slices {min(lengths)}..{max(lengths)} "
            f"tokens; planned in {self.plan_seconds:.2f} s",
            f"  predicted latency {self.predicted:.4g} s (sum t + (K-1) max t, planner's "
            f"cost model), t_max {1e3 * (p.t_max or np.nan):.3g} ms",
        ]
        if sc.method == "paper":
            lines.append(f"  paper objective (sum over batch slices of T_b) {self.objective:.4g} s")
        best = self.best_uniform
        lines.append(
            f"  best uniform: #slices={best['n_slices']}, predicted {best['predicted']:.4g} s "
            f"(the DP saves {1 - self.predicted / best['predicted']:.1%}); GPipe predicted "
            f"{self.gpipe_predicted:.4g} s (DP {self.gpipe_predicted / self.predicted:.2f}x)"
        )
        if self.seq1f1b is not None:
            lines.append(
                f"  Seq1F1B (equal-FLOP slices): #slices={self.seq1f1b.n_token_slices(0)}, "
                f"predicted {self.seq1f1b_predicted:.4g} s (the DP saves "
                f"{1 - self.predicted / self.seq1f1b_predicted:.1%})"
            )
        if self.sim is not None and self.gpipe is not None:
            lines.append(
                f"  simulated: DP {self.sim.latency:.4g} s (bubble "
                f"{self.sim.bubble_fraction:.0%}), GPipe {self.gpipe.latency:.4g} s (bubble "
                f"{self.gpipe.bubble_fraction:.0%}): speedup "
                f"{self.gpipe.latency / self.sim.latency:.2f}x"
            )
        if self.memory is not None and self.gpipe_memory is not None:
            lines.append(f"  memory per GPU, DP plan: {self.memory}")
            lines.append(f"  memory per GPU, GPipe:   {self.gpipe_memory}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _uniform_table(sc: Scenario, cached: _CachedSliceTimes, flops: FlopModel) -> pd.DataFrame:
    """Every uniform slicing of one-sequence batch slices, #slices = 1, 2, 4, ... <= L / g,
    and Seq1F1B's equal-FLOP slicing at the same #slices."""
    cluster = cached.cost if isinstance(cached.cost, ClusterCostModel) else None
    rows = []
    for e in range((sc.seq_len // sc.granularity).bit_length()):
        u = uniform(
            cached, sc.seq_len, sc.pipeline_batch, sc.n_stages, 2**e, granularity=sc.granularity
        )
        mem = cluster.memory(u) if cluster else None
        seq = seq1f1b_plan(
            flops,
            seq_len=sc.seq_len,
            batch_slices=(1,) * sc.pipeline_batch,
            n_slices=2**e,
            granularity=sc.granularity,
        )
        rows.append(
            {
                "n_slices": 2**e,
                "plan": u.to_paper(),
                "predicted": u.latency,
                "t_max": u.t_max,
                "memory_gib": mem.total / 2**30 if mem else np.nan,
                "fits_memory": mem.fits if mem else None,
                "seq1f1b_plan": seq.to_paper(),
                "seq1f1b_predicted": pipeline_latency(seq, cached, sc.n_stages),
            }
        )
    return pd.DataFrame(rows)


def explore(scenario: Scenario) -> Exploration:
    """Plan ``scenario``, evaluate the uniform slicings, simulate the DP plan and GPipe."""
    sc, notes = scenario, []
    cost = cost_model(sc)
    t0 = time.perf_counter()
    p = plan_slices(
        cost,
        seq_len=sc.seq_len,
        batch=sc.pipeline_batch,
        n_stages=sc.n_stages,
        granularity=sc.granularity,
        eps=sc.eps,
        method=sc.method,
    )
    plan_seconds = time.perf_counter() - t0
    assert p.latency is not None  # the planner always records its objective
    cached = _CachedSliceTimes(cost)  # one cache for the uniform plans and the DP plan
    flops = FlopModel.of(cost.config if isinstance(cost, Profile) else get_config(sc.model))
    uniform_df = _uniform_table(sc, cached, flops)
    seq = best_seq1f1b(
        cost,
        flops,
        seq_len=sc.seq_len,
        batch=sc.pipeline_batch,
        n_stages=sc.n_stages,
        granularity=sc.granularity,
    )

    costs: ActionCosts
    if isinstance(cost, ClusterCostModel):
        costs = cost  # it prices sends, the all-reduce and the optimizer step itself
    else:
        costs = costs_from_slice_model(cost)
        notes.append("a profile prices slices only: simulated = fill-drain of its slice times")
    gpipe_plan = Plan.gpipe(sc.pipeline_batch, sc.seq_len)
    best_plan = Plan.from_paper(uniform_df.plan.iloc[int(uniform_df.predicted.argmin())])

    def replay(what: str, schedule: str, candidate: Plan) -> SimResult | None:
        actions = 2 * candidate.n_units * sc.n_stages
        if actions <= MAX_SIM_ACTIONS:
            return simulate_schedule(schedule, sc.n_stages, candidate, costs, validate=False)
        notes.append(
            f"{what} not simulated: {actions} compute actions exceed {MAX_SIM_ACTIONS} "
            "(seconds to replay)"
        )
        return None

    sim = replay("the DP plan", "terapipe", p)
    best_sim = replay("the best uniform slicing", "terapipe", best_plan)
    seq_sim = replay("Seq1F1B's slicing", "terapipe", seq)
    gpipe = replay("GPipe", "gpipe", gpipe_plan)
    memory = gpipe_memory = seq_memory = None
    if isinstance(cost, ClusterCostModel):
        memory, gpipe_memory = cost.memory(p), cost.memory(gpipe_plan)
        seq_memory = cost.memory(seq)
    return Exploration(
        scenario=sc,
        plan=p,
        predicted=pipeline_latency(p, cached, sc.n_stages),
        objective=p.latency,
        plan_seconds=plan_seconds,
        uniform=uniform_df,
        gpipe_predicted=float(uniform_df["predicted"].iloc[0]),  # one slice: GPipe
        sim=sim,
        gpipe=gpipe,
        best_uniform_sim=best_sim,
        memory=memory,
        gpipe_memory=gpipe_memory,
        notes=tuple(notes),
        seq1f1b=seq,
        seq1f1b_predicted=pipeline_latency(seq, cached, sc.n_stages),
        seq1f1b_sim=seq_sim,
        seq1f1b_memory=seq_memory,
    )
