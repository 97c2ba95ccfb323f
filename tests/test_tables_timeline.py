"""Tests for tplib.tables.timeline: the timeline's rows, boxes, chunks and legend."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgba_array
from matplotlib.figure import Figure

from tests.unit_costs import ConstantCosts
from tplib.plan import Plan
from tplib.schedule import make_schedule
from tplib.sim.simulate import simulate
from tplib.tables.timeline import plot_timeline

COMM = ("SA", "RA", "SG", "RG")


@pytest.fixture(autouse=True)
def _close_leftover_figures() -> Iterator[None]:
    """Tests close their figures; this closes those of a test that failed half-way."""
    yield
    plt.close("all")


# ---- reading what was drawn ----------------------------------------------------------------


@dataclass(frozen=True)
class Box:
    x0: float
    x1: float
    y: float  # the centre: the row's index, 0 at the top
    height: float
    rgba: tuple[float, float, float, float]

    @property
    def grey(self) -> bool:
        r, g, b, _ = self.rgba
        return r == g == b


def _boxes(ax: Axes) -> list[Box]:
    """Every rectangle of the axes' broken_barh collections."""
    boxes = []
    for coll in ax.collections:
        assert isinstance(coll, PolyCollection)
        faces = to_rgba_array(coll.get_facecolor())
        for i, path in enumerate(coll.get_paths()):
            ext = path.get_extents()
            r, g, b, a = (float(c) for c in faces[i if len(faces) > 1 else 0])
            boxes.append(Box(ext.x0, ext.x1, (ext.y0 + ext.y1) / 2, ext.height, (r, g, b, a)))
    return boxes


def _compute_boxes(ax: Axes) -> list[Box]:
    """Forward and backward boxes: the coloured ones (steps are grey, messages black)."""
    return [b for b in _boxes(ax) if not b.grey]


def _close(ax: Axes) -> None:
    fig = ax.get_figure(root=True)
    assert isinstance(fig, Figure)
    plt.close(fig)


def _legend_labels(ax: Axes) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None
    return [t.get_text() for t in legend.get_texts()]


def _n_compute_rows(df: pd.DataFrame) -> int:
    return int(df["kind"].isin(["F", "B"]).sum())


@pytest.fixture(scope="module")
def timeline() -> pd.DataFrame:
    """Two stages, two batch slices of two token slices each; sends take 0.1 s."""
    plan = Plan.uniform(2, 8, n_token_slices=2)
    return simulate(make_schedule("terapipe", 2, plan), ConstantCosts(t_send=0.1)).timeline


# ---- plot_timeline ---------------------------------------------------------------------------


def test_timeline_has_one_row_per_stage_with_stage_0_on_top(timeline: pd.DataFrame) -> None:
    ax = plot_timeline(timeline, title="simulated")
    assert list(ax.get_yticks()) == [0, 1]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    bottom, top = ax.get_ylim()
    assert bottom > top  # inverted: row 0 is drawn at the top
    assert ax.get_title() == "simulated"
    # Each stage's compute boxes lie in its own row, at the times of its rows.
    boxes = _compute_boxes(ax)
    for row, stage in enumerate([0, 1]):
        rows = timeline[(timeline.stage == stage) & timeline.kind.isin(["F", "B"])]
        drawn = sorted((b.x0, b.x1) for b in boxes if abs(b.y - row) < 0.4)
        expected = sorted(zip(rows.start, rows.end, strict=True))
        assert np.allclose(drawn, expected), stage
    _close(ax)


def test_timeline_draws_one_box_per_forward_and_backward(timeline: pd.DataFrame) -> None:
    ax = plot_timeline(timeline, show_comm=False)
    boxes = _boxes(ax)
    n_compute = _n_compute_rows(timeline)
    assert n_compute == 16  # 2 stages x 4 units x (F, B)
    assert len(_compute_boxes(ax)) == n_compute
    n_steps = int(timeline["kind"].isin(["AR", "OPT"]).sum())
    assert len(boxes) == n_compute + n_steps  # no messages without show_comm
    _close(ax)

    ax = plot_timeline(timeline)
    messages = timeline[timeline["kind"].isin(COMM) & (timeline.end > timeline.start)]
    assert len(messages) > 0
    thin = [b for b in _boxes(ax) if b.height < 0.4]
    assert len(thin) == len(messages)
    assert len(_boxes(ax)) == n_compute + n_steps + len(messages)
    _close(ax)


def test_backward_boxes_are_darker_than_forward_ones(timeline: pd.DataFrame) -> None:
    ax = plot_timeline(timeline)
    colours: dict[tuple[str, int], set[tuple[float, ...]]] = {}
    for box in _compute_boxes(ax):
        stage = round(box.y)
        match = timeline[
            (timeline.stage == stage)
            & timeline.kind.isin(["F", "B"])
            & np.isclose(timeline.start, box.x0)
            & np.isclose(timeline.end, box.x1)
        ]
        assert len(match) == 1, box
        kind, b = str(match.kind.iloc[0]), int(match.b.iloc[0])
        colours.setdefault((kind, b), set()).add(box.rgba)
    assert sorted(colours) == [("B", 0), ("B", 1), ("F", 0), ("F", 1)]
    assert all(len(c) == 1 for c in colours.values())  # one colour per (kind, batch slice)
    for b in (0, 1):
        (fwd,), (bwd,) = colours[("F", b)], colours[("B", b)]
        assert all(d <= f for d, f in zip(bwd[:3], fwd[:3], strict=True)), b
        assert sum(bwd[:3]) < sum(fwd[:3]), b
    assert colours[("B", 0)] != colours[("B", 1)]  # batch slices differ in colour
    _close(ax)


def test_timeline_legend_names_the_kinds_of_boxes(timeline: pd.DataFrame) -> None:
    ax = plot_timeline(timeline)
    labels = _legend_labels(ax)
    assert {"forward: light shade", "backward: full shade"} <= set(labels)
    assert {"AR", "OPT", "send / receive"} <= set(labels)
    # The shades are grey: a batch slice's colour would claim "backward" for it alone.
    legend = ax.get_legend()
    assert legend is not None and legend.get_title().get_text() == "colour: batch slice"
    shades = [h.get_facecolor()[:3] for h in legend.legend_handles[:2]]  # type: ignore[union-attr]
    assert all(r == g == b for r, g, b in shades)
    _close(ax)
    ax = plot_timeline(timeline, show_comm=False)
    labels = _legend_labels(ax)
    assert {"backward: full shade", "AR", "OPT"} <= set(labels)
    assert "send / receive" not in labels
    _close(ax)


def test_timeline_tells_chunks_apart() -> None:
    """Under a V of virtual stages the second chunk's boxes are dotted and outlined, the
    first's plain, and the legend names both."""
    schedule = make_schedule("zbv", 2, Plan.gpipe(2, 8))
    df = simulate(schedule, ConstantCosts()).timeline
    assert set(df["chunk"]) == {0, 1}
    ax = plot_timeline(df, show_comm=False)
    hatches: dict[str | None, int] = {}
    for coll in ax.collections:
        hatches[coll.get_hatch()] = hatches.get(coll.get_hatch(), 0) + len(coll.get_paths())
    per_chunk = df[df["kind"].isin(["F", "B"])].groupby("chunk").size()
    assert hatches[".."] == per_chunk[1]  # every chunk-1 forward and backward, dotted
    assert hatches["///"] == int((df["kind"] == "W").sum())
    assert {"chunk 0", "chunk 1"} <= set(_legend_labels(ax))
    _close(ax)
    plain = plot_timeline(
        simulate(make_schedule("1f1b", 2, Plan.gpipe(2, 8)), ConstantCosts()).timeline
    )
    assert "chunk 0" not in _legend_labels(plain)  # one chunk per stage: nothing to tell
    _close(plain)


def test_timeline_selects_a_replica(timeline: pd.DataFrame) -> None:
    latency = float(timeline.end.max())
    # Replica 1 runs twice as slow and later: its own times start at 5 s.
    slower = timeline.assign(
        replica=1, rank=timeline.stage + 2, start=5 + 2 * timeline.start, end=5 + 2 * timeline.end
    )
    both = pd.concat([timeline, slower], ignore_index=True)
    n_compute = _n_compute_rows(timeline)
    for replica, extent, n_boxes in [
        (0, latency, n_compute),
        (1, 2 * latency, n_compute),
        (None, 5 + 2 * latency, 2 * n_compute),
    ]:
        ax = plot_timeline(both, replica=replica)
        boxes = _boxes(ax)
        assert len(_compute_boxes(ax)) == n_boxes, replica
        assert min(b.x0 for b in boxes) == pytest.approx(0.0), replica
        assert max(b.x1 for b in boxes) == pytest.approx(extent), replica
        _close(ax)


def test_timeline_draws_only_the_stages_asked_for(timeline: pd.DataFrame) -> None:
    ax = plot_timeline(timeline, stages=[1])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 1"]
    stage_1 = timeline[timeline.stage == 1]
    t0 = float(stage_1.start.min())  # times start at the first row shown
    compute = stage_1[stage_1.kind.isin(["F", "B"])]
    drawn = sorted((b.x0, b.x1) for b in _compute_boxes(ax))
    assert all(abs(b.y) < 0.4 for b in _boxes(ax))  # all in the single row
    assert np.allclose(drawn, sorted(zip(compute.start - t0, compute.end - t0, strict=True)))
    _close(ax)


def test_timeline_time_unit_scales_the_axis(timeline: pd.DataFrame) -> None:
    latency = float(timeline.end.max())
    ax = plot_timeline(timeline)
    assert ax.get_xlabel() == "time (s)"
    assert max(b.x1 for b in _boxes(ax)) == pytest.approx(latency)
    _close(ax)
    ax = plot_timeline(timeline, time_unit=1e-3)
    assert ax.get_xlabel() == "time (ms)"
    assert max(b.x1 for b in _boxes(ax)) == pytest.approx(1000 * latency)
    _close(ax)


def test_timeline_draws_into_given_axes(timeline: pd.DataFrame) -> None:
    fig, (top, bottom) = plt.subplots(2, 1)
    assert plot_timeline(timeline, ax=bottom) is bottom
    assert not top.collections and len(_compute_boxes(bottom)) == _n_compute_rows(timeline)
    plt.close(fig)


def test_timeline_without_required_columns_is_refused(timeline: pd.DataFrame) -> None:
    with pytest.raises(ValueError, match=r"timeline lacks columns \['b', 'start'\]"):
        plot_timeline(timeline.drop(columns=["b", "start"]))
    assert not plt.get_fignums()  # refused before drawing anything


def _runtime_trace() -> pd.DataFrame:
    """A runtime-like trace: clock times, two iterations, one batch slice of two slices."""
    rows = []
    for it in (0, 1):
        base = 1000.0 + 10.0 * it
        for stage in (0, 1):
            s = base + 0.2 * stage
            steps = [
                ("F", 0, 0, s + 0.0, s + 0.1),
                ("SA", 0, 0, s + 0.1, s + 0.12),
                ("F", 0, 1, s + 0.12, s + 0.22),
                ("SA", 0, 1, s + 0.22, s + 0.24),
                ("B", 0, 1, s + 1.0, s + 1.2),
                ("SG", 0, 1, s + 1.2, s + 1.22),
                ("B", 0, 0, s + 1.22, s + 1.42),
                ("SG", 0, 0, s + 1.42, s + 1.44),
                ("AR", -1, -1, s + 1.5, s + 1.6),
                ("OPT", -1, -1, s + 1.6, s + 1.65),
            ]
            rows += [(stage, stage, 0, it, *step) for step in steps]
    columns = ["rank", "stage", "replica", "iteration", "kind", "b", "t", "start", "end"]
    return pd.DataFrame.from_records(rows, columns=columns)


def test_timeline_draws_one_iteration_of_a_runtime_trace() -> None:
    trace = _runtime_trace()
    ax = plot_timeline(trace, iteration=1, time_unit=1e-3)
    assert ax.get_xlabel() == "time (ms)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    assert len(_compute_boxes(ax)) == 8  # 2 stages x 2 slices x (F, B)
    boxes = _boxes(ax)
    # Iteration 1 runs from 1010.0 to 1010.2 + 1.65 s: 1850 ms from its own start.
    assert min(b.x0 for b in boxes) == pytest.approx(0.0)
    assert max(b.x1 for b in boxes) == pytest.approx(1850.0)
    _close(ax)

    ax = plot_timeline(trace)  # every iteration
    assert len(_compute_boxes(ax)) == 16
    assert max(b.x1 for b in _boxes(ax)) == pytest.approx(11.85)
    _close(ax)
