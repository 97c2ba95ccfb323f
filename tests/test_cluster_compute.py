"""Tests for tplib.cluster.compute: one layer on one V100, against hand-counted FLOPs
and bytes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tplib.cluster import CALIBRATION, P3_16XLARGE
from tplib.cluster.compute import (
    DROPOUT_SCORE_BYTES,
    DROPOUT_TOKEN_ELEMS,
    gemm_time,
    hbm_rate,
    layer_times,
)
from tplib.cluster.hardware import FP16
from tplib.nn.configs import get_config

HW = P3_16XLARGE


def test_matrix_products_follow_flops_or_bandwidth() -> None:
    cal = replace(CALIBRATION, quantization=False)
    rate = cal.gemm_efficiency * 125e12
    hbm = cal.hbm_efficiency * 900e9
    big = gemm_time(np.array([4096.0]), 5120.0, 5120.0, cal=cal, hw=HW)
    assert big[0] == pytest.approx(2 * 4096 * 5120 * 5120 / rate)  # compute-bound
    one = gemm_time(np.array([1.0]), 5120.0, 5120.0, cal=cal, hw=HW)
    assert one[0] == pytest.approx(2 * (5120 + 5120 * 5120 + 5120) / hbm)  # weight-bound
    # Quantization only slows products down, most for few tokens.
    for tokens in (16.0, 100.0, 2048.0):
        m = np.array([tokens])
        assert (
            gemm_time(m, 5120.0, 5120.0, cal=CALIBRATION, hw=HW)[0]
            >= (gemm_time(m, 5120.0, 5120.0, cal=cal, hw=HW)[0])
        )
    # 129 x 129 output needs 4 tiles of 128 x 128, all in one wave of 80 SMs: the product
    # runs at 129 * 129 / (80 * 128 * 128) of the rate.
    slow = gemm_time(np.array([129.0]), 129.0, 1e6, cal=CALIBRATION, hw=HW)
    used = 129 * 129 / (80 * 128 * 128)
    assert slow[0] == pytest.approx(2 * 129 * 129 * 1e6 / (rate * used))


def test_layer_flops_dominate_a_long_sequence() -> None:
    cal = replace(CALIBRATION, quantization=False)
    cfg = get_config("GPT3-175B")
    fwd, bwd = layer_times(cfg, 4, 1, np.array([2048]), np.array([0]), cal=cal, hw=HW)
    h, s = 12288, 2048
    gemm = 24 * s * h * h / 4 / (cal.gemm_efficiency * 125e12)
    assert gemm < fwd[0] < 1.3 * gemm  # products dominate; attention, memory, Megatron add
    assert 2 * gemm < bwd[0] < 1.3 * (2 * gemm) + 0.01


def test_megatron_adds_two_ring_allreduces_per_pass() -> None:
    """#Op = 2: the forward adds 2 all-reduces of the slice's fp16 activations (b s H
    values) over NVLink. A ring of 2 ranks moves the whole buffer once, at
    nvlink_efficiency x 6 links x 25 GB/s, and each all-reduce pays one collective latency."""
    cfg = get_config("GPT3-13B")
    s, c = np.array([512]), np.array([0])

    def fwd(n_op: int, **changes: Any) -> float:
        cal = replace(CALIBRATION, **changes)
        return float(layer_times(cfg, n_op, 1, s, c, cal=cal, hw=HW)[0][0])

    nbytes = 2 * 512 * 5120
    slow, fast = nbytes / (0.4 * 6 * 25e9), nbytes / (0.8 * 6 * 25e9)
    diff = fwd(2, nvlink_efficiency=0.4) - fwd(2, nvlink_efficiency=0.8)
    assert diff == pytest.approx(2 * (slow - fast))
    diff = fwd(2, collective_latency=50e-6) - fwd(2, collective_latency=20e-6)
    assert diff == pytest.approx(2 * 30e-6)
    # Without operation partitioning there is nothing to all-reduce.
    assert fwd(1, nvlink_efficiency=0.4, collective_latency=50e-6) == fwd(1)


def test_dropout_traffic_is_charged_only_when_the_model_drops() -> None:
    cfg = get_config("GPT3-1B")
    assert cfg.dropout == 0.1  # GPT-3 trained with dropout
    length, context = np.array([256.0]), np.array([512.0])
    with_drop = layer_times(cfg, 1, 2, length, context, cal=CALIBRATION, hw=P3_16XLARGE)
    without = layer_times(
        cfg.with_(dropout=0.0), 1, 2, length, context, cal=CALIBRATION, hw=P3_16XLARGE
    )
    hbm = hbm_rate(CALIBRATION, P3_16XLARGE)
    # 2 sequences x 256 tokens; scores: 2 x 16 heads x 256 queries x 768 keys.
    tokens, scores = 2 * 256, 2 * 16 * 256 * 768
    token_bytes = tokens * cfg.hidden * FP16 * DROPOUT_TOKEN_ELEMS
    fwd = (token_bytes + scores * DROPOUT_SCORE_BYTES) / hbm
    bwd = (2 * token_bytes + scores * DROPOUT_SCORE_BYTES) / hbm
    np.testing.assert_allclose(with_drop[0] - without[0], fwd, rtol=1e-9)
    np.testing.assert_allclose(with_drop[1] - without[1], bwd, rtol=1e-9)
