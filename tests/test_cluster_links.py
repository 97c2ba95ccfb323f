"""The messages of a layout on a DGX: rails, scatter-gather, sequence parallelism, the
data-parallel ring and its overlap with the last backward."""

from __future__ import annotations

import numpy as np
import pytest

from tplib.cluster import CALIBRATIONS, DGX_A100, P3_16XLARGE, ClusterCostModel, Implementation
from tplib.cluster.implementation import PAPER
from tplib.nn.configs import get_config
from tplib.sim.costs import ring_allreduce

CAL = CALIBRATIONS["dgx-a100"]
MB = 64 * 2**20


def _model(
    impl: Implementation = PAPER, *, n_stages: int = 2, n_op: int = 8, n_data: int = 1
) -> ClusterCostModel:
    return ClusterCostModel(
        get_config("GPT3-13B"),
        n_stages=n_stages,
        n_op=n_op,
        n_data=n_data,
        calibration=CAL,
        hardware=DGX_A100,
        implementation=impl,
    )


def test_nvswitch_links_every_pair_with_all_links() -> None:
    assert {DGX_A100.links(a, b) for a in range(8) for b in range(8) if a != b} == {12}
    assert P3_16XLARGE.links(3, 4) == 0  # the cube mesh has pairs without NVLink


def test_a_message_between_nodes_takes_one_rail_or_all_of_the_groups() -> None:
    plain, sg = _model(), _model(Implementation(scatter_gather=True))
    assert plain.crosses_nodes(0, 1)
    rail = CAL.network_efficiency * DGX_A100.network / 8
    latency = CAL.inter_node_latency
    assert plain.p2p(0, 1, MB) == pytest.approx(MB / rail + latency)
    assert sg.p2p(0, 1, MB) == pytest.approx(MB / 8 / rail + latency)
    # The receivers then all-gather the parts; with sequence parallelism nobody does.
    gather = 7 / 8 * MB / (CAL.nvlink_efficiency * 12 * 25e9) + CAL.collective_latency
    assert sg._op_broadcast(np.array(MB)) == pytest.approx(gather)
    sp = _model(Implementation(sequence_parallel=True))
    assert sp.p2p(0, 1, MB) == sg.p2p(0, 1, MB)
    assert sp._op_broadcast(np.array(MB)) == 0


def test_the_data_parallel_ring_uses_the_rails_of_the_groups_gpus_in_a_node() -> None:
    one_per_node = _model(n_stages=1, n_data=4)  # #Op 8: a replica fills a node
    eight_per_node = _model(n_stages=1, n_op=1, n_data=16)  # 8 replicas per node, 2 nodes
    rail = CAL.allreduce_efficiency * DGX_A100.network / 8
    grads = 2 * one_per_node.stage_params(0)
    expected = ring_allreduce(grads, 4, rail, CAL.inter_node_latency)
    copies = 12 * one_per_node.stage_params(0) / (CAL.hbm_efficiency * DGX_A100.hbm_bandwidth)
    assert one_per_node.allreduce(0) == pytest.approx(float(expected) + copies)
    nvlink = CAL.nvlink_efficiency * 12 * 25e9
    grads = 2 * eight_per_node.stage_params(0)
    wire = ring_allreduce(grads, 16, min(8 * rail, nvlink), CAL.inter_node_latency)
    copies = 12 * eight_per_node.stage_params(0) / (CAL.hbm_efficiency * DGX_A100.hbm_bandwidth)
    assert eight_per_node.allreduce(0) == pytest.approx(float(wire) + copies)


def test_overlap_hides_the_reduction_behind_the_last_backward() -> None:
    impl = Implementation(overlap_grad_reduce=True)
    exposed = _model(n_stages=1, n_data=4)
    hidden = ClusterCostModel(
        get_config("GPT3-13B"), n_stages=1, n_op=8, n_data=4, calibration=CAL,
        hardware=DGX_A100, implementation=impl, overlap_unit=(1, 2048),
    )  # fmt: skip
    window = hidden.overlap_window(0)
    assert window > 0
    assert hidden.allreduce(0) == pytest.approx(max(exposed.allreduce(0) - window, 0.0))


def test_the_models_ends_add_the_embedding_to_the_end_stages() -> None:
    ends = _model(Implementation(ends=True), n_stages=4, n_op=1)
    layers = _model(n_stages=4, n_op=1)
    cfg = get_config("GPT3-13B")
    words = cfg.vocab_size * cfg.hidden
    assert ends.stage_params(0) - layers.stage_params(0) == words + cfg.seq_len * cfg.hidden
    assert ends.stage_params(3) - layers.stage_params(3) == words  # the head's copy
    assert ends.stage_params(1) == layers.stage_params(1)
