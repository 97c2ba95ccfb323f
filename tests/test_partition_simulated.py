"""The 2BW closed form against the simulated ``2bw`` schedule, by hand and at scale."""

from __future__ import annotations

import pytest

from tplib.partition import Layer, LayerChain, Topology, TwoBWConfig, cluster_chain, twobw_plan
from tplib.partition.simulated import ChainCosts, twobw_simulated
from tplib.plan import Plan
from tplib.schedule import Action, Kind

INF = float("inf")


def chain(params: float = 0.0, output: float = 0.0) -> LayerChain:
    """Four layers of 1 s forward and 2 s backward per microbatch of one sequence."""
    layers = tuple(Layer(f"l{i}", 1.0, 2.0, params, 0.0, output, 0.0) for i in range(4))
    return LayerChain(layers, 1, 8, 1, 2.0, 1.0, INF, 0.0, "hand")


def config(w: int, d: int, g: int, ranges: tuple[tuple[int, int], ...]) -> TwoBWConfig:
    return TwoBWConfig(w, d, 1, False, g, ranges, 0.0, 0.0, 0.0, True)


def test_balanced_pipeline_with_free_links_runs_at_its_stage_time() -> None:
    """Two stages of 2 layers, nothing to send or reduce: 1F1B without flushes keeps
    both busy, 6 s per microbatch, as the closed form says."""
    flat = Topology.flat(2, 1.0)
    c = config(1, 2, 4, ((0, 2), (2, 4)))
    assert twobw_simulated(chain(), flat, c) == pytest.approx(6.0)


def test_an_allreduce_on_the_stage_is_not_hidden() -> None:
    """Data parallelism over 2 GPUs (d = 1): the closed form takes max(12, AR / g), but
    the stage runs its all-reduce after its last backward: 12 + AR / g per microbatch.
    AR = 2 (2 - 1) / 2 x 4 layers x 100 params x 1 byte / 10 B/s = 40 s, g = 4."""
    flat = Topology.flat(2, 10.0)
    c = config(2, 1, 4, ((0, 4),))
    assert twobw_simulated(chain(params=100.0), flat, c) == pytest.approx(12.0 + 40.0 / 4)


def test_a_slow_boundary_paces_the_pipeline_by_its_round_trip() -> None:
    """A cut whose activation takes 10 s each way. The closed form charges each stage
    its boundary traffic, 2 x 10 s, and predicts 20 s. The schedule keeps 2 microbatches
    in flight on stage 0 (1F1B, d = 2), and each makes a round trip of F 2 + send 10 +
    F 2 + B 4 + send 10 + B 4 = 32 s (messages share nothing on the link): 16 s."""
    flat = Topology.flat(2, 1.0)
    for g in (4, 8):
        c = config(1, 2, g, ((0, 2), (2, 4)))
        assert twobw_simulated(chain(output=10.0), flat, c) == pytest.approx(32.0 / 2)


def test_gpt3_1b_candidates_agree_with_their_schedules() -> None:
    """Where compute dominates (every candidate that fits for GPT3-1B on two nodes),
    the closed form is within 2% of the simulated schedule."""
    top = Topology.cluster(16)
    chains = {b: cluster_chain("GPT3-1B", microbatch=b) for b in (1, 2, 4, 8)}
    plan = twobw_plan(chains.__getitem__, top, batch=64)
    fits = [c for c in plan.candidates if c.fits][:10]
    for c in fits:
        sim = twobw_simulated(chains[c.microbatch], top, c)
        assert sim == pytest.approx(c.seconds_per_microbatch, rel=0.02), str(c)


def test_costs_refuse_other_units() -> None:
    costs = ChainCosts(chain(), ((0, 2), (2, 4)), Topology.flat(2, 1.0))
    plan = Plan((2,), ((8,),))
    with pytest.raises(ValueError, match="whole microbatches of 1 x 8"):
        costs.compute(0, Action(Kind.F, 0, 0, 0), plan)
    with pytest.raises(ValueError, match="b=2"):
        twobw_simulated(chain(), Topology.flat(2, 1.0), TwoBWConfig(
            1, 2, 2, False, 4, ((0, 2), (2, 4)), 0.0, 0.0, 0.0, True
        ))  # fmt: skip
