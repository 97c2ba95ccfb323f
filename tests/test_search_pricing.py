"""One layout under one schedule, priced: 1F1B over token slices is periodic like 1F1B over
microbatches, so its extrapolation equals simulating every microbatch; TeraPipe's rounds
of gradient accumulation cost what the rounds simulated one after another do."""

from __future__ import annotations

import pytest

from tplib.cluster import DGX_H100, ClusterCostModel
from tplib.cluster.calibration import DGX_H100_CALIBRATION as CAL
from tplib.nn.configs import GPTConfig
from tplib.plan import Plan, Unit
from tplib.schedule import Kind, make_schedule
from tplib.schedule.generators import _complete
from tplib.search.long_context import LONG_CONTEXT
from tplib.search.pricing import price_microbatches, price_terapipe
from tplib.sim.simulate import simulate

CFG = GPTConfig("p", n_layer=8, hidden=1024, n_head=8, seq_len=8192, vocab_size=32000)


@pytest.mark.parametrize(("n_cp", "slices"), [(2, (3072, 2048, 2048, 1024)), (1, (4096, 4096))])
def test_sliced_1f1b_extrapolated_equals_simulating_every_microbatch(
    n_cp: int, slices: tuple[int, ...]
) -> None:
    cost = ClusterCostModel(
        CFG, n_stages=4, n_op=2, n_data=1, seq_len=8192, calibration=CAL, hardware=DGX_H100,
        recompute="selective", implementation=LONG_CONTEXT.implementation, n_cp=n_cp,
    )  # fmt: skip
    priced = price_microbatches(cost, "seq1f1b", 20, 1, token_slices=slices)
    every = make_schedule("1f1b", 4, Plan((1,) * 20, (slices,) * 20), validate=False)
    assert priced.latency == pytest.approx(simulate(every, cost).latency, rel=1e-12)
    assert Plan.from_paper(priced.plan) == every.plan


def test_terapipe_in_rounds_costs_the_rounds_run_one_after_another() -> None:
    """Two fill-drain rounds of the planner's plan for 2 sequences, then one update,
    written out as one schedule and simulated, against the round priced twice."""
    cost = ClusterCostModel(
        CFG, n_stages=4, n_op=2, n_data=1, seq_len=8192, calibration=CAL, hardware=DGX_H100,
        implementation=LONG_CONTEXT.implementation,
    )  # fmt: skip
    priced = price_terapipe(cost, "terapipe", 4, granularity=512, eps=1e-4, rounds=2)
    one = Plan.from_paper(priced.plan)
    n = one.n_batch_slices
    both = Plan(one.batch_slices * 2, one.token_slices * 2)
    order: list[tuple[Kind, Unit]] = []
    for r in range(2):
        units = [Unit(b + r * n, t) for b in range(n) for t in range(len(one.token_slices[b]))]
        order += [(Kind.F, u) for u in units] + [(Kind.B, u) for u in reversed(units)]
    rounds = _complete("terapipe", 4, both, [order] * 4)
    assert priced.latency == pytest.approx(simulate(rounds, cost).latency, rel=1e-12)
