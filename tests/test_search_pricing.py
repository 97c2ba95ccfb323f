"""One layout under one schedule, priced: 1F1B over token slices is periodic like 1F1B over
microbatches, so its extrapolation equals simulating every microbatch."""

from __future__ import annotations

import pytest

from tplib.cluster import DGX_H100, ClusterCostModel
from tplib.cluster.calibration import DGX_H100_CALIBRATION as CAL
from tplib.nn.configs import GPTConfig
from tplib.plan import Plan
from tplib.schedule import make_schedule
from tplib.search.long_context import LONG_CONTEXT
from tplib.search.pricing import price_microbatches, register_slicing
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


def test_a_slicing_must_be_callable() -> None:
    with pytest.raises(ValueError, match="is not callable"):
        register_slicing("seq1f1b", 42)  # type: ignore[arg-type]
