"""How the packed-sequences table reads (:mod:`tplib.tables.packed_sequences`): its
findings and figures, in both modes.

The simulated findings set the DP's plans per packed batch (d) against padding (a),
packing alone (b) and uniform slices on the same rows (c), and say what padding each
scheme wastes and what planning costs per batch. Simulate mode draws, in one figure: the
sources' document lengths; the padding each scheme wastes; one batch's DP plan over its
documents (:func:`draw_plan`: rows as horizontal bars, documents in alternating shades
and padding grey, document boundaries as ticks, the plan's token slice cuts as vertical
lines across the rows of their batch slice); and per cluster, the document-masked
schemes' real tokens per second over packing alone (b), per setting and source (padding
(a) against (b) is the padding panel's story: (b) carries ``(1 - its padding) / (1 -
pad's)`` times the tokens in the same time).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from tplib.documents import Documents
from tplib.plan import Plan
from tplib.tables.base import Rows

__all__ = [
    "cache_summary",
    "draw_plan",
    "figure",
    "findings",
    "measured_figure",
    "measured_findings",
]

_SHADES = ("#9ecae1", "#4292c6")  # documents alternate; the padding is grey


def _span(values: pd.Series, fmt: str) -> str:
    lo, hi = values.min(), values.max()
    return format(lo, fmt) if np.isclose(lo, hi) else f"{lo:{fmt}} to {hi:{fmt}}"


def findings(df: pd.DataFrame) -> str:
    """(d) over (a) and over (c), the padding each scheme wastes, planning's share."""
    key = ["setting", "cluster", "source"]
    by = df.set_index([*key, "scheme"]).real_tokens_per_s.unstack("scheme")
    lines = []
    for cluster, part in by.groupby(level="cluster", sort=False):
        gain = part["packed-dp"] / part["pad"]
        best = gain.index[int(np.argmax(gain.to_numpy()))]
        lines.append(
            f"- **{cluster}**: packing with document-masked DP plans (d) carries "
            f"{_span(gain, '.2f')}x the real tokens per second of padding each document "
            f"(a); most at ({best[0]}) {best[2]}. Packing alone (b) gives "
            f"{_span(part['packed-unmasked'] / part['pad'], '.2f')}x; document masking "
            f"and the DP add {_span(part['packed-dp'] / part['packed-unmasked'], '.3f')}x "
            "to it."
        )
    over = by["packed-dp"] / by["packed-uniform"] - 1
    slower = over[over < 0]
    if slower.empty:
        lines.append(
            f"- (d) is at least as fast as uniform slices on the packed rows (c) everywhere: "
            f"{_span(100 * over, '.2f')}% more real tokens per second; the snap rule gets "
            f"{_span(100 * (by['packed-snap'] / by['packed-uniform'] - 1), '.2f')}%."
        )
    else:
        where = ", ".join(
            f"({k[0]}) {k[1]} {k[2]}: {100 * v:.2f}%"
            for k, v in zip(slower.index, slower, strict=True)
        )
        lines.append(f"- (d) is SLOWER than uniform slices (c) at {where}.")
    pad = df.groupby(["source", "scheme"], sort=False).padding_fraction.mean().unstack()
    for source, r in pad.iterrows():
        lines.append(
            f"- Padding, {source}: {r['pad']:.1%} of the tokens when each document has its "
            f"row, {r['packed-dp']:.1%} packed first-fit decreasing."
        )
    dp = df[df.scheme == "packed-dp"]
    share = 100 * dp.plan_ms / (1e3 * dp.iteration_s)
    lines.append(
        f"- Planning each packed batch (granularity-grid DP, this machine, one core): "
        f"{dp.plan_ms.mean():.0f} ms on average, at most {dp.plan_ms.max():.0f} ms; "
        f"{share.max():.1f}% of the simulated iteration at most. Fit residuals "
        f"{_span(100 * dp.fit_residual, '.1f')}%."
    )
    return "\n".join(lines)


def cache_summary(cache: pd.DataFrame) -> str:
    """The ``cache`` extra in a line per bucket: hit rates, planning's share, plan loss."""
    lines = []
    for bucket, part in cache.groupby("bucket", sort=True):
        lines.append(
            f"- Bucket of {bucket} tokens: hit rate {_span(part.hit_rate, '.0%')}, "
            f"planning {_span(part.plan_pct, '.2f')}% of the iteration, cached plans "
            f"{_span(100 * part.over_own_plans, '.2f')}% slower than each batch's own."
        )
    return "\n".join(lines)


def draw_plan(
    ax: Axes,
    documents: Documents,
    plan: Plan,
    title: str = "",
    real: Sequence[int] | None = None,
) -> None:
    """``plan`` over the rows ``documents`` (see the module docstring); ``real``: each
    row's real tokens, the rest drawn as padding (default: none)."""
    L = documents.seq_len
    for r, bounds in enumerate(documents.bounds):
        end = L if real is None else real[r]
        for j, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            shade = _SHADES[j % 2] if lo < end else "lightgrey"
            ax.broken_barh([(lo, hi - lo)], (r - 0.4, 0.8), color=shade, lw=0)
        ax.vlines(bounds[1:-1], r - 0.45, r + 0.45, color="black", lw=0.6)
    for b, size in enumerate(plan.batch_slices):
        first = plan.batch_offset(b)
        cuts = plan.token_bounds(b)[1:-1]
        ax.vlines(cuts, first - 0.5, first + size - 0.5, color="crimson", lw=1.4)
        ax.axhline(first + size - 0.5, color="crimson", lw=0.5, ls=":")
    ax.set_xlim(0, L)
    ax.set_ylim(documents.batch - 0.5, -0.5)
    ax.set_xlabel("token (document boundaries: ticks; slice cuts: red)")
    ax.set_ylabel("row")
    ax.set_title(title)


def figure(rows: Rows) -> Figure:
    """The simulated table's figure (see the module docstring)."""
    df = rows.df
    clusters = list(dict.fromkeys(df.cluster))
    fig = plt.figure(figsize=(17, 9))
    grid = fig.add_gridspec(2, 6)
    lengths, padding, plan = (fig.add_subplot(grid[0, 2 * k : 2 * k + 2]) for k in range(3))
    lengths_df = rows.traces.get("lengths")
    if isinstance(lengths_df, pd.DataFrame) and not lengths_df.empty:
        sns.histplot(lengths_df, x="length", hue="source", log_scale=True, stat="density",
                     common_norm=False, element="step", ax=lengths)  # fmt: skip
        lengths.axvline(2048, color="black", ls="--", lw=0.8)
    lengths.set_title("document lengths (L = 2048 dashed)")
    sns.barplot(df, x="scheme", y="padding_fraction", hue="source", errorbar=None, ax=padding)
    padding.set_title("padding's share of the tokens")
    padding.tick_params(axis="x", rotation=20)
    example: Any = rows.traces.get("example")
    if example is not None:
        draw_plan(plan, **example)
    width = 6 // max(1, len(clusters))
    schemes = [s for s in dict.fromkeys(df.scheme) if s not in ("pad", "packed-unmasked")]
    base = df[df.scheme == "packed-unmasked"].set_index(["setting", "cluster", "source"])
    over = df.join(base.real_tokens_per_s.rename("unmasked"), on=["setting", "cluster", "source"])
    over = over.assign(
        over_unmasked=over.real_tokens_per_s / over.unmasked,
        case="(" + over.setting.astype(str) + ") " + over.source,
    )
    for k, cluster in enumerate(clusters):
        ax = fig.add_subplot(grid[1, k * width : (k + 1) * width])
        part = over[(over.cluster == cluster) & over.scheme.isin(schemes)]
        sns.barplot(part, x="case", y="over_unmasked", hue="scheme", hue_order=schemes, ax=ax)
        ax.axhline(1.0, color="black", lw=0.8)
        if not part.empty:  # the differences are percents: no bar from zero
            lo, hi = part.over_unmasked.min(), part.over_unmasked.max()
            ax.set_ylim(lo - 0.1 * (hi - lo) - 0.01, hi + 0.1 * (hi - lo) + 0.01)
        ax.set_ylabel("real tokens / s over packing alone (b)")
        ax.set_xlabel("")
        ax.set_title(f"{cluster}: masked schemes against packed-unmasked")
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    return fig


def measured_figure(rows: Rows) -> Figure:
    """Measured real tokens per second per scheme and source."""
    df = rows.df
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.barplot(df, x="scheme", y="real_tokens_per_s", hue="source", ax=ax)
    ax.set_ylabel("real tokens / s (measured)")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    return fig


def measured_findings(df: pd.DataFrame) -> str:
    """Per source, the measured schemes against padding, and the loss check."""
    lines = []
    for source, part in df.groupby("source", sort=False):
        best = part.sort_values("real_tokens_per_s").iloc[-1]
        gains = ", ".join(f"{r.scheme} {r.speedup_over_pad:.2f}x" for r in part.itertuples())
        lines.append(
            f"- **{source}**: fastest `{best.scheme}` ({best.real_tokens_per_s:,.0f} real "
            f"tokens/s); over padding: {gains}."
        )
    if "loss_vs_masked" in df and np.isfinite(df.loss_vs_masked).any():
        lines.append(
            f"- Loss against the document-masked reference: largest difference "
            f"{np.nanmax(np.abs(df.loss_vs_masked)):.2e}."
        )
    return "\n".join(lines)
