"""The pipeline timeline (the paper's Figure 2) of a simulated or measured trace.

:func:`plot_timeline` takes a DataFrame with the trace columns of
:data:`tplib.sim.simulate.TIMELINE_COLUMNS` (``rank, stage, replica, kind, b, t, chunk,
start, end``; the runtime's traces have them too) and draws one row per stage: forward
and backward boxes coloured by batch slice (the forward light, the backward dark, as in
the paper's Figure 2), sends and receives as thin bars under them, the data-parallel
all-reduce and the optimizer step in grey. Gaps are the pipeline bubbles. With virtual
stages each chunk after the first is outlined and dotted its own way, so the loops of an
interleaved schedule, or the two arms of a V, read apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from tplib.schedule import COMMUNICATION, COMPUTE, Kind

__all__ = ["plot_timeline"]

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
