"""Context parallelism in the cluster model: the ring's exchanges against a hand
computation, #CP = 1 priced as before #CP existed, a rank's memory, the gradient
reduction over #Data x #CP, and the layouts refused."""

from __future__ import annotations

import numpy as np
import pytest

from tplib.cluster import DGX_H100, ClusterCostModel
from tplib.cluster.calibration import DGX_H100_CALIBRATION as CAL
from tplib.cluster.compute import layer_times
from tplib.cluster.implementation import Implementation
from tplib.cluster.memory import stage_memory_on_cluster
from tplib.nn.configs import GPTConfig, get_config
from tplib.plan import Plan
from tplib.schedule import make_schedule
from tplib.search.megatron import MegatronRun, predict

FLASH = Implementation(attention="flash")
RING = GPTConfig("ring", n_layer=2, hidden=1024, n_head=8, seq_len=4096, vocab_size=1024)


def _cost(n_op: int, n_cp: int, **kw: object) -> ClusterCostModel:
    fields: dict[str, object] = dict(
        n_stages=1, n_op=n_op, n_data=1, calibration=CAL, hardware=DGX_H100,
        implementation=FLASH, n_cp=n_cp,
    )  # fmt: skip
    fields.update(kw)
    return ClusterCostModel(RING, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n_op", "bandwidth"),
    [
        (1, 0.8 * 18 * 25e9),  # 4 CP ranks in a node: NVLink through NVSwitch, 80%
        (4, 0.9 * 400e9 / 8),  # 4 x 4 GPUs span two nodes: one 400 Gb/s rail each, 90%
    ],
)
def test_the_rings_exposed_exchanges_are_the_hand_computed_ones(
    n_op: int, bandwidth: float
) -> None:
    """One sequence of 4,096 tokens, #CP = 4, the ring's addition to one layer: an
    exchange's latency, then each of the 3 exchanges beyond its step of attention."""
    cost = _cost(n_op, 4)
    block = 2 * 2 * (4096 / 4) * (1024 / n_op)  # K and V, fp16, a rank's tokens
    # FlashAttention-2 over the whole sequence on one GPU: 4 (heads / #Op) x 128 x L x
    # (L + 1) / 2 at 33% of 989 TFLOPS; a rank's step is 1 / 16 of it, backward 2.5x.
    step = 4 * (8 / n_op) * 128 * 4096 * 4097 / 2 / (0.33 * 989e12) / 16
    latency = 10e-6
    fwd = latency + 3 * max(0.0, latency + block / bandwidth - step)
    bwd = latency + 3 * max(0.0, latency + 2 * block / bandwidth - 2.5 * step)
    assert fwd > latency and bwd > latency  # the exchanges show past the steps here
    length, context = np.array([4096.0]), np.array([0.0])
    plain = layer_times(RING, n_op, 1, length, context, cal=CAL, hw=DGX_H100, impl=FLASH, n_cp=4)
    ring = [a - b for a, b in zip(cost.layer_times(1, length, context), plain, strict=True)]
    assert ring[0][0] == pytest.approx(fwd, rel=1e-9)
    assert ring[1][0] == pytest.approx(bwd, rel=1e-9)


def test_with_one_cp_rank_every_price_is_what_it_was_before_context_parallelism() -> None:
    """Values the cluster model gave before it knew #CP (pinned), through Megatron runs
    (compute, sends, the reduction, the update, the schedules' memory) and the planner's
    slice times and plan memory."""
    runs = [
        MegatronRun("dgx-h100", 64, layers=16, hidden=2048, heads=16, batch=64,
                    seq_len=4096, tp=2, pp=4, interleave=2, recompute="selective",
                    sequence_parallel=True, distributed_optimizer=True),
        MegatronRun("dgx-a100", 16, layers=8, hidden=1024, heads=8, batch=16, seq_len=2048,
                    tp=1, pp=2, schedule="terapipe", recompute="full",
                    overlap_grad_reduce=True),
    ]  # fmt: skip
    pinned = [(0.10694396744528167, 8.351057052612305), (0.03485612485165924, 7.1845855712890625)]
    for run, (latency, memory) in zip(runs, pinned, strict=True):
        p = predict(run)
        assert (p.iteration_s, p.memory_gib) == (latency, memory)
    plan = Plan.from_paper("[(2, [1024, 512, 512])] * 4")
    cases = [
        ("none", True, 6837154816.0, [0.008497455026086956, 0.008510562226086957]),
        ("full", False, 5595640832.0, [0.010928427470531401, 0.010992507114975847]),
    ]
    for recompute, sp, memory, times in cases:
        impl = Implementation(attention="flash", sequence_parallel=sp, distributed_optimizer=True)
        cost = ClusterCostModel(
            get_config("GPT3-1B"), n_stages=4, n_op=4, n_data=4, calibration=CAL,
            hardware=DGX_H100, recompute=recompute, implementation=impl,
        )  # fmt: skip
        assert cost.memory(plan).total == memory
        t = cost.slice_time(2, np.array([256.0, 512.0]), np.array([0.0, 1024.0]))
        assert t.tolist() == times


def test_a_rank_keeps_one_cp_th_of_the_activations_and_the_rings_blocks() -> None:
    schedule = make_schedule("1f1b", 2, Plan.gpipe(4, 4096))
    sharded = Implementation(attention="flash", distributed_optimizer=True)
    one, two = (
        stage_memory_on_cluster(RING, schedule, 0, n_op=1, n_cp=c, implementation=sharded)
        for c in (1, 2)
    )
    assert two.activations == one.activations / 2
    # Four blocks in flight, each the K and V of 2,048 tokens x 1,024 in fp16.
    assert (one.contexts, two.contexts) == (0.0, 4 * 2 * 2 * 2048 * 1024)
    # The optimizer shards over #Data x #CP: #CP = 2 holds what #Data = 2 does.
    assert (
        two.states
        == stage_memory_on_cluster(
            RING, schedule, 0, n_op=1, n_data=2, implementation=sharded
        ).states
    )


def test_the_gradients_are_reduced_over_data_times_cp() -> None:
    """#Data = 2 x #CP = 2 and #Data = 4 reduce the same gradients over the same four
    GPUs of one node, and with the distributed optimizer step the same shard."""
    sharded = Implementation(attention="flash", distributed_optimizer=True)
    a = _cost(1, 2, n_data=2, implementation=sharded)
    b = _cost(1, 1, n_data=4, implementation=sharded)
    assert a.allreduce(0) == b.allreduce(0) > 0
    assert a.optimizer(0) == b.optimizer(0)


@pytest.mark.parametrize(
    ("kw", "rule"),
    [
        ({"n_cp": 2, "implementation": Implementation()}, "ring attention over FlashAttention"),
        ({"n_cp": 0}, r"#CP must be a whole number of ranks, at least 1"),
        ({"n_op": 4, "n_cp": 3}, r"#Op x #CP = 12 GPUs must fill a share of a node"),
    ],
)
def test_layouts_context_parallelism_cannot_run_are_refused(
    kw: dict[str, object], rule: str
) -> None:
    fields: dict[str, object] = {"n_op": 1}
    fields.update(kw)
    with pytest.raises(ValueError, match=rule):
        _cost(**fields)  # type: ignore[arg-type]
