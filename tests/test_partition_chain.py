"""The layer chain the partitioning planners read, and the topologies they run on."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tplib.cluster import ClusterCostModel
from tplib.cluster.memory import STATE_BYTES, memory_per_gpu
from tplib.cluster.runtime_memory import stage_memory
from tplib.nn.configs import get_config, stage_params
from tplib.partition import Layer, LayerChain, Topology, cluster_chain, profile_chain
from tplib.perfmodel import Profile, build_profile
from tplib.plan import Plan
from tplib.schedule import Action, Kind


def test_cluster_chain_blocks_cost_what_the_simulator_charges() -> None:
    """A middle block is the cluster model's stage time over its layers; the ends add
    the embeddings and the head, so they are the heaviest layers."""
    chain = cluster_chain("GPT3-13B", microbatch=2)
    cost = ClusterCostModel("GPT3-13B", n_stages=40)
    fwd, bwd = cost.stage_times(2, np.array([2048]), np.array([0]))
    middle = chain.layers[5]
    assert middle.forward == pytest.approx(float(fwd[0]))
    assert middle.backward == pytest.approx(float(bwd[0]))
    assert chain.layers[0].compute > middle.compute and chain.layers[-1].compute > middle.compute
    assert chain.layers[-1].compute > chain.layers[0].compute  # the head's V x H product
    assert chain.compute(0, 40) == pytest.approx(sum(x.compute for x in chain.layers))
    assert chain.compute(3, 5, recompute=True) == pytest.approx(
        2 * middle.forward * 2 + 2 * middle.backward
    )


def test_cluster_chain_memory_is_the_cluster_models() -> None:
    """One microbatch on a stage of middle blocks keeps what memory_per_gpu counts for a
    GPipe plan of one sequence (plus the output waiting for its gradient), and the
    states are 16 bytes per parameter; stage 0 holds the embeddings as parameters. (The
    chain counts a block's replicated LayerNorms and row biases on every #Op rank, which
    memory_per_gpu splits: a few kB apart.)"""
    cfg = get_config("GPT3-1B")
    chain = cluster_chain(cfg, microbatch=1, n_op=2)
    estimate = memory_per_gpu(cfg, n_stages=12, n_op=2, plan=Plan.gpipe(1, 2048))
    got = chain.stage_memory(2, 4, in_flight=1)
    output = 2 * 2048 * cfg.hidden
    assert got == pytest.approx(estimate.total + output, rel=1e-4)
    assert chain.layers[0].params == stage_params(cfg, 0, 1, n_op=2)
    assert chain.layers[0].states == STATE_BYTES * stage_params(cfg, 0, 1, n_op=2)
    # Each version beyond the first is one more fp16 copy of the stage's weights;
    # recomputation keeps the stage's input per microbatch and rebuilds one at a time.
    two = chain.stage_memory(2, 4, in_flight=1, versions=2)
    assert two - got == pytest.approx(2 * chain.total("params", 2, 4))
    many = chain.stage_memory(2, 4, in_flight=3, recompute=True)
    one = chain.stage_memory(2, 4, in_flight=1, recompute=True)
    assert many - one == pytest.approx(2 * (output + output))
    with pytest.raises(ValueError, match="in_flight=0"):
        chain.stage_memory(0, 1, in_flight=0)
    with pytest.raises(ValueError, match=r"layer range \[3, 2\)"):
        chain.compute(3, 2)


def test_profile_chain_recovers_the_blocks_and_the_ends() -> None:
    """Stage profiles of [0, 1), [1, 3), [3, 4) timed as block + embeddings, 2 blocks,
    block + head: the chain splits them back exactly."""
    cfg = get_config("tiny")
    n = cfg.n_layer
    block, emb, head = 1e-3, 4e-4, 7e-4

    def stage(lo: int, hi: int) -> Profile:
        extra = (emb if lo == 0 else 0.0) + (head if hi == n else 0.0)
        return build_profile(
            lambda b, length, c: b * length / 64 * ((hi - lo) * block + extra),
            config=cfg, layers_per_stage=hi - lo, seq_len=64, stage=(lo, hi), fwd_fraction=0.25,
        )  # fmt: skip

    cuts = [0, 1, n - 1, n]
    profiles = [stage(lo, hi) for lo, hi in itertools.pairwise(cuts)]
    chain = profile_chain(profiles[::-1], microbatch=1, seq_len=64)
    assert len(chain) == n
    assert [x.compute for x in chain.layers] == pytest.approx(
        [block + emb] + [block] * (n - 2) + [block + head]
    )
    assert chain.layers[1].forward == pytest.approx(0.25 * block)
    plan, one = Plan.gpipe(1, 64), (Action(Kind.F, 0, 0, 0),)
    for i in (0, 1, n - 1):
        mem = stage_memory(cfg, i, i + 1, plan=plan, actions=one)
        assert chain.layers[i].states == mem.states
    with pytest.raises(ValueError, match="no middle stage"):
        profile_chain([stage(0, 1), stage(1, n)], microbatch=1)
    with pytest.raises(ValueError, match="do not cover"):
        profile_chain([stage(0, 1), stage(1, 2)], microbatch=1)


def test_topology_of_a_cluster() -> None:
    t = Topology.cluster(384)
    assert [lv.count for lv in t.levels] == [8, 48] and t.n_gpus == 384
    assert t.levels[0].bandwidth > 10 * t.levels[1].bandwidth  # NVLink vs 25 Gbps
    assert t.gpus_below(1) == 8 and t.gpus_below(0) == 1
    assert [lv.count for lv in Topology.cluster(4).levels] == [4]
    assert Topology.flat(3, 1e9).n_gpus == 3
    with pytest.raises(ValueError, match="n_gpus=12 does not fill whole nodes"):
        Topology.cluster(12)
    with pytest.raises(ValueError, match="n_gpus=0"):
        Topology.cluster(0)


def test_a_chain_needs_layers() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        LayerChain((), 1, 8, 1, 2, 2, 1.0, 0.0, "none")
    assert Layer("x", 1.0, 2.0, 0, 0, 0, 0).compute == 3.0
