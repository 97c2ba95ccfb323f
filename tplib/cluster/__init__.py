"""Analytic models of clusters: the paper's AWS p3.16xlarge nodes of 8 V100 GPUs, and
DGX A100 and DGX H100 nodes.

One :class:`ClusterCostModel` prices a layout for the planner and the simulator. The
package, one mechanism per module:

- :mod:`~tplib.cluster.hardware`: published specs (:class:`Hardware`, :data:`P3_16XLARGE`,
  :data:`DGX_A100`, :data:`DGX_H100`);
- :mod:`~tplib.cluster.calibration`: every free parameter, its value and provenance
  (:class:`Calibration`, :data:`CALIBRATION`, :data:`CALIBRATIONS` by cluster);
- :mod:`~tplib.cluster.implementation`: what the training code does (:class:`Implementation`:
  attention, sequence parallelism, the distributed optimizer, the model's ends);
- :mod:`~tplib.cluster.layout`: the rules of a layout (:func:`check_layout`) and where
  its GPUs sit;
- :mod:`~tplib.cluster.compute`: what one layer costs on one GPU;
- :mod:`~tplib.cluster.context_parallel`: what ring attention adds under context
  parallelism (#CP);
- :mod:`~tplib.cluster.links`: what the messages cost (pipeline sends, the data-parallel
  reduction);
- :mod:`~tplib.cluster.cost`: :class:`ClusterCostModel`, stages on top;
- :mod:`~tplib.cluster.memory`: peak memory per GPU (:func:`memory_per_gpu`; any schedule,
  weight versions and units in flight: :func:`~tplib.cluster.memory.schedule_memory_per_gpu`);
- :mod:`~tplib.cluster.fit`: :func:`fit_calibration`, which re-derives the fitted
  parameters from the paper's GPipe latencies only.
"""

from tplib.cluster.calibration import (
    CALIBRATION,
    CALIBRATIONS,
    COMM_MODES,
    FIT_STAGES,
    HELD_OUT,
    Calibration,
)
from tplib.cluster.cost import ClusterCostModel
from tplib.cluster.fit import FitResult, fit_calibration
from tplib.cluster.hardware import CLUSTERS, DGX_A100, DGX_H100, P3_16XLARGE, Hardware
from tplib.cluster.implementation import Implementation
from tplib.cluster.layout import check_layout
from tplib.cluster.memory import MemoryEstimate, memory_per_gpu

__all__ = [
    "CALIBRATION",
    "CALIBRATIONS",
    "CLUSTERS",
    "COMM_MODES",
    "DGX_A100",
    "DGX_H100",
    "FIT_STAGES",
    "HELD_OUT",
    "P3_16XLARGE",
    "Calibration",
    "ClusterCostModel",
    "FitResult",
    "Hardware",
    "Implementation",
    "MemoryEstimate",
    "check_layout",
    "fit_calibration",
    "memory_per_gpu",
]
