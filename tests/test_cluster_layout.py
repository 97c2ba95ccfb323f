"""Tests for tplib.cluster.layout: the layout rules (each error names the value and the
rule) and the paper's rank order."""

from __future__ import annotations

import pytest

from tplib.cluster import ClusterCostModel, check_layout
from tplib.nn.configs import get_config
from tplib.paper import SETTINGS

GPT13 = get_config("GPT3-13B")  # 40 layers, 40 heads


def test_paper_layouts_pass() -> None:
    for s in SETTINGS.values():
        check_layout(s.config, n_stages=s.n_stages, n_op=s.n_op, n_data=s.n_data)


@pytest.mark.parametrize(
    ("n_stages", "n_op", "n_data", "message"),
    [
        (7, 1, 1, r"n_stages=7 does not divide GPT3-13B's 40 layers"),
        (0, 1, 1, r"n_stages=0 does not divide"),
        (40, 3, 1, r"n_op=3 must divide the 8 GPUs of a node .* GPT3-13B's 40 heads"),
        (40, 16, 1, r"n_op=16 must divide the 8 GPUs"),
        (40, 0, 1, r"n_op=0 must divide"),
        (40, 1, 0, r"n_data=0: need at least one data-parallel replica"),
    ],
)
def test_each_rule_names_the_value(n_stages: int, n_op: int, n_data: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_layout(GPT13, n_stages=n_stages, n_op=n_op, n_data=n_data)


def test_heads_limit_the_operation_partitioning() -> None:
    cfg = GPT13.with_(hidden=768, n_head=6)  # 6 heads split over 2 GPUs, not over 4
    check_layout(cfg, n_stages=40, n_op=2, n_data=1)
    with pytest.raises(ValueError, match=r"n_op=4 must divide .* 6 heads"):
        check_layout(cfg, n_stages=40, n_op=4, n_data=1)


def test_placement_follows_the_papers_rank_order() -> None:
    op8 = ClusterCostModel.for_setting(SETTINGS[5])  # a stage fills a node
    assert all(op8.crosses_nodes(k, k + 1) and op8.crosses_nodes(k + 1, k) for k in range(39))
    op1 = ClusterCostModel.for_setting(SETTINGS[6])  # 8 stages per node
    crossing = [k for k in range(95) if op1.crosses_nodes(k, k + 1)]
    assert crossing == list(range(7, 95, 8))
    op4 = ClusterCostModel.for_setting(SETTINGS[9])  # 2 stages per node
    assert [op4.crosses_nodes(k, k + 1) for k in range(4)] == [False, True, False, True]
    assert op1.node_of(8) == 1 and op1.node_of(0, replica=1) == 12  # 96 stages = 12 nodes
