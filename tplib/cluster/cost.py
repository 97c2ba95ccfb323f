"""Analytic cost model of the paper's cluster: one layout on AWS p3.16xlarge nodes.

One :class:`ClusterCostModel` prices a Table-1 layout (#Pipe stages K of N/K layers,
each stage operation-partitioned over #Op GPUs, #Data replicas; see
:mod:`tplib.cluster.layout`) for both consumers: the DP planner (``slice_time``, a
:class:`~tplib.sim.costs.SliceCostModel`) and the simulator (``compute``/``transfer``/
``allreduce``/``optimizer``, an :class:`~tplib.sim.costs.ActionCosts`). It models the
paper's implementation (appendix B: PyTorch + NCCL + Megatron-LM, fp16 layers, fp32
master weights, Adam): only the N transformer layers are pipelined, which is also what
the paper's TFLOPS column counts.

What one layer costs on one GPU is :mod:`tplib.cluster.compute`. On top of it, a stage
of N/K layers never computes faster than the host issues its kernels (paper Fig. 3: a
GPT3-1B layer's forward takes as long for 1 token as for 256): a layer's forward takes
at least the GPU time of a 256-token GPT3-1B layer forward, its backward twice that.

Virtual stages (:meth:`ClusterCostModel.placed`): v chunks per stage of N / (vK) layers
each. A chunk computes its own layers, broadcasts in its #Op group only what came from
another stage, and sends to the stage of the neighbouring part, across the wrap from
stage K-1 to stage 0 too (off the node unless the replica fits in one). ``slice_time``
holds all of a stage's chunks, each with its messages; the update, all N / K layers.

Sends run on the compute stream, so a stage is busy while it sends (``comm``, see
:class:`~tplib.cluster.calibration.Calibration`); a message between nodes also passes
through host memory at both ends (``staging``: the nodes have no GPUDirect RDMA). The
data-parallel all-reduce crosses the network, and all 8 GPUs of a node all-reduce at
about the same time (their stages finish the backward within a few slices of each
other): they SHARE the node's 25 Gbps.
"""

from __future__ import annotations

import copy
from functools import cached_property

import numpy as np

from tplib.cluster.calibration import CALIBRATION, Calibration
from tplib.cluster.compute import hbm_rate, layer_times, layer_wgrad_time, nvlink_bus
from tplib.cluster.hardware import FP16, P3_16XLARGE, Hardware
from tplib.cluster.layout import check_layout, gpu_rank, send_ranks
from tplib.cluster.memory import MemoryEstimate, memory_per_gpu
from tplib.nn.configs import GPTConfig, check_recompute, get_config, n_params_per_layer
from tplib.paper import Setting
from tplib.plan import Plan
from tplib.schedule import SENDS, Action, Kind, covered_slices
from tplib.schedule.chunks import Placement
from tplib.sim.costs import Parts, memo, ring_allreduce, unit_shape

__all__ = ["ClusterCostModel"]

Bytes = np.ndarray | float

# Optimizer step per parameter: fp16 grad -> fp32 master grad with loss unscaling
# (r 2 + w 4, then r/w 4 + 4), fused Adam (r param, grad, m, v; w param, m, v: 28),
# fp32 master -> fp16 weights (r 4 + w 2).
OPTIMIZER_BYTES = 14.0 + 28.0 + 6.0
# Data-parallel all-reduce bookkeeping per parameter (Megatron's bucketed all-reduce):
# flatten the fp16 grads, scale, unflatten: three reads and three writes.
ALLREDUCE_COPY_BYTES = 3 * 2 * FP16


class ClusterCostModel:
    """Costs of one pipeline layout on p3.16xlarge nodes (see the module docstring).

    ``model``: a config or its name; ``n_stages`` (K), ``n_op`` (#Op) and ``n_data``
    (#Data) as in Table 1; ``seq_len`` (L) bounds context + slice length; ``recompute``
    ("none" or "full") as the runtime's; ``placement`` the stage of each model part with
    virtual stages (:meth:`placed`; None: one part per stage).
    """

    max_batch_slice_size: int | None = None  # analytic: it prices any batch slice
    blocking_sends: bool

    def __init__(
        self,
        model: GPTConfig | str,
        *,
        n_stages: int,
        n_op: int = 1,
        n_data: int = 1,
        seq_len: int | None = None,
        calibration: Calibration = CALIBRATION,
        hardware: Hardware = P3_16XLARGE,
        recompute: str = "none",
        placement: Placement | None = None,
    ) -> None:
        check_recompute(recompute)
        self.recompute = recompute
        self.cfg = get_config(model) if isinstance(model, str) else model
        self.seq_len = seq_len or self.cfg.seq_len
        check_layout(self.cfg, n_stages=n_stages, n_op=n_op, n_data=n_data, hardware=hardware)
        self.n_stages, self.n_op, self.n_data = n_stages, n_op, n_data
        self.layers_per_stage = self.cfg.n_layer // n_stages
        self.cal, self.hw = calibration, hardware
        self.blocking_sends = calibration.comm != "async"
        self._place(Parts.of_stages(n_stages) if placement is None else Parts(placement))

    def _place(self, parts: Parts) -> None:
        v = parts.n_chunks
        if parts.n_stages != self.n_stages or self.layers_per_stage % v:
            raise ValueError(
                f"placement {parts.placement} on {self.n_stages} stages of "
                f"{self.layers_per_stage} layers: it must place {v} chunks on each stage, "
                f"and {v} must divide the stage's layers (every part has as many layers)"
            )
        self.parts, self.layers_per_chunk = parts, self.layers_per_stage // v

    def placed(self, placement: Placement) -> ClusterCostModel:
        """The same layout running a schedule of ``placement`` (virtual stages: see the
        module docstring); ``self`` if it already prices that placement."""
        if tuple(placement) == self.parts.placement:
            return self
        # The copy shares the memo caches: their keys hold all that a placement changes.
        other = copy.copy(self)
        other._place(Parts(tuple(placement)))
        return other

    @classmethod
    def for_setting(
        cls, s: Setting, calibration: Calibration = CALIBRATION, recompute: str = "none"
    ) -> ClusterCostModel:
        """The model of Table-1 setting ``s`` (its model, K, #Op, #Data and L)."""
        return cls(
            s.config,
            n_stages=s.n_stages,
            n_op=s.n_op,
            n_data=s.n_data,
            seq_len=s.seq_len,
            calibration=calibration,
            recompute=recompute,
        )

    def __repr__(self) -> str:
        chunks = f", v={self.parts.n_chunks}" if self.parts.n_chunks > 1 else ""
        return (
            f"ClusterCostModel({self.cfg.name}, K={self.n_stages}, #Op={self.n_op}, "
            f"#Data={self.n_data}, L={self.seq_len}{chunks})"
        )

    # ---- rates and one layer --------------------------------------------------------

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
    def params_per_layer(self) -> float:
        """Parameters of one layer on one GPU of the #Op group."""
        return n_params_per_layer(self.cfg) / self.n_op

    def layer_times(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """GPU seconds of one layer's (forward, backward) for a slice, on one GPU."""
        return layer_times(
            self.cfg, self.n_op, batch_slice_size, length, context, cal=self.cal, hw=self.hw
        )

    @cached_property
    def host_floor(self) -> float:
        """Seconds a layer's forward takes at least (Fig. 3's flat region): the GPU time
        of a ``knee_tokens``-token forward of one ``knee_model`` layer on one GPU."""
        knee = get_config(self.cal.knee_model)
        tokens, context = np.array([self.cal.knee_tokens]), np.array([0])
        fwd, _ = layer_times(knee, 1, 1, tokens, context, cal=self.cal, hw=self.hw)
        return float(fwd[0])

    # ---- one stage -------------------------------------------------------------------

    def stage_times(
        self,
        batch_slice_size: int,
        length: np.ndarray,
        context: np.ndarray,
        layers: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Compute seconds of one stage (N/K layers, or ``layers``: a chunk's) for a
        slice: (forward, backward), without the broadcast of received tensors inside the
        #Op group. With full recomputation the backward runs the forward again first."""
        n = self.layers_per_stage if layers is None else layers
        fwd, bwd = self.layer_seconds(batch_slice_size, length, context)
        fwd, bwd = n * fwd, n * bwd
        return fwd, bwd + fwd if self.recompute == "full" else bwd

    def layer_seconds(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """One layer's (forward, backward) seconds inside a stage: its GPU time, never
        below the host floor (backward: ``backward_floor`` x the floor)."""
        fwd, bwd = self.layer_times(batch_slice_size, length, context)
        floor = self.host_floor
        return np.maximum(fwd, floor), np.maximum(bwd, self.cal.backward_floor * floor)

    def _op_broadcast(self, nbytes: np.ndarray) -> np.ndarray:
        if self.n_op == 1:
            return np.zeros_like(nbytes)
        return nbytes / self._nvlink_bus + self.cal.collective_latency

    def node_of(self, stage: int, op_rank: int = 0, replica: int = 0) -> int:
        """Node of a GPU under the paper's rank order (op, then stage, then replica)."""
        rank = gpu_rank(stage, op_rank, replica, n_stages=self.n_stages, n_op=self.n_op)
        return rank // self.hw.gpus_per_node

    def crosses_nodes(self, src: int, dst: int, forward: bool | None = None) -> bool:
        """Whether a send from stage ``src`` to stage ``dst`` leaves the node (``forward``:
        an activation; default ``dst > src``, see :func:`~tplib.cluster.layout.send_ranks`)."""
        a, b = send_ranks(src, dst, self.n_op, forward)
        return a // self.hw.gpus_per_node != b // self.hw.gpus_per_node

    def p2p(self, src: int, dst: int, nbytes: Bytes, forward: bool | None = None) -> np.ndarray:
        """Seconds to move ``nbytes`` from stage ``src`` to stage ``dst`` (``forward``
        as in :meth:`crosses_nodes`)."""
        nbytes = np.asarray(nbytes, dtype=float)
        if self.crosses_nodes(src, dst, forward):
            net = self.cal.network_efficiency * self.hw.network
            return (
                nbytes / net + self.cal.inter_node_latency + self.staging(nbytes, receiving=False)
            )
        a, b = send_ranks(src, dst, self.n_op, forward)
        g = self.hw.gpus_per_node
        return nbytes / self._intra_p2p(a % g, b % g) + self.cal.intra_node_latency

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

    # ---- SliceCostModel (planner) ----------------------------------------------------

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        """Forward + backward seconds of one stage for a slice plus the pipeline
        communication of the busiest stage: the planner's t(l, c) (Eq. 4)."""
        length, context = np.asarray(length, dtype=float), np.asarray(context, dtype=float)
        fwd, bwd = self.stage_times(batch_slice_size, length, context)
        nbytes = FP16 * batch_slice_size * length * self.cfg.hidden
        comm = np.max([self.stage_comm(k, nbytes) for k in range(self.n_stages)], axis=0)
        return fwd + bwd + comm

    def wgrad_time(
        self, batch_slice_size: int, length: np.ndarray, layers: int | None = None
    ) -> np.ndarray:
        """Seconds of one stage's (or ``layers``') weight gradients over ``batch_slice_size``
        x ``length`` tokens at once (:class:`~tplib.planner.zero_bubble.WeightGradModel`)."""
        tokens = batch_slice_size * np.asarray(length, dtype=float)
        t = layer_wgrad_time(self.cfg, self.n_op, tokens, cal=self.cal, hw=self.hw)
        return (self.layers_per_stage if layers is None else layers) * t

    # ---- ActionCosts (simulator) -----------------------------------------------------

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        """A chunk's forward or backward of a unit (a stage's, without virtual stages),
        with the #Op broadcast of what it received from another stage."""
        shape, receives = unit_shape(plan, action), self.parts.receives(stage, action)
        return self._compute(action.kind, receives, *shape, self.layers_per_chunk)

    @memo
    def _compute(
        self, kind: Kind, receives: bool, size: int, length: int, context: int, layers: int
    ) -> float:
        fwd, bwd = self.stage_times(size, np.array([length]), np.array([context]), layers)
        t = float((fwd if kind is Kind.F else bwd)[0])
        if receives:
            nbytes = np.array([FP16 * size * length * self.cfg.hidden])
            t += float(self._op_broadcast(nbytes)[0])
        return t

    def weight_grad(self, stage: int, action: Action, plan: Plan) -> float:
        """A ``W``: the stage's weight-gradient products over the unit's tokens, or with
        ``action.whole_sequence`` over the whole sequence's at once (one product per
        weight, one ``w.grad +=``). A split ``B`` costs the backward less the unit's
        ``W`` (see :class:`~tplib.sim.costs.SplitBackwardCosts`), so the host floor stays
        with ``B``."""
        ts = plan.token_slices[action.b]
        length = sum(ts[t] for t in covered_slices(plan, action.b, action.t))
        return self._weight_grad(plan.batch_slices[action.b] * length, self.layers_per_chunk)

    @memo
    def _weight_grad(self, tokens: int, layers: int) -> float:
        return float(self.wgrad_time(1, np.array([tokens]), layers)[0])

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        """A send's time on the link; a receive's own time on the receiving stage; the
        peer holds the neighbouring part (across the wrap too)."""
        size, length, _ = unit_shape(plan, action)
        src, dst = self.parts.link(stage, action)
        forward = action.kind in (Kind.SA, Kind.RA)
        return self._transfer(action.kind in SENDS, src, dst, forward, size, length)

    @memo
    def _transfer(self, send: bool, src: int, dst: int, fwd: bool, size: int, n: int) -> float:
        nbytes = FP16 * size * n * self.cfg.hidden
        return float((self.p2p if send else self.receive)(src, dst, nbytes, fwd))

    def stage_params(self, stage: int = 0) -> float:
        """Parameters one GPU of ``stage`` holds (every stage holds N/K layers, in all
        its chunks)."""
        return self.layers_per_stage * self.params_per_layer

    def allreduce(self, stage: int) -> float:
        """Data-parallel ring all-reduce of the stage's fp16 gradients over #Data
        replicas: over NVLink when they all share a node, else over the network, whose
        link the 8 GPUs of a node share."""
        n = self.n_data
        if n == 1:
            return 0.0
        params = self.stage_params(stage)
        grads = FP16 * params
        # One node only if every replica of the stage sits in it; a ring that leaves the
        # node is held to the network, whose link the node's GPUs share.
        if len({self.node_of(stage, replica=r) for r in range(n)}) == 1:
            wire = ring_allreduce(grads, n, self._nvlink_bus, self.cal.collective_latency)
        else:
            share = self.cal.allreduce_efficiency * self.hw.network / self.hw.gpus_per_node
            if self.cal.allreduce_ring:
                wire = ring_allreduce(grads, n, share, self.cal.inter_node_latency)
            else:
                wire = grads / share
            wire += self.cal.allreduce_latency
        return float(wire) + ALLREDUCE_COPY_BYTES * params / self._hbm

    def optimizer(self, stage: int) -> float:
        """Mixed-precision Adam step over the stage's parameters: memory-bound."""
        return OPTIMIZER_BYTES * self.stage_params(stage) / self._hbm

    # ---- memory ----------------------------------------------------------------------

    def memory(self, plan: Plan) -> MemoryEstimate:
        """Peak memory per GPU for running ``plan`` on this layout."""
        return memory_per_gpu(
            self.cfg,
            n_stages=self.n_stages,
            n_op=self.n_op,
            plan=plan,
            calibration=self.cal,
            hardware=self.hw,
            recompute=self.recompute,
        )
