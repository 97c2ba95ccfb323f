"""Tests for tplib.explorer.plot: the exploration's figure, with and without a timeline."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from tests.explorer_cases import SMALL, write_profile
from tplib.explorer.exploration import explore
from tplib.explorer.plot import figure
from tplib.explorer.scenario import scenario_for_profile, scenario_for_setting


def _titles(fig: Figure) -> list[str]:
    return [ax.get_title()[:3] for ax in fig.axes]


def test_figure_has_the_three_panels() -> None:
    fig = figure(explore(scenario_for_setting(SMALL)))
    assert isinstance(fig, Figure)
    assert _titles(fig) == ["(a)", "(b)", "(c)"]


def test_figure_of_a_profile(tmp_path: Path) -> None:
    ex = explore(scenario_for_profile(write_profile(tmp_path), pipeline_batch=4))
    assert _titles(figure(ex)) == ["(a)", "(b)", "(c)"]


def test_figure_without_a_simulation_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Too big to simulate: the timeline's panel shows the note instead.
    monkeypatch.setattr(importlib.import_module("tplib.explorer.exploration"), "MAX_SIM_ACTIONS", 0)
    ex = explore(scenario_for_profile(write_profile(tmp_path)))
    assert ex.sim is None and ex.gpipe is None
    timeline = figure(ex).axes[2]
    assert not timeline.axison
    assert any("not simulated" in t.get_text() for t in timeline.texts)
