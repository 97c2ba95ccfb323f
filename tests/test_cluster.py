"""Tests for tplib.cluster's cost model (tplib.cluster.cost) and its calibration
(tplib.cluster.calibration, tplib.cluster.fit): the stored calibration is what the
GPipe-only fit re-derives; virtual stages priced chunk by chunk, across the wrap."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from tplib.cluster import (
    CALIBRATION,
    FIT_STAGES,
    HELD_OUT,
    Calibration,
    ClusterCostModel,
    fit_calibration,
)
from tplib.paper import GPIPE, SETTINGS, TERAPIPE, main_row, setting
from tplib.plan import Plan
from tplib.planner import pipeline_latency
from tplib.schedule import WHOLE_SEQUENCE, Action, Kind, make_schedule
from tplib.schedule.chunks import interleaved, v_shape
from tplib.search.setting import cost_model, simulate_on_cluster
from tplib.sim.simulate import action_cost, simulate

FITTED = [f for fields, _ in FIT_STAGES for f in fields]


def test_stored_calibration_equals_a_fresh_fit() -> None:
    """The fit from the stored values must stay there: if the model or the fit changes,
    CALIBRATION must be refitted (python -c 'from tplib.cluster import *;
    print(fit_calibration(Calibration()).calibration)')."""
    fit = fit_calibration(CALIBRATION)
    for f in FITTED:
        assert getattr(fit.calibration, f) == pytest.approx(getattr(CALIBRATION, f), rel=2e-3), f
    # Only GPipe rows enter the fit; the held-out ones are reported beside them.
    assert set(fit.settings) == set(range(1, 11)) and fit.held_out == HELD_OUT
    assert fit.paper == tuple(main_row(s, GPIPE).latency for s in fit.settings)
    # The rows it used fit within 6%; the held-out ones within 15% ((4) is -14%).
    for s, err in fit.errors.items():
        assert abs(err) < (0.15 if s in HELD_OUT else 0.06), s
    assert fit.rms_log_error < 0.05


def test_fit_refuses_to_hold_out_a_fitted_row() -> None:
    with pytest.raises(ValueError, match="also fitted"):
        fit_calibration(CALIBRATION, held_out=(3,), max_iter=0)


def test_calibration_is_checked() -> None:
    with pytest.raises(ValueError, match="efficiencies lie in"):
        Calibration(gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="comm"):
        Calibration(comm="carrier pigeon")  # type: ignore[arg-type]


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


def test_the_cluster_model_prices_any_batch_slice() -> None:
    m = ClusterCostModel.for_setting(SETTINGS[10])  # GPT3-175B: 96 layers on 48 stages
    assert m.max_batch_slice_size is None
    assert m.layers_per_stage == 2


def test_links_follow_the_placement() -> None:
    op1 = ClusterCostModel.for_setting(SETTINGS[6])  # 8 stages per node
    op4 = ClusterCostModel.for_setting(SETTINGS[9])  # 2 stages per node, GPUs 3 -> 4 inside
    nbytes = 2048 * 12288 * 2.0
    pcie, net = op4.p2p(0, 1, nbytes), op4.p2p(1, 2, nbytes)
    nvlink = op1.p2p(1, 2, nbytes)  # GPUs 1 -> 2: two NVLinks
    assert nvlink < pcie < net


def test_cross_node_messages_are_staged_through_host_memory() -> None:
    """Setting (8): every stage is a node. A send pays the network and one NCCL slot's
    copy to host memory; the receiver copies what waits in its buffer (at most 4 MiB)."""
    on, off = (
        ClusterCostModel.for_setting(SETTINGS[8], replace(CALIBRATION, host_staging=h))
        for h in (True, False)
    )
    assert on.crosses_nodes(0, 1)
    pcie = 0.8 * 15.75e9
    for nbytes in (256 * 1024, 3e6, 25e6):
        slot, buffer = min(nbytes, 512 * 1024), min(nbytes, 4 * 2**20)
        assert on.p2p(0, 1, nbytes) - off.p2p(0, 1, nbytes) == pytest.approx(slot / pcie)
        assert on.receive(0, 1, nbytes) - off.receive(0, 1, nbytes) == pytest.approx(buffer / pcie)
    # Inside a node nothing is staged.
    op4 = ClusterCostModel.for_setting(SETTINGS[9])
    assert not op4.crosses_nodes(0, 1) and op4.receive(0, 1, 3e6) == pytest.approx(10e-6)


def test_allreduce_and_optimizer() -> None:
    s6, s9 = SETTINGS[6], SETTINGS[9]
    m6, m9 = ClusterCostModel.for_setting(s6), ClusterCostModel.for_setting(s9)
    assert m9.allreduce(0) == 0.0  # one replica
    # 4 replicas on 4 nodes: 8 GPUs send their fp16 gradients through each node's 25 Gbps
    # once, after a fixed latency; the ring's form moves 2 (4 - 1) / 4 = 1.5 times that.
    grads, eff = 2 * m6.stage_params(), CALIBRATION.allreduce_efficiency
    wire = 8 * grads / (eff * 25e9 / 8)
    assert m6.allreduce(0) == pytest.approx(wire + CALIBRATION.allreduce_latency, rel=0.02)
    ring = ClusterCostModel.for_setting(s6, replace(CALIBRATION, allreduce_ring=True))
    assert ring.allreduce(0) == pytest.approx(1.5 * wire + CALIBRATION.allreduce_latency, rel=0.02)
    assert 0 < m6.optimizer(0) < 0.1 and m6.optimizer(0) == pytest.approx(m9.optimizer(0), rel=0.01)


def test_each_unit_is_priced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """compute and transfer ask the model once per distinct unit shape: a unit priced on
    another stage, or again, comes from the cache."""
    m = ClusterCostModel.for_setting(SETTINGS[9])
    calls: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        method = getattr(m, name)

        def wrapper(*args: Any) -> Any:
            calls.append(name)
            return method(*args)

        return wrapper

    monkeypatch.setattr(m, "stage_times", counted("stage_times"))
    monkeypatch.setattr(m, "p2p", counted("p2p"))
    plan = Plan.from_paper("[(1, [1024, 1024])] * 2")
    first = m.compute(2, Action(Kind.F, 2, 0, 0), plan)
    assert calls == ["stage_times"]
    assert m.compute(2, Action(Kind.F, 2, 0, 0), plan) == first
    assert m.compute(2, Action(Kind.F, 2, 1, 0), plan) == first  # same shape: 1 x 1024 after 0
    assert m.compute(3, Action(Kind.F, 3, 0, 0), plan) == first  # a middle stage, receiving too
    assert calls == ["stage_times"]
    send = m.transfer(2, Action(Kind.SA, 2, 0, 1), plan)
    assert m.transfer(2, Action(Kind.SA, 2, 1, 1), plan) == send
    assert calls == ["stage_times", "p2p"]


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
    with pytest.raises(ValueError, match="n_stages=7 does not divide GPT3-13B's 40 layers"):
        ClusterCostModel("GPT3-13B", n_stages=7)
    with pytest.raises(ValueError, match="inside a node"):
        ClusterCostModel("GPT3-13B", n_stages=40, n_op=3)


def test_recomputation_costs_a_forward_and_saves_activations() -> None:
    s = SETTINGS[5]
    plain = ClusterCostModel.for_setting(s)
    again = ClusterCostModel(
        s.config, n_stages=s.n_stages, n_op=s.n_op, n_data=s.n_data, recompute="full"
    )
    length, context = np.array([256.0, 2048.0]), np.array([512.0, 0.0])
    fwd, bwd = plain.stage_times(1, length, context)
    fwd2, bwd2 = again.stage_times(1, length, context)
    np.testing.assert_array_equal(fwd2, fwd)
    np.testing.assert_allclose(bwd2, bwd + fwd)
    p = Plan.gpipe(s.pipeline_batch, s.seq_len)
    kept, rebuilt = plain.memory(p), again.memory(p)
    assert kept.states == rebuilt.states
    # Each of the 16 sequences keeps only its fp16 input; one is rebuilt at a time.
    inputs = s.pipeline_batch * s.seq_len * s.config.hidden * 2
    assert rebuilt.activations == pytest.approx(inputs + kept.activations / s.pipeline_batch)
    with pytest.raises(ValueError, match=r"recompute='some'"):
        ClusterCostModel(s.config, n_stages=s.n_stages, recompute="some")


# ---- split backwards: W and the split B ---------------------------------------------------


def _whole_and_parts(m: ClusterCostModel, stage: int, plan: Plan, b: int) -> tuple[float, float]:
    """A batch slice's W over its whole sequence, and the sum of its units' W."""
    whole = m.weight_grad(stage, Action(Kind.W, stage, b, WHOLE_SEQUENCE), plan)
    parts = sum(
        m.weight_grad(stage, Action(Kind.W, stage, b, t), plan)
        for t in range(plan.n_token_slices(b))
    )
    return whole, parts


@pytest.mark.parametrize("index", sorted(SETTINGS))
def test_fusing_a_sequences_weight_grads_never_costs_more(index: int) -> None:
    s = setting(index)
    m = cost_model(s)
    one = Plan.gpipe(2, s.seq_len)
    for k in (0, s.n_stages - 1):
        whole, parts = _whole_and_parts(m, k, one, 0)
        assert 0 < whole == parts  # one token slice: the same product
        ratios = []
        for per in (512, 128, 16):  # ever shorter slices of one batch slice of 2
            p = Plan((2,), ((per,) * (s.seq_len // per),))
            whole, parts = _whole_and_parts(m, k, p, 0)
            assert whole < parts, per
            ratios.append(whole / parts)
        # The shorter the slices, the more the per-product passes over dW weigh.
        assert ratios[0] > ratios[1] > ratios[2] and ratios[2] < 0.25
        paper = main_row(index, TERAPIPE).plan
        for b in range(paper.n_batch_slices):
            whole, parts = _whole_and_parts(m, k, paper, b)
            assert whole <= parts * (1 + 1e-12)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("index", sorted(SETTINGS))
def test_a_split_backward_is_never_negative(index: int, recompute: str) -> None:
    """B of a split schedule costs the backward less its unit's W: the backward holds at
    least the W's products, down to the shortest slices (host-bound ones included)."""
    s = setting(index)
    m = ClusterCostModel(
        s.config, n_stages=s.n_stages, n_op=s.n_op, n_data=s.n_data, recompute=recompute
    )
    L = s.seq_len
    plans = [
        main_row(index, TERAPIPE).plan,
        Plan.from_paper(f"[(1, [8] * {L // 8})]"),
        Plan.from_paper(f"[(1, [1] * 64 + [{L - 64}])]"),  # one-token slices
        Plan.from_paper(f"[(4, [16] * {L // 16})]"),
    ]
    for p in plans:
        for k in (0, s.n_stages - 1):
            for u in p.units():
                backward = m.compute(k, Action(Kind.B, k, u.b, u.t), p)
                w = m.weight_grad(k, Action(Kind.W, k, u.b, u.t), p)
                assert 0 < w < backward, (p, k, u)
                assert action_cost(m, Action(Kind.B, k, u.b, u.t), p, split_backward=True) == (
                    pytest.approx(backward - w)
                )


def test_terapipe_zb_simulates_on_the_cluster_faster_than_terapipe() -> None:
    s = setting(9)
    p = main_row(9, TERAPIPE).plan
    zb = simulate_on_cluster(s, p, "terapipe-zb", validate=True)
    base = simulate_on_cluster(s, p, "terapipe")
    assert zb.latency < base.latency
    assert (zb.timeline["kind"] == "W").sum() == s.n_stages * p.n_batch_slices


# ---- virtual stages ---------------------------------------------------------------------

PLAN_2K = Plan.from_paper("[(2, [1024, 1024])]")


def test_a_chunk_computes_its_own_layers() -> None:
    """4 stages of 6 layers, 2 chunks each: a chunk is 3 layers, priced as a stage of
    the 8-stage layout of 3 layers, with the #Op broadcast where its input arrived."""
    four = ClusterCostModel("GPT3-1B", n_stages=4, n_op=2)
    eight = ClusterCostModel("GPT3-1B", n_stages=8, n_op=2)
    whole = four.compute(1, Action(Kind.F, 1, 0, 1), PLAN_2K)  # before placing: shared memo
    chunks = four.placed(interleaved(4, 2))
    assert chunks.layers_per_chunk == 3 and four.placed(interleaved(4, 1)) is four
    for kind in (Kind.F, Kind.B):
        first = chunks.compute(0, Action(kind, 0, 0, 1), PLAN_2K)  # part 0
        last = chunks.compute(3, Action(kind, 3, 0, 1, chunk=1), PLAN_2K)  # part 7
        middle = chunks.compute(1, Action(kind, 1, 0, 1, chunk=1), PLAN_2K)  # part 5
        assert first == eight.compute(0, Action(kind, 0, 0, 1), PLAN_2K)
        assert last == eight.compute(7, Action(kind, 7, 0, 1), PLAN_2K)
        assert middle == eight.compute(5, Action(kind, 5, 0, 1), PLAN_2K)
        assert len({first, last, middle}) == 2  # a broadcast at one end of the model
    w = Action(Kind.W, 2, 0, WHOLE_SEQUENCE, chunk=1)
    assert chunks.weight_grad(2, w, PLAN_2K) == eight.weight_grad(6, w, PLAN_2K)
    part5 = chunks.compute(1, Action(Kind.F, 1, 0, 1, chunk=1), PLAN_2K)
    assert four.compute(1, Action(Kind.F, 1, 0, 1), PLAN_2K) == whole > part5
    # The update covers the stage's 6 layers, whatever its chunks.
    assert (chunks.optimizer(0), chunks.allreduce(0)) == (four.optimizer(0), four.allreduce(0))
    with pytest.raises(ValueError, match="must divide the stage's layers"):
        four.placed(interleaved(4, 4))  # 6 layers do not cut into 4 chunks


def test_the_wrap_leaves_the_node_when_the_replica_spans_two() -> None:
    """#Op = 4: stages 0, 1 fill node 0 and stages 2, 3 node 1. Across the wrap, stage 3
    sends to stage 0 over the network, as stage 1 sends to stage 2."""
    m = ClusterCostModel("GPT3-1B", n_stages=4, n_op=4)
    chunks = m.placed(interleaved(4, 2))
    wrap = chunks.transfer(3, Action(Kind.SA, 3, 0, 1), PLAN_2K)
    assert wrap == m.transfer(1, Action(Kind.SA, 1, 0, 1), PLAN_2K)  # between nodes
    assert wrap > m.transfer(0, Action(Kind.SA, 0, 0, 1), PLAN_2K)  # inside node 0
    back = chunks.transfer(0, Action(Kind.RA, 0, 0, 1, chunk=1), PLAN_2K)
    assert back == m.transfer(2, Action(Kind.RA, 2, 0, 1), PLAN_2K)  # staged through host
    grad = chunks.transfer(0, Action(Kind.SG, 0, 0, 1, chunk=1), PLAN_2K)
    assert grad == m.transfer(2, Action(Kind.SG, 2, 0, 1), PLAN_2K)
    assert m.crosses_nodes(3, 0, forward=True) and not m.crosses_nodes(0, 1)


def test_the_wrap_inside_one_node_goes_through_host_memory() -> None:
    """#Op = 2, one node: the wrap runs from GPU 7 to GPU 0, which share no NVLink, as
    GPUs 3 and 4 (stage 1 to stage 2) do not; GPUs 1 and 2 (stage 0 to 1) have two."""
    m = ClusterCostModel("GPT3-1B", n_stages=4, n_op=2)
    wrap = m.placed(interleaved(4, 2)).transfer(3, Action(Kind.SA, 3, 0, 1), PLAN_2K)
    assert wrap == m.transfer(1, Action(Kind.SA, 1, 0, 1), PLAN_2K)
    assert wrap > m.transfer(0, Action(Kind.SA, 0, 0, 1), PLAN_2K)


def test_the_v_shape_turn_needs_no_broadcast() -> None:
    """Under a V, stage K-1's second chunk takes its input from its first, on the same
    GPUs: no message, no #Op broadcast, as the model's first part."""
    chunks = ClusterCostModel("GPT3-1B", n_stages=4, n_op=2).placed(v_shape(4))
    turn = chunks.compute(3, Action(Kind.F, 3, 0, 1, chunk=1), PLAN_2K)
    assert turn == chunks.compute(0, Action(Kind.F, 0, 0, 1), PLAN_2K)
    assert turn < chunks.compute(1, Action(Kind.F, 1, 0, 1), PLAN_2K)


def test_the_planners_slice_time_holds_every_chunks_messages() -> None:
    """K = 2 on GPUs 0 and 1, v = 2: stage 0's chunks hold parts 0 and 2, which exchange
    3 activation-gradient pairs with stage 1's parts 1 and 3 (one without chunks), all
    over the same NVLink."""
    m = ClusterCostModel("GPT3-1B", n_stages=2)
    chunks = m.placed(interleaved(2, 2))
    length, context = np.array([512, 256]), np.array([0, 512])
    fwd, bwd = m.stage_times(4, length, context)
    comm = m.slice_time(4, length, context) - fwd - bwd
    assert comm.min() > 0
    assert chunks.slice_time(4, length, context) - fwd - bwd == pytest.approx(3 * comm)
