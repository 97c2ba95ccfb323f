"""Analytic cost model of the paper's cluster: AWS p3.16xlarge nodes of 8 V100 GPUs.

One :class:`ClusterCostModel` prices a Table-1 layout (#Pipe stages K of N/K layers,
each stage operation-partitioned over #Op GPUs, #Data replicas) for both consumers: the
DP planner (``slice_time``, a :class:`~tplib.planner.SliceCostModel`) and the simulator
(``compute``/``transfer``/``allreduce``/``optimizer``, an
:class:`~tplib.simulate.ActionCosts`). It models the paper's implementation (appendix B:
PyTorch + NCCL + Megatron-LM, fp16 layers, fp32 master weights, Adam): only the N
transformer layers are pipelined, which is also what the paper's TFLOPS column counts.

Per layer and slice of b sequences, s tokens after c tokens of context, on one GPU:

* matrix products: forward 24 b s H^2 / #Op FLOPs in four products (QKV 6, output
  projection 2, MLP 16), backward twice that (dX and dW); attention 4 b s (c + s) H / #Op
  (QK^T and AV over all c + s keys: the implementation computes masked entries too). Each
  product runs at ``gemm_efficiency`` x the 125 TFLOPS fp16 peak, slowed by tile and wave
  quantization (whole 128 x 128 output tiles, in waves of one tile per each of the 80
  SMs; this is why small slices and small per-GPU matrices run below peak), and never
  faster than moving its operands through HBM (so a tiny slice still streams the weights);
* ``w.grad += dW`` on every slice (read two, write one fp16 copy of the weights) and the
  K/V-context gradient accumulation;
* memory-bound kernels at ``hbm_efficiency`` x 900 GB/s: LayerNorms, residuals, dropout,
  biases, activation (:data:`TOKEN_BYTES_FWD`) and the score matrix (scale, mask, fp32
  softmax, dropout: :data:`SCORE_BYTES_FWD` / :data:`SCORE_BYTES_BWD` bytes per score);
* Megatron (#Op > 1): 2 forward and 2 backward all-reduces of b s H fp16 values per layer
  over NVLink, ring cost 2 (n-1)/n bytes / bandwidth + ``collective_latency``;
* host floor (paper Fig. 3: a GPT3-1B layer's forward takes as long for 1 token as for
  256): Python issues the kernels, so a layer's forward never takes less than the GPU
  time of a 256-token GPT3-1B layer forward, its backward twice that.

Placement follows the paper's rank order (op innermost, then stage, then replica): node
n holds ranks 8n..8n+7, so it holds 8/#Op consecutive stages of one replica. Stage k
sends one copy of its output from its last GPU to the first GPU of stage k+1 (their
NVLinks in a node, or PCIe through host memory where the hybrid cube-mesh has no link,
e.g. GPUs 3 -> 4; the node's 25 Gbps across nodes), which broadcasts it to its #Op group.
Sends run on the compute stream, so a stage is busy while it sends (``comm``, see
:class:`Calibration`). Replicas of a stage sit on different nodes, so the data-parallel
all-reduce crosses the network, and all 8 GPUs of a node all-reduce at about the same
time (their stages finish the backward within a few slices of each other): they SHARE
the node's 25 Gbps.

Calibration: :class:`Calibration` lists every free parameter, its value and provenance.
Parameters are published specs, or fitted by :func:`fit_calibration` to the paper's
GPipe ("w/o TeraPipe") latencies of Table 2 only; every TeraPipe latency is a prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

import numpy as np

from tplib.config import GPTConfig, get_config, n_params_per_layer
from tplib.paper import GPIPE, TABLE2, PaperResult, Setting, setting
from tplib.plan import Plan
from tplib.schedule import Action, Schedule, make_schedule

__all__ = [
    "CALIBRATION",
    "COMM_MODES",
    "FIT_STAGES",
    "P3_16XLARGE",
    "Calibration",
    "ClusterCostModel",
    "FitResult",
    "Hardware",
    "MemoryEstimate",
    "fit_calibration",
    "memory_per_gpu",
]

FP16, FP32 = 2, 4

# Memory traffic of the memory-bound kernels, bytes per element (counted from the reads
# and writes of a plain PyTorch layer; the backward does about twice the forward).
TOKEN_BYTES_FWD = (15.0, 16.0)  # per (token, hidden) element: (replicated, per #Op share)
# replicated over the #Op group: 2 LayerNorms (r+w), 2 residual adds (2r+w), 2 dropouts;
# per #Op share: QKV and FC1 biases, the activation over 4H.
SCORE_BYTES_FWD = 16.0  # per attention score: write, scale, mask, fp32 softmax, dropout
SCORE_BYTES_BWD = 32.0
# Optimizer step per parameter: fp16 grad -> fp32 master grad with loss unscaling
# (r 2 + w 4, then r/w 4 + 4), fused Adam (r param, grad, m, v; w param, m, v: 28),
# fp32 master -> fp16 weights (r 4 + w 2).
OPTIMIZER_BYTES = 14.0 + 28.0 + 6.0
# Data-parallel all-reduce bookkeeping per parameter (Megatron's bucketed all-reduce):
# flatten the fp16 grads, scale, unflatten: three reads and three writes.
ALLREDUCE_COPY_BYTES = 3 * 2 * FP16
# Weights and optimizer state per parameter in mixed precision: fp16 weights and grads,
# fp32 master weights and grads, Adam's m and v.
STATE_BYTES = FP16 + FP16 + FP32 + FP32 + FP32 + FP32
# Activations kept for the backward per token and hidden element, fp16: (replicated, per
# #Op share). Replicated: LN1 in/out, attention output, LN2 in/out. Shared: Q, K, V, the
# attention context, FC1 out (4H), activation out (4H).
ACT_ELEMS = (5.0, 12.0)
ACT_SCORE_BYTES = FP16 + FP32  # attention scores (fp16) and probabilities (fp32)

CommMode = Literal["eager", "rendezvous", "async"]
COMM_MODES = ("eager", "rendezvous", "async")


@dataclass(frozen=True)
class Hardware:
    """AWS p3.16xlarge: published specs (NVIDIA V100-SXM2 datasheet, AWS instance page,
    the DGX-1V hybrid cube-mesh NVLink topology that p3.16xlarge shares)."""

    gpus_per_node: int = 8
    gpu_memory: float = 16 * 2**30  # V100-SXM2 16 GB HBM2
    peak_fp16: float = 125e12  # tensor-core peak, FLOP/s
    peak_fp32: float = 15.7e12  # FLOP/s (unused by the fp16 layers; for reference)
    hbm_bandwidth: float = 900e9  # bytes/s
    sms: int = 80  # streaming multiprocessors of a V100
    gemm_tile: int = 128  # output tile of cuBLAS's large fp16 tensor-core kernels
    nvlink_link: float = 25e9  # one NVLink 2.0 link, bytes/s per direction
    nvlink_links: int = 6  # per V100: 6 x 25 GB/s x 2 directions = 300 GB/s aggregate
    pcie: float = 15.75e9  # PCIe 3.0 x16, bytes/s per direction
    network: float = 25e9 / 8  # 25 Gbps per instance, bytes/s per direction
    # NVLink links between GPU pairs: two fully connected quads 0-3 and 4-7 joined by
    # 0-4, 1-5, 2-6, 3-7; some pairs have two links. Pairs without a link (3-4, 0-5, ...)
    # go through host memory over PCIe, across the CPU sockets.
    nvlink_pairs: tuple[tuple[int, int, int], ...] = (
        (0, 1, 1), (0, 2, 1), (0, 3, 2), (0, 4, 2), (1, 2, 2), (1, 3, 1), (1, 5, 2),
        (2, 3, 1), (2, 6, 2), (3, 7, 2), (4, 5, 1), (4, 6, 1), (4, 7, 2), (5, 6, 2),
        (5, 7, 1), (6, 7, 1),
    )  # fmt: skip

    def links(self, a: int, b: int) -> int:
        """NVLink links between local GPUs ``a`` and ``b`` of a node."""
        for x, y, n in self.nvlink_pairs:
            if {x, y} == {a, b}:
                return n
        return 0


P3_16XLARGE = Hardware()


@dataclass(frozen=True)
class Calibration:
    """Every free parameter of the cluster model, its value and where it comes from.

    ====================  ========  ========================================================
    parameter             value     provenance
    ====================  ========  ========================================================
    gemm_efficiency       0.811     FITTED: achieved fraction of the fp16 tensor peak in
                                    matrix products (before tile/wave quantization), on
                                    the GPipe rows of the 5 settings without data
                                    parallelism, (3) (5) (8) (9) (10), together with:
    network_efficiency    0.827     FITTED: achieved fraction of 25 Gbps for pipeline
                                    sends across nodes; same rows, same fit
    allreduce_efficiency  0.462     FITTED: achieved fraction of 25 Gbps (shared by a
                                    node's 8 GPUs) in the data-parallel all-reduce, on the
                                    GPipe rows of the 5 data-parallel settings (1) (2) (4)
                                    (6) (7), the two values above held fixed
    comm                  eager     structure, chosen by the same GPipe fit: a send runs on
                                    the sender's compute stream and the receiver finds the
                                    data in NCCL's buffer. RMS log error of the fit on
                                    (3) (5) (8) (9) (10): eager 2.6%; rendezvous (both
                                    ends busy) 16% with network_efficiency pinned at 1;
                                    async (overlapped) 24% with gemm_efficiency pinned
                                    at 1
    quantization          True      tile and wave quantization of matrix products (NVIDIA,
                                    "Matrix Multiplication Background" guide); 128 x 128
                                    tiles and 80 SMs from :class:`Hardware`
    hbm_efficiency        0.833     750 of 900 GB/s: V100 memory bandwidth measured by Jia
                                    et al. 2018, "Dissecting the NVIDIA Volta GPU
                                    Architecture via Microbenchmarking"
    nvlink_efficiency     0.8       assumption: NCCL reaches ~80% of a link's peak
                                    (NVLink 2.0 or PCIe 3.0) on large messages
    knee_tokens           256       paper Fig. 3: a GPT3-1B layer's forward takes as long
    knee_model            GPT3-1B   for 1 token as for 256 (host-bound floor)
    backward_floor        2.0       assumption: autograd issues about twice the kernels
    intra_node_latency    10 us     assumption: NCCL p2p small-message latency, NVLink
    collective_latency    20 us     assumption: NCCL all-reduce latency in a node; a fit
                                    to the GPipe rows drives it to its 1 us lower bound
    inter_node_latency    50 us     assumption: NCCL small-message latency over TCP/ENA
    memory_reserve        2 GiB     assumption: CUDA context, cuBLAS workspace, allocator
                                    slack (the authors' scripts cap memory at 14 GB)
    ====================  ========  ========================================================

    :data:`CALIBRATION` stores the fitted values; :func:`fit_calibration` re-derives them
    (procedure in its docstring) and a test checks they agree, so they cannot drift.
    """

    gemm_efficiency: float = 0.7
    network_efficiency: float = 0.8
    allreduce_efficiency: float = 0.5
    comm: CommMode = "eager"
    quantization: bool = True
    hbm_efficiency: float = 750e9 / 900e9
    nvlink_efficiency: float = 0.8
    knee_tokens: int = 256
    knee_model: str = "GPT3-1B"
    backward_floor: float = 2.0
    intra_node_latency: float = 10e-6
    collective_latency: float = 20e-6
    inter_node_latency: float = 50e-6
    memory_reserve: float = 2 * 2**30

    def __post_init__(self) -> None:
        for name in ("gemm_efficiency", "network_efficiency", "allreduce_efficiency",
                     "hbm_efficiency", "nvlink_efficiency"):  # fmt: skip
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Calibration.{name}={value}: efficiencies lie in (0, 1]")
        if self.comm not in COMM_MODES:
            raise ValueError(f"Calibration.comm={self.comm!r}: choose one of {COMM_MODES}")


# The two-stage fit: (fields, settings whose GPipe rows fit them). Data-parallel settings
# come second so that their all-reduce cannot leak into the compute and pipeline fields.
FIT_STAGES: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = (
    (("gemm_efficiency", "network_efficiency"), (3, 5, 8, 9, 10)),
    (("allreduce_efficiency",), (1, 2, 4, 6, 7)),
)
CALIBRATION = Calibration(
    gemm_efficiency=0.81080, network_efficiency=0.82661, allreduce_efficiency=0.46240
)


class ClusterCostModel:
    """Costs of one pipeline layout on p3.16xlarge nodes (see the module docstring).

    ``model``: a config or its name; ``n_stages`` (K), ``n_op`` (#Op) and ``n_data``
    (#Data) as in Table 1; ``seq_len`` (L) bounds context + slice length.
    """

    def __init__(
        self, model: GPTConfig | str, *, n_stages: int, n_op: int = 1, n_data: int = 1,
        seq_len: int | None = None, calibration: Calibration = CALIBRATION,
        hardware: Hardware = P3_16XLARGE,
    ) -> None:  # fmt: skip
        self.cfg = get_config(model) if isinstance(model, str) else model
        self.seq_len = seq_len or self.cfg.seq_len
        if n_stages < 1 or self.cfg.n_layer % n_stages:
            raise ValueError(
                f"{self.cfg.name} has {self.cfg.n_layer} layers, not divisible into "
                f"n_stages={n_stages}: the paper gives every stage the same layers"
            )
        g = hardware.gpus_per_node
        if n_op < 1 or g % n_op or self.cfg.n_head % n_op:
            raise ValueError(
                f"n_op={n_op} must divide the {g} GPUs of a node (the paper partitions "
                f"operations only inside a node) and the {self.cfg.n_head} heads"
            )
        if n_data < 1:
            raise ValueError(f"n_data={n_data}: need at least one replica")
        self.n_stages, self.n_op, self.n_data = n_stages, n_op, n_data
        self.layers = self.cfg.n_layer // n_stages
        self.cal, self.hw = calibration, hardware
        self.blocking_sends = calibration.comm != "async"  # read by tplib.simulate
        self._cache: dict[tuple, float] = {}

    @classmethod
    def for_setting(cls, s: Setting, calibration: Calibration = CALIBRATION) -> ClusterCostModel:
        """The model of Table-1 setting ``s`` (its model, K, #Op, #Data and L)."""
        return cls(s.config, n_stages=s.n_stages, n_op=s.n_op, n_data=s.n_data,
                   seq_len=s.seq_len, calibration=calibration)  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"ClusterCostModel({self.cfg.name}, K={self.n_stages}, #Op={self.n_op}, "
            f"#Data={self.n_data}, L={self.seq_len})"
        )

    # ---- rates -----------------------------------------------------------------------

    @property
    def _flops(self) -> float:
        return self.cal.gemm_efficiency * self.hw.peak_fp16

    @property
    def _hbm(self) -> float:
        return self.cal.hbm_efficiency * self.hw.hbm_bandwidth

    @property
    def _nvlink_bus(self) -> float:
        # NCCL collectives in a node use rings over all of a GPU's NVLinks.
        return self.cal.nvlink_efficiency * self.hw.nvlink_link * self.hw.nvlink_links

    def _intra_p2p(self, a: int, b: int) -> float:
        """Bytes/s from local GPU ``a`` to ``b``: their NVLinks, or PCIe through host
        memory (two copies) when the pair has none."""
        links = self.hw.links(a, b)
        peak = links * self.hw.nvlink_link if links else self.hw.pcie / 2
        return self.cal.nvlink_efficiency * peak

    # ---- one layer, one GPU ----------------------------------------------------------

    @property
    def params_per_layer(self) -> float:
        """Parameters of one layer on one GPU of the #Op group."""
        return n_params_per_layer(self.cfg) / self.n_op

    def _gemm(
        self, m: np.ndarray, n: float | np.ndarray, k: float | np.ndarray,
        batch: float | np.ndarray = 1.0,
    ) -> np.ndarray:  # fmt: skip
        """Seconds of ``batch`` products (m x k) @ (k x n) in fp16."""
        if self.cal.quantization:
            t, sms = self.hw.gemm_tile, self.hw.sms
            tiles = batch * np.ceil(m / t) * np.ceil(n / t)
            slots = np.ceil(tiles / sms) * sms * t * t  # whole waves of whole tiles
            used = batch * m * n / slots
        else:
            used = 1.0
        compute = 2 * batch * m * n * k / (self._flops * used)
        traffic = FP16 * batch * (m * k + k * n + m * n) / self._hbm
        return np.maximum(compute, traffic)

    def _allreduce_in_node(self, nbytes: np.ndarray) -> np.ndarray:
        n = self.n_op
        ring = 2 * (n - 1) / n * nbytes / self._nvlink_bus
        return ring + self.cal.collective_latency

    def layer_times(
        self, batch: int, length: np.ndarray, context: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """GPU seconds of one layer's (forward, backward) for a slice, on one GPU."""
        h, n_op, heads = self.cfg.hidden, self.n_op, self.cfg.n_head // self.n_op
        s, c = np.asarray(length, dtype=float), np.asarray(context, dtype=float)
        tokens, keys, b = batch * s, c + s, batch
        # The four products per GPU as (n, k) of (tokens x k) @ (k x n): Megatron splits
        # QKV and FC1 by columns, the output projection and FC2 by rows.
        shapes = [(3 * h / n_op, h), (h, h / n_op), (4 * h / n_op, h), (h, 4 * h / n_op)]
        fwd_gemm = sum(self._gemm(tokens, n, k) for n, k in shapes)
        # Backward: dX = dY W^T (tokens x k) and dW = X^T dY (k x n, reducing over tokens).
        bwd_gemm = sum(self._gemm(tokens, k, n) + self._gemm(k, n, tokens) for n, k in shapes)
        # Attention per (sequence, head): QK^T (s x dh) @ (dh x keys), AV (s x keys) @ (keys
        # x dh).
        pairs, dh = b * heads, self.cfg.head_dim
        attn = self._gemm(s, keys, dh, pairs) + self._gemm(s, dh, keys, pairs)
        scores = pairs * s * keys
        rep, part = TOKEN_BYTES_FWD
        elementwise = tokens * h * FP16 * (rep + part / n_op) / self._hbm
        megatron = 2 * self._allreduce_in_node(FP16 * tokens * h) if n_op > 1 else 0.0
        fwd = fwd_gemm + attn + scores * SCORE_BYTES_FWD / self._hbm + elementwise + megatron
        accumulate = 3 * FP16 * self.params_per_layer / self._hbm  # w.grad += dW per slice
        kv_grad = 3 * 2 * FP16 * b * c * h / n_op / self._hbm  # context grads += update
        bwd = (
            bwd_gemm + 2 * attn + scores * SCORE_BYTES_BWD / self._hbm + 2 * elementwise
            + megatron + accumulate + kv_grad
        )  # fmt: skip
        return fwd, bwd

    @cached_property
    def host_floor(self) -> float:
        """Seconds a layer's forward takes at least (Fig. 3's flat region): the GPU time
        of a ``knee_tokens``-token forward of one ``knee_model`` layer on one GPU."""
        knee = ClusterCostModel(
            self.cal.knee_model, n_stages=1, calibration=self.cal, hardware=self.hw
        )
        fwd, _ = knee.layer_times(1, np.array([self.cal.knee_tokens]), np.array([0]))
        return float(fwd[0])

    # ---- one stage -------------------------------------------------------------------

    def stage_times(
        self, batch: int, length: np.ndarray, context: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Compute seconds of one stage (N/K layers) for a slice: (forward, backward),
        without the broadcast of received tensors inside the #Op group."""
        fwd, bwd = self.layer_times(batch, length, context)
        floor = self.host_floor
        return (
            self.layers * np.maximum(fwd, floor),
            self.layers * np.maximum(bwd, self.cal.backward_floor * floor),
        )

    def _op_broadcast(self, nbytes: np.ndarray) -> np.ndarray:
        if self.n_op == 1:
            return np.zeros_like(nbytes)
        return nbytes / self._nvlink_bus + self.cal.collective_latency

    def node_of(self, stage: int, op_rank: int = 0, replica: int = 0) -> int:
        """Node of a GPU under the paper's rank order (op, then stage, then replica)."""
        rank = (replica * self.n_stages + stage) * self.n_op + op_rank
        return rank // self.hw.gpus_per_node

    def _endpoints(self, src: int, dst: int) -> tuple[int, int]:
        """Ranks (in replica 0) of the GPUs that carry a send from stage src to dst: the
        last GPU of the sender forward, the first GPU of the sender backward."""
        last = self.n_op - 1
        if dst > src:
            return src * self.n_op + last, dst * self.n_op
        return src * self.n_op, dst * self.n_op + last

    def crosses_nodes(self, src: int, dst: int) -> bool:
        """Whether a send from stage ``src`` to the adjacent stage ``dst`` leaves the node."""
        a, b = self._endpoints(src, dst)
        return a // self.hw.gpus_per_node != b // self.hw.gpus_per_node

    def p2p(self, src: int, dst: int, nbytes: np.ndarray | float) -> np.ndarray:
        """Seconds to move ``nbytes`` from stage ``src`` to the adjacent stage ``dst``."""
        nbytes = np.asarray(nbytes, dtype=float)
        if self.crosses_nodes(src, dst):
            net = self.cal.network_efficiency * self.hw.network
            return nbytes / net + self.cal.inter_node_latency
        a, b = self._endpoints(src, dst)
        g = self.hw.gpus_per_node
        return nbytes / self._intra_p2p(a % g, b % g) + self.cal.intra_node_latency

    def receive(self, src: int, dst: int, nbytes: np.ndarray | float) -> np.ndarray:
        """Seconds the receiving stage itself is busy with a receive: the whole transfer
        (rendezvous), only the call's latency (eager: the data waits in NCCL's buffer),
        or nothing (async)."""
        nbytes = np.asarray(nbytes, dtype=float)
        if self.cal.comm == "rendezvous":
            return self.p2p(src, dst, nbytes)
        if self.cal.comm == "async":
            return np.zeros_like(nbytes)
        cross = self.crosses_nodes(src, dst)
        latency = self.cal.inter_node_latency if cross else self.cal.intra_node_latency
        return np.full_like(nbytes, latency)

    def stage_comm(self, stage: int, nbytes: np.ndarray | float) -> np.ndarray:
        """Seconds of pipeline communication stage ``stage`` adds per unit: its send to
        each neighbour (on the critical path even when asynchronous), its share of each
        receive, and the #Op broadcast of what it received."""
        nbytes = np.asarray(nbytes, dtype=float)
        total = np.zeros_like(nbytes)
        for nbr in (stage - 1, stage + 1):
            if 0 <= nbr < self.n_stages:
                total = total + self.p2p(stage, nbr, nbytes) + self.receive(nbr, stage, nbytes)
                total = total + self._op_broadcast(nbytes)
        return total

    # ---- SliceCostModel (planner) ----------------------------------------------------

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Forward + backward seconds of one stage for a slice plus the pipeline
        communication of the busiest stage: the planner's t(l, c) (Eq. 4)."""
        length, context = np.asarray(length, dtype=float), np.asarray(context, dtype=float)
        fwd, bwd = self.stage_times(batch, length, context)
        nbytes = FP16 * batch * length * self.cfg.hidden
        comm = np.max([self.stage_comm(k, nbytes) for k in range(self.n_stages)], axis=0)
        return fwd + bwd + comm

    # ---- ActionCosts (simulator) -----------------------------------------------------

    def _unit(self, plan: Plan, a: Action) -> tuple[int, int, int]:
        return plan.batch_slices[a.b], plan.token_slices[a.b][a.t], plan.token_offset(a.b, a.t)

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        """A stage's forward or backward of a unit, with the #Op broadcast of the
        received input (forward) or gradient (backward)."""
        size, length, context = self._unit(plan, action)
        receives = stage > 0 if action.kind == "F" else stage < self.n_stages - 1
        key = (action.kind, receives, size, length, context)
        if key not in self._cache:
            fwd, bwd = self.stage_times(size, np.array([length]), np.array([context]))
            t = float((fwd if action.kind == "F" else bwd)[0])
            if receives:
                nbytes = np.array([FP16 * size * length * self.cfg.hidden])
                t += float(self._op_broadcast(nbytes)[0])
            self._cache[key] = t
        return self._cache[key]

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        """A send's time on the link; a receive's own time on the receiving stage."""
        size, length, _ = self._unit(plan, action)
        src = {"SA": stage, "RA": stage - 1, "SG": stage, "RG": stage + 1}[action.kind]
        dst = {"SA": stage + 1, "RA": stage, "SG": stage - 1, "RG": stage}[action.kind]
        send = action.kind in ("SA", "SG")
        key = ("send" if send else "recv", src, dst, size, length)
        if key not in self._cache:
            nbytes = FP16 * size * length * self.cfg.hidden
            self._cache[key] = float(self.p2p(src, dst, nbytes) if send
                                     else self.receive(src, dst, nbytes))  # fmt: skip
        return self._cache[key]

    def stage_params(self, stage: int = 0) -> float:
        """Parameters one GPU of ``stage`` holds (every stage holds N/K layers)."""
        return self.layers * self.params_per_layer

    def allreduce(self, stage: int) -> float:
        """Data-parallel ring all-reduce of the stage's fp16 gradients over #Data
        replicas, each on another node; the 8 GPUs of a node share its link."""
        n = self.n_data
        if n == 1:
            return 0.0
        params = self.stage_params(stage)
        ring = 2 * (n - 1) / n * FP16 * params
        if self.node_of(stage, replica=0) == self.node_of(stage, replica=1):
            wire = ring / self._nvlink_bus + 2 * (n - 1) * self.cal.collective_latency
        else:
            net = self.cal.allreduce_efficiency * self.hw.network
            wire = self.hw.gpus_per_node * ring / net + 2 * (n - 1) * self.cal.inter_node_latency
        return wire + ALLREDUCE_COPY_BYTES * params / self._hbm

    def optimizer(self, stage: int) -> float:
        """Mixed-precision Adam step over the stage's parameters: memory-bound."""
        return OPTIMIZER_BYTES * self.stage_params(stage) / self._hbm

    # ---- memory ----------------------------------------------------------------------

    def memory(self, plan: Plan) -> MemoryEstimate:
        """Peak memory per GPU for running ``plan`` on this layout."""
        return memory_per_gpu(
            self.cfg, n_stages=self.n_stages, n_op=self.n_op, plan=plan,
            calibration=self.cal, hardware=self.hw,
        )  # fmt: skip


# ---- memory model ----------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU: weights and optimizer state, stored activations, reserve."""

    states: float
    activations: float
    reserve: float
    capacity: float

    @property
    def total(self) -> float:
        return self.states + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def __str__(self) -> str:
        gib = 2**30
        return (
            f"{self.total / gib:.1f} GiB of {self.capacity / gib:.0f} GiB "
            f"(states {self.states / gib:.1f}, activations {self.activations / gib:.1f}, "
            f"reserve {self.reserve / gib:.1f}): {'fits' if self.fits else 'does NOT fit'}"
        )


def memory_per_gpu(
    model: GPTConfig | str, *, n_stages: int, n_op: int, plan: Plan,
    calibration: Calibration = CALIBRATION, hardware: Hardware = P3_16XLARGE,
) -> MemoryEstimate:  # fmt: skip
    """Memory of one GPU of a stage: mixed-precision states (:data:`STATE_BYTES` per
    parameter: fp16 weights and grads, fp32 master weights and grads, Adam m and v) and
    the activations of the WHOLE minibatch, which GPipe and TeraPipe keep until the
    backward (paper §3.4). A slice of s tokens after c keeps s (c + s) attention scores
    per head, so token slicing stores (L^2 + sum s^2) / 2 scores per sequence, not L^2."""
    cfg = get_config(model) if isinstance(model, str) else model
    layers = cfg.n_layer // n_stages
    states = STATE_BYTES * layers * n_params_per_layer(cfg) / n_op
    rep, part = ACT_ELEMS
    acts = plan.batch * plan.seq_len * cfg.hidden * FP16 * (rep + part / n_op)
    scores = 0.0
    for size, slices in zip(plan.batch_slices, plan.token_slices, strict=True):
        s = np.asarray(slices, dtype=float)
        scores += size * float(np.sum(s * np.cumsum(s)))  # s * (context + s)
    acts += cfg.n_head / n_op * scores * ACT_SCORE_BYTES
    return MemoryEstimate(states, layers * acts, calibration.memory_reserve, hardware.gpu_memory)


# ---- calibration fit -------------------------------------------------------------------

# Bounds of fitted fields: efficiencies are fractions of a peak.
_BOUNDS = {"gemm_efficiency": (0.01, 1.0), "network_efficiency": (0.01, 1.0),
           "allreduce_efficiency": (0.01, 1.0), "collective_latency": (1e-6, 1e-2)}  # fmt: skip
_GPIPE_SCHEDULES: dict[tuple[int, int, int], Schedule] = {}


def _gpipe_latencies(cal: Calibration, rows: list[PaperResult]) -> np.ndarray:
    """Simulated GPipe latency of each row's setting under ``cal``."""
    from tplib.simulate import simulate  # simulate needs nothing from here; avoid a cycle

    out = []
    for r in rows:
        s = setting(r.setting, r.seq_len)
        key = (s.n_stages, s.pipeline_batch, s.seq_len)
        if key not in _GPIPE_SCHEDULES:  # schedules do not depend on the calibration
            _GPIPE_SCHEDULES[key] = make_schedule("gpipe", s.n_stages, s.gpipe_plan())
        out.append(simulate(_GPIPE_SCHEDULES[key], ClusterCostModel.for_setting(s, cal)).latency)
    return np.array(out)


def _gauss_newton(
    start: Calibration, fields: tuple[str, ...], rows: list[PaperResult], tol: float,
    max_iter: int,
) -> tuple[Calibration, int]:  # fmt: skip
    """Least squares on log latency over ``rows`` in log-parameter space."""
    target = np.log([r.latency for r in rows])
    lo, hi = np.log([_BOUNDS[f] for f in fields]).T

    def calib(theta: np.ndarray) -> Calibration:
        return replace(start, **dict(zip(fields, map(float, np.exp(theta)), strict=True)))

    def residual(theta: np.ndarray) -> np.ndarray:
        return np.log(_gpipe_latencies(calib(theta), rows)) - target

    theta = np.log([getattr(start, f) for f in fields])
    r = residual(theta)
    for it in range(1, max_iter + 1):
        # Forward differences, stepping inward at an upper bound.
        steps = np.where(theta + 1e-4 > hi, -1e-4, 1e-4)
        jac = np.stack(
            [(residual(theta + h * e) - r) / h for h, e in zip(steps, np.eye(len(fields)), strict=True)],
            axis=1,
        )  # fmt: skip
        step = np.linalg.lstsq(jac, -r, rcond=None)[0]
        for _ in range(20):  # halve the step until the cost does not grow
            new = np.clip(theta + step, lo, hi)
            r_new = residual(new)
            if r_new @ r_new <= r @ r:
                break
            step = step / 2
        else:
            return calib(theta), it
        moved = np.max(np.abs(new - theta))
        theta, r = new, r_new
        if moved < tol:
            return calib(theta), it
    return calib(theta), max_iter


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit_calibration` found: the calibration, the GPipe rows it used
    (setting, simulated, paper) and the RMS error of log latency over them."""

    calibration: Calibration
    settings: tuple[int, ...]
    simulated: tuple[float, ...]
    paper: tuple[float, ...]
    iterations: int

    @property
    def rms_log_error(self) -> float:
        err = np.log(self.simulated) - np.log(self.paper)
        return float(math.sqrt(np.mean(err**2)))


def fit_calibration(
    start: Calibration = CALIBRATION,
    stages: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = FIT_STAGES,
    *, tol: float = 1e-5, max_iter: int = 30,
) -> FitResult:  # fmt: skip
    """Re-derive the fitted fields of :class:`Calibration` from Table 2's GPipe rows.

    For each (fields, settings) of ``stages`` in turn: minimise sum_i (log sim_i - log
    paper_i)^2 over the "w/o TeraPipe" rows of those settings, where sim_i is
    :func:`tplib.simulate.simulate` of the GPipe schedule (microbatches of one sequence)
    on :class:`ClusterCostModel`, by Gauss-Newton in log-parameter space (forward
    differences, step halving, efficiencies bounded to (0.01, 1]), starting at ``start``.
    Deterministic. No TeraPipe number enters the fit.
    """
    cal, iterations = start, 0
    for fields, settings in stages:
        rows = [r for r in TABLE2 if r.algorithm == GPIPE and r.setting in settings]
        cal, it = _gauss_newton(cal, fields, rows, tol, max_iter)
        iterations += it
    rows = [r for r in TABLE2 if r.algorithm == GPIPE and any(r.setting in s for _, s in stages)]
    sim = _gpipe_latencies(cal, rows)
    return FitResult(
        cal, tuple(r.setting for r in rows), tuple(map(float, sim)),
        tuple(r.latency for r in rows), iterations,
    )  # fmt: skip
