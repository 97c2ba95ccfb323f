"""Cost model from measurements: profile one pipeline stage and predict its slice times
(paper §3.3, Eq. 9).

- :mod:`~tplib.perfmodel.profile`: :class:`Profile`, measured slice times as plain data
  (Eq. 9's context model, JSON files); the planner's cost model;
- :mod:`~tplib.perfmodel.build`: :func:`build_profile`, from any ``measure(b, l, c)``:
  where to measure, the fit and its held-out score, smoothing;
- :mod:`~tplib.perfmodel.timer`: :class:`StageTimer`, :func:`profile_stage` and
  :func:`profile_pipeline`, which time real stages with torch;
- :mod:`~tplib.perfmodel.contention`: :func:`measure_contention`, how much the stages
  slow each other when they work at once on this machine (torch, its own processes).

Planning from a saved profile never imports torch: the timer's names are loaded on first
use (PEP 562), everything else is torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tplib.perfmodel.build import build_profile, context_points, smooth_lengths
from tplib.perfmodel.profile import (
    ATTENTIONS,
    DEFAULT_LINK_BANDWIDTH,
    DEFAULT_LINK_LATENCY,
    WIRE_BYTES,
    Profile,
    ProfileError,
    ProfileMismatchWarning,
    context_time,
    fit_context,
    run_attention,
)

if TYPE_CHECKING:
    from tplib.perfmodel.timer import StageTimer, profile_pipeline, profile_stage

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

_TIMER = ("StageTimer", "profile_pipeline", "profile_stage")  # these need torch


def __getattr__(name: str) -> Any:
    if name in _TIMER:
        return getattr(importlib.import_module("tplib.perfmodel.timer"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
