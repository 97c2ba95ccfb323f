"""Tests for tplib.cluster: the analytic p3.16xlarge model, its memory model, and that
the stored calibration is what the GPipe-only fit re-derives."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tplib.cluster import (
    CALIBRATION,
    FIT_STAGES,
    P3_16XLARGE,
    Calibration,
    ClusterCostModel,
    fit_calibration,
    memory_per_gpu,
)
from tplib.paper import GPIPE, SETTINGS, TERAPIPE, main_row
from tplib.plan import Plan
from tplib.planner import pipeline_latency
from tplib.schedule import make_schedule
from tplib.simulate import simulate

FITTED = [f for fields, _ in FIT_STAGES for f in fields]


def test_stored_calibration_equals_a_fresh_fit() -> None:
    """The fit from the stored values must stay there: if the model or the fit changes,
    CALIBRATION must be refitted (python -c 'from tplib.cluster import *;
    print(fit_calibration(Calibration()).calibration)')."""
    fit = fit_calibration(CALIBRATION)
    for f in FITTED:
        assert getattr(fit.calibration, f) == pytest.approx(getattr(CALIBRATION, f), rel=2e-3), f
    # Only GPipe rows enter the fit.
    assert set(fit.settings) == set(range(1, 11))
    assert fit.paper == tuple(main_row(s, GPIPE).latency for s in fit.settings)
    # The settings without data parallelism, which fix compute and network, fit closely.
    for s, sim, paper in zip(fit.settings, fit.simulated, fit.paper, strict=True):
        if SETTINGS[s].n_data == 1:
            assert sim == pytest.approx(paper, rel=0.06), s
    assert fit.rms_log_error < 0.2


def test_calibration_is_checked() -> None:
    with pytest.raises(ValueError, match="efficiencies lie in"):
        Calibration(gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="comm"):
        Calibration(comm="carrier pigeon")  # type: ignore[arg-type]


def test_matrix_products_follow_flops_or_bandwidth() -> None:
    cal = replace(CALIBRATION, quantization=False)
    m = ClusterCostModel("GPT3-13B", n_stages=40, calibration=cal)
    rate = cal.gemm_efficiency * P3_16XLARGE.peak_fp16
    hbm = cal.hbm_efficiency * P3_16XLARGE.hbm_bandwidth
    big = m._gemm(np.array([4096.0]), 5120.0, 5120.0)
    assert big[0] == pytest.approx(2 * 4096 * 5120 * 5120 / rate)  # compute-bound
    one = m._gemm(np.array([1.0]), 5120.0, 5120.0)
    assert one[0] == pytest.approx(2 * (5120 + 5120 * 5120 + 5120) / hbm)  # weight-bound
    # Quantization only slows products down, most for few tokens.
    q = ClusterCostModel("GPT3-13B", n_stages=40)
    for tokens in (16.0, 100.0, 2048.0):
        assert (
            q._gemm(np.array([tokens]), 5120.0, 5120.0)[0]
            >= m._gemm(np.array([tokens]), 5120.0, 5120.0)[0]
        )


def test_layer_flops_dominate_a_long_sequence() -> None:
    cal = replace(CALIBRATION, quantization=False)
    m = ClusterCostModel("GPT3-175B", n_stages=96, n_op=4, calibration=cal)
    fwd, bwd = m.layer_times(1, np.array([2048]), np.array([0]))
    h, s = 12288, 2048
    gemm = 24 * s * h * h / 4 / (cal.gemm_efficiency * P3_16XLARGE.peak_fp16)
    assert gemm < fwd[0] < 1.3 * gemm  # products dominate; attention, memory, Megatron add
    assert 2 * gemm < bwd[0] < 1.3 * (2 * gemm) + 0.01


def test_figure3_small_slices_are_host_bound() -> None:
    """Paper Fig. 3: a GPT3-1B layer's forward takes as long for 1 token as for 256."""
    m = ClusterCostModel("GPT3-1B", n_stages=24)
    tokens = np.array([1, 16, 64, 256, 512, 2048])
    fwd, _ = m.stage_times(1, tokens, np.zeros_like(tokens))
    assert np.allclose(fwd[:4], m.host_floor)
    assert fwd[4] > 1.2 * fwd[3] and fwd[5] > 3 * fwd[4]


def test_slice_time_grows_with_length_context_and_batch() -> None:
    m = ClusterCostModel.for_setting(SETTINGS[9])
    lengths = np.arange(128, 2049, 128)
    t = m.slice_time(1, lengths, np.zeros_like(lengths))
    assert (np.diff(t) > 0).all()
    ctx = m.slice_time(1, np.full(8, 128), np.arange(0, 1921, 256))
    assert (np.diff(ctx) > 0).all()  # later slices attend to more context
    assert (
        m.slice_time(2, np.array([512]), np.array([0]))[0]
        > m.slice_time(1, np.array([512]), np.array([0]))[0]
    )


def test_placement_follows_the_papers_rank_order() -> None:
    op8 = ClusterCostModel.for_setting(SETTINGS[5])  # a stage fills a node
    assert all(op8.crosses_nodes(k, k + 1) and op8.crosses_nodes(k + 1, k) for k in range(39))
    op1 = ClusterCostModel.for_setting(SETTINGS[6])  # 8 stages per node
    crossing = [k for k in range(95) if op1.crosses_nodes(k, k + 1)]
    assert crossing == list(range(7, 95, 8))
    op4 = ClusterCostModel.for_setting(SETTINGS[9])  # 2 stages per node, GPUs 3 -> 4 inside
    assert [op4.crosses_nodes(k, k + 1) for k in range(4)] == [False, True, False, True]
    nbytes = 2048 * 12288 * 2.0
    pcie, net = op4.p2p(0, 1, nbytes), op4.p2p(1, 2, nbytes)
    nvlink = op1.p2p(1, 2, nbytes)  # GPUs 1 -> 2: two NVLinks
    assert nvlink < pcie < net
    assert op1.node_of(8) == 1 and op1.node_of(0, replica=1) == 12


def test_allreduce_and_optimizer() -> None:
    s6, s9 = SETTINGS[6], SETTINGS[9]
    m6, m9 = ClusterCostModel.for_setting(s6), ClusterCostModel.for_setting(s9)
    assert m9.allreduce(0) == 0.0  # one replica
    # Ring over 4 replicas on 4 nodes, 8 GPUs sharing each node's 25 Gbps.
    grads = 2 * m6.stage_params()
    wire = 8 * 1.5 * grads / (CALIBRATION.allreduce_efficiency * 25e9 / 8)
    assert m6.allreduce(0) == pytest.approx(wire, rel=0.02)
    assert 0 < m6.optimizer(0) < 0.1 and m6.optimizer(0) == pytest.approx(m9.optimizer(0), rel=0.01)


def test_memory_model() -> None:
    for s in SETTINGS.values():
        m = ClusterCostModel.for_setting(s)
        gpipe, tera = m.memory(s.gpipe_plan()), m.memory(main_row(s.index, TERAPIPE).plan)
        assert gpipe.fits, (s.index, str(gpipe))
        assert tera.total <= gpipe.total + 1  # token slicing stores fewer attention scores
    # GPT3-175B on 24 stages x 8 GPUs: 4 layers of weights and Adam states per GPU.
    too_big = memory_per_gpu("GPT3-175B", n_stages=24, n_op=8, plan=Plan.gpipe(1, 2048))
    assert not too_big.fits and "does NOT fit" in str(too_big)
    # Mixed precision: 20 bytes per parameter.
    one = memory_per_gpu("GPT3-1B", n_stages=24, n_op=1, plan=Plan.gpipe(1, 2048))
    assert one.states == pytest.approx(20 * ClusterCostModel("GPT3-1B", n_stages=24).stage_params())


def test_simulator_and_planner_agree_on_the_cluster_model() -> None:
    """The planner's t(l, c) charges the busiest stage's communication to every stage,
    so its latency is close to (not equal to) the simulated one."""
    s = SETTINGS[10]
    m = ClusterCostModel.for_setting(s)
    p = main_row(10, TERAPIPE).plan
    sim = simulate(make_schedule("terapipe", s.n_stages, p), m)
    planned = pipeline_latency(p, m, s.n_stages) + m.optimizer(0)
    assert sim.latency == pytest.approx(planned, rel=0.05)
    assert set(sim.timeline["kind"]) >= {"F", "B", "SA", "RA", "SG", "RG", "OPT"}


def test_bad_layouts_are_named() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        ClusterCostModel("GPT3-13B", n_stages=7)
    with pytest.raises(ValueError, match="inside a node"):
        ClusterCostModel("GPT3-13B", n_stages=40, n_op=3)
