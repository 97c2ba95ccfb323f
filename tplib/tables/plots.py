"""Plots: pipeline timelines (the paper's Figure 2) and the reproduced tables'
figures (Figures 5, 6 and 7), with the paper's values beside ours.

:func:`plot_timeline` takes a DataFrame with the trace columns of
:data:`tplib.sim.simulate.TIMELINE_COLUMNS` (``rank, stage, replica, kind, b, t, chunk,
start, end``) and draws one row per stage: forward and backward boxes coloured by batch
slice (the forward light, the backward dark, as in the paper's Figure 2), sends and receives
as thin bars under them, the data-parallel all-reduce and the optimizer step in grey.
Gaps are the pipeline bubbles. With virtual stages (a ``chunk`` column, as the
simulator's and the runtime's traces have), each chunk after the first is outlined and
dotted its own way, so the loops of an interleaved schedule, or the two arms of a V,
read apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from tplib.schedule import COMMUNICATION, COMPUTE, Kind

__all__ = [
    "dp_ablation_figure",
    "main_results_figure",
    "measured_ablation_figure",
    "measured_figure",
    "plot_timeline",
    "seqlen_figure",
    "validation_figure",
]

_COMPUTE = sorted(k.value for k in COMPUTE)
_COMM = sorted(k.value for k in COMMUNICATION)
_STEP_COLORS = {Kind.AR.value: "0.45", Kind.OPT.value: "0.75"}  # the update: AR, then OPT


def _lighten(color: tuple[float, float, float], amount: float) -> tuple[float, float, float]:
    r, g, b = color
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _chunk_hatch(chunk: int) -> str | None:
    """Chunk 0 plain, then dots, rings, crosses, ... for the chunks after it."""
    return (None, "..", "oo", "xx", "++", "**")[chunk % 6]


def plot_timeline(
    df: pd.DataFrame,
    ax: Axes | None = None,
    title: str | None = None,
    *,
    replica: int | None = 0,
    iteration: int | None = None,
    show_comm: bool = True,
    palette: str = "tab10",
    time_unit: float = 1.0,
    stages: Sequence[int] | None = None,
) -> Axes:
    """Gantt chart of a pipeline trace, one row per stage (stage 0 at the top).

    ``replica`` selects one data-parallel replica of a measured trace (None: all rows,
    drawn over each other); ``iteration`` one iteration of a trace with an
    ``iteration`` column (the runtime's); ``time_unit`` divides the times (1e-3 for
    milliseconds); ``stages`` limits the rows drawn. Times start at the first row shown.
    Returns the axes.
    """
    missing = {"stage", "kind", "b", "start", "end"} - set(df.columns)
    if missing:
        raise ValueError(
            f"timeline lacks columns {sorted(missing)}: expected those of "
            "tplib.sim.simulate.TIMELINE_COLUMNS (rank, stage, replica, kind, b, t, chunk, "
            "start, end)"
        )
    if replica is not None and "replica" in df.columns:
        df = df[df["replica"] == replica]
    if iteration is not None and "iteration" in df.columns:
        df = df[df["iteration"] == iteration]
    if stages is not None:
        df = df[df["stage"].isin(list(stages))]
    if ax is None:
        n = max(int(df["stage"].nunique()), 1)
        _, ax = plt.subplots(figsize=(12, min(0.35 * n + 1.5, 14)))
    rows = sorted(df["stage"].unique())
    n_b = int(df.loc[df["b"] >= 0, "b"].max() + 1) if (df["b"] >= 0).any() else 1
    colors = [to_rgb(c) for c in sns.color_palette(palette, n_colors=min(n_b, 10))]
    t0 = float(df["start"].min()) if len(df) else 0.0
    for y, stage in enumerate(rows):
        part = df[df["stage"] == stage]
        start = (part["start"].to_numpy() - t0) / time_unit
        width = (part["end"].to_numpy() - part["start"].to_numpy()) / time_unit
        kinds, bs = part["kind"].to_numpy(), part["b"].to_numpy()
        chunks = part["chunk"].to_numpy() if "chunk" in part else np.zeros(len(part), int)
        for c in np.unique(chunks):
            compute = np.isin(kinds, _COMPUTE) & (chunks == c)
            faces = [
                _lighten(colors[int(b) % len(colors)], 0.55 if k == Kind.F else 0.0)
                for k, b in zip(kinds[compute], bs[compute], strict=True)
            ]
            ax.broken_barh(
                list(zip(start[compute], width[compute], strict=True)),
                (y - 0.4, 0.8),
                facecolors=faces,
                edgecolor="white" if c == 0 else "black",
                linewidth=0.3,
                hatch=_chunk_hatch(int(c)),
            )
        # Weight gradients (split backwards): the batch slice's colour, hatched.
        sel = kinds == Kind.W.value
        if sel.any():
            ax.broken_barh(
                list(zip(start[sel], width[sel], strict=True)),
                (y - 0.4, 0.8),
                facecolors=[_lighten(colors[int(b) % len(colors)], 0.3) for b in bs[sel]],
                edgecolor="white",
                linewidth=0.3,
                hatch="///",
            )
        for kind, color in _STEP_COLORS.items():
            sel = kinds == kind
            if sel.any():
                ax.broken_barh(
                    list(zip(start[sel], width[sel], strict=True)), (y - 0.4, 0.8), facecolors=color
                )
        if show_comm:
            sel = np.isin(kinds, _COMM) & (width > 0)
            if sel.any():
                ax.broken_barh(
                    list(zip(start[sel], width[sel], strict=True)),
                    (y + 0.25, 0.15),
                    facecolors="black",
                    alpha=0.6,
                )
    ax.set_yticks(range(len(rows)), [f"stage {s}" for s in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    unit = {1.0: "s", 1e-3: "ms", 1e-6: "us"}.get(time_unit, f"x{time_unit:g} s")
    ax.set_xlabel(f"time ({unit})")
    if title:
        ax.set_title(title)
    # Compute bars take their batch slice's colour; the legend shows the shades in grey
    # so that no one colour reads as "backward".
    grey = (0.35, 0.35, 0.35)
    handles = [
        Patch(facecolor=_lighten(grey, 0.55), label="forward: light shade"),
        Patch(facecolor=grey, label="backward: full shade"),
        *(
            [Patch(facecolor=_lighten(grey, 0.3), hatch="///", label="weight gradients: hatched")]
            if (df["kind"] == Kind.W.value).any()
            else []
        ),
        *(Patch(facecolor=c, label=k) for k, c in _STEP_COLORS.items()),
    ]
    if "chunk" in df and (df["chunk"] > 0).any():
        handles += [
            Patch(
                facecolor=_lighten(grey, 0.55),
                edgecolor="white" if c == 0 else "black",
                hatch=_chunk_hatch(c),
                label=f"chunk {c}",
            )
            for c in range(int(df["chunk"].max()) + 1)
        ]
    if show_comm:
        handles.append(Patch(facecolor="black", alpha=0.6, label="send / receive"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
        title="colour: batch slice",
        title_fontsize="small",
    )
    return ax


# ---- the tables' figures ----------------------------------------------------------------

_SERIES_COLORS = {
    "paper, w/o TeraPipe": "#9ecae1",
    "paper, w/ TeraPipe": "#3182bd",
    "ours, w/o TeraPipe": "#fdae6b",
    "ours, w/ TeraPipe": "#e6550d",
}


def _latency_long(df: pd.DataFrame, x: str) -> pd.DataFrame:
    """Long form: one row per (x, series) with the latency of that series."""
    parts = []
    for col, series in (
        ("paper_latency_gpipe", "paper, w/o TeraPipe"),
        ("paper_latency_terapipe", "paper, w/ TeraPipe"),
        ("latency_gpipe", "ours, w/o TeraPipe"),
        ("latency_terapipe", "ours, w/ TeraPipe"),
    ):
        parts.append(pd.DataFrame({x: df[x], "series": series, "latency (s)": df[col]}))
    return pd.concat(parts, ignore_index=True)


def _speedup_panel(ax: Axes, df: pd.DataFrame, x: str, band: float) -> None:
    long = pd.concat(
        [
            pd.DataFrame({x: df[x], "source": "paper", "speedup": df["paper_speedup"]}),
            pd.DataFrame({x: df[x], "source": "ours", "speedup": df["speedup"]}),
        ],
        ignore_index=True,
    )
    sns.barplot(long, x=x, y="speedup", hue="source", palette=["#3182bd", "#e6550d"], ax=ax)
    # The target: our speedup within +-band of the paper's, drawn around the paper's bar.
    for i, value in enumerate(df["paper_speedup"]):
        ax.plot([i - 0.4, i], [value * (1 - band)] * 2, color="0.3", lw=0.8)
        ax.plot([i - 0.4, i], [value * (1 + band)] * 2, color="0.3", lw=0.8)
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_ylabel("speedup of TeraPipe over GPipe")
    # Outside the axes: inside, it covers the tallest bars (setting (9)'s 6.7x).
    ax.legend(title=None, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _latency_and_speedup(
    df: pd.DataFrame, labels: list[str], *, tall: bool, title: str, xlabel: str, band: float
) -> plt.Figure:
    """Latency of GPipe and TeraPipe, paper and ours, over ``labels`` (log scale when
    ``tall``, for settings whose latencies span decades), and the speedups below or beside,
    with ticks at the paper's speedup ±``band``."""
    df = df.assign(label=labels)
    if tall:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 1.1 * len(df)), 7))
    else:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    long = _latency_long(df, "label")
    sns.barplot(long, x="label", y="latency (s)", hue="series", palette=_SERIES_COLORS, ax=ax1)
    if tall:
        ax1.set_yscale("log")
    ax1.set_xlabel("")
    ax1.set_title(title)
    ax1.legend(title=None, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _speedup_panel(ax2, df, "label", band)
    ax2.set_xlabel(xlabel)
    ax2.set_title(f"Speedup; ticks mark the paper's value ±{band:.0%}")
    fig.tight_layout()
    return fig


def main_results_figure(df: pd.DataFrame, band: float) -> plt.Figure:
    """Figure 5: iteration latency of every setting w/o and w/ TeraPipe, paper and ours;
    ticks at the paper's speedup ±``band`` (the target)."""
    labels = [f"({s})\n{m}" for s, m in zip(df.setting, df.model, strict=True)]
    title = "Training iteration latency (Figure 5): paper vs reproduced"
    return _latency_and_speedup(
        df, labels, tall=True, title=title, xlabel="setting (Table 1)", band=band
    )


def dp_ablation_figure(df: pd.DataFrame) -> plt.Figure:
    """Figure 6: uniform #slices against the DP, one panel per setting, paper and ours."""
    settings = list(dict.fromkeys(df.setting))
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, n in zip(axes[0], settings, strict=True):
        part = df[df.setting == n]
        long = pd.concat(
            [
                part.assign(source=source, seconds=part[column])
                for source, column in (("paper", "paper_latency"), ("ours", "latency"))
            ],
            ignore_index=True,
        )
        sns.barplot(
            long, x="algorithm", y="seconds", hue="source", palette=["#3182bd", "#e6550d"], ax=ax
        )
        ax.set_ylabel("latency (s)")
        ax.set_title(f"({n}) {part.model.iloc[0]}: uniform slicing vs DP (Figure 6)")
        ax.tick_params(axis="x", rotation=45)
        ax.set_xlabel("")
        ax.legend(title=None, fontsize=8)
    fig.tight_layout()
    return fig


def seqlen_figure(df: pd.DataFrame, band: float) -> plt.Figure:
    """Figure 7: GPT3-13B at growing sequence length, w/o and w/ TeraPipe, paper and ours;
    ticks at the paper's speedup ±``band``."""
    labels = [f"L={s}\nB={b}" for s, b in zip(df.seq_len, df.pipeline_batch, strict=True)]
    title = "GPT3-13B, setting (5): latency (Figure 7)"
    return _latency_and_speedup(df, labels, tall=False, title=title, xlabel="", band=band)


# ---- measured (real processes) beside simulated -------------------------------------------


def _bars_with_error(ax: Axes, labels: list[str], series: dict[str, tuple], width: float) -> None:
    """Grouped bars; ``series`` maps a name to (values, errors or None, colour)."""
    x = np.arange(len(labels))
    n = len(series)
    for i, (name, (values, errors, color)) in enumerate(series.items()):
        offset = (i - (n - 1) / 2) * width
        ax.bar(x + offset, values, width, yerr=errors, color=color, label=name, capsize=3)
    ax.set_xticks(x, labels)


def measured_figure(df: pd.DataFrame, x: str) -> plt.Figure:
    """Measure mode of Tables 2 and 4: measured latency (median, error bar one standard
    deviation over the timed iterations) of GPipe and TeraPipe at each ``x``
    (pipeline_batch or seq_len), each beside the simulator's prediction from the locally
    profiled costs; and both speedups."""
    short = {"pipeline_batch": "B", "seq_len": "L"}.get(x, x)
    labels = [f"{short}={v}" for v in df[x]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    _bars_with_error(
        ax1,
        labels,
        {
            "measured, w/o TeraPipe": (df.latency_gpipe, df.latency_gpipe_std, "#fdae6b"),
            "simulated, w/o TeraPipe": (df.simulated_latency_gpipe, None, "#fee6ce"),
            "measured, w/ TeraPipe": (df.latency_terapipe, df.latency_terapipe_std, "#e6550d"),
            "simulated, w/ TeraPipe": (df.simulated_latency_terapipe, None, "#fdd0a2"),
        },
        width=0.2,
    )
    ax1.set_ylabel("iteration latency (s)")
    ax1.set_title(
        f"Measured on this machine vs simulated ({df.model.iloc[0]}, K={df.n_stages.iloc[0]})"
    )
    ax1.legend(fontsize=8)
    _bars_with_error(
        ax2,
        labels,
        {
            "measured": (df.speedup, None, "#e6550d"),
            "simulated": (df.simulated_speedup, None, "#fdd0a2"),
        },
        width=0.35,
    )
    ax2.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax2.set_ylabel("speedup of TeraPipe over GPipe")
    ax2.set_title("Speedup: measured vs simulated")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def measured_ablation_figure(df: pd.DataFrame) -> plt.Figure:
    """Measure mode of Table 3: uniform #slices and the DP, measured (median, error bar
    one standard deviation) beside the simulator's prediction."""
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(df)), 4))
    _bars_with_error(
        ax,
        list(df.algorithm),
        {
            "measured": (df.latency, df.latency_std, "#e6550d"),
            "simulated": (df.simulated_latency, None, "#fdd0a2"),
        },
        width=0.35,
    )
    ax.set_ylabel("iteration latency (s)")
    ax.set_title(
        f"Uniform slicing vs DP, measured vs simulated ({df.model.iloc[0]}, "
        f"L={df.seq_len.iloc[0]}, B={df.pipeline_batch.iloc[0]})"
    )
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def validation_figure(df: pd.DataFrame, runs: Mapping[str, Any]) -> plt.Figure:
    """The simulator's validation: per schedule the measured median latency (error bar:
    one standard deviation) beside both predictions; below, per schedule, the Gantt chart
    of the measured iteration whose latency is the median and the simulated timeline
    (shared cores) on the same time axis. ``runs`` maps each schedule to its
    :class:`~tplib.measure.Measured`."""
    long = pd.concat(
        [
            df.assign(source="measured (median)", seconds=df["latency"]),
            df.assign(source="simulated (shared cores)", seconds=df["simulated_latency"]),
            df.assign(
                source="simulated (a core per stage)", seconds=df["simulated_latency_dedicated"]
            ),
        ]
    )
    fig = plt.figure(figsize=(12, 3 + 3.6 * len(df)), layout="constrained")
    grid = fig.add_gridspec(1 + 2 * len(df), 1, height_ratios=[2.2] + [1.0] * (2 * len(df)))
    ax = fig.add_subplot(grid[0])
    sns.barplot(long, x="schedule", y="seconds", hue="source", ax=ax)
    ax.errorbar(
        np.arange(len(df)) - 0.27, df["latency"], yerr=df["latency_std"], fmt="none", color="k"
    )
    first = df.iloc[0]
    ax.set_title(
        f"{first.model}, K={first.n_stages}, B={first.pipeline_batch}, L={first.seq_len}: "
        "iteration latency"
    )
    for i, schedule in enumerate(df["schedule"]):
        m = runs[schedule]
        it = int(np.argsort(m.latencies)[len(m.latencies) // 2])  # the median iteration
        ax_m = fig.add_subplot(grid[1 + 2 * i])
        plot_timeline(
            m.result.trace, ax=ax_m, iteration=it, title=f"{schedule}: measured (iteration {it})"
        )
        ax_s = fig.add_subplot(grid[2 + 2 * i], sharex=ax_m)
        plot_timeline(m.sim.timeline, ax=ax_s, title=f"{schedule}: simulated")
        ax_m.set_xlim(0, 1.02 * max(m.latencies[it], m.sim.latency))
    return fig
