"""The interactive plan explorer: pick a model and a pipeline layout, see the DP's plan.

The logic is plain functions, testable without a browser; the widgets only call them:

* :class:`Scenario` (frozen, validated) says what to plan: a model, L, the sequences one
  pipeline processes (B / #Data), the layout (K stages, #Op, #Data), the cost source (the
  V100-cluster model of :mod:`tplib.cluster`, or a measured profile file of
  :mod:`tplib.perfmodel`) and the planner's ``eps``, ``method`` and granularity ``g``.
  :func:`scenario_for_setting` and :func:`scenario_for_profile` build common ones.
* :func:`explore` plans it and returns an :class:`Exploration`: the DP plan in the paper's
  notation and its predicted latency, every uniform slicing (#slices = 1, 2, 4, ... up to
  L / g) under the same cost model, the simulated timeline of the DP plan, the GPipe
  ("w/o TeraPipe") baseline and, on the cluster model, the memory per GPU.
* :func:`figure` draws it: (a) uniform slicings against the DP, (b) the DP's slice
  lengths (mostly longer first: a later slice attends to more context, so it must be
  shorter to take as long), (c) the simulated pipeline timeline.
* :func:`build_explorer` wraps all that in ipywidgets: pick a paper setting (its fields
  fill in) or "custom", the cost source and the planner's knobs; the output recomputes on
  every change.

"Predicted" latencies are the planner's objective ``sum t + (K - 1) max t`` (Eq. 5) under
the cost model's slice times; "simulated" ones replay the schedule in
:func:`tplib.simulate.simulate`, which on the cluster model also prices the pipeline's
sends, the data-parallel all-reduce and the optimizer step.
"""

from __future__ import annotations

import base64
import io
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ipywidgets as ipw
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from tplib.cluster import ClusterCostModel, MemoryEstimate
from tplib.config import MODELS, get_config
from tplib.experiments import EPS, GRANULARITY, Method
from tplib.paper import SEQLEN_BATCH, SETTINGS, setting
from tplib.perfmodel import Profile
from tplib.plan import Plan
from tplib.planner import SliceCostModel, pipeline_latency, plan, uniform
from tplib.plots import plot_timeline
from tplib.simulate import SimResult, costs_from_slice_model, simulate_plan

__all__ = [
    "CLUSTER",
    "METHODS",
    "Exploration",
    "Explorer",
    "Scenario",
    "build_explorer",
    "explore",
    "figure",
    "make_scenario",
    "scenario_for_profile",
    "scenario_for_setting",
]

CLUSTER = "cluster"  # Scenario.cost for the V100-cluster model; anything else is a path
METHODS = ("exact", "paper")
# Beyond this many compute actions (2 x units x K) the simulation takes seconds; such a
# scenario still gets its plan and uniform curve, just no timeline.
MAX_SIM_ACTIONS = 100_000
# Timelines with more rows than this are drawn without the send/receive bars: they would
# be too thin to see and double the drawing time.
MAX_COMM_ROWS = 12_000
CACHE_SIZE = 16  # explorations the widget keeps, oldest dropped first


# ---- scenario ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """What to plan. ``batch`` is B / #Data, the sequences ONE pipeline processes."""

    model: str  # a name in tplib.config.MODELS (with a profile: the profiled model)
    seq_len: int  # L
    batch: int  # sequences per pipeline per iteration (B / #Data)
    n_stages: int  # K (#Pipe)
    n_op: int = 1  # #Op: GPUs each stage is operation-partitioned over (cluster only)
    n_data: int = 1  # #Data: data-parallel replicas (cluster only: prices the all-reduce)
    cost: str = CLUSTER  # "cluster" (the V100 model) or the path of a profile JSON
    eps: float = EPS  # the planner's t_max tolerance, seconds (0: exact)
    method: Method = "exact"  # "exact" (true fill-drain) or "paper" (§3.4's sum of T_b)
    granularity: int = GRANULARITY  # g: slice lengths are multiples of g tokens

    def __post_init__(self) -> None:
        if isinstance(self.cost, os.PathLike):
            object.__setattr__(self, "cost", os.fspath(self.cost))
        for name in ("seq_len", "batch", "n_stages", "n_op", "n_data", "granularity"):
            value = getattr(self, name)
            # bool is an int subclass; True as a batch size is a bug, not 1.
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"Scenario.{name}={value!r}: must be a positive integer")
            object.__setattr__(self, name, int(value))
        if self.seq_len % self.granularity:
            raise ValueError(
                f"Scenario.seq_len={self.seq_len} is not a multiple of granularity="
                f"{self.granularity}: slice lengths lie on a grid of g tokens, pick a g "
                "that divides L"
            )
        if not isinstance(self.eps, int | float) or not 0 <= self.eps < float("inf"):
            raise ValueError(f"Scenario.eps={self.eps!r}: must be finite seconds >= 0")
        if self.method not in METHODS:
            raise ValueError(f"Scenario.method={self.method!r}: choose one of {METHODS}")
        if not isinstance(self.cost, str) or not self.cost.strip():
            raise ValueError(
                f"Scenario.cost={self.cost!r}: use {CLUSTER!r} for the V100-cluster model "
                "or the path of a profile JSON (python -m tplib profile ...)"
            )
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"Scenario.model={self.model!r}: must be a model name")
        if self.uses_cluster:
            self._check_cluster_layout()
        elif self.n_op != 1 or self.n_data != 1:
            raise ValueError(
                f"Scenario.n_op={self.n_op}, n_data={self.n_data} with a profile: a profile "
                "prices one stage on one device, so #Op and #Data are not modelled; set "
                "both to 1 (or use the cluster model)"
            )

    def _check_cluster_layout(self) -> None:
        # The same rules as ClusterCostModel, but raised now and naming Scenario's fields.
        try:
            cfg = get_config(self.model)
        except ValueError:
            raise ValueError(
                f"Scenario.model={self.model!r} is unknown: known models are {sorted(MODELS)}"
            ) from None
        if cfg.n_layer % self.n_stages:
            raise ValueError(
                f"Scenario.n_stages={self.n_stages} does not divide {cfg.name}'s "
                f"{cfg.n_layer} layers: every stage holds the same number of layers"
            )
        if 8 % self.n_op or cfg.n_head % self.n_op:
            raise ValueError(
                f"Scenario.n_op={self.n_op} must divide a node's 8 GPUs and {cfg.name}'s "
                f"{cfg.n_head} heads (Megatron partitions operations inside a node)"
            )

    @property
    def uses_cluster(self) -> bool:
        return self.cost == CLUSTER

    def with_(self, **changes: Any) -> Scenario:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @property
    def label(self) -> str:
        source = "V100 cluster model" if self.uses_cluster else f"profile {self.cost}"
        return (
            f"{self.model}, L={self.seq_len}, {self.batch} sequence(s) per pipeline, "
            f"K={self.n_stages}, #Op={self.n_op}, #Data={self.n_data}; cost: {source}; "
            f"method={self.method}, eps={self.eps * 1e3:g} ms, g={self.granularity}"
        )


def scenario_for_setting(n: int, seq_len: int | None = None, **changes: Any) -> Scenario:
    """Table-1 setting ``(n)`` (with ``seq_len``: its Table-4 variant) as a scenario on
    the cluster model; ``changes`` override fields (e.g. ``eps=0``, ``method="paper"``)."""
    s = setting(n, seq_len)
    base = Scenario(s.model, s.seq_len, s.pipeline_batch, s.n_stages, s.n_op, s.n_data)
    return base.with_(**changes) if changes else base


def scenario_for_profile(
    path: str | os.PathLike, *, n_stages: int | None = None, batch: int = 1, **changes: Any
) -> Scenario:
    """A scenario priced by the profile at ``path``: its model, L and g; ``n_stages``
    defaults to the profiled model's layers over the profiled stage's layers."""
    prof = _load_profile(os.fspath(path))
    if n_stages is None:
        n_stages = max(1, prof.config.n_layer // prof.n_layers)
    return Scenario(
        prof.config.name,
        prof.seq_len,
        batch,
        n_stages,
        cost=os.fspath(path),
        granularity=prof.granularity,
    ).with_(**changes)


def make_scenario(
    n: int | None = None,
    *,
    seq_len: int | None = None,
    profile: str | os.PathLike | None = None,
    **fields: Any,
) -> Scenario:
    """The notebook's parameters as a scenario: priced by ``profile`` when given, else
    Table-1 setting ``(n)`` on the cluster model, else ``fields`` alone. ``fields``
    override what the first two fill in; so does ``seq_len``, except that setting (5)
    with a Table-4 length takes that variant, batch included."""
    table4 = n == 5 and seq_len in SEQLEN_BATCH
    if seq_len is not None and not table4:
        fields["seq_len"] = seq_len
    if profile is not None:
        return scenario_for_profile(profile, **fields)
    if n is not None:
        base = scenario_for_setting(n, seq_len if table4 else None)
        return base.with_(**fields) if fields else base
    return Scenario(**fields)


def _load_profile(path: str) -> Profile:
    if not Path(path).is_file():
        raise ValueError(
            f"profile {path!r} does not exist: give the JSON written by "
            "python -m tplib profile, or use the cluster model"
        )
    return Profile.load(path)


# ---- exploring ---------------------------------------------------------------------------


class _Memo:
    """Caches a cost model's slice times per distinct call. Uniform plans ask for the same
    slicing once per batch slice; the cluster model's slice_time takes milliseconds."""

    def __init__(self, cost: SliceCostModel) -> None:
        self.cost = cost
        if hasattr(cost, "max_batch"):
            self.max_batch = cost.max_batch
        self._cache: dict[tuple, np.ndarray] = {}

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        length, context = np.broadcast_arrays(np.asarray(length), np.asarray(context))
        key = (batch, length.shape, length.tobytes(), context.tobytes())
        if key not in self._cache:
            self._cache[key] = np.asarray(self.cost.slice_time(batch, length, context), float)
        return self._cache[key]


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
    memory: MemoryEstimate | None = None  # cluster only: peak memory per GPU, DP plan
    gpipe_memory: MemoryEstimate | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def best_uniform(self) -> pd.Series:
        """The row of :attr:`uniform` with the lowest predicted latency."""
        return self.uniform.loc[self.uniform["predicted"].idxmin()]

    def summary(self) -> pd.DataFrame:
        """DP vs best uniform vs GPipe: predicted and simulated latency, speedup over GPipe
        (predicted and simulated) and, on the cluster model, memory per GPU."""
        best = self.best_uniform
        sim = self.sim.latency if self.sim else np.nan
        g_sim = self.gpipe.latency if self.gpipe else np.nan
        gib = [m.total / 2**30 if m else np.nan for m in (self.memory, self.gpipe_memory)]
        fits = [m.fits if m else None for m in (self.memory, self.gpipe_memory)]
        gpipe = Plan.gpipe(self.scenario.batch, self.scenario.seq_len).to_paper()
        # The best uniform plan is not simulated: its predicted latency is the comparison
        # the DP makes, and a second replay would double the time of a big setting.
        rows = [
            ("DP (TeraPipe)", self.plan.to_paper(), self.predicted, sim, gib[0], fits[0]),
            (f"best uniform (#slices={best['n_slices']})", best["plan"], best["predicted"],
             np.nan, best["memory_gib"], best["fits_memory"]),
            ("GPipe (w/o TeraPipe)", gpipe, self.gpipe_predicted, g_sim, gib[1], fits[1]),
        ]  # fmt: skip
        df = pd.DataFrame(
            rows,
            columns=[
                "algorithm",
                "plan",
                "predicted_s",
                "simulated_s",
                "memory_gib",
                "fits_memory",
            ],
        )
        df.insert(4, "speedup_predicted", self.gpipe_predicted / df["predicted_s"])
        df.insert(5, "speedup_simulated", g_sim / df["simulated_s"])
        return df.set_index("algorithm")

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
        if self.scenario.method == "paper":
            lines.append(f"  paper objective (sum over batch slices of T_b) {self.objective:.4g} s")
        best = self.best_uniform
        lines.append(
            f"  best uniform: #slices={best['n_slices']}, predicted {best['predicted']:.4g} s "
            f"(the DP saves {1 - self.predicted / best['predicted']:.1%}); GPipe predicted "
            f"{self.gpipe_predicted:.4g} s (DP {self.gpipe_predicted / self.predicted:.2f}x)"
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


def _cost_model(sc: Scenario) -> SliceCostModel:
    if sc.uses_cluster:
        cfg = get_config(sc.model)
        cfg = cfg if cfg.seq_len == sc.seq_len else cfg.with_(seq_len=sc.seq_len)
        return ClusterCostModel(
            cfg, n_stages=sc.n_stages, n_op=sc.n_op, n_data=sc.n_data, seq_len=sc.seq_len
        )
    prof = _load_profile(sc.cost)
    if prof.config.name.lower() != sc.model.lower():
        raise ValueError(
            f"profile {sc.cost!r} was measured on model {prof.config.name!r}, but "
            f"Scenario.model={sc.model!r}: plan the profiled model "
            "(scenario_for_profile reads it from the file)"
        )
    if sc.seq_len > prof.seq_len or sc.granularity % prof.granularity:
        raise ValueError(
            f"Scenario seq_len={sc.seq_len}, granularity={sc.granularity} is off profile "
            f"{sc.cost!r}'s grid (L <= {prof.seq_len}, g a multiple of {prof.granularity})"
        )
    return prof


def explore(scenario: Scenario) -> Exploration:
    """Plan ``scenario``, evaluate the uniform slicings, simulate the DP plan and GPipe."""
    sc, notes = scenario, []
    cost = _cost_model(sc)
    t0 = time.perf_counter()
    p = plan(
        cost,
        seq_len=sc.seq_len,
        batch=sc.batch,
        n_stages=sc.n_stages,
        granularity=sc.granularity,
        eps=sc.eps,
        method=sc.method,
    )
    plan_seconds = time.perf_counter() - t0
    memo = _Memo(cost)
    predicted = pipeline_latency(p, memo, sc.n_stages)
    assert p.latency is not None  # the planner always records its objective

    n = sc.seq_len // sc.granularity
    rows = []
    for e in range(n.bit_length()):  # #slices = 1, 2, 4, ... <= L / g
        u = uniform(memo, sc.seq_len, sc.batch, sc.n_stages, 2**e, granularity=sc.granularity)
        mem = cost.memory(u) if isinstance(cost, ClusterCostModel) else None
        rows.append({
            "n_slices": 2**e, "plan": u.to_paper(), "predicted": u.latency, "t_max": u.t_max,
            "memory_gib": mem.total / 2**30 if mem else np.nan,
            "fits_memory": mem.fits if mem else None,
        })  # fmt: skip
    uniform_df = pd.DataFrame(rows)

    if isinstance(cost, ClusterCostModel):
        costs: Any = cost  # it prices sends, the all-reduce and the optimizer step itself
    else:
        costs = costs_from_slice_model(cost)
        notes.append("a profile prices slices only: simulated = fill-drain of its slice times")
    gpipe_plan = Plan.gpipe(sc.batch, sc.seq_len)
    if 2 * p.n_units * sc.n_stages <= MAX_SIM_ACTIONS:
        sim = simulate_plan("terapipe", sc.n_stages, p, costs, validate=False)
    else:
        sim = None
        notes.append(
            f"not simulated: {2 * p.n_units * sc.n_stages} compute actions exceed "
            f"{MAX_SIM_ACTIONS} (seconds to replay)"
        )
    gpipe = (
        simulate_plan("gpipe", sc.n_stages, gpipe_plan, costs, validate=False)
        if 2 * sc.batch * sc.n_stages <= MAX_SIM_ACTIONS
        else None
    )
    memory = gpipe_memory = None
    if isinstance(cost, ClusterCostModel):
        memory, gpipe_memory = cost.memory(p), cost.memory(gpipe_plan)
    return Exploration(
        scenario=sc, plan=p, predicted=predicted, objective=p.latency,
        plan_seconds=plan_seconds, uniform=uniform_df,
        gpipe_predicted=float(uniform_df.loc[0, "predicted"]),  # one slice: GPipe
        sim=sim, gpipe=gpipe, memory=memory, gpipe_memory=gpipe_memory, notes=tuple(notes),
    )  # fmt: skip


# ---- figure -----------------------------------------------------------------------------


def _distinct_slicings(p: Plan, limit: int = 4) -> pd.DataFrame:
    """One row per (slicing, token slice): the plan's distinct (batch-slice size, token
    slicing) pairs with how often each occurs, at most ``limit`` of them."""
    groups: dict[tuple[int, tuple[int, ...]], int] = {}
    for size, ts in zip(p.batch_slices, p.token_slices, strict=True):
        groups[(size, ts)] = groups.get((size, ts), 0) + 1
    rows = []
    for (size, ts), count in list(groups.items())[:limit]:
        label = f"{count} x {size} seq."
        rows += [{"slicing": label, "slice": i + 1, "tokens": s} for i, s in enumerate(ts)]
    return pd.DataFrame(rows)


def figure(ex: Exploration) -> Figure:
    """(a) predicted latency of uniform slicings vs #slices, the DP as a line; (b) the DP
    plan's token-slice lengths; (c) the DP plan's simulated timeline."""
    sc = ex.scenario
    height = min(0.12 * sc.n_stages + 2.0, 9.0)
    fig = Figure(figsize=(13, 3.8 + height), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[3.8, height])
    ax_u, ax_s, ax_t = (
        fig.add_subplot(grid[0, 0]),
        fig.add_subplot(grid[0, 1]),
        fig.add_subplot(grid[1, :]),
    )

    u = ex.uniform
    ax_u.plot(u["n_slices"], u["predicted"], "o-", color="C0", label="uniform slicing")
    ax_u.axhline(ex.predicted, color="C3", ls="--", label=f"DP plan ({ex.predicted:.3g} s)")
    best = ex.best_uniform
    ax_u.plot(
        [best["n_slices"]],
        [best["predicted"]],
        "*",
        ms=14,
        color="C1",
        label=f"best uniform ({best['predicted']:.3g} s)",
    )
    ax_u.set_xscale("log", base=2)
    ax_u.set_xlabel("token slices per sequence (#slices)")
    ax_u.set_ylabel("predicted latency (s)")
    ax_u.set_title("(a) uniform slicing vs the DP (planner's cost model)")
    ax_u.legend(fontsize="small")

    lengths = _distinct_slicings(ex.plan)
    multi = lengths["slicing"].nunique() > 1
    sns.barplot(
        data=lengths,
        x="slice",
        y="tokens",
        hue="slicing" if multi else None,
        ax=ax_s,
        color=None if multi else "C3",
    )
    n_slices = int(lengths["slice"].max())
    if n_slices > 24:  # keep the tick labels legible
        ticks = list(range(0, n_slices, -(-n_slices // 12)))
        ax_s.set_xticks(ticks, [str(t + 1) for t in ticks])
    ax_s.set_xlabel("token slice (first to last)")
    ax_s.set_ylabel("length (tokens)")
    ax_s.set_title("(b) the DP plan's slice lengths")

    if ex.sim is None:
        ax_t.text(0.5, 0.5, "\n".join(ex.notes), ha="center", va="center", transform=ax_t.transAxes)
        ax_t.set_axis_off()
        return fig
    df = ex.sim.timeline
    unit = 1e-3 if ex.sim.latency < 1 else 1.0
    title = f"(c) simulated timeline of the DP plan: {ex.sim.latency:.3g} s"
    if len(df) > MAX_COMM_ROWS:
        title += " (sends/receives not drawn)"
    plot_timeline(df, ax=ax_t, title=title, time_unit=unit, show_comm=len(df) <= MAX_COMM_ROWS)
    if sc.n_stages > 24:  # one label per stage would overlap
        ticks = list(range(0, sc.n_stages, -(-sc.n_stages // 12)))
        ax_t.set_yticks(ticks, [f"stage {k}" for k in ticks])
    return fig


# ---- widgets ------------------------------------------------------------------------------

_SOURCES = {"V100 cluster model": CLUSTER, "profile file": "profile"}
_FIELDS = ("model", "seq_len", "batch", "n_stages", "n_op", "n_data", "granularity")


def _setting_options() -> list[tuple[str, tuple[int, int] | None]]:
    opts: list[tuple[str, tuple[int, int] | None]] = [("custom", None)]
    for n, s in SETTINGS.items():
        opts.append(
            (f"{s.label}  (K={s.n_stages}, #Op={s.n_op}, #Data={s.n_data})", (n, s.seq_len))
        )
    for seq_len in SEQLEN_BATCH:  # Table 4: setting (5) at longer L, smaller batch
        if seq_len != SETTINGS[5].seq_len:
            opts.append((f"{setting(5, seq_len).label}  (Table 4)", (5, seq_len)))
    return opts


class Explorer(ipw.VBox):
    """The explorer widget. ``controls`` maps field names to their widgets; after each
    change ``exploration`` holds the result (or ``error`` the message) and ``runs``
    counts the recomputations."""

    def __init__(self, initial: Scenario | None = None, *, show_figure: bool = True) -> None:
        initial = initial or scenario_for_setting(9)
        style = {"description_width": "initial"}
        small = ipw.Layout(width="150px")
        self.setting = ipw.Dropdown(
            options=_setting_options(),
            description="paper setting",
            style=style,
            layout=ipw.Layout(width="470px"),
        )
        self.controls: dict[str, ipw.ValueWidget] = {
            "model": ipw.Dropdown(options=list(MODELS), description="model", style=style),
            "seq_len": ipw.BoundedIntText(min=1, max=1 << 20, description="L", layout=small),
            "batch": ipw.BoundedIntText(
                min=1, max=1 << 16, description="B/#Data", style=style, layout=small
            ),
            "n_stages": ipw.BoundedIntText(
                min=1, max=1024, description="#Pipe K", style=style, layout=small
            ),
            "n_op": ipw.BoundedIntText(min=1, max=8, description="#Op", layout=small),
            "n_data": ipw.BoundedIntText(min=1, max=1024, description="#Data", layout=small),
            "granularity": ipw.BoundedIntText(min=1, max=4096, description="g", layout=small),
            "source": ipw.ToggleButtons(options=list(_SOURCES), description="cost", style=style),
            "profile": ipw.Text(
                placeholder="path/to/profile.json",
                description="profile",
                continuous_update=False,
                layout=ipw.Layout(width="420px"),
            ),
            "method": ipw.Dropdown(
                options=list(METHODS), description="method", layout=ipw.Layout(width="200px")
            ),
            "eps_ms": ipw.BoundedFloatText(
                min=0.0, max=1e6, step=0.05, description="eps (ms)", style=style, layout=small
            ),
        }
        self.show_figure = show_figure
        self.output = ipw.Output()
        self.exploration: Exploration | None = None
        self.error: str | None = None
        self.runs = 0
        self._quiet = False  # see _quietly
        self._cache: dict[tuple, Exploration] = {}
        c = self.controls
        super().__init__(
            [
                ipw.HBox([self.setting, c["model"]]),
                ipw.HBox(
                    [
                        c[k]
                        for k in ("seq_len", "batch", "n_stages", "n_op", "n_data", "granularity")
                    ]
                ),
                ipw.HBox([c["source"], c["profile"]]),
                ipw.HBox([c["method"], c["eps_ms"]]),
                self.output,
            ]
        )
        self.set_scenario(initial)
        self.setting.observe(self._on_setting, names="value")
        for name in (*_FIELDS, "method", "eps_ms"):
            c[name].observe(self._on_field, names="value")
        c["source"].observe(self._on_source, names="value")
        c["profile"].observe(self._on_profile, names="value")
        self.recompute()

    # -- reading and writing the fields --

    def scenario(self) -> Scenario:
        """The scenario the fields describe (ValueError if they describe none)."""
        c = self.controls
        values = {k: c[k].value for k in _FIELDS}
        source = _SOURCES[c["source"].value]
        cost = CLUSTER if source == CLUSTER else c["profile"].value.strip()
        if source != CLUSTER and not cost:
            raise ValueError("cost source is a profile file: enter its path")
        return Scenario(**values, cost=cost, eps=c["eps_ms"].value * 1e-3, method=c["method"].value)

    def set_scenario(self, sc: Scenario) -> None:
        """Fill every field from ``sc`` (one recompute afterwards, if already built)."""
        with self._quietly():
            ctl = self.controls
            if sc.model not in ctl["model"].options:  # a profiled model outside MODELS
                ctl["model"].options = [*ctl["model"].options, sc.model]
            for k in _FIELDS:
                ctl[k].value = getattr(sc, k)
            ctl["method"].value, ctl["eps_ms"].value = sc.method, sc.eps * 1e3
            ctl["source"].value = "V100 cluster model" if sc.uses_cluster else "profile file"
            if not sc.uses_cluster:
                ctl["profile"].value = sc.cost
            self.setting.value = self._matching_setting(sc)
            self._sync_enabled()

    def _matching_setting(self, sc: Scenario) -> tuple[int, int] | None:
        for _, key in self.setting.options:
            if key is not None and sc.uses_cluster:
                ref = scenario_for_setting(*key)
                if all(getattr(ref, k) == getattr(sc, k) for k in _FIELDS):
                    return key
        return None

    def _sync_enabled(self) -> None:
        profile = _SOURCES[self.controls["source"].value] != CLUSTER
        self.controls["profile"].disabled = not profile
        for k in ("n_op", "n_data"):  # a profile models neither
            self.controls[k].disabled = profile

    @contextmanager
    def _quietly(self) -> Iterator[None]:
        """Ignore field changes inside (nests): filling fields in bulk recomputes once."""
        before, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = before

    # -- reacting to changes --

    def _on_setting(self, change: dict) -> None:
        if self._quiet or change["new"] is None:
            return
        ctl = self.controls
        sc = scenario_for_setting(
            *change["new"], eps=ctl["eps_ms"].value * 1e-3, method=ctl["method"].value
        )
        with self._quietly():
            self.set_scenario(sc)
        self.recompute()

    def _on_field(self, change: dict) -> None:
        if self._quiet:
            return
        with self._quietly():  # a hand-edited field leaves the paper setting
            try:
                self.setting.value = self._matching_setting(self.scenario())
            except ValueError:
                self.setting.value = None
        self.recompute()

    def _on_source(self, change: dict) -> None:
        if self._quiet:
            return
        with self._quietly():
            self._sync_enabled()
            if _SOURCES[change["new"]] != CLUSTER:
                self.controls["n_op"].value = self.controls["n_data"].value = 1
                self.setting.value = None
        if _SOURCES[change["new"]] != CLUSTER and self.controls["profile"].value.strip():
            self._on_profile({"new": self.controls["profile"].value})
        else:
            self.recompute()

    def _on_profile(self, change: dict) -> None:
        if self._quiet:
            return
        path = change["new"].strip()
        try:  # adopt the profile's model and grid; keep the user's K and batch
            sc = scenario_for_profile(
                path,
                n_stages=self.controls["n_stages"].value,
                batch=self.controls["batch"].value,
                method=self.controls["method"].value,
                eps=self.controls["eps_ms"].value * 1e-3,
            )
        except (ValueError, OSError):
            self.recompute()  # shows the error
            return
        with self._quietly():
            self.set_scenario(sc)
        self.recompute()

    def recompute(self) -> None:
        """Explore the current fields and redraw the output area."""
        if self._quiet:
            return
        self.runs += 1
        try:
            sc = self.scenario()
            stamp = None if sc.uses_cluster else os.stat(sc.cost).st_mtime_ns
            key = (sc, stamp)
            if key not in self._cache:  # revisiting a scenario is instant
                if len(self._cache) >= CACHE_SIZE:  # timelines are megabytes each
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = explore(sc)
            ex = self._cache[key]
        except (ValueError, OSError) as exc:
            self.exploration, self.error = None, str(exc)
            self.output.outputs = (_stream(f"cannot plan this: {exc}\n"),)
            return
        self.exploration, self.error = ex, None
        outputs = [_stream(ex.describe() + "\n"), _table(ex.summary().round(4))]
        if self.show_figure:
            outputs.append(_png(figure(ex)))
        # Replacing the widget's outputs in one state update, rather than printing inside
        # `with self.output:`, needs no output capture: nothing flickers, it works from any
        # thread, and headless runs (papermill, nbclient) cannot lose the capture messages.
        self.output.outputs = tuple(outputs)


def _stream(text: str) -> dict[str, Any]:
    return {"output_type": "stream", "name": "stdout", "text": text}


def _table(df: pd.DataFrame) -> dict[str, Any]:
    data = {"text/html": df.to_html(), "text/plain": df.to_string()}
    return {"output_type": "display_data", "data": data, "metadata": {}}


def _png(fig: Figure) -> dict[str, Any]:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    data = {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"), "text/plain": repr(fig)}
    return {"output_type": "display_data", "data": data, "metadata": {}}


def build_explorer(initial: Scenario | int | None = None, *, show_figure: bool = True) -> Explorer:
    """The explorer widget (an ``ipywidgets.VBox``), preselected with ``initial``: a
    :class:`Scenario`, a Table-1 setting number, or None for setting (9)."""
    if isinstance(initial, int):
        initial = scenario_for_setting(initial)
    return Explorer(initial, show_figure=show_figure)
