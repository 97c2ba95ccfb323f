"""Tests for tplib.partition.pipedream: PipeDream's optimizer against a brute force over
every plan, small cases worked by hand, memory, and a real chain."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache
from itertools import combinations, pairwise, product

import numpy as np
import pytest

from tplib.nn.configs import get_config
from tplib.nn.layer_ranges import check_stage_ranges
from tplib.partition import DoesNotFit, Layer, LayerChain, Level, Topology, cluster_chain
from tplib.partition.pipedream import PipeDreamPlan, PipeDreamStage, pipedream_partition

GIB = 2.0**30
INF = math.inf


def make_chain(
    times: list[float],
    *,
    params: list[float] | None = None,
    outputs: list[float] | None = None,
    states: list[float] | None = None,
    stash: list[float] | None = None,
    capacity: float = INF,
) -> LayerChain:
    """A chain whose layer l computes for times[l] seconds (half forward, half backward)."""
    n = len(times)
    params = params or [0.0] * n
    outputs = outputs or [0.0] * n
    states = states or [0.0] * n
    stash = stash or [0.0] * n
    layers = tuple(
        Layer(f"l{i}", t / 2, t / 2, params[i], stash[i], outputs[i], states[i])
        for i, t in enumerate(times)
    )
    return LayerChain(layers, 1, 1, 1, 1.0, 1.0, capacity, 0.0, "test chain")


# ---- an independent brute force ----------------------------------------------------------


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every tuple of ``parts`` positive integers summing to ``total``."""
    out = []
    for bars in combinations(range(1, total), parts - 1):
        edges = (0, *bars, total)
        out.append(tuple(b - a for a, b in pairwise(edges)))
    return out


def brute_force(chain: LayerChain, topology: Topology) -> tuple[float, float]:
    """(best slowest-stage time, least largest per-GPU memory) over every plan: at each
    level every cut of the layers into contiguous stages and every replication vector
    summing to the level's count, each stage running the best plan of the level below."""
    layers, W = chain.layers, topology.n_gpus
    levels = topology.levels

    def compute(lo: int, hi: int) -> float:
        return sum(x.forward + x.backward for x in layers[lo:hi])

    def weights(lo: int, hi: int) -> float:
        return chain.grad_bytes * sum(x.params for x in layers[lo:hi])

    def memory(lo: int, hi: int, r: int) -> float:
        f = -(-W // r)
        return chain.stage_memory(lo, hi, in_flight=f, versions=f)

    @cache
    def best(k: int, lo: int, hi: int, m: int) -> tuple[float, float]:
        """Level k >= 1: layers [lo, hi) on m components of level k."""
        B = levels[k - 1].bandwidth
        time, mem = INF, INF
        for cuts in product((False, True), repeat=hi - lo - 1):
            edges = [lo, *(lo + 1 + i for i, c in enumerate(cuts) if c), hi]
            stages = list(pairwise(edges))
            for reps in compositions(m, len(stages)):
                t = max((2 * layers[s - 1].output / B for s in edges[1:-1]), default=0.0)
                worst = 0.0
                for (a, b), r in zip(stages, reps, strict=True):
                    if k == 1:
                        inner = compute(a, b)
                        need = memory(a, b, r)
                        if need > chain.capacity:
                            inner = INF
                    else:
                        inner, need = best(k - 1, a, b, levels[k - 2].count)
                    t = max(t, max(inner, 2 * (r - 1) * weights(a, b) / B) / r)
                    worst = max(worst, need)
                time, mem = min(time, t), min(mem, worst)
        return time, mem

    return best(len(levels), 0, len(layers), levels[-1].count)


def check_plan(plan: PipeDreamPlan, chain: LayerChain, topology: Topology) -> None:
    """The plan covers the chain, uses every GPU, and its slowest is its largest part."""
    ranges = plan.stage_ranges
    assert ranges[0][0] == 0 and ranges[-1][1] == len(chain)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in pairwise(ranges))
    assert sum(s.replicas for s in plan.stages) == topology.n_gpus == plan.n_gpus
    assert len(plan.transfers) == len(plan.stages) - 1
    assert plan.slowest == max([s.time for s in plan.stages] + list(plan.transfers))
    assert plan.in_flight == -(-topology.n_gpus // plan.stages[0].replicas)
    assert plan.throughput == pytest.approx(1 / plan.slowest)


def random_chain(rng: np.random.Generator, n: int, topology: Topology) -> LayerChain:
    """Random profile; capacity infinite, or among what the stages a plan may form need."""
    u = lambda lo, hi: [float(x) for x in rng.uniform(lo, hi, n)]  # noqa: E731
    chain = make_chain(u(0.2, 2.0), params=u(0, 3), outputs=u(0, 3), states=u(0, 2), stash=u(0, 1))
    if rng.random() < 0.3:
        return chain
    W, m1 = topology.n_gpus, topology.levels[0].count
    needs = sorted(
        chain.stage_memory(lo, hi, in_flight=f, versions=f)
        for lo, hi in combinations(range(n + 1), 2)
        for f in {-(-W // r) for r in range(1, m1 + 1)}
    )
    return replace(chain, capacity=float(rng.uniform(needs[len(needs) // 5], needs[-1])))


def compare(chain: LayerChain, topology: Topology) -> PipeDreamPlan | None:
    time, mem = brute_force(chain, topology)
    if math.isinf(time):
        with pytest.raises(DoesNotFit) as err:
            pipedream_partition(chain, topology)
        assert mem > chain.capacity
        assert err.value.memory == pytest.approx(mem)
        return None
    plan = pipedream_partition(chain, topology)
    assert plan.slowest == pytest.approx(time, rel=1e-12)
    check_plan(plan, chain, topology)
    return plan


BANDWIDTHS = [0.5, 2.0, 8.0, INF]


def test_one_level_equals_the_brute_force() -> None:
    rng = np.random.default_rng(0)
    infeasible = 0
    for _ in range(80):
        n, W = int(rng.integers(4, 7)), int(rng.integers(3, 6))
        topology = Topology.flat(W, float(rng.choice(BANDWIDTHS)))
        chain = random_chain(rng, n, topology)
        plan = compare(chain, topology)
        if plan is None:
            infeasible += 1
            continue
        # One level: each stage is charged max(compute, sync) / r and fits with ceil(W / r).
        B = topology.levels[0].bandwidth
        for s in plan.stages:
            sync = 2 * (s.replicas - 1) * chain.total("params", s.lo, s.hi) / B
            assert s.time == pytest.approx(max(chain.compute(s.lo, s.hi), sync) / s.replicas)
            f = -(-W // s.replicas)
            assert chain.stage_memory(s.lo, s.hi, in_flight=f, versions=f) <= chain.capacity
        assert plan.transfers == pytest.approx(
            [2 * chain.layers[s.hi - 1].output / B for s in plan.stages[:-1]]
        )
    assert 0 < infeasible < 40  # both branches were exercised


@pytest.mark.parametrize(
    ("counts", "n_range"),
    [((2, 2), (4, 7)), ((3, 2), (4, 6)), ((2, 3), (4, 6)), ((2, 2, 2), (3, 5))],
)
def test_hierarchical_equals_the_brute_force(
    counts: tuple[int, ...], n_range: tuple[int, int]
) -> None:
    rng = np.random.default_rng(sum(counts) * 10 + len(counts))
    for _ in range(40):
        levels = tuple(Level(c, float(rng.choice(BANDWIDTHS))) for c in counts)
        topology = Topology(levels)
        chain = random_chain(rng, int(rng.integers(*n_range)), topology)
        compare(chain, topology)


# ---- small cases worked by hand ----------------------------------------------------------


def test_two_equal_layers_on_a_free_link_tie_and_replication_wins() -> None:
    chain = make_chain([1.0, 1.0], params=[5.0, 5.0], outputs=[5.0, 5.0])
    # Two stages: max(1, 2 a / inf, 1) = 1. One stage on 2: max(2, 2 * 1 * 10 / inf) / 2 = 1.
    plan = pipedream_partition(chain, Topology.flat(2, INF))
    assert plan.slowest == 1.0
    assert plan.stages == (PipeDreamStage(0, 2, 2, 1.0),)  # ties go to the single stage
    assert plan.in_flight == 1 and plan.transfers == ()
    # Three workers: replicate 2 / 3 beats any split (the 1-GPU stage takes 1 s).
    plan = pipedream_partition(chain, Topology.flat(3, INF))
    assert plan.slowest == pytest.approx(2 / 3)
    assert plan.stage_ranges == ((0, 2),) and plan.stages[0].replicas == 3


def test_a_huge_activation_forces_replication() -> None:
    chain = make_chain([1.0, 1.0], params=[1e3, 1e3], outputs=[1e9, 1e9])
    # Split: max(1, 2 * 1e9 / 1e9, 1) = 2; replicated: max(2, 2 * 2e3 / 1e9) / 2 = 1.
    plan = pipedream_partition(chain, Topology.flat(2, 1e9))
    assert plan.stages == (PipeDreamStage(0, 2, 2, 1.0),)
    assert plan.slowest == 1.0


def test_huge_parameters_force_a_split() -> None:
    chain = make_chain([1.0, 1.0], params=[1e9, 1e9], outputs=[1e6, 1e6])
    # Replicated: max(2, 2 * 1 * 2e9 / 1e9) / 2 = 2; split: max(1, 2e6 / 1e9, 1) = 1.
    plan = pipedream_partition(chain, Topology.flat(2, 1e9))
    assert plan.stages == (PipeDreamStage(0, 1, 1, 1.0), PipeDreamStage(1, 2, 1, 1.0))
    assert plan.transfers == pytest.approx((2e-3,))
    assert plan.slowest == 1.0 and plan.in_flight == 2 and plan.throughput == 1.0
    assert str(plan).splitlines() == [
        "stage 0: layers [0, 1) on 1 GPU, 1000.000 ms per minibatch",
        "stage 1: layers [1, 2) on 1 GPU, 1000.000 ms per minibatch",
    ]


# Two nodes of 2 GPUs; 1 GB of weights and 0.25 GB of output per layer.
# Fast inside (1e11), slow between (1e9): across nodes a data-parallel stage syncs
# 2 * 1 * 2e9 / 1e9 = 4 s, so replicating both layers on both nodes costs >= 4 / 2 = 2.
# Splitting across nodes costs the cut 2 * 2.5e8 / 1e9 = 0.5 and, per node, one layer on
# 2 GPUs: max(1, 2 * 1 * 1e9 / 1e11) / 2 = 0.5.
# Slow inside (1e9), fast between (1e12): inside a node a split, max(1, 2 * 2.5e8 / 1e9,
# 1) = 1, beats replication, max(2, 2 * 2e9 / 1e9) / 2 = 2. Across nodes replicating that
# pipeline, max(1, 2 * 2e9 / 1e12) / 2 = 0.5, beats a split, whose 1-layer stages on 2
# GPUs take max(1, 2 * 1e9 / 1e9) / 2 = 1. Flattened: each stage on 2 GPUs at 1 / 2 =
# 0.5, the in-node transfer 0.5 / 2 = 0.25.
@pytest.mark.parametrize(("inside", "between", "transfer"), [(1e11, 1e9, 0.5), (1e9, 1e12, 0.25)])
def test_two_levels_split_where_links_are_slow(
    inside: float, between: float, transfer: float
) -> None:
    chain = make_chain([1.0, 1.0], params=[1e9, 1e9], outputs=[2.5e8, 2.5e8])
    topology = Topology((Level(2, inside), Level(2, between)))
    plan = pipedream_partition(chain, topology)
    assert plan.stages == (PipeDreamStage(0, 1, 2, 0.5), PipeDreamStage(1, 2, 2, 0.5))
    assert plan.transfers == (transfer,)
    assert plan.slowest == 0.5 and plan.in_flight == 2
    check_plan(plan, chain, topology)


# ---- memory --------------------------------------------------------------------------------


def test_a_capacity_forces_more_stages_and_nothing_fitting_names_the_closest() -> None:
    # Each layer: 10 GiB of states, 1 Gi parameters (1 byte per extra version). One stage
    # on 2 GPUs (1 in flight): 20 GiB; two 1-GPU stages (2 in flight, 2 versions): 11 GiB.
    def chain(capacity: float = INF) -> LayerChain:
        return make_chain(
            [1.0, 1.0], params=[GIB, GIB], states=[10 * GIB, 10 * GIB], capacity=capacity
        )

    topology = Topology.flat(2, INF)
    free = pipedream_partition(chain(), topology)
    assert free.stages == (PipeDreamStage(0, 2, 2, 1.0),)
    assert pipedream_partition(chain(8 * GIB), topology, memory=False) == free
    tight = pipedream_partition(chain(16 * GIB), topology)
    assert tight.stage_ranges == ((0, 1), (1, 2)) and tight.slowest == 1.0
    with pytest.raises(
        DoesNotFit,
        match=r"closest is layers \[0, 1\) on 1 GPU, \[1, 2\) on 1 GPU .*needs 11\.0 GiB",
    ) as err:
        pipedream_partition(chain(8 * GIB), topology)
    assert err.value.memory == 11 * GIB and err.value.capacity == 8 * GIB


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chain", "message"),
    [
        (make_chain([1.0, -1.0]), r"layer 1 \(l1\) has forward=-0.5: .*non-negative"),
        (make_chain([1.0, 1.0], outputs=[math.nan, 0.0]), r"layer 0 \(l0\) has output=nan"),
        (make_chain([0.0, 0.0]), r"computes for 0 s per minibatch"),
        (make_chain([1.0], capacity=0.0), r"chain.capacity=0.0: a GPU's memory must be > 0"),
    ],
)
def test_bad_chains_are_rejected(chain: LayerChain, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipedream_partition(chain, Topology.flat(2, 1.0))


def test_a_plan_too_large_to_search_is_rejected_before_work_starts() -> None:
    chain = make_chain([1.0] * 48)
    with pytest.raises(ValueError, match=r"48 layers on levels of \[4096\] components"):
        pipedream_partition(chain, Topology.flat(4096, 1.0))


# ---- a real chain --------------------------------------------------------------------------


def test_gpt3_1b_on_two_nodes() -> None:
    cfg = get_config("GPT3-1B")
    chain = cluster_chain(cfg, microbatch=1)
    topology = Topology.cluster(16)
    plan = pipedream_partition(chain, topology, memory=False)
    check_plan(plan, chain, topology)
    check_stage_ranges(cfg, plan.stage_ranges, len(plan.stages))
    # Under the conservative bound nothing fits a 16 GiB V100: a 1-GPU stage holds
    # ceil(16 / 1) = 16 microbatches' activations, and replicating stages to hold fewer
    # leaves fewer stages, each with more layers.
    with pytest.raises(DoesNotFit, match="the closest is layers") as err:
        pipedream_partition(chain, topology)
    assert err.value.memory > chain.capacity
    # Weights too slow to synchronise (1 GB/s): a straight pipeline, RunConfig's ranges.
    straight = pipedream_partition(chain, Topology.flat(4, 1e9), memory=False)
    assert all(s.replicas == 1 for s in straight.stages)
    check_stage_ranges(cfg, straight.stage_ranges, 4)
