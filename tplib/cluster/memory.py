"""Peak memory per GPU of a plan on a cluster layout: will it fit in 16 GB?

GPipe and TeraPipe keep the activations of the WHOLE minibatch until the backward (paper
§3.4), beside the weights and the mixed-precision optimizer state. Token slicing changes
only the attention scores kept: a slice of s tokens after c keeps s (c + s) scores per
head, so a sequence sliced s_1..s_M keeps (L^2 + sum s_i^2) / 2 of them, not L^2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tplib.cluster.calibration import CALIBRATION, Calibration
from tplib.cluster.hardware import FP16, FP32, P3_16XLARGE, Hardware
from tplib.config import GPTConfig, get_config, n_params_per_layer
from tplib.plan import Plan

__all__ = ["ACT_ELEMS", "ACT_SCORE_BYTES", "STATE_BYTES", "MemoryEstimate", "memory_per_gpu"]

# Weights and optimizer state per parameter in mixed precision: fp16 weights and grads,
# fp32 master weights and grads, Adam's m and v.
STATE_BYTES = FP16 + FP16 + FP32 + FP32 + FP32 + FP32
# Activations kept for the backward per token and hidden element, fp16: (replicated, per
# #Op share). Replicated: LN1 in/out, attention output, LN2 in/out. Shared: Q, K, V, the
# attention context, FC1 out (4H), activation out (4H).
ACT_ELEMS = (5.0, 12.0)
ACT_SCORE_BYTES = FP16 + FP32  # attention scores (fp16) and probabilities (fp32)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU: weights and optimizer state, stored activations, reserve."""

    states: float
    activations: float
    reserve: float
    capacity: float

    @property
    def total(self) -> float:
        return self.states + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def __str__(self) -> str:
        gib = 2**30
        return (
            f"{self.total / gib:.1f} GiB of {self.capacity / gib:.0f} GiB "
            f"(states {self.states / gib:.1f}, activations {self.activations / gib:.1f}, "
            f"reserve {self.reserve / gib:.1f}): {'fits' if self.fits else 'does NOT fit'}"
        )


def memory_per_gpu(
    model: GPTConfig | str,
    *,
    n_stages: int,
    n_op: int,
    plan: Plan,
    calibration: Calibration = CALIBRATION,
    hardware: Hardware = P3_16XLARGE,
) -> MemoryEstimate:
    """Memory of one GPU of a stage: mixed-precision states (:data:`STATE_BYTES` per
    parameter) and the activations of the whole minibatch (see the module docstring)."""
    cfg = get_config(model) if isinstance(model, str) else model
    layers_per_stage = cfg.n_layer // n_stages
    states = STATE_BYTES * layers_per_stage * n_params_per_layer(cfg) / n_op
    rep, part = ACT_ELEMS
    acts = plan.batch * plan.seq_len * cfg.hidden * FP16 * (rep + part / n_op)
    scores = 0.0
    for size, slices in zip(plan.batch_slices, plan.token_slices, strict=True):
        s = np.asarray(slices, dtype=float)
        scores += size * float(np.sum(s * np.cumsum(s)))  # s * (context + s)
    acts += cfg.n_head / n_op * scores * ACT_SCORE_BYTES
    return MemoryEstimate(
        states, layers_per_stage * acts, calibration.memory_reserve, hardware.gpu_memory
    )
