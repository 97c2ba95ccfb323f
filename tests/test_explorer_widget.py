"""Tests for tplib.explorer.widget: the explorer recomputes on every change."""

from __future__ import annotations

from pathlib import Path

from tests.explorer_cases import SMALL, write_profile
from tplib.explorer.exploration import Exploration
from tplib.explorer.scenario import scenario_for_setting
from tplib.explorer.widget import Explorer, build_explorer


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
    assert "DP plan: [(" in shown[0]["text"] and "GPipe" in shown[1]["data"]["text/html"]
    assert ex.setting.value == (SMALL, 2048)
    assert c["pipeline_batch"].value == 4 and c["pipeline_batch"].description == "B/#Data"

    c["n_stages"].value = 48  # a hand edit: recompute, and the setting becomes "custom"
    assert ex.runs == 2 and _shown(ex).scenario.n_stages == 48
    assert ex.setting.value is None

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
