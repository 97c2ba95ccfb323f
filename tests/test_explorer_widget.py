"""Tests for tplib.explorer.widget: the explorer recomputes on every change."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.explorer_cases import SMALL, write_profile
from tplib.explorer.exploration import Exploration
from tplib.explorer.scenario import MAX_GRID_STEPS, scenario_for_setting
from tplib.explorer.widget import CUSTOM, Explorer, build_explorer


def _shown(ex: Explorer) -> Exploration:
    """The exploration the widget shows (it shows no error beside one)."""
    assert ex.exploration is not None and ex.error is None, ex.error
    return ex.exploration


def _error_shown(ex: Explorer) -> str:
    """The error the widget shows in place of an exploration."""
    assert ex.exploration is None and ex.error is not None
    assert ex.output.outputs[0]["text"].startswith("cannot plan this")
    return ex.error


def test_explorer_recomputes_on_change(tmp_path: Path) -> None:
    ex = build_explorer(SMALL, show_figure=False)
    c = ex.controls
    assert ex.runs == 1 and _shown(ex).scenario == scenario_for_setting(SMALL)
    shown = ex.output.outputs  # the plan's text, then the DP / uniform / GPipe table
    assert "DP plan: [(" in shown[0]["data"]["text/plain"]
    assert "word-break: normal" in shown[0]["data"]["text/html"]  # wraps between words
    assert "GPipe" in shown[1]["data"]["text/html"]
    assert ex.status.value.startswith("explored in")
    assert ex.setting.value == (SMALL, 2048)
    assert c["pipeline_batch"].value == 4 and c["pipeline_batch"].description == "B/#Data"

    c["n_stages"].value = 48  # a hand edit: recompute, and the setting becomes "custom"
    assert ex.runs == 2 and _shown(ex).scenario.n_stages == 48
    assert ex.setting.value == CUSTOM and ex.setting.label == "custom"

    c["pipeline_batch"].value = 2
    assert ex.runs == 3 and _shown(ex).scenario.pipeline_batch == 2

    c["n_stages"].value = 5  # an invalid layout: shown as an error, nothing raised
    assert ex.runs == 4 and "n_stages=5" in _error_shown(ex)

    ex.setting.value = (10, 2048)  # a paper setting fills in every field, recomputes once
    assert ex.runs == 5 and _shown(ex).scenario == scenario_for_setting(10)
    assert (c["model"].value, c["n_stages"].value, c["n_op"].value) == ("GPT3-175B", 48, 8)

    profile = write_profile(tmp_path)
    c["source"].value = "profile file"
    c["profile"].value = str(profile)  # the profile's model and grid are adopted
    sc = _shown(ex).scenario
    assert (sc.model, sc.cost, sc.n_op, sc.n_data, sc.seq_len) == ("tiny", str(profile), 1, 1, 64)
    assert sc.pipeline_batch == 2  # the user's B/#Data is kept
    assert c["n_op"].disabled


def test_the_table_cuts_long_plans_and_simulates_the_best_uniform() -> None:
    ex = build_explorer(SMALL, show_figure=False)
    summary = _shown(ex).summary()
    assert summary["simulated_s"].notna().all()  # the best uniform slicing too
    # Setting (7) plans 6 distinct slices (41 characters); the paper's (5) at L = 8192
    # needs more than the table's 48.
    c = ex.controls
    c["seq_len"].value, c["granularity"].value = 8192, 16
    long_plan = _shown(ex).plan.to_paper()
    table = ex.output.outputs[1]["data"]["text/plain"]
    assert len(long_plan) > 48 and long_plan not in table and long_plan[:45] + "..." in table
    assert long_plan in ex.output.outputs[0]["data"]["text/plain"]  # whole, in the text


def test_a_grid_too_fine_to_plan_interactively_is_refused() -> None:
    ex = build_explorer(SMALL, show_figure=False)
    c = ex.controls
    c["seq_len"].value = 8192
    c["granularity"].value = 4  # 2048 grid points: the DP would take about a minute
    assert f"at most {MAX_GRID_STEPS}" in _error_shown(ex) and "g >= 8" in _error_shown(ex)


def _wait_idle(ex: Explorer, deadline: float) -> None:
    """Until the explorer's planning thread has nothing left to do."""
    while ex._worker is not None:
        assert time.monotonic() < deadline, "the planning thread did not finish"
        time.sleep(0.01)


def test_background_changes_coalesce_into_one_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    ex = build_explorer(SMALL, show_figure=False, background=True)
    deadline = time.monotonic() + 60
    _wait_idle(ex, deadline)
    assert ex.runs == 1
    # Hold the planner so that every change below arrives while one recompute runs.
    gate, entered = threading.Event(), threading.Event()
    plan = ex._explore

    def slow(*args: object) -> Exploration:
        entered.set()
        gate.wait(30)
        return plan(*args)

    monkeypatch.setattr(ex, "_explore", slow)
    c = ex.controls
    c["pipeline_batch"].value = 2
    assert entered.wait(30)
    assert "planning" in ex.status.value and "previous one" in ex.status.value
    for b in (3, 5, 6, 8):  # four more clicks while the first plan runs
        c["pipeline_batch"].value = b
    gate.set()
    _wait_idle(ex, deadline)
    assert ex.runs == 3  # the first change, then one for the four that waited
    assert _shown(ex).scenario.pipeline_batch == 8
