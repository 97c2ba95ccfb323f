"""The facade, ``tplib/__init__``: every name it exports is the object its module defines,
it loads lazily, and the walk-through in its docstring runs as written."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

import tplib
from tests.conftest import ROOT


def _example() -> list[str]:
    doc = tplib.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    return textwrap.dedent(block).splitlines()


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_export_is_its_modules_object() -> None:
    assert sorted(tplib.__all__) == sorted(tplib._EXPORTS) == tplib.__all__
    for name, module in tplib._EXPORTS.items():
        assert getattr(tplib, name) is getattr(importlib.import_module(module), name), name
    assert set(tplib.__all__) <= set(dir(tplib))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'plan_slice'"):
        _ = tplib.plan_slice


def test_planning_and_simulating_through_the_facade_load_no_torch() -> None:
    lines = _example()
    light = lines[: next(i for i, line in enumerate(lines) if "autoplan" in line)]
    out = _run(
        "import sys, tplib\n"
        "assert 'numpy' not in sys.modules, 'import tplib loaded numpy'\n"
        + "\n".join(light)
        + "\nprint(tplib.simulate(schedule, costs).latency, 'torch' in sys.modules)"
    )
    latency, torch_loaded = out.split()
    assert float(latency) > 0 and torch_loaded == "False"


@pytest.mark.system
def test_the_docstrings_walk_through_runs_as_written() -> None:
    _run("import tplib\n" + "\n".join(_example()))
