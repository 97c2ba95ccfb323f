"""Measure mode: pipelines on real local processes, beside the simulator.

================  ====================================================================
module            what it holds
================  ====================================================================
``options``       the CPU table model and :class:`Profiling`, how stages are profiled
``costs``         :class:`LocalCosts` (simulator) and :class:`BottleneckCost` (planner)
                  from measured stage profiles and the measured link
``shared``        :func:`simulate_shared`: stages sharing this machine's cores
``context_       :class:`ContextParallelCosts` (simulator): one stage on #CP local
parallel``        processes, from the stages' profiles and the link
``harness``       :class:`Bench`: profile, plan, run on a pool, simulate beside it
================  ====================================================================

The measured tables themselves are in :mod:`tplib.tables`. Only ``harness`` starts
processes (and imports torch); it loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tplib.measure.context_parallel import ContextParallelCosts, context_parallel_costs
from tplib.measure.options import TABLE_MODEL, Profiling, grid
from tplib.measure.pricing import BYTES_PER_ACTIVATION, BottleneckCost, LocalCosts, local_costs
from tplib.measure.shared import SharedCores, simulate_shared

if TYPE_CHECKING:
    from tplib.measure.harness import Bench, Measured, measured_bench

__all__ = [
    "BYTES_PER_ACTIVATION",
    "TABLE_MODEL",
    "Bench",
    "BottleneckCost",
    "ContextParallelCosts",
    "LocalCosts",
    "Measured",
    "Profiling",
    "SharedCores",
    "context_parallel_costs",
    "grid",
    "local_costs",
    "measured_bench",
    "simulate_shared",
]


def __getattr__(name: str) -> Any:
    if name in ("Bench", "Measured", "measured_bench"):
        return getattr(importlib.import_module("tplib.measure.harness"), name)
    raise AttributeError(f"module 'tplib.measure' has no attribute {name!r}")
