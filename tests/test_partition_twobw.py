"""PipeDream-2BW's planner: hand-checked cost functions, the in-flight count against the
real 2BW schedule, an independent brute force, memory decisions, bad input, and one run
on the cluster model."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from tplib.cluster.memory import peak_in_flight
from tplib.nn.layer_ranges import balanced_stages
from tplib.partition.chain import DoesNotFit, Layer, LayerChain, cluster_chain
from tplib.partition.topology import Level, Topology
from tplib.partition.twobw import (
    TwoBWConfig,
    twobw_memory,
    twobw_plan,
    twobw_throughput,
)
from tplib.plan import Plan
from tplib.schedule.asynchronous import held_versions, min_microbatches, two_bw

INF = float("inf")


def round_chain(b: int = 1, capacity: float = INF) -> LayerChain:
    """4 layers with round numbers; the ends (embeddings, head) are heavier. Times and
    activations scale with the microbatch b."""
    spec = [(2.0, 4.0), (1.0, 2.0), (1.0, 2.0), (3.0, 6.0)]  # (forward, backward) at b=1
    layers = tuple(
        Layer(f"block {i}", b * f, b * bw, 10.0, b * 100.0, b * 50.0, 40.0)
        for i, (f, bw) in enumerate(spec)
    )
    return LayerChain(layers, b, 8, 1, 2.0, 10.0, capacity, 1000.0, "round numbers")


# Two nodes of two GPUs: 100 B/s inside a node, 10 B/s between nodes.
TWO_NODES = Topology((Level(2, 100.0), Level(2, 10.0)), "2x2")


# ---- hand-checked cost functions -------------------------------------------------------


def test_throughput_by_hand_pipelined_within_and_across_nodes() -> None:
    c = round_chain()
    # (w=2, d=2), g=4: stages [0,2) on ranks 0,1 (node 0) and [2,4) on ranks 2,3 (node 1).
    comp = [(2 + 1) + (4 + 2), (1 + 3) + (2 + 6)]  # 9, 12
    p2p = 2 * 50 / 10  # the boundary crosses the network in both replicas: 10
    reduce0 = 2 * (2 - 1) / 2 * (10.0 * 20) / 100 / 4  # inside node 0, amortised over g
    t = max(max(comp[0], p2p, reduce0), max(comp[1], p2p, reduce0))
    assert t == 12
    assert twobw_throughput(
        c, TWO_NODES, width=2, depth=2, recompute=False, accumulation=4
    ) == pytest.approx((t, 2 * 1 / t))
    # Recomputation runs stage 1's forward (1 + 3) again.
    t_r = 12 + (1 + 3)
    assert twobw_throughput(
        c, TWO_NODES, width=2, depth=2, recompute=True, accumulation=4
    ) == pytest.approx((t_r, 2 / t_r))
    # (w=1, d=4): ranks 0..3; boundaries 0-1 and 2-3 inside a node, 1-2 across.
    inside, across = 2 * 50 / 100, 2 * 50 / 10
    t4 = max(2 + 4, inside, 1 + 2, inside + across, 1 + 2, across + inside, 3 + 6, inside)
    assert t4 == 11  # the middle stages wait on the network
    assert twobw_throughput(
        c, TWO_NODES, width=1, depth=4, recompute=False, accumulation=3
    ) == pytest.approx((t4, 1 / t4))


def test_throughput_by_hand_without_pipelining() -> None:
    c = round_chain(b=2)
    comp = 2 * (7 + 14)  # the whole model, twice the work at b=2: 42
    # (w=4, d=1): the all-reduce spans both nodes, at the network's 10 B/s.
    reduce = 2 * (4 - 1) / 4 * (10.0 * 40) / 10  # 60 per update
    assert twobw_throughput(
        c, TWO_NODES, width=4, depth=1, recompute=False, accumulation=1
    ) == pytest.approx((60, 4 * 2 / 60))
    assert twobw_throughput(
        c, TWO_NODES, width=4, depth=1, recompute=False, accumulation=2
    ) == pytest.approx((comp, 4 * 2 / comp))  # 60 / 2 = 30 hides under the compute
    # (w=2, d=1): inside a node.
    reduce2 = 2 * (2 - 1) / 2 * 400 / 100
    assert reduce < INF and reduce2 < comp
    assert twobw_throughput(
        c, TWO_NODES, width=2, depth=1, recompute=False, accumulation=1
    ) == pytest.approx((comp, 2 * 2 / comp))


def test_memory_by_hand() -> None:
    c = round_chain()
    reserve, version = 1000, 2.0 * 10  # one more fp16 copy of a layer's 10 parameters
    # d = 1: one version, one microbatch in flight; no output kept (the head's stage).
    assert twobw_memory(c, depth=1, recompute=False) == 4 * 40 + 4 * 100 + reserve
    # d = 2: two versions; stage 0 holds 2 microbatches (stash + output), stage 1 one.
    s0 = 2 * 40 + 2 * version + 2 * (2 * 100 + 50) + reserve  # 1620
    s1 = 2 * 40 + 2 * version + 1 * (2 * 100) + reserve  # 1320
    assert twobw_memory(c, depth=2, recompute=False) == max(s0, s1) == 1620
    # Recomputation keeps each microbatch's input and output, and rebuilds one stash.
    r0 = 2 * 40 + 2 * version + 2 * (0 + 50) + 2 * 100 + reserve  # 1420
    r1 = 2 * 40 + 2 * version + 1 * (50 + 0) + 2 * 100 + reserve  # 1370
    assert twobw_memory(c, depth=2, recompute=True) == max(r0, r1) == 1420
    # d = 4: 4, 3, 2, 1 in flight.
    per = [40 + version + k * (100 + 50) + reserve for k in (4, 3, 2)]
    per.append(40 + version + 1 * 100 + reserve)
    assert twobw_memory(c, depth=4, recompute=False) == max(per) == 1660


# ---- the in-flight count against the real schedule -------------------------------------


@pytest.mark.parametrize("d", [1, 2, 3, 4, 5])
def test_in_flight_matches_the_2bw_schedule(d: int) -> None:
    L = 8
    assert min_microbatches(d, (L,)) == max(d - 1, 1)  # the planner's g >= rule
    for m in (min_microbatches(d, (L,)), d + 2):
        schedule = two_bw(d, Plan((1,) * m, ((L,),) * m), 3)
        peaks = [peak_in_flight(acts, kept=lambda u: 1.0) for acts in schedule.actions]
        assert peaks == [d - i for i in range(d)]
        if d > 1:
            assert held_versions(schedule) == (2,) * d
    # twobw_memory is each stage's memory at the schedule's own peak.
    layers = tuple(Layer(f"{i}", 1, 2, 10 + i, 100 + 7 * i, 30 + i, 40 + i) for i in range(d))
    c = LayerChain(layers, 1, L, 1, 2.0, 2.0, INF, 0.0, "one layer per stage")
    schedule = two_bw(d, Plan((1,) * d, ((L,),) * d), 3)
    expect = max(
        c.stage_memory(
            i,
            i + 1,
            in_flight=int(peak_in_flight(schedule.actions[i], kept=lambda u: 1.0)),
            versions=2 if d > 1 else 1,
        )
        for i in range(d)
    )
    assert twobw_memory(c, depth=d, recompute=False) == expect


# ---- an independent brute force -----------------------------------------------------------


def random_chains(rng: random.Random, n_layers: int) -> dict[int, LayerChain]:
    # (forward, backward, params, stash, output, states) at b = 1
    spans = [(0.5, 2), (1, 4), (1, 50), (10, 200), (1, 40), (10, 300)]
    base = [tuple(rng.uniform(lo, hi) for lo, hi in spans) for _ in range(n_layers)]
    grad, version, reserve = rng.choice([2.0, 4.0]), rng.choice([2.0, 4.0]), 50.0

    def chain(b: int) -> LayerChain:
        # Larger microbatches run at a higher arithmetic intensity: less time per sample.
        speed = b**0.8
        layers = tuple(
            Layer(f"{i}", f * speed, bw * speed, p, b * s, b * o, st)
            for i, (f, bw, p, s, o, st) in enumerate(base)
        )
        return LayerChain(layers, b, 16, 1, version, grad, INF, reserve, "random")

    return {b: chain(b) for b in (1, 2, 4)}


def brute_force(
    chains: dict[int, LayerChain], n_gpus: int, bw: float, batch: int
) -> list[tuple[tuple[int, int, int, bool, int], float, float]]:
    """Every valid (w, d, b, r, g) on a flat topology with its throughput and memory, from
    the formulas written out here."""
    out = []
    n_layers = len(chains[1])
    for w in range(1, n_gpus + 1):
        for d in range(1, min(n_gpus // w, n_layers) + 1):
            for b, c in chains.items():
                if batch % (w * b):
                    continue
                g = batch // (w * b)
                if d > 1 and g < d - 1:
                    continue
                stages = balanced_stages(n_layers, d)
                for r in (False, True):
                    stage_t, stage_m = [], []
                    for i, (lo, hi) in enumerate(stages):
                        ls = c.layers[lo:hi]
                        fwd = sum(x.forward for x in ls)
                        comp = fwd + sum(x.backward for x in ls) + (fwd if r else 0)
                        sends = [] if hi == n_layers else [ls[-1].output]
                        gets = [] if lo == 0 else [c.layers[lo - 1].output]
                        comm = sum(2 * a / bw for a in sends + gets) if d > 1 else 0
                        params = sum(x.params for x in ls)
                        reduce = 2 * (w - 1) / w * c.grad_bytes * params / bw / g
                        stage_t.append((comp, comm, reduce))
                        states = sum(x.states for x in ls)
                        states += (1 if d > 1 else 0) * c.version_bytes * params
                        flight = d - i
                        out_kept = sends[0] if sends else 0
                        stash = sum(x.stash for x in ls)
                        if r:
                            acts = flight * ((gets[0] if gets else 0) + out_kept) + stash
                        else:
                            acts = flight * (stash + out_kept)
                        stage_m.append(states + acts + c.reserve)
                    if d > 1:
                        t = max(max(x) for x in stage_t)
                    else:
                        t = sum(max(a + m, red) for a, m, red in stage_t)
                    out.append(((w, d, b, r, g), w * b / t, max(stage_m)))
    return out


def key(c: TwoBWConfig) -> tuple[int, int, int, bool, int]:
    return (c.width, c.depth, c.microbatch, c.recompute, c.accumulation)


def test_planner_equals_brute_force_on_a_flat_topology() -> None:
    rng = random.Random(2021)
    checked = raised = 0
    for _ in range(60):
        n_layers, n_gpus = rng.randint(2, 6), rng.randint(1, 6)
        batch, bw = rng.choice([4, 6, 8, 12, 16]), rng.uniform(5, 100)
        chains = random_chains(rng, n_layers)
        everything = brute_force(chains, n_gpus, bw, batch)
        mems = sorted(m for _, _, m in everything)
        # Between two memories, so that summation order cannot decide a fit.
        cuts = [mems[0] * 0.99] + [
            (x + y) / 2 for x, y in itertools.pairwise(mems) if y > x * (1 + 1e-9)
        ]
        capacity = rng.choice([*cuts[:: max(1, len(cuts) // 4)], cuts[-1]])
        capped = {b: dataclasses.replace(c, capacity=capacity) for b, c in chains.items()}
        fitting = [(k, s, m) for k, s, m in everything if m <= capacity]
        topo = Topology.flat(n_gpus, bw)
        if not fitting:
            with pytest.raises(DoesNotFit) as e:
                twobw_plan(capped.__getitem__, topo, batch=batch, microbatches=(1, 2, 4))
            assert e.value.memory == pytest.approx(mems[0])
            raised += 1
            continue
        plan = twobw_plan(capped.__getitem__, topo, batch=batch, microbatches=(1, 2, 4))
        got = {key(c): c for c in plan.candidates}
        assert set(got) == {k for k, _, _ in everything}
        for k, speed, mem in everything:
            assert got[k].throughput == pytest.approx(speed, rel=1e-9)
            assert got[k].memory == pytest.approx(mem, rel=1e-9)
            assert got[k].fits == (mem <= capacity)
        best_k, best_speed, _ = max(fitting, key=lambda x: (x[1], -x[2]))
        assert plan.best.throughput == pytest.approx(best_speed, rel=1e-9)
        assert key(plan.best) == best_k
        assert plan.candidates[0] == plan.best
        speeds = [c.throughput for c in plan.candidates if c.fits]
        assert speeds == sorted(speeds, reverse=True)
        assert all(c.fits for c in plan.candidates[: len(speeds)])
        checked += 1
    assert checked > 30 and raised > 0


def test_planner_picks_the_best_on_a_two_level_topology() -> None:
    # The cost functions are hand-checked above; here the search itself on 2 nodes x 3.
    rng = random.Random(7)
    topo = Topology((Level(3, 80.0), Level(2, 8.0)))
    for _ in range(10):
        chains = random_chains(rng, rng.randint(2, 6))
        plan = twobw_plan(chains.__getitem__, topo, batch=12, microbatches=(1, 2, 4))
        n_layers = len(chains[1])
        expected = set()
        for w, d, b, r in itertools.product(range(1, 7), range(1, 7), (1, 2, 4), (False, True)):
            g = 12 // (w * b) if 12 % (w * b) == 0 else 0
            if w * d <= 6 and d <= n_layers and g >= (d - 1 if d > 1 else 1):
                expected.add((w, d, b, r, g))
        assert {key(c) for c in plan.candidates} == expected
        assert all(c.fits for c in plan.candidates)  # unbounded capacity
        best = max(
            plan.candidates,
            key=lambda c: twobw_throughput(
                chains[c.microbatch],
                topo,
                width=c.width,
                depth=c.depth,
                recompute=c.recompute,
                accumulation=c.accumulation,
            )[1],
        )
        assert plan.best.throughput == best.throughput


def test_all_reduces_stay_inside_a_node_when_they_can() -> None:
    # (w=3, d=2) on 2 nodes of 3: each stage's replicas fill one node; (w=2, d=3) puts
    # stage 1's replicas on ranks 2 and 3, across the nodes.
    topo = Topology((Level(3, 100.0), Level(2, 1.0)))
    c = LayerChain(
        tuple(Layer(f"{i}", 0.0, 0.0, 10.0, 0.0, 0.0, 0.0) for i in range(6)),
        1,
        8,
        1,
        2.0,
        1.0,
        INF,
        0.0,
        "all-reduce only",
    )
    t3, _ = twobw_throughput(c, topo, width=3, depth=2, recompute=False, accumulation=1)
    assert t3 == pytest.approx(2 * 2 / 3 * 30 / 100)  # 3 layers of 10 params per stage
    t2, _ = twobw_throughput(c, topo, width=2, depth=3, recompute=False, accumulation=1)
    assert t2 == pytest.approx(2 * 1 / 2 * 20 / 1.0)


# ---- memory decisions ---------------------------------------------------------------------


def test_recomputation_is_chosen_when_only_it_fits() -> None:
    flat = Topology.flat(2, 100.0)
    plan = twobw_plan(round_chain, flat, batch=2, microbatches=(1,))
    assert not plan.best.recompute  # with room to spare it costs time for nothing
    # d=1 needs 1560 either way, (d=2) 1620 without recomputation, 1420 with it.
    plan = twobw_plan(lambda b: round_chain(b, capacity=1500), flat, batch=2, microbatches=(1,))
    assert (plan.best.depth, plan.best.recompute, plan.best.memory) == (2, True, 1420)
    assert [c.fits for c in plan.candidates].count(True) == 1
    assert all(c.memory > 1500 for c in plan.candidates[1:])


def test_nothing_fits_names_the_closest() -> None:
    flat = Topology.flat(2, 100.0)
    with pytest.raises(DoesNotFit, match=r"closest is \(w=1, d=2\), b=1, recompute, g=2") as e:
        twobw_plan(lambda b: round_chain(b, capacity=1000), flat, batch=2, microbatches=(1,))
    assert e.value.memory == 1420 and e.value.capacity == 1000


# ---- bad input ----------------------------------------------------------------------------


def test_bad_input() -> None:
    flat = Topology.flat(4, 100.0)
    with pytest.raises(ValueError, match=r"depth 5 is more than the chain's 4 layers"):
        twobw_plan(round_chain, Topology.flat(8, 1.0), batch=8, depths=(5,))
    with pytest.raises(ValueError, match=r"depth=5 must be between 1 and the chain's 4"):
        twobw_memory(round_chain(), depth=5, recompute=False)
    with pytest.raises(ValueError, match=r"batch=0: the global batch"):
        twobw_plan(round_chain, flat, batch=0)
    with pytest.raises(ValueError, match=r"width·depth = 2·4 = 8 exceeds the topology's 4"):
        twobw_plan(round_chain, flat, batch=8, widths=(1, 2), depths=(4,))
    with pytest.raises(ValueError, match=r"width·depth = 4·2 = 8 exceeds the topology's 4"):
        twobw_throughput(round_chain(), flat, width=4, depth=2, recompute=False, accumulation=1)
    with pytest.raises(ValueError, match=r"widths=\[5\]: .* between 1 and the topology's 4"):
        twobw_plan(round_chain, flat, batch=8, widths=(5,))
    with pytest.raises(ValueError, match=r"no microbatch size in \[3\] divides batch=8"):
        twobw_plan(round_chain, flat, batch=8, microbatches=(3,))
    # b divides B, but a 4-deep pipeline needs g >= 3 microbatches per update.
    with pytest.raises(ValueError, match=r"no \(w, d, b\) for batch=2 .* g = B/\(w·b\) >="):
        twobw_plan(round_chain, flat, batch=2, microbatches=(1, 2), depths=(4,))
    with pytest.raises(ValueError, match=r"accumulation=0"):
        twobw_throughput(round_chain(), flat, width=1, depth=1, recompute=False, accumulation=0)
    with pytest.raises(ValueError, match=r"chain_for\(2\) gave a chain of microbatch 1"):
        twobw_plan(lambda b: round_chain(), flat, batch=8, microbatches=(1, 2))


# ---- the cluster model --------------------------------------------------------------------


def test_gpt3_1b_on_two_nodes() -> None:
    plan = twobw_plan(
        lambda b: cluster_chain("GPT3-1B", microbatch=b), Topology.cluster(16), batch=64
    )
    best = plan.best
    assert best.fits and best.memory <= 16 * 2**30
    assert best.width * best.depth <= 16
    assert best.accumulation * best.width * best.microbatch == 64
    assert best.throughput == max(c.throughput for c in plan.candidates if c.fits)
    assert not all(c.fits for c in plan.candidates)  # memory does decide something
