"""Tests for tplib.cluster.slice_memory: the planner's per-unit view of the cluster's
memory accounting matches memory_per_gpu on fill-drain plans and bounds the replay of
1F1B's schedule, and the planner holds its plans to it."""

from __future__ import annotations

from typing import Any

import pytest

from tplib.cluster import ClusterCostModel, Implementation
from tplib.cluster.implementation import MEGATRON_2021
from tplib.cluster.memory import memory_per_gpu, stage_memory_on_cluster
from tplib.cluster.slice_memory import ClusterSliceMemory
from tplib.nn.configs import get_config
from tplib.plan import Plan
from tplib.planner import NothingFitsError, SliceMemory, exact_joint, peak_bytes
from tplib.schedule import make_schedule

CFG = get_config("GPT3-1B")
PLANS = (
    Plan((1, 2, 1), ((1024, 512, 512), (1024, 1024), (256, 768, 1024))),
    Plan.uniform(4, 2048, n_token_slices=4),
)
FLASH = Implementation(attention="flash", sequence_parallel=True)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_fill_drain_peak_is_memory_per_gpu(recompute: str) -> None:
    mem: SliceMemory = ClusterSliceMemory(CFG, 4, n_op=2, recompute=recompute)
    for p in PLANS:
        expected = memory_per_gpu(CFG, n_stages=4, n_op=2, plan=p, recompute=recompute)
        assert peak_bytes(p, mem) == pytest.approx(expected.total, rel=1e-12)


@pytest.mark.parametrize("impl", [Implementation(), FLASH, MEGATRON_2021])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_1f1b_peak_bounds_the_schedule(impl: Implementation, recompute: str) -> None:
    for stage in (0, 3):
        for p in PLANS:
            mem = ClusterSliceMemory(
                CFG,
                4,
                n_op=2,
                recompute=recompute,
                implementation=impl,
                schedule="1f1b",
                stage=stage,
            )
            schedule = make_schedule("1f1b", 4, p)
            replay = stage_memory_on_cluster(
                CFG, schedule, stage, n_op=2, recompute=recompute, implementation=impl
            )
            assert peak_bytes(p, mem) >= replay.total * (1 - 1e-12)
            assert peak_bytes(p, mem) <= replay.total * 1.25  # and not far above it


def test_1f1b_peak_is_the_replay_on_equal_units() -> None:
    # Equal units, nothing rebuilt: stage 0 holds exactly K - 1 + M of them at its peak.
    p = Plan.uniform(4, 2048, n_token_slices=4)
    mem = ClusterSliceMemory(CFG, 4, n_op=2, implementation=FLASH, schedule="1f1b")
    replay = stage_memory_on_cluster(
        CFG, make_schedule("1f1b", 4, p), 0, n_op=2, implementation=FLASH
    )
    assert peak_bytes(p, mem) == pytest.approx(replay.total, rel=1e-12)


def test_of_a_cost_model_and_bad_input() -> None:
    cost = ClusterCostModel(CFG, n_stages=4, n_op=2, recompute="full", implementation=FLASH)
    mem = ClusterSliceMemory.of(cost, "1f1b")
    assert (mem.n_stages, mem.n_op, mem.recompute, mem.implementation) == (4, 2, "full", FLASH)
    assert mem.in_flight == 3 and ClusterSliceMemory.of(cost).in_flight is None
    with pytest.raises(ValueError, match="chunks per stage"):
        ClusterSliceMemory.of(cost.placed((0, 1, 2, 3, 0, 1, 2, 3)))
    with pytest.raises(ValueError, match="schedule='zb'"):
        ClusterSliceMemory(CFG, 4, schedule="zb")
    with pytest.raises(ValueError, match="stage=4"):
        ClusterSliceMemory(CFG, 4, stage=4)


def test_the_planner_keeps_the_cluster_plan_within_memory() -> None:
    # The paper's setting-(7)-like layout with scores kept: the fastest plan's scores
    # need more than the capacity given; the planner's plan fits, as memory_per_gpu says.
    cost = ClusterCostModel("GPT3-44B", n_stages=24, n_op=8)
    mem = ClusterSliceMemory.of(cost)
    kw: dict[str, Any] = {"seq_len": 2048, "batch": 4, "n_stages": 24, "granularity": 128}
    free = exact_joint(cost, **kw)
    need = memory_per_gpu("GPT3-44B", n_stages=24, n_op=8, plan=free).total
    with pytest.raises(NothingFitsError, match="smallest peak any plan attains") as info:
        exact_joint(cost, **kw, memory=mem, capacity=mem.fixed)
    least = info.value.smallest_peak
    assert mem.fixed < least < need
    capacity = (least + need) / 2
    p = exact_joint(cost, **kw, memory=mem, capacity=capacity)
    assert memory_per_gpu("GPT3-44B", n_stages=24, n_op=8, plan=p).total <= capacity
    assert p.latency is not None and free.latency is not None and p.latency > free.latency
