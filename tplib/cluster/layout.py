"""Cluster layouts: the rules a Table-1 layout must follow, and where its GPUs sit.

A layout is #Pipe stages K of N/K layers each, each stage operation-partitioned
(Megatron) over #Op GPUs, and #Data data-parallel replicas of the whole pipeline.
:func:`check_layout` is the one place its rules are written; the cluster model and the
plan explorer both call it.

Placement follows the paper's rank order (op innermost, then stage, then replica): node
n holds ranks 8n..8n+7, so it holds 8/#Op consecutive stages of one replica. Stage k
sends one copy of its output from its last GPU to the first GPU of stage k+1 (their
NVLinks in a node, or PCIe through host memory where the hybrid cube-mesh has no link,
e.g. GPUs 3 -> 4; the node's 25 Gbps across nodes), which broadcasts it to its #Op group.
With virtual stages the activations also wrap from stage K-1 back to stage 0, which
leaves the node whenever the replica spans more than one.
Replicas of a stage sit on different nodes, so the data-parallel all-reduce crosses the
network.

Context parallelism (#CP, :mod:`tplib.cluster.context_parallel`) gives each stage #Op x
#CP GPUs, in Megatron-LM's rank order: op innermost, then the CP rank, then stage, then
replica. The #Op x #CP GPUs of a stage fill a share of one node or whole nodes, so
the ring of a CP group stays on NVLink exactly when #Op x #CP fits in a node.
"""

from __future__ import annotations

from tplib.cluster.hardware import P3_16XLARGE, Hardware
from tplib.nn.configs import GPTConfig

__all__ = ["check_layout", "gpu_rank", "send_ranks"]


def check_layout(
    cfg: GPTConfig,
    *,
    n_stages: int,
    n_op: int,
    n_data: int,
    hardware: Hardware = P3_16XLARGE,
    n_cp: int = 1,
) -> None:
    """Raise ``ValueError`` naming the value and the rule unless ``cfg`` runs on
    ``n_stages`` equal stages, each partitioned over ``n_op`` GPUs of one node and
    ``n_cp`` context-parallel ranks, in ``n_data`` replicas."""
    if n_stages < 1 or cfg.n_layer % n_stages:
        raise ValueError(
            f"n_stages={n_stages} does not divide {cfg.name}'s {cfg.n_layer} layers: the "
            "paper gives every stage the same number of layers"
        )
    g = hardware.gpus_per_node
    if n_op < 1 or g % n_op or cfg.n_head % n_op:
        raise ValueError(
            f"n_op={n_op} must divide the {g} GPUs of a node (the paper partitions "
            f"operations only inside a node) and {cfg.name}'s {cfg.n_head} heads"
        )
    if n_data < 1:
        raise ValueError(f"n_data={n_data}: need at least one data-parallel replica")
    group = n_op * n_cp
    if n_cp < 1 or (group % g and g % group):
        raise ValueError(
            f"n_cp={n_cp}: #Op x #CP = {group} GPUs must fill a share of a node or whole "
            f"nodes of {g} GPUs (a stage's GPUs sit together in Megatron's rank order)"
        )


def gpu_rank(
    stage: int,
    op_rank: int = 0,
    replica: int = 0,
    *,
    n_stages: int,
    n_op: int,
    cp_rank: int = 0,
    n_cp: int = 1,
) -> int:
    """Global rank of a GPU under the paper's rank order (op, then stage, then replica),
    with context parallelism Megatron-LM's (op, then CP rank, then stage, then replica)."""
    return ((replica * n_stages + stage) * n_cp + cp_rank) * n_op + op_rank


def send_ranks(src: int, dst: int, n_op: int, forward: bool | None = None) -> tuple[int, int]:
    """Ranks (in replica 0) of the GPUs that carry a send from stage ``src`` to stage
    ``dst`` when each stage has ``n_op`` GPUs (with #CP: pass #Op x #CP, whose every GPU
    sends its share to its peer, as far from it as these two are): the last GPU of the
    sender to the first of the receiver for an activation
    (``forward``), the first GPU of the sender to the last of the receiver for a
    gradient. ``forward`` defaults to ``dst > src``, the direction between adjacent
    stages; with virtual stages the activation that wraps from the last stage back to
    the first goes forward to a lower stage."""
    last = n_op - 1
    if dst > src if forward is None else forward:
        return src * n_op + last, dst * n_op
    return src * n_op, dst * n_op + last
