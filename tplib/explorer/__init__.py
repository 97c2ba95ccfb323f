"""The interactive plan explorer: pick a model and a pipeline layout, see the DP's plan.

The logic is plain functions, testable without a browser; the widget only calls them.
One mechanism per module:

==========================================  ===============================================
:mod:`~tplib.explorer.scenario`             :class:`Scenario` (frozen, validated): what to
                                            plan, and the cost model it names; built by
                                            :func:`scenario_for_setting`,
                                            :func:`scenario_for_profile`,
                                            :func:`make_scenario`
:mod:`~tplib.explorer.exploration`          :func:`explore` plans a scenario and returns an
                                            :class:`Exploration`: the DP plan, every uniform
                                            slicing, GPipe, the simulated timelines and the
                                            memory per GPU
:mod:`~tplib.explorer.plot`                 :func:`figure`: uniform slicings vs the DP, the
                                            DP's slice lengths, its simulated timeline
:mod:`~tplib.explorer.widget`               :class:`Explorer` and :func:`build_explorer`:
                                            the ipywidgets form; recomputes on every change
==========================================  ===============================================

``import tplib.explorer`` loads neither torch nor matplotlib, seaborn or ipywidgets:
:func:`figure`, :class:`Explorer` and :func:`build_explorer` load their modules on
first use, so planning from a script stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tplib.explorer.exploration import Exploration, explore
from tplib.explorer.scenario import (
    CLUSTER,
    METHODS,
    Scenario,
    make_scenario,
    scenario_for_profile,
    scenario_for_setting,
)

if TYPE_CHECKING:
    from tplib.explorer.plot import figure
    from tplib.explorer.widget import Explorer, build_explorer

__all__ = [
    "CLUSTER",
    "METHODS",
    "Exploration",
    "Explorer",
    "Scenario",
    "build_explorer",
    "explore",
    "figure",
    "make_scenario",
    "scenario_for_profile",
    "scenario_for_setting",
]

# Names whose modules import matplotlib and seaborn (which imports ipywidgets) or ipywidgets.
_LAZY = {
    "figure": "tplib.explorer.plot",
    "Explorer": "tplib.explorer.widget",
    "build_explorer": "tplib.explorer.widget",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tplib.explorer' has no attribute {name!r}")
