"""Tests for the tplib.explorer package: its names, what importing it loads, and the
explore notebook run headless under papermill (about 15 s, most of it the kernel)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest

import tplib.explorer
from tests.explorer_cases import write_profile
from tplib.reproduce import notebooks_dir


def test_public_names_resolve() -> None:
    from tplib.explorer.plot import figure
    from tplib.explorer.widget import Explorer

    for name in tplib.explorer.__all__:
        assert getattr(tplib.explorer, name) is not None, name
    assert tplib.explorer.figure is figure and tplib.explorer.Explorer is Explorer
    assert callable(tplib.explorer.explore)
    with pytest.raises(AttributeError, match="no attribute 'widgets'"):
        tplib.explorer.widgets  # noqa: B018


@pytest.mark.parametrize(
    ("module", "heavy"),
    [
        ("tplib.explorer.scenario", ["torch"]),
        ("tplib.explorer.exploration", ["torch"]),
        ("tplib.explorer", ["torch", "matplotlib", "seaborn", "ipywidgets"]),
    ],
)
def test_planning_imports_stay_light(
    fresh_python: Callable[..., str], module: str, heavy: list[str]
) -> None:
    fresh_python(f"import {module}\nlight(*{heavy!r})")


def test_notebook_runs_headless(tmp_path: Path) -> None:
    # On the small profile: the cluster model's path is tested in test_explorer_widget, and
    # the kernel's start and imports already take most of the time.
    import papermill as pm

    out = tmp_path / "explore.ipynb"
    parameters = {
        "setting": None,
        "cost_source": "profile",
        "profile": str(write_profile(tmp_path)),
        "custom": {"pipeline_batch": 2},
    }
    pm.execute_notebook(
        str(notebooks_dir() / "explore.ipynb"),
        str(out),
        kernel_name="python3",
        parameters=parameters,
        cwd=str(notebooks_dir()),
        progress_bar=False,
        start_timeout=120,  # fail, not hang, if the kernel is stuck
        execution_timeout=300,
    )
    outputs = [
        o
        for c in nbformat.read(out, as_version=4).cells
        if c.cell_type == "code"
        for o in c.outputs
    ]
    text = "".join(o.get("text", "") for o in outputs)
    assert "DP plan: [(" in text and "cost: profile" in text
    assert "2 sequence(s) per pipeline" in text
    kinds = {k for o in outputs for k in o.get("data", {})}
    assert {"image/png", "application/vnd.jupyter.widget-view+json"} <= kinds
