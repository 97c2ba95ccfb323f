"""The reproduced tables' figures (Figures 5, 6 and 7, and the measured and validation
figures), with the paper's values beside ours. The pipeline timeline they draw on is
:mod:`tplib.tables.timeline`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes

from tplib.tables.timeline import plot_timeline

__all__ = [
    "dp_ablation_figure",
    "main_results_figure",
    "measured_ablation_figure",
    "measured_figure",
    "seqlen_figure",
    "validation_figure",
]

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
