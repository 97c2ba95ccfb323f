"""The facade, ``tplib/__init__``: every name it exports is the object its module defines,
it loads lazily, and the walk-through in its docstring runs as written."""

from __future__ import annotations

import importlib
import textwrap
from collections.abc import Callable

import pytest

import tplib


def _example() -> list[str]:
    doc = tplib.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    return textwrap.dedent(block).splitlines()


def test_every_export_is_its_modules_object() -> None:
    assert sorted(tplib.__all__) == sorted(tplib._EXPORTS) == tplib.__all__
    for name, module in tplib._EXPORTS.items():
        assert getattr(tplib, name) is getattr(importlib.import_module(module), name), name
    assert set(tplib.__all__) <= set(dir(tplib))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'plan_slice'"):
        _ = tplib.plan_slice


def test_planning_and_simulating_through_the_facade_load_no_torch(
    fresh_python: Callable[..., str],
) -> None:
    lines = _example()
    planning = lines[: next(i for i, line in enumerate(lines) if "autoplan" in line)]
    out = fresh_python(
        "import tplib\n"
        'light("numpy")\n'
        + "\n".join(planning)
        + "\nprint(tplib.simulate(schedule, costs).latency, 'torch' in sys.modules)"
    )
    latency, torch_loaded = out.split()
    assert float(latency) > 0 and torch_loaded == "False"


@pytest.mark.system
def test_the_docstrings_walk_through_runs_as_written(fresh_python: Callable[..., str]) -> None:
    fresh_python("import tplib\n" + "\n".join(_example()), timeout_s=600)
