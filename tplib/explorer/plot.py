"""Draw an :class:`~tplib.explorer.exploration.Exploration` as one figure of three panels.

(a) the predicted latency of every uniform slicing and of Seq1F1B's equal-FLOP
slicing against #slices, the DP plan as a line; (b) the DP plan's slice lengths, mostly longer first: a later slice attends to
more context, so it must be shorter to take as long; (c) the DP plan's simulated
pipeline timeline (:func:`tplib.tables.timeline.plot_timeline`).

The module is named ``plot``, not ``figure``, so that ``tplib.explorer.figure`` stays
the function even after this module is imported.
"""

from __future__ import annotations

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from tplib.explorer.exploration import Exploration
from tplib.plan import Plan
from tplib.tables.timeline import plot_timeline

__all__ = ["figure"]

# Timelines with more rows than this are drawn without the send/receive bars: they would
# be too thin to see and double the drawing time.
_MAX_COMM_ROWS = 12_000


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


def _sparse_ticks(n: int) -> list[int]:
    """About 12 of ``n`` positions, for axes where a label on each would overlap."""
    return list(range(0, n, -(-n // 12)))


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
    ax_u.plot(
        u["n_slices"], u["seq1f1b_predicted"], "s-", color="C2", label="Seq1F1B (equal FLOPs)"
    )
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
    ax_u.set_title("(a) uniform and Seq1F1B slicing vs the DP (planner's cost model)")
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
    if n_slices > 24:
        ticks = _sparse_ticks(n_slices)
        ax_s.set_xticks(ticks, [str(t + 1) for t in ticks])
    ax_s.set_xlabel("token slice (first to last)")
    ax_s.set_ylabel("length (tokens)")
    ax_s.set_title("(b) the DP plan's slice lengths")

    if ex.sim is None:  # too big to simulate: say why where the timeline would be
        ax_t.text(0.5, 0.5, "\n".join(ex.notes), ha="center", va="center", transform=ax_t.transAxes)
        ax_t.set_axis_off()
        return fig
    df = ex.sim.timeline
    unit = 1e-3 if ex.sim.latency < 1 else 1.0
    title = f"(c) simulated timeline of the DP plan: {ex.sim.latency:.3g} s"
    if len(df) > _MAX_COMM_ROWS:
        title += " (sends/receives not drawn)"
    plot_timeline(df, ax=ax_t, title=title, time_unit=unit, show_comm=len(df) <= _MAX_COMM_ROWS)
    if sc.n_stages > 24:
        ticks = _sparse_ticks(sc.n_stages)
        ax_t.set_yticks(ticks, [f"stage {k}" for k in ticks])
    return fig
