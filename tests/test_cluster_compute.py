"""Tests for tplib.cluster.compute: one layer on one V100, against hand-counted FLOPs
and bytes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tplib.cluster import (
    CALIBRATION,
    CALIBRATIONS,
    DGX_A100,
    P3_16XLARGE,
    ClusterCostModel,
    Implementation,
)
from tplib.cluster.compute import (
    DROPOUT_SCORE_BYTES,
    DROPOUT_TOKEN_ELEMS,
    attention_core_time,
    flash_times,
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


# ---- modern implementations (tplib.cluster.implementation) ---------------------------


def _dgx_times(impl: Implementation, recompute: str = "none", n_op: int = 8) -> tuple[float, float]:
    cost = ClusterCostModel(
        get_config("GPT3-13B"), n_stages=1, n_op=n_op, calibration=CALIBRATIONS["dgx-a100"],
        hardware=DGX_A100, implementation=impl, recompute=recompute,
    )  # fmt: skip
    fwd, bwd = cost.stage_times(1, np.array([2048.0]), np.array([0.0]))
    return float(fwd[0]), float(bwd[0])


def test_flash_attention_writes_no_scores_and_is_faster_than_written_out() -> None:

    flash = _dgx_times(Implementation(attention="flash"))
    fused = _dgx_times(Implementation(attention="fused-softmax"))
    unfused = _dgx_times(Implementation())
    assert flash[0] < fused[0] < unfused[0]
    assert flash[1] < fused[1] < unfused[1]


def test_flash_attention_does_the_causal_half_and_a_backward_of_two_and_a_half() -> None:

    cal = CALIBRATIONS["dgx-a100"]
    assert cal.flash_efficiency is not None
    fwd, bwd = flash_times(4, 128, np.array([1024.0]), np.array([0.0]), cal=cal, hw=DGX_A100)
    causal = 4 * 4 * 128 * 1024 * (1024 + 1) / 2  # 2 products x 2 FLOPs, half the pairs
    assert float(fwd[0]) == pytest.approx(causal / (cal.flash_efficiency * 312e12))
    assert float(bwd[0]) == pytest.approx(2.5 * float(fwd[0]))
    with pytest.raises(ValueError, match="no flash_efficiency"):
        flash_times(4, 128, np.array([8.0]), np.array([0.0]), cal=CALIBRATION, hw=DGX_A100)


def test_selective_recomputation_costs_the_attention_core_or_nothing_with_flash() -> None:

    fused = Implementation(attention="fused-softmax")
    none, sel = _dgx_times(fused), _dgx_times(fused, "selective")
    full = _dgx_times(fused, "full")
    core = attention_core_time(
        get_config("GPT3-13B"), 8, 1, np.array([2048.0]), np.array([0.0]),
        cal=CALIBRATIONS["dgx-a100"], hw=DGX_A100, impl=fused,
    )  # fmt: skip
    assert sel[1] - none[1] == pytest.approx(40 * float(core[0]))  # 40 layers
    assert none[1] < sel[1] < full[1]
    flash = Implementation(attention="flash")
    assert _dgx_times(flash, "selective") == _dgx_times(flash)


def test_sequence_parallelism_splits_the_replicated_elementwise_work() -> None:

    plain = _dgx_times(Implementation(attention="flash"))
    sp = _dgx_times(Implementation(attention="flash", sequence_parallel=True))
    assert sp[0] < plain[0] and sp[1] < plain[1]
    with pytest.raises(ValueError, match="needs #Op > 1"):
        _dgx_times(Implementation(sequence_parallel=True), n_op=1)
