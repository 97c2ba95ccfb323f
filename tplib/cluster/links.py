"""How a layout's GPUs talk: the network half of the cluster model.

:class:`LayoutLinks` prices every message a layout sends, for
:class:`~tplib.cluster.cost.ClusterCostModel` (which adds the compute): a pipeline send
between two stages, over NVLink inside a node or over the network between nodes; the
#Op group's broadcast (or all-gather) of what a stage received; the data-parallel
reduction of the gradients at the end of the iteration.

The node designs of :mod:`tplib.cluster.hardware` differ here:

- p3.16xlarge (the paper's): NVLink pairs of a hybrid cube mesh, PCIe through host
  memory for pairs without one; one 25 Gb/s port per node, which the node's 8 GPUs
  SHARE in the data-parallel all-reduce (their stages finish the backward within a few
  slices of each other), and no GPUDirect RDMA, so a message between nodes is staged
  through host memory at both ends (see :meth:`LayoutLinks.staging`);
- DGX: NVSwitch, one InfiniBand adapter per GPU (a rail) with GPUDirect RDMA. A
  message between nodes takes its sender's own rail; with scatter-gather or sequence
  parallelism (:class:`~tplib.cluster.implementation.Implementation`) each GPU of the
  #Op group sends its 1 / #Op share on its own rail. The data-parallel ring of a stage
  crosses each node boundary on the rails of the group's GPUs in that node: g of them
  give g rails' bandwidth, up to the GPU's NVLink.

GPUs are numbered in the paper's rank order (:func:`~tplib.cluster.layout.gpu_rank`:
#Op, then stage, then replica), so an #Op group shares a node.

Context parallelism (#CP; :mod:`tplib.cluster.context_parallel`): a stage's GPUs are #Op x
#CP (op, then CP rank). Each CP rank sends its 1 / #CP of a message between stages to its
peer at once, on its own rail or NVLink (:attr:`LayoutLinks._split`), and broadcasts in
its #Op group only its share; the gradients are reduced over #Data x #CP GPUs, as
Megatron folds the CP group into the data-parallel one; :meth:`LayoutLinks.cp_ring` is
the link the ring attention's exchanges run on.
"""

from __future__ import annotations

import math

import numpy as np

from tplib.cluster.calibration import Calibration
from tplib.cluster.compute import hbm_rate, nvlink_bus
from tplib.cluster.hardware import FP16, Hardware
from tplib.cluster.implementation import Implementation
from tplib.cluster.layout import gpu_rank, send_ranks
from tplib.cluster.memory import end_params
from tplib.nn.configs import GPTConfig, n_params_per_layer
from tplib.sim.costs import Link, Parts, ring_allreduce

__all__ = ["ALLREDUCE_COPY_BYTES", "LayoutLinks"]

Bytes = np.ndarray | float

# Data-parallel all-reduce bookkeeping per parameter (Megatron's bucketed all-reduce):
# flatten the fp16 grads, scale, unflatten: three reads and three writes.
ALLREDUCE_COPY_BYTES = 3 * 2 * FP16


class LayoutLinks:
    """The messages of one layout (see the module docstring). Subclasses set the
    layout's fields in their constructor."""

    cfg: GPTConfig
    n_stages: int
    n_op: int
    n_data: int
    n_cp: int
    layers_per_stage: int
    cal: Calibration
    hw: Hardware
    impl: Implementation
    parts: Parts

    # ---- rates -----------------------------------------------------------------------

    @property
    def _hbm(self) -> float:
        return hbm_rate(self.cal, self.hw)

    @property
    def _nvlink_bus(self) -> float:
        return nvlink_bus(self.cal, self.hw)

    def _intra_p2p(self, a: int, b: int) -> float:
        """Bytes/s from local GPU ``a`` to ``b``: their NVLinks, or PCIe through host
        memory (two copies) when the pair has none."""
        links = self.hw.links(a, b)
        if links:
            return self.cal.nvlink_efficiency * links * self.hw.nvlink_link
        return self._pcie / 2

    @property
    def _pcie(self) -> float:
        """Bytes/s of a copy between a GPU and host memory."""
        return self.cal.pcie_efficiency * self.hw.pcie

    def staging(self, nbytes: np.ndarray, *, receiving: bool) -> np.ndarray:
        """Seconds one end of a cross-node message is busy copying it between GPU and
        host memory. Without GPUDirect RDMA, NCCL's network transport stages every
        message through a host buffer of ``nccl_buffer`` bytes in ``nccl_steps`` slots.
        The sender's copy runs ahead of the wire one slot at a time, so only the first
        slot adds to the transfer; the receiver's data wait in the buffer until its
        kernel runs, which then copies up to a whole buffer."""
        if not self.cal.host_staging:
            return np.zeros_like(nbytes)
        ahead = self.cal.nccl_buffer if receiving else self.cal.nccl_buffer / self.cal.nccl_steps
        return np.minimum(nbytes, ahead) / self._pcie

    @property
    def rails(self) -> bool:
        """Whether each GPU of a node has its own network adapter (a DGX's rails)."""
        return self.hw.nics_per_node == self.hw.gpus_per_node

    @property
    def _split(self) -> int:
        """Into how many parts a message between stages is split, each sent by one GPU
        of the stage: #Op with scatter-gather or sequence parallelism, else 1, times #CP
        (each CP rank sends its own tokens)."""
        impl = self.impl
        return (self.n_op if impl.scatter_gather or impl.sequence_parallel else 1) * self.n_cp

    @property
    def params_per_layer(self) -> float:
        """Parameters of one layer on one GPU of the #Op group."""
        return n_params_per_layer(self.cfg) / self.n_op

    # ---- pipeline messages -------------------------------------------------------------

    def _op_broadcast(self, nbytes: np.ndarray) -> np.ndarray:
        """Seconds the #Op group spends making what one stage received whole on every
        GPU: a broadcast of it, an all-gather of the scattered parts, or nothing under
        sequence parallelism (each GPU goes on with its own shard). With #CP each #Op
        group makes whole only its CP rank's 1 / #CP of the message."""
        nbytes = nbytes / self.n_cp
        if self.n_op == 1 or self.impl.sequence_parallel:
            return np.zeros_like(nbytes)
        if self.impl.scatter_gather:
            gather = (self.n_op - 1) / self.n_op * nbytes / self._nvlink_bus
            return gather + self.cal.collective_latency
        return nbytes / self._nvlink_bus + self.cal.collective_latency

    def node_of(self, stage: int, op_rank: int = 0, replica: int = 0, cp_rank: int = 0) -> int:
        """Node of a GPU under the paper's rank order (op, then stage, then replica;
        with #CP, Megatron's: op, then CP rank, then stage, then replica)."""
        rank = gpu_rank(
            stage,
            op_rank,
            replica,
            n_stages=self.n_stages,
            n_op=self.n_op,
            cp_rank=cp_rank,
            n_cp=self.n_cp,
        )
        return rank // self.hw.gpus_per_node

    def crosses_nodes(self, src: int, dst: int, forward: bool | None = None) -> bool:
        """Whether a send from stage ``src`` to stage ``dst`` leaves the node (``forward``:
        an activation; default ``dst > src``, see :func:`~tplib.cluster.layout.send_ranks`)."""
        a, b = send_ranks(src, dst, self.n_op * self.n_cp, forward)
        return a // self.hw.gpus_per_node != b // self.hw.gpus_per_node

    def p2p(self, src: int, dst: int, nbytes: Bytes, forward: bool | None = None) -> np.ndarray:
        """Seconds to move ``nbytes`` from stage ``src`` to stage ``dst`` (``forward``
        as in :meth:`crosses_nodes`)."""
        nbytes = np.asarray(nbytes, dtype=float)
        if self.crosses_nodes(src, dst, forward):
            # One adapter's bandwidth (a p3.16xlarge has one; each DGX GPU its own, and
            # a split message goes out on as many rails at once).
            net = self.cal.network_efficiency * self.hw.network / self.hw.nics_per_node
            wire = nbytes / self._split if self.rails else nbytes
            return wire / net + self.cal.inter_node_latency + self.staging(nbytes, receiving=False)
        a, b = send_ranks(src, dst, self.n_op * self.n_cp, forward)
        g = self.hw.gpus_per_node
        return nbytes / self._split / self._intra_p2p(a % g, b % g) + self.cal.intra_node_latency

    def receive(self, src: int, dst: int, nbytes: Bytes, forward: bool | None = None) -> np.ndarray:
        """Seconds the receiving stage itself is busy with a receive: the whole transfer
        (rendezvous), only the call's latency (eager: the data waits in NCCL's buffer),
        or nothing (async)."""
        nbytes = np.asarray(nbytes, dtype=float)
        if self.cal.comm == "rendezvous":
            return self.p2p(src, dst, nbytes, forward)
        if self.cal.comm == "async":
            return np.zeros_like(nbytes)
        if self.crosses_nodes(src, dst, forward):
            return self.cal.inter_node_latency + self.staging(nbytes, receiving=True)
        return np.full_like(nbytes, self.cal.intra_node_latency)

    def stage_comm(self, stage: int, nbytes: np.ndarray | float) -> np.ndarray:
        """Seconds of pipeline communication stage ``stage`` adds per unit: for each of
        its chunks, its send to the stage of each neighbouring part (on the critical
        path even when asynchronous), its share of each receive, and the #Op broadcast
        of what it received; nothing between two chunks of the stage."""
        nbytes = np.asarray(nbytes, dtype=float)
        total = np.zeros_like(nbytes)
        for chunk in range(self.parts.n_chunks):
            for step in (-1, 1):
                nbr = self.parts.neighbour(stage, chunk, step)
                if nbr is None or nbr == stage:
                    continue
                forward = step > 0
                total = (
                    total
                    + self.p2p(stage, nbr, nbytes, forward)
                    + self.receive(nbr, stage, nbytes, not forward)
                )
                total = total + self._op_broadcast(nbytes)
        return total

    # ---- the context-parallel ring -------------------------------------------------------

    def cp_ring(self) -> Link:
        """The link of the context-parallel ring's exchanges: its slowest hop. Inside a
        node the pair's NVLinks (all of them through NVSwitch); between nodes one rail per
        GPU, or on a p3.16xlarge the node's port shared by the #Op rings, staged through
        host memory. Every GPU sends at once, so the slowest hop paces each step. With
        one CP rank there is no ring: an infinitely fast link."""
        g, n_op, n_cp = self.hw.gpus_per_node, self.n_op, self.n_cp
        if n_cp == 1:
            return Link(math.inf, 0.0)
        ranks = [c * n_op for c in range(n_cp)]  # op rank 0 of each CP rank, stage 0
        hops = list(zip(ranks, ranks[1:] + ranks[:1], strict=True))
        if any(a // g != b // g for a, b in hops):
            net = self.cal.network_efficiency * self.hw.network / self.hw.nics_per_node
            first_slot = self.staging(np.array(math.inf), receiving=False)
            latency = self.cal.inter_node_latency + float(first_slot)
            return Link(net if self.rails else net / n_op, latency)
        bandwidth = min(self._intra_p2p(a % g, b % g) for a, b in hops)
        return Link(bandwidth, self.cal.intra_node_latency)

    # ---- the data-parallel reduction ----------------------------------------------------

    def stage_params(self, stage: int = 0) -> float:
        """Parameters one GPU of ``stage`` holds: N/K layers, in all its chunks, and with
        the model's ends the word embedding on the first and the last stage (the head
        shares it, so the last stage holds a copy) and the positions on the first."""
        params = self.layers_per_stage * self.params_per_layer
        if self.impl.ends:
            params += end_params(self.cfg, self.n_op, stage, self.parts.placement)
        return params

    def overlap_window(self, stage: int) -> float:
        """Seconds of the last backward the data-parallel reduction of ``stage`` hides
        behind (see :class:`~tplib.cluster.implementation.Implementation`); none here:
        the cost model, which prices compute, says."""
        return 0.0

    def allreduce(self, stage: int) -> float:
        """Data-parallel ring all-reduce of the stage's fp16 gradients over #Data
        replicas times #CP ranks (with the distributed optimizer: a reduce-scatter of
        the gradients and an all-gather of the weights, the same volume): over NVLink
        when they all share a node, else over the network, whose link the 8 GPUs of a
        p3.16xlarge share and whose rails a DGX's GPUs each have."""
        n = self.n_data * self.n_cp
        if n == 1:
            return 0.0
        params = self.stage_params(stage)
        grads = FP16 * params
        # One node only if every replica of the stage sits in it; a ring that leaves the
        # node is held to the network, whose link the node's GPUs share.
        nodes = len(
            {
                self.node_of(stage, replica=r, cp_rank=c)
                for r in range(self.n_data)
                for c in range(self.n_cp)
            }
        )
        if nodes == 1:
            wire = ring_allreduce(grads, n, self._nvlink_bus, self.cal.collective_latency)
        elif self.rails:
            # NCCL's rings cross each node boundary on the rails of the group's GPUs in
            # that node (n / nodes of them), never faster than the GPU's NVLink.
            rail = self.cal.allreduce_efficiency * self.hw.network / self.hw.nics_per_node
            bandwidth = min(rail * n / nodes, self._nvlink_bus)
            wire = ring_allreduce(grads, n, bandwidth, self.cal.inter_node_latency)
            wire += self.cal.allreduce_latency
        else:
            share = self.cal.allreduce_efficiency * self.hw.network / self.hw.gpus_per_node
            if self.cal.allreduce_ring:
                wire = ring_allreduce(grads, n, share, self.cal.inter_node_latency)
            else:
                wire = grads / share
            wire += self.cal.allreduce_latency
        total = float(wire) + ALLREDUCE_COPY_BYTES * params / self._hbm
        if self.impl.overlap_grad_reduce:
            return max(total - self.overlap_window(stage), 0.0)
        return total
