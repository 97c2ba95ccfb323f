"""Cost model from measurements: profile one pipeline stage and predict its slice times
(paper §3.3, Eq. 9).

- :mod:`~tplib.perfmodel.profile`: :class:`Profile`, measured slice times as plain data
  (Eq. 9's context model, JSON files); the planner's cost model;
- :mod:`~tplib.perfmodel.conditions`: what a profile timed (device, precision, attention,
  dropout) and how a run differs from it;
- :mod:`~tplib.perfmodel.build`: :func:`build_profile`, from any ``measure(b, l, c)``:
  where to measure, the fit and its held-out score, smoothing;
- :mod:`~tplib.perfmodel.timer`: :class:`StageTimer`, which times real stages with torch;
- :mod:`~tplib.perfmodel.profiler`: :func:`profile_stage` and :func:`profile_pipeline`,
  a stage's or a pipeline's profiles measured with it;
- :mod:`~tplib.perfmodel.contention`: :func:`measure_contention`, how much the stages
  slow each other when they work at once on this machine (torch, its own processes).

Planning from a saved profile never imports torch: the timer's names are loaded on first
use (PEP 562), everything else is torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tplib.perfmodel.build import build_profile, context_points, smooth_lengths
from tplib.perfmodel.conditions import (
    ATTENTIONS,
    WIRE_BYTES,
    ProfileMismatchWarning,
    run_attention,
)
from tplib.perfmodel.profile import (
    DEFAULT_LINK_BANDWIDTH,
    DEFAULT_LINK_LATENCY,
    Profile,
    ProfileError,
    context_time,
    fit_context,
)

if TYPE_CHECKING:
    from tplib.perfmodel.profiler import profile_pipeline, profile_stage
    from tplib.perfmodel.timer import StageTimer

__all__ = [
    "ATTENTIONS",
    "DEFAULT_LINK_BANDWIDTH",
    "DEFAULT_LINK_LATENCY",
    "WIRE_BYTES",
    "Profile",
    "ProfileError",
    "ProfileMismatchWarning",
    "StageTimer",
    "build_profile",
    "context_points",
    "context_time",
    "fit_context",
    "profile_pipeline",
    "profile_stage",
    "run_attention",
    "smooth_lengths",
]

# These need torch: the module each is loaded from on first use.
_TORCH = {"StageTimer": "timer", "profile_pipeline": "profiler", "profile_stage": "profiler"}


def __getattr__(name: str) -> Any:
    if name in _TORCH:
        return getattr(importlib.import_module(f"tplib.perfmodel.{_TORCH[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
