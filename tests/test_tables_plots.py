"""Tests for tplib.tables.plots: the tables' figures, the paper's values beside ours."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from tplib.tables.plots import dp_ablation_figure, main_results_figure, seqlen_figure

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _close_leftover_figures() -> Iterator[None]:
    """Tests close their figures; this closes those of a test that failed half-way."""
    yield
    plt.close("all")


# ---- the tables' figures ---------------------------------------------------------------------

LATENCY_SERIES = {
    "paper, w/o TeraPipe": "paper_latency_gpipe",
    "paper, w/ TeraPipe": "paper_latency_terapipe",
    "ours, w/o TeraPipe": "latency_gpipe",
    "ours, w/ TeraPipe": "latency_terapipe",
}
SPEEDUP_SERIES = {"paper": "paper_speedup", "ours": "speedup"}


def _read(name: str, columns: list[str]) -> pd.DataFrame:
    return pd.read_csv(ROOT / "results" / name / f"{name}-simulate.csv", usecols=columns)


def _series(ax: Axes) -> dict[str, list[float]]:
    """Bar heights of each legend entry, left to right; one bar per x tick."""
    legend = ax.get_legend()
    assert legend is not None
    series = {}
    for handle, text in zip(legend.legend_handles, legend.get_texts(), strict=True):
        assert handle is not None
        colour = handle.get_facecolor()  # type: ignore[attr-defined]
        (container,) = [
            c
            for c in ax.containers
            if isinstance(c, BarContainer) and np.allclose(c.patches[0].get_facecolor(), colour)
        ]
        bars = sorted(container.patches, key=lambda p: p.get_x())
        centres = [p.get_x() + p.get_width() / 2 for p in bars]
        assert [round(c) for c in centres] == list(range(len(ax.get_xticks())))
        series[text.get_text()] = [p.get_height() for p in bars]
    return series


def _assert_series(ax: Axes, df: pd.DataFrame, columns: dict[str, str]) -> None:
    series = _series(ax)
    assert list(series) == list(columns)
    for name, column in columns.items():
        assert np.allclose(series[name], df[column]), name


def _render(fig: Figure) -> None:
    fig.canvas.draw()


def test_main_results_figure_shows_latencies_and_speedups() -> None:
    df = _read(
        "main_results", ["setting", "model", *LATENCY_SERIES.values(), *SPEEDUP_SERIES.values()]
    )
    fig = main_results_figure(df, 0.15)
    _render(fig)
    assert len(fig.axes) == 2
    latency, speedup = fig.axes
    _assert_series(latency, df, LATENCY_SERIES)
    assert latency.get_yscale() == "log"
    ticks = [t.get_text() for t in latency.get_xticklabels()]
    assert len(ticks) == len(df) == 10
    for tick, setting, model in zip(ticks, df.setting, df.model, strict=True):
        assert f"({setting})" in tick and model in tick
    _assert_series(speedup, df, SPEEDUP_SERIES)
    assert speedup.get_title().endswith("±15%")
    # No legend over the bars: each legend's box starts right of its axes.
    for ax in (latency, speedup):
        legend, box = ax.get_legend(), ax.get_window_extent()
        assert legend is not None and legend.get_window_extent().x0 >= box.x1 - 1
    plt.close(fig)


def test_dp_ablation_figure_has_one_panel_per_setting() -> None:
    df = _read("dp_ablation", ["setting", "model", "algorithm", "latency", "paper_latency"])
    fig = dp_ablation_figure(df)
    _render(fig)
    settings = list(dict.fromkeys(df.setting))
    assert settings == [8, 9]
    assert len(fig.axes) == len(settings)
    for ax, setting in zip(fig.axes, settings, strict=True):
        part = df[df.setting == setting]
        assert ax.get_title().startswith(f"({setting}) {part.model.iloc[0]}")
        assert [t.get_text() for t in ax.get_xticklabels()] == list(part.algorithm)
        _assert_series(ax, part, {"paper": "paper_latency", "ours": "latency"})
    plt.close(fig)


def test_seqlen_figure_shows_latencies_and_speedups_per_length() -> None:
    df = _read(
        "seqlen_sweep",
        ["seq_len", "pipeline_batch", *LATENCY_SERIES.values(), *SPEEDUP_SERIES.values()],
    )
    fig = seqlen_figure(df, 0.15)
    _render(fig)
    assert len(fig.axes) == 2
    latency, speedup = fig.axes
    _assert_series(latency, df, LATENCY_SERIES)
    ticks = [t.get_text() for t in latency.get_xticklabels()]
    assert len(ticks) == len(df) == 4
    for tick, seq_len, batch in zip(ticks, df.seq_len, df.pipeline_batch, strict=True):
        assert str(seq_len) in tick and str(batch) in tick
    _assert_series(speedup, df, SPEEDUP_SERIES)
    plt.close(fig)
