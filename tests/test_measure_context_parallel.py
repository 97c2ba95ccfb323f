"""Tests for tplib.measure.context_parallel: the price of a one-stage run on #CP ranks.

Two hand-made stage profiles (a table t(1, l, 0) and Eq. 9's coefficients each) and a
slow link, so that every term of a unit's price is worked out by hand below: each CP
rank's two chunks on both stages, split by each stage's forward share, the slowest rank,
and the ring's messages on both layers.
"""

from __future__ import annotations

import pytest

from tplib.measure import context_parallel_costs
from tplib.nn.configs import GPTConfig
from tplib.perfmodel import Profile
from tplib.plan import Plan
from tplib.schedule import make_schedule
from tplib.sim.costs import Link
from tplib.sim.simulate import simulate

CFG = GPTConfig("pair", n_layer=2, hidden=8, n_head=2, seq_len=16, vocab_size=16)
LINK = Link(bandwidth=1e6, latency=1e-3)


def _stage(lo: int, step: float, coef: tuple[float, ...], fwd: float, opt: float) -> Profile:
    """Layer ``lo`` alone; t(1, l, 0) = ``step`` x l / 2 at l = 2, 4, ..., 16."""
    return Profile(
        config=CFG,
        layers_per_stage=1,
        seq_len=16,
        granularity=2,
        batch_slice_sizes=(1,),
        times=(tuple(step * k for k in range(1, 9)),),
        coef=(coef,),
        samples=(),
        holdout_error=(0.0,),
        holdout_error_ctx=(0.0,),
        stage=(lo, lo + 1),
        fwd_fraction=fwd,
        optimizer_time=opt,
    )


PROFILES = [
    _stage(0, 0.1, (0.01, 0.002, 0.003, 0.0004), fwd=0.25, opt=0.5),
    _stage(1, 0.05, (0.02, 0.001, 0.001, 0.0002), fwd=0.4, opt=0.25),
]


def _t(stage: int, length: int, context: int) -> float:
    """The stage's t(1, l, c) from its table and Eq. 9, written out."""
    step, (a0, a1, a2, a3) = (0.1, 0.05)[stage], PROFILES[stage].coef[0]
    ctx = a0 + a1 * length + a2 * context + a3 * length * context if context else 0.0
    return step * length / 2 + ctx


def test_a_unit_costs_its_slowest_rank_plus_the_ring() -> None:
    costs = context_parallel_costs(PROFILES, LINK, n_cp=2)
    plan = Plan((1,), ((8, 8),))  # one sequence of 16 tokens, two slices of 8
    schedule = make_schedule("terapipe", 1, plan)
    sim = simulate(schedule, costs)
    tl = sim.timeline
    spans = (tl.end - tl.start).to_numpy()
    times = {(str(k), int(t)): float(d) for k, t, d in zip(tl.kind, tl.t, spans, strict=True)}
    for t, context in ((0, 0), (1, 8)):
        # #CP = 2: chunks of 2 tokens; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
        ranks = [(context, context + 6), (context + 2, context + 4)]
        fwd = [sum(0.25 * _t(0, 2, c) + 0.4 * _t(1, 2, c) for c in cs) for cs in ranks]
        bwd = [sum(0.75 * _t(0, 2, c) + 0.6 * _t(1, 2, c) for c in cs) for cs in ranks]
        # K or V of one rank's (8 + context) / 2 slots of hidden 8, float32.
        kv = (8 + context) // 2 * 8 * 4
        ring_f = 2 * (1e-3 + 2 * kv / 1e6)  # 2 layers x one shift of K and V
        ring_b = 2 * ((1e-3 + 4 * kv / 1e6) + (1e-3 + 2 * kv / 1e6))  # ... with dK, dV; home
        assert times["F", t] == pytest.approx(max(fwd) + ring_f, rel=1e-12)
        assert times["B", t] == pytest.approx(max(bwd) + ring_b, rel=1e-12)
    # At context 0 rank 1's chunks both pay Eq. 9's fixed context terms, rank 0's one.
    assert costs.rank_work(True, 1, 8, 0)[1] > costs.rank_work(True, 1, 8, 0)[0]
    # The whole model's float32 gradient (embeddings 2 x 16 x 8, two layers of
    # 12 h^2 + 13 h, the final LayerNorm) all-reduced by a ring of 2; both steps summed.
    grads = (2 * 16 * 8 + 2 * (12 * 64 + 13 * 8) + 2 * 8) * 4
    assert costs.allreduce(0) == pytest.approx(grads / 1e6 + 2e-3)
    assert costs.optimizer(0) == 0.75
    assert sim.latency == pytest.approx(sum(times.values()))


def test_cp_costs_refuse_what_they_cannot_price() -> None:
    with pytest.raises(ValueError, match="layers \\[0, 1\\) of 2"):
        context_parallel_costs(PROFILES[:1], LINK, n_cp=2)
    with pytest.raises(ValueError, match="profile 0 is not the pipeline stage starting at layer 0"):
        context_parallel_costs(PROFILES[::-1], LINK, n_cp=2)
    with pytest.raises(ValueError, match="n_cp=0"):
        context_parallel_costs(PROFILES, LINK, n_cp=0)
    costs = context_parallel_costs(PROFILES, LINK, n_cp=2)
    with pytest.raises(ValueError, match=r"10 tokens is not divisible by 2\*#CP = 4"):
        costs.rank_work(True, 1, 10, 0)
