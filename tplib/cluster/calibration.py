"""The cluster models' free parameters: their values and where each comes from.

:class:`Calibration` lists every parameter of the model that is not a published spec of
:class:`~tplib.cluster.hardware.Hardware`. Each is a published measurement, an
assumption, or fitted by :func:`~tplib.cluster.fit.fit_calibration` to the paper's GPipe
("w/o TeraPipe") latencies of Table 2 only (in the stages of :data:`FIT_STAGES`; the rows
of :data:`HELD_OUT` check the fit), so every TeraPipe latency the model gives is a
prediction. :data:`CALIBRATION` holds the fitted values.

The DGX clusters (:data:`DGX_A100_CALIBRATION`, :data:`DGX_H100_CALIBRATION`; by name in
:data:`CALIBRATIONS`) reuse the structure with their own values: the A100's matrix-product
efficiency is fitted by :func:`tplib.search.megatron_fit.fit_dgx_a100` to Megatron's
published A100 runs (Narayanan et al. 2021, Table 1: :mod:`tplib.published`) and nothing
else; the H100 model takes that fraction of its own peak, and every other value of
both is a published measurement or an assumption, named in the tables below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "CALIBRATION",
    "CALIBRATIONS",
    "COMM_MODES",
    "DGX_A100_CALIBRATION",
    "DGX_H100_CALIBRATION",
    "FIT_STAGES",
    "HELD_OUT",
    "Calibration",
    "CommMode",
]

CommMode = Literal["eager", "rendezvous", "async"]
COMM_MODES = ("eager", "rendezvous", "async")
_EFFICIENCIES = (
    "gemm_efficiency",
    "network_efficiency",
    "allreduce_efficiency",
    "hbm_efficiency",
    "nvlink_efficiency",
    "pcie_efficiency",
)
_OPTIONAL_EFFICIENCIES = ("flash_efficiency",)


@dataclass(frozen=True)
class Calibration:
    """Every free parameter of the cluster model, its value and where it comes from.

    ====================  ========  ========================================================
    parameter             value     provenance
    ====================  ========  ========================================================
    gemm_efficiency       0.759     FITTED: achieved fraction of the fp16 tensor peak in
                                    matrix products (before tile/wave quantization), on
                                    the GPipe rows of (3) (5) (8) (9), together with:
    network_efficiency    0.888     FITTED: achieved fraction of 25 Gbps for pipeline
                                    sends across nodes; same rows, same fit. Held out of
                                    both: (10), the fifth setting without data parallelism
    allreduce_efficiency  0.553     FITTED: achieved fraction of 25 Gbps (shared by a
                                    node's 8 GPUs) in the data-parallel all-reduce, on the
                                    GPipe rows of (2) (6) (7), the values above held fixed
                                    (published TCP runs of NCCL reach about 60% of the
                                    wire: NVIDIA/nccl#209), together with:
    allreduce_latency     0.285 s   FITTED: the all-reduce's fixed cost per iteration; same
                                    rows, same fit. Held out of both: (1) and (4)
    allreduce_ring        False     structure, chosen on the GPipe rows of all five
                                    data-parallel settings: each GPU's gradients cross the
                                    node's shared link once, whatever #Data; the ring's
                                    2 (#Data - 1) / #Data volume fits them worse (RMS log
                                    error of the fit 4.3% against 2.9%; held-out (1)
                                    +11.5% against -5.1%)
    comm                  eager     structure, chosen by the GPipe fit: a send runs on the
                                    sender's compute stream and the receiver finds the
                                    data in NCCL's buffer (see ``host_staging``). RMS
                                    log error of the first fit stage: eager 2.9%;
                                    rendezvous (both ends busy) 14% with
                                    network_efficiency pinned at 1; async (overlapped)
                                    20% with gemm_efficiency pinned at 1
    quantization          True      tile and wave quantization of matrix products (NVIDIA,
                                    "Matrix Multiplication Background" guide); 128 x 128
                                    tiles and 80 SMs from :class:`Hardware`
    hbm_efficiency        0.833     750 of 900 GB/s: V100 memory bandwidth measured by Jia
                                    et al. 2018, "Dissecting the NVIDIA Volta GPU
                                    Architecture via Microbenchmarking"
    nvlink_efficiency     0.8       assumption: NCCL reaches ~80% of a link's peak on
                                    large messages
    pcie_efficiency       0.8       assumption, as for NVLink: copies between GPU and host
                                    memory reach ~80% of PCIe 3.0 x16
    host_staging          True      p3.16xlarge has no GPUDirect RDMA (on EC2 only P-series
                                    from p4d has it: aws/aws-ofi-nccl#547), so NCCL's
                                    network transport goes through host memory
                                    (NVIDIA/nccl#465): the sender copies a message into
                                    a host buffer one slot ahead of the wire, the receiver
                                    copies what waits in its buffer when its kernel runs
    nccl_buffer           4 MiB     NCCL's default NCCL_BUFFSIZE (NCCL environment
    nccl_steps            8         variables documentation) and its 8 slots (NCCL_STEPS)
    knee_tokens           256       paper Fig. 3: a GPT3-1B layer's forward takes as long
    knee_model            GPT3-1B   for 1 token as for 256 (host-bound floor)
    backward_floor        2.6       counted from the paper's implementation: autograd
                                    issues about twice the forward's ~23 kernels per layer,
                                    and each unit's backward adds 14 launches of the same
                                    cost, one ``w.grad +=`` per parameter tensor (12: two
                                    LayerNorms, four linear layers, weights and biases)
                                    and the K and V context gradients: 2 + 14 / 23
    intra_node_latency    10 us     assumption: NCCL p2p small-message latency, NVLink
    collective_latency    20 us     assumption: NCCL all-reduce latency in a node
    inter_node_latency    50 us     published: NCCL's socket transport between two nodes
                                    takes 50-60 us for 1-16 KB messages (uccl-project/
                                    uccl#638), 31-34 us in nccl-tests' sendrecv
                                    (NVIDIA/nccl-tests#214)
    memory_reserve        2 GiB     assumption: CUDA context, cuBLAS workspace, allocator
                                    slack (the authors' scripts cap memory at 14 GB)
    host_floor            None      the knee rule above; a DGX's: seconds of a layer's
                                    forward at least, measured (see its calibration)
    flash_efficiency      None      V100s run no FlashAttention-2 (it needs sm_80)
    ====================  ========  ========================================================

    :data:`CALIBRATION` stores the fitted values; :func:`~tplib.cluster.fit.fit_calibration`
    re-derives them (procedure in its docstring) and a test checks they agree, so they
    cannot drift.
    """

    gemm_efficiency: float = 0.7
    network_efficiency: float = 0.8
    allreduce_efficiency: float = 0.5
    allreduce_latency: float = 0.1
    allreduce_ring: bool = False
    comm: CommMode = "eager"
    quantization: bool = True
    hbm_efficiency: float = 750e9 / 900e9
    nvlink_efficiency: float = 0.8
    pcie_efficiency: float = 0.8
    host_staging: bool = True
    nccl_buffer: float = 4 * 2**20
    nccl_steps: int = 8
    knee_tokens: int = 256
    knee_model: str = "GPT3-1B"
    backward_floor: float = 2 + 14 / 23
    intra_node_latency: float = 10e-6
    collective_latency: float = 20e-6
    inter_node_latency: float = 50e-6
    memory_reserve: float = 2 * 2**30
    host_floor: float | None = None
    flash_efficiency: float | None = None

    def __post_init__(self) -> None:
        for name in _EFFICIENCIES + _OPTIONAL_EFFICIENCIES:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_EFFICIENCIES:
                continue
            if not 0 < value <= 1:
                raise ValueError(f"Calibration.{name}={value}: efficiencies lie in (0, 1]")
        if self.comm not in COMM_MODES:
            raise ValueError(f"Calibration.comm={self.comm!r}: choose one of {COMM_MODES}")
        if self.allreduce_latency < 0 or self.nccl_buffer <= 0 or self.nccl_steps < 1:
            raise ValueError(
                f"Calibration: allreduce_latency={self.allreduce_latency} must be >= 0, "
                f"nccl_buffer={self.nccl_buffer} > 0 and nccl_steps={self.nccl_steps} >= 1"
            )
        if self.host_floor is not None and self.host_floor < 0:
            raise ValueError(f"Calibration.host_floor={self.host_floor}: seconds are >= 0")


# The two-stage fit: (fields, settings whose GPipe rows fit them). Data-parallel settings
# come second so that their all-reduce cannot leak into the compute and pipeline fields.
# The GPipe rows of HELD_OUT enter no stage: the fit is judged on them.
FIT_STAGES: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = (
    (("gemm_efficiency", "network_efficiency"), (3, 5, 8, 9)),
    (("allreduce_efficiency", "allreduce_latency"), (2, 6, 7)),
)
HELD_OUT: tuple[int, ...] = (1, 4, 10)
CALIBRATION = Calibration(
    gemm_efficiency=0.75913,
    network_efficiency=0.88757,
    allreduce_efficiency=0.55285,
    allreduce_latency=0.28521,
)


# DGX A100 (80 GB), Megatron-LM on it. Every value but gemm_efficiency is a published
# measurement or an assumption:
#
#   gemm_efficiency       FITTED to the ten rows of Narayanan et al. 2021, Table 1 (their
#                         achieved TFLOPS per GPU) by tplib.search.megatron_fit, nothing
#                         else; least squares on the log of the ratio
#   network_efficiency    0.9, assumption: InfiniBand HDR point-to-point with GPUDirect
#                         RDMA reaches about 90% of the 200 Gb/s line rate
#   allreduce_efficiency  0.9, assumption, the same for NCCL's ring over the rails
#   allreduce_ring        True: NCCL's ring, 2 (n - 1) / n of the gradients per GPU
#   allreduce_latency     0: no fixed cost beyond the ring's per-step latency
#   comm                  eager, as Megatron's blocking p2p calls between microbatches
#   hbm_efficiency        0.85, assumption: copy kernels reach about 85% of HBM2e's 2,039
#                         GB/s (90% was measured on an H100 by tplib's GPU check, 3.0 of
#                         3.35 TB/s; taken lower here for the smaller kernels)
#   nvlink_efficiency     0.8, as the V100's: NCCL reaches about 80% of NVLink's peak
#   host_staging          False: GPUDirect RDMA, the adapters read GPU memory
#   host_floor            0.390 ms: tplib's own GPT3-1B layer forward at 256 tokens on an
#                         H100 node (make gpu-check, figure 3; results/gpu/, the second of
#                         two runs on 2026-11-27, the first measured 0.514 ms): 1 to 1,024
#                         tokens all took 0.39-0.57 ms over both runs, the host issuing
#                         kernels. Taken for both DGX nodes, whose hosts are of one
#                         generation; it bounds only small slices, never a run of the fit
#   flash_efficiency      0.6: FlashAttention-2's forward + backward on an A100 at head
#                         dimension 128 and 2K tokens (its paper reports 50-73% of peak
#                         over its kernel benchmarks)
#   inter_node_latency    10 us, assumption: NCCL over InfiniBand with GPUDirect
#   memory_reserve        4 GiB, assumption: CUDA context, NCCL and cuBLAS workspaces,
#                         allocator fragmentation on an 80 GB GPU
DGX_A100_GEMM_EFFICIENCY = 0.71784  # FITTED: see above (tplib.search.megatron_fit)
DGX_A100_CALIBRATION = Calibration(
    gemm_efficiency=DGX_A100_GEMM_EFFICIENCY,
    network_efficiency=0.9,
    allreduce_efficiency=0.9,
    allreduce_latency=0.0,
    allreduce_ring=True,
    comm="eager",
    hbm_efficiency=0.85,
    nvlink_efficiency=0.8,
    host_staging=False,
    host_floor=0.390e-3,
    flash_efficiency=0.6,
    inter_node_latency=10e-6,
    memory_reserve=4 * 2**30,
)
# DGX H100: no H100 run enters any fit. The A100 fit's lesson is the fraction of the
# tensor peak Megatron's matrix products reach; the H100 is given the same fraction of
# its own peak, and everything else as the A100's but for FlashAttention-2, which is not
# written for Hopper: the FlashAttention-3 paper measured FlashAttention-2 at 362 of 989
# TFLOPS forward at head dimension 128 and 2K tokens (0.33 taken, the backward slower).
DGX_H100_CALIBRATION = replace(DGX_A100_CALIBRATION, flash_efficiency=0.33)

# The calibration of each cluster of tplib.cluster.hardware.CLUSTERS, by name.
CALIBRATIONS: dict[str, Calibration] = {
    "p3.16xlarge": CALIBRATION,
    "dgx-a100": DGX_A100_CALIBRATION,
    "dgx-h100": DGX_H100_CALIBRATION,
}
