"""Hierarchical machine topologies, as PipeDream's optimizer sees them (PipeDream §3.1).

Level k is ``m_k`` components of level k-1 joined by links of bandwidth ``B_k``; level 0
is one GPU. A cluster of p3.16xlarge nodes has two levels: the 8 GPUs of a node over
NVLink, and the nodes over the 25 Gbps network. :class:`Topology` is that list of
levels; :meth:`Topology.cluster` builds it for a GPU count and refuses a count the nodes
cannot hold, and :meth:`Topology.flat` is one level (e.g. the processes on this machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tplib.cluster.calibration import CALIBRATION, Calibration
from tplib.cluster.compute import nvlink_bus
from tplib.cluster.hardware import P3_16XLARGE, Hardware

__all__ = ["Level", "Topology"]


@dataclass(frozen=True)
class Level:
    """``count`` components of the level below, joined at ``bandwidth`` bytes/s."""

    count: int
    bandwidth: float

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"Level.count={self.count!r}: a level holds >= 1 components")
        if not self.bandwidth > 0:
            raise ValueError(f"Level.bandwidth={self.bandwidth!r}: must be > 0 bytes/s")


@dataclass(frozen=True)
class Topology:
    """Levels from the innermost (GPUs in a node) out; ``name`` for reports."""

    levels: tuple[Level, ...]
    name: str = ""

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("a Topology needs at least one level")

    @property
    def n_gpus(self) -> int:
        return math.prod(level.count for level in self.levels)

    def gpus_below(self, k: int) -> int:
        """GPUs in one component of level ``k`` (level 0: one GPU)."""
        return math.prod(level.count for level in self.levels[:k])

    @classmethod
    def flat(cls, n_gpus: int, bandwidth: float, name: str = "") -> Topology:
        """One level: ``n_gpus`` workers all joined at ``bandwidth``."""
        return cls((Level(n_gpus, bandwidth),), name or f"{n_gpus} workers")

    @classmethod
    def cluster(
        cls,
        n_gpus: int,
        hardware: Hardware = P3_16XLARGE,
        calibration: Calibration = CALIBRATION,
    ) -> Topology:
        """``n_gpus`` GPUs of p3.16xlarge nodes: GPUs in a node over NVLink (the bus
        bandwidth NCCL reaches), nodes over the network. Up to a node's GPU count they
        share one node; beyond it they must fill whole nodes."""
        g = hardware.gpus_per_node
        if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
            raise ValueError(f"n_gpus={n_gpus!r}: need a positive number of GPUs")
        if n_gpus > g and n_gpus % g:
            raise ValueError(
                f"n_gpus={n_gpus} does not fill whole nodes: a p3.16xlarge node holds {g} "
                f"GPUs, so a cluster of more than {g} has a multiple of {g} "
                f"(e.g. {n_gpus // g * g} or {(n_gpus // g + 1) * g})"
            )
        node = Level(min(n_gpus, g), nvlink_bus(calibration, hardware))
        if n_gpus <= g:
            return cls((node,), f"{n_gpus} GPUs of one p3.16xlarge")
        net = Level(n_gpus // g, calibration.network_efficiency * hardware.network)
        return cls((node, net), f"{n_gpus // g} p3.16xlarge nodes ({n_gpus} GPUs)")
