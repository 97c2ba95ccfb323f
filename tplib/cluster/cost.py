"""Analytic cost model of a cluster: one pipeline layout on p3.16xlarge or DGX nodes.

One :class:`ClusterCostModel` prices a layout (#Pipe stages K of N/K layers, each stage
operation-partitioned over #Op GPUs, #Data replicas; see :mod:`tplib.cluster.layout`)
for both consumers: the DP planner (``slice_time``, a
:class:`~tplib.sim.costs.SliceCostModel`) and the simulator (``compute``/``transfer``/
``allreduce``/``optimizer``, an :class:`~tplib.sim.costs.ActionCosts`). By default it
models the paper's implementation (appendix B: PyTorch + NCCL + Megatron-LM, fp16
layers, fp32 master weights, Adam) on its p3.16xlarge nodes: only the N transformer
layers are pipelined, which is also what the paper's TFLOPS column counts. Another
:class:`~tplib.cluster.implementation.Implementation` (Megatron's attention, sequence
parallelism, the distributed optimizer, the embedding and head on the end stages) and
another cluster (:data:`~tplib.cluster.hardware.DGX_A100`, with its calibration) price
Megatron-LM's runs on today's nodes.

What one layer costs on one GPU is :mod:`tplib.cluster.compute`; what the messages
cost, :mod:`tplib.cluster.links`. On top of the layer, a stage of N/K layers never
computes faster than the host issues its kernels (paper Fig. 3: a GPT3-1B layer's
forward takes as long for 1 token as for 256): a layer's forward takes at least the GPU
time of a 256-token GPT3-1B layer forward (or the calibration's measured
``host_floor``), its backward ``backward_floor`` times that.

Recomputation (``recompute``): ``full`` runs each stage's forward again before its
backward; ``selective`` (Korthikanti et al. 2022) only the attention core, which costs
nothing more under FlashAttention-2 (its backward recomputes the scores anyway).

Virtual stages (:meth:`ClusterCostModel.placed`): v chunks per stage of N / (vK) layers
each. A chunk computes its own layers, broadcasts in its #Op group only what came from
another stage, and sends to the stage of the neighbouring part, across the wrap from
stage K-1 to stage 0 too (off the node unless the replica fits in one). ``slice_time``
holds all of a stage's chunks, each with its messages; the update, all N / K layers.

Context parallelism (``n_cp``, #CP; :mod:`tplib.cluster.context_parallel`): each stage's
GPU computes 1 / #CP of every slice's tokens and of its causal attention, and each layer
adds what its ring attention's exchanges do not hide; the messages between stages, the
gradient reduction over #Data x #CP and the distributed optimizer's shards follow
(:mod:`tplib.cluster.links`), and so does the memory (:mod:`tplib.cluster.memory`).
With ``n_cp=1`` every price is what it was without it, bit for bit.
"""

from __future__ import annotations

import copy
from functools import cached_property

import numpy as np

from tplib.cluster.calibration import CALIBRATION, Calibration
from tplib.cluster.compute import (
    attention_core_time,
    embedding_times,
    head_times,
    layer_times,
    layer_wgrad_time,
)
from tplib.cluster.context_parallel import ring_times
from tplib.cluster.hardware import FP16, P3_16XLARGE, Hardware
from tplib.cluster.implementation import (
    PAPER,
    Implementation,
    check_context_parallel,
    check_recompute,
)
from tplib.cluster.layout import check_layout
from tplib.cluster.links import LayoutLinks
from tplib.cluster.memory import MemoryEstimate, memory_per_gpu
from tplib.nn.configs import GPTConfig, get_config
from tplib.paper import Setting
from tplib.plan import Plan
from tplib.schedule import SENDS, Action, Kind, covered_slices
from tplib.schedule.chunks import Placement
from tplib.sim.costs import Link, Parts, memo, unit_shape

__all__ = ["ClusterCostModel"]

# Optimizer step per parameter: fp16 grad -> fp32 master grad with loss unscaling
# (r 2 + w 4, then r/w 4 + 4), fused Adam (r param, grad, m, v; w param, m, v: 28),
# fp32 master -> fp16 weights (r 4 + w 2).
OPTIMIZER_BYTES = 14.0 + 28.0 + 6.0


class ClusterCostModel(LayoutLinks):
    """Costs of one pipeline layout on a cluster (see the module docstring).

    ``model``: a config or its name; ``n_stages`` (K), ``n_op`` (#Op) and ``n_data``
    (#Data) as in Table 1; ``seq_len`` (L) bounds context + slice length; ``recompute``
    ("none", "selective" or "full"); ``placement`` the stage of each model part with
    virtual stages (:meth:`placed`; None: one part per stage); ``hardware`` and
    ``calibration`` the cluster's; ``implementation`` what the training code does;
    ``overlap_unit``: the (batch slice size, length) of the last backward the gradient
    reduction overlaps (with ``implementation.overlap_grad_reduce``); ``n_cp`` (#CP) the
    context-parallel ranks of each stage (FlashAttention only).
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
        implementation: Implementation = PAPER,
        overlap_unit: tuple[int, int] | None = None,
        n_cp: int = 1,
    ) -> None:
        check_recompute(recompute)
        check_context_parallel(n_cp, implementation.attention)
        if implementation.sequence_parallel and n_op == 1:
            raise ValueError(
                "sequence_parallel with n_op=1: sequence parallelism splits the #Op group's "
                "replicated regions, so it needs #Op > 1"
            )
        self.recompute, self.impl, self.overlap_unit = recompute, implementation, overlap_unit
        self.cfg = get_config(model) if isinstance(model, str) else model
        self.seq_len = seq_len or self.cfg.seq_len
        check_layout(
            self.cfg, n_stages=n_stages, n_op=n_op, n_data=n_data, hardware=hardware, n_cp=n_cp
        )
        self.n_stages, self.n_op, self.n_data, self.n_cp = n_stages, n_op, n_data, n_cp
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
        cls,
        s: Setting,
        calibration: Calibration = CALIBRATION,
        recompute: str = "none",
        *,
        hardware: Hardware = P3_16XLARGE,
        implementation: Implementation = PAPER,
    ) -> ClusterCostModel:
        """The model of Table-1 setting ``s`` (its model, K, #Op, #Data and L), on the
        paper's cluster unless ``hardware`` (with its ``calibration``) says otherwise."""
        return cls(
            s.config,
            n_stages=s.n_stages,
            n_op=s.n_op,
            n_data=s.n_data,
            seq_len=s.seq_len,
            calibration=calibration,
            hardware=hardware,
            recompute=recompute,
            implementation=implementation,
        )

    def __repr__(self) -> str:
        chunks = f", v={self.parts.n_chunks}" if self.parts.n_chunks > 1 else ""
        cp = f", #CP={self.n_cp}" if self.n_cp > 1 else ""
        return (
            f"ClusterCostModel({self.cfg.name}, K={self.n_stages}, #Op={self.n_op}{cp}, "
            f"#Data={self.n_data}, L={self.seq_len}{chunks})"
        )

    # ---- rates and one layer --------------------------------------------------------

    def layer_times(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """GPU seconds of one layer's (forward, backward) for a slice, on one GPU; with
        #CP, its share and what the ring's exchanges add
        (:func:`~tplib.cluster.context_parallel.ring_times`)."""
        fwd, bwd = layer_times(
            self.cfg,
            self.n_op,
            batch_slice_size,
            length,
            context,
            cal=self.cal,
            hw=self.hw,
            impl=self.impl,
            n_cp=self.n_cp,
        )
        if self.n_cp == 1:
            return fwd, bwd
        ring_fwd, ring_bwd = ring_times(
            self.cfg, self.n_op, self.n_cp, batch_slice_size, length, context, self._ring,
            cal=self.cal, hw=self.hw,
        )  # fmt: skip
        return fwd + ring_fwd, bwd + ring_bwd

    @cached_property
    def _ring(self) -> Link:
        """The ring attention's link (:meth:`~tplib.cluster.links.LayoutLinks.cp_ring`)."""
        return self.cp_ring()

    @cached_property
    def host_floor(self) -> float:
        """Seconds a layer's forward takes at least (Fig. 3's flat region): the
        calibration's measured ``host_floor``, or else the GPU time of a
        ``knee_tokens``-token forward of one ``knee_model`` layer on one GPU."""
        if self.cal.host_floor is not None:
            return self.cal.host_floor
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
        #Op group. With full recomputation the backward runs the forward again first;
        with selective, each layer's attention core."""
        n = self.layers_per_stage if layers is None else layers
        fwd, bwd = self.layer_seconds(batch_slice_size, length, context)
        fwd, bwd = n * fwd, n * bwd
        if self.recompute == "selective":
            core = attention_core_time(
                self.cfg,
                self.n_op,
                batch_slice_size,
                length,
                context,
                cal=self.cal,
                hw=self.hw,
                impl=self.impl,
            )
            return fwd, bwd + n * core
        return fwd, bwd + fwd if self.recompute == "full" else bwd

    def layer_seconds(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """One layer's (forward, backward) seconds inside a stage: its GPU time, never
        below the host floor (backward: ``backward_floor`` x the floor)."""
        fwd, bwd = self.layer_times(batch_slice_size, length, context)
        floor = self.host_floor
        return np.maximum(fwd, floor), np.maximum(bwd, self.cal.backward_floor * floor)

    def overlap_window(self, stage: int) -> float:
        """Seconds of the backward the data-parallel reduction overlaps: one
        ``overlap_unit``'s backward through a chunk of the stage (the iteration's last
        backward there); 0 without an ``overlap_unit``."""
        if self.overlap_unit is None:
            return 0.0
        size, length = self.overlap_unit
        return self._compute(Kind.B, False, size, length, 0, self.layers_per_chunk, 0)

    # ---- SliceCostModel (planner) ----------------------------------------------------

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        """Forward + backward seconds of one stage for a slice plus the pipeline
        communication of the busiest stage: the planner's t(l, c) (Eq. 4)."""
        length, context = np.asarray(length, dtype=float), np.asarray(context, dtype=float)
        fwd, bwd = self.stage_times(batch_slice_size, length, context)
        # Communication depends on the length alone: priced once per distinct length (a
        # planner's grid asks for a few hundred lengths at tens of thousands of points).
        lengths, where = np.unique(length, return_inverse=True)
        nbytes = FP16 * batch_slice_size * lengths * self.cfg.hidden
        comm = np.max([self.stage_comm(k, nbytes) for k in range(self.n_stages)], axis=0)
        return fwd + bwd + comm[where].reshape(length.shape)

    def wgrad_time(
        self, batch_slice_size: int, length: np.ndarray, layers: int | None = None
    ) -> np.ndarray:
        """Seconds of one stage's (or ``layers``') weight gradients over ``batch_slice_size``
        x ``length`` tokens at once (:class:`~tplib.planner.zero_bubble.WeightGradModel`)."""
        tokens = batch_slice_size * np.asarray(length, dtype=float) / self.n_cp
        t = layer_wgrad_time(self.cfg, self.n_op, tokens, cal=self.cal, hw=self.hw)
        return (self.layers_per_stage if layers is None else layers) * t

    # ---- ActionCosts (simulator) -----------------------------------------------------

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        """A chunk's forward or backward of a unit (a stage's, without virtual stages),
        with the #Op broadcast of what it received from another stage."""
        shape, receives = unit_shape(plan, action), self.parts.receives(stage, action)
        ends = 0
        if self.impl.ends:
            part = self.parts.part(stage, action.chunk)
            ends = (part == 0) + 2 * (part == len(self.parts.placement) - 1)
        return self._compute(action.kind, receives, *shape, self.layers_per_chunk, ends)

    @memo
    def _compute(
        self,
        kind: Kind,
        receives: bool,
        size: int,
        length: int,
        context: int,
        layers: int,
        ends: int = 0,
    ) -> float:
        fwd, bwd = self.stage_times(size, np.array([length]), np.array([context]), layers)
        t = float((fwd if kind is Kind.F else bwd)[0])
        if receives:
            nbytes = np.array([FP16 * size * length * self.cfg.hidden])
            t += float(self._op_broadcast(nbytes)[0])
        # The model's ends (``ends``: 1 the first part, 2 the last, 3 both), on the GPU's
        # 1 / #CP of the tokens.
        tokens, at = size * length / self.n_cp, 0 if kind is Kind.F else 1
        if ends & 1:
            t += embedding_times(self.cfg, self.n_op, tokens, cal=self.cal, hw=self.hw)[at]
        if ends & 2:
            t += head_times(self.cfg, self.n_op, tokens, cal=self.cal, hw=self.hw)[at]
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

    def optimizer(self, stage: int) -> float:
        """Mixed-precision Adam step over the stage's parameters (with the distributed
        optimizer, over its 1 / (#Data x #CP) shard of them): memory-bound."""
        params = self.stage_params(stage)
        if self.impl.distributed_optimizer:
            params /= self.n_data * self.n_cp
        return OPTIMIZER_BYTES * params / self._hbm

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
            implementation=self.impl,
            n_data=self.n_data,
            n_cp=self.n_cp,
        )
