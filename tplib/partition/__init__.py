"""Partitioning a model into pipeline stages: the planners of GPipe, PipeDream and
PipeDream-2BW, on any of tplib's cost models. One mechanism per module:

- :mod:`~tplib.partition.chain`: the model as a chain of layers (time, activation,
  parameter and memory sizes per layer, with the embeddings and the head), from the
  cluster model or from measured profiles;
- :mod:`~tplib.partition.topology`: hierarchical topologies (GPUs in a node, nodes);
- :mod:`~tplib.partition.balance`: GPipe's partitioning by cost;
- :mod:`~tplib.partition.pipedream`: PipeDream's optimizer (stages, replication,
  hierarchical dynamic program);
- :mod:`~tplib.partition.twobw`: PipeDream-2BW's planner (width, depth, microbatch,
  recomputation under the memory capacity);
- :mod:`~tplib.partition.simulated`: a chain's actions priced for the simulator, so a
  planner's closed form can be checked against the schedule it assumes.
"""

from tplib.partition.balance import balance, cell_costs
from tplib.partition.chain import DoesNotFit, Layer, LayerChain, cluster_chain, profile_chain
from tplib.partition.pipedream import PipeDreamPlan, PipeDreamStage, pipedream_partition
from tplib.partition.topology import Level, Topology
from tplib.partition.twobw import (
    TwoBWConfig,
    TwoBWPlan,
    twobw_memory,
    twobw_plan,
    twobw_throughput,
)

__all__ = [
    "DoesNotFit",
    "Layer",
    "LayerChain",
    "Level",
    "PipeDreamPlan",
    "PipeDreamStage",
    "Topology",
    "TwoBWConfig",
    "TwoBWPlan",
    "balance",
    "cell_costs",
    "cluster_chain",
    "pipedream_partition",
    "profile_chain",
    "twobw_memory",
    "twobw_plan",
    "twobw_throughput",
]
