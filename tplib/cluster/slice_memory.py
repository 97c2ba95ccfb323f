"""The cluster model's memory accounting, unit by unit, for the memory-aware planner.

:class:`ClusterSliceMemory` answers the planner's questions
(:class:`~tplib.planner.memory.SliceMemory`: ``kept``, ``working``, ``fixed``,
``in_flight``) with the accounting of :mod:`tplib.cluster.memory` for one GPU of one
stage (stage 0 by default: under 1F1B it holds the most units; with the model's
``ends`` it also holds the embedding):

- kept: what a unit keeps on the stage's N / K layers, the hidden-size activations and,
  with written-out attention and no selective recomputation, its ``l (c + l)`` scores
  per head (:func:`~tplib.cluster.memory.activation_rates`); with the ends, the last
  stage also keeps the unit's logits. Under full recomputation it keeps only its input
  (once, or per layer with ``layer_checkpoints``), and its activations are the working
  bytes, rebuilt one checkpoint's span at a time inside its backward.
- fixed: the stage's weights and optimizer state (:func:`~tplib.cluster.memory.state_bytes`)
  and the calibration's reserve.
- in_flight: None for the fill-drain schedules (``gpipe``, ``terapipe``), ``K - 1`` for
  ``1f1b`` (K - 1 units beside a batch slice's token slices, on stage 0).

On the fill-drain schedules the planner's peak is :func:`~tplib.cluster.memory.memory_per_gpu`'s
total for the paper's implementation; on ``1f1b`` it bounds
:func:`~tplib.cluster.memory.stage_memory_on_cluster` from above. The planner never
imports the cluster; this class fits its protocol by shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tplib.cluster.calibration import CALIBRATION, Calibration
from tplib.cluster.cost import ClusterCostModel
from tplib.cluster.hardware import FP16, P3_16XLARGE, Hardware
from tplib.cluster.implementation import PAPER, Implementation, check_recompute
from tplib.cluster.memory import _LOGIT_KEPT, activation_rates, end_params, state_bytes
from tplib.nn.configs import GPTConfig, n_params_per_layer, padded_vocab

__all__ = ["FILL_DRAIN", "SCHEDULES", "ClusterSliceMemory"]

FILL_DRAIN = ("gpipe", "terapipe")  # every unit held before the first backward
SCHEDULES = (*FILL_DRAIN, "1f1b")


@dataclass(frozen=True)
class ClusterSliceMemory:
    """Bytes per unit on one GPU of ``stage`` of the layout (K = ``n_stages`` stages of
    N / K layers over #Op GPUs), as the cluster model counts them, for ``schedule``."""

    model: GPTConfig
    n_stages: int
    n_op: int = 1
    n_data: int = 1
    recompute: str = "none"
    implementation: Implementation = PAPER
    calibration: Calibration = CALIBRATION
    hardware: Hardware = P3_16XLARGE
    schedule: str = "terapipe"
    stage: int = 0

    def __post_init__(self) -> None:
        check_recompute(self.recompute)
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule={self.schedule!r}: the memory rule is known for {SCHEDULES}"
            )
        if not 0 <= self.stage < self.n_stages:
            raise ValueError(f"stage={self.stage} is outside 0..{self.n_stages - 1}")

    @classmethod
    def of(
        cls, cost: ClusterCostModel, schedule: str = "terapipe", stage: int = 0
    ) -> ClusterSliceMemory:
        """The memory of ``cost``'s layout, cluster and implementation (one chunk per
        stage: virtual stages hold units per chunk, which this rule does not count)."""
        if cost.parts.n_chunks != 1:
            raise ValueError(
                f"{cost!r} places {cost.parts.n_chunks} chunks per stage: the planner's "
                "memory rule counts one chunk per stage"
            )
        return cls(
            cost.cfg,
            cost.n_stages,
            cost.n_op,
            cost.n_data,
            cost.recompute,
            cost.impl,
            cost.cal,
            cost.hw,
            schedule,
            stage,
        )

    @property
    def capacity(self) -> float:
        """The GPU's memory, bytes."""
        return float(self.hardware.gpu_memory)

    @property
    def in_flight(self) -> int | None:
        return None if self.schedule in FILL_DRAIN else self.n_stages - 1

    @property
    def _layers(self) -> int:
        return self.model.n_layer // self.n_stages

    @property
    def fixed(self) -> float:
        cfg, impl = self.model, self.implementation
        params = self._layers * n_params_per_layer(cfg) / self.n_op
        if impl.ends:
            params += end_params(cfg, self.n_op, self.stage, range(self.n_stages))
        return state_bytes(params, impl, self.n_data) + self.calibration.memory_reserve

    def _activations(self, b: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Everything the unit keeps on the stage's layers without recomputation."""
        per_token, score = activation_rates(
            self.model, self.n_op, self.implementation, self.recompute
        )
        tokens = b * np.asarray(length, dtype=float)
        end = np.asarray(context, dtype=float) + length
        return self._layers * tokens * (per_token + end * score)

    def _logits(self, b: int, length: np.ndarray) -> np.ndarray:
        last = self.implementation.ends and self.stage == self.n_stages - 1
        per_token = padded_vocab(self.model.vocab_size, self.n_op) / self.n_op * _LOGIT_KEPT
        return b * np.asarray(length, dtype=float) * (per_token if last else 0.0)

    def kept(self, batch_slice_size: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        b, impl = batch_slice_size, self.implementation
        if self.recompute != "full":
            return self._activations(b, length, context) + self._logits(b, length)
        inputs = b * np.asarray(length, dtype=float) * self.model.hidden * FP16
        inputs /= self.n_op if impl.sequence_parallel else 1
        inputs *= self._layers if impl.layer_checkpoints else 1
        return inputs + self._logits(b, length)

    def working(self, batch_slice_size: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        if self.recompute != "full":
            return np.zeros(np.broadcast(length, context).shape)
        span = self._layers if self.implementation.layer_checkpoints else 1
        return self._activations(batch_slice_size, length, context) / span
