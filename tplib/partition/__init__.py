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
  recomputation under the memory capacity).
"""

from tplib.partition.chain import DoesNotFit, Layer, LayerChain, cluster_chain, profile_chain
from tplib.partition.topology import Level, Topology

__all__ = [
    "DoesNotFit",
    "Layer",
    "LayerChain",
    "Level",
    "Topology",
    "cluster_chain",
    "profile_chain",
]
