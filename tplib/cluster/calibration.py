"""The cluster model's free parameters: their values and where each comes from.

:class:`Calibration` lists every parameter of the model that is not a published spec of
:class:`~tplib.cluster.hardware.Hardware`. Each is a published measurement, an
assumption, or fitted by :func:`~tplib.cluster.fit.fit_calibration` to the paper's GPipe
("w/o TeraPipe") latencies of Table 2 only (in the stages of :data:`FIT_STAGES`), so
every TeraPipe latency the model gives is a prediction. :data:`CALIBRATION` holds the
fitted values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CALIBRATION", "COMM_MODES", "FIT_STAGES", "Calibration", "CommMode"]

CommMode = Literal["eager", "rendezvous", "async"]
COMM_MODES = ("eager", "rendezvous", "async")
_EFFICIENCIES = (
    "gemm_efficiency",
    "network_efficiency",
    "allreduce_efficiency",
    "hbm_efficiency",
    "nvlink_efficiency",
)


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

    :data:`CALIBRATION` stores the fitted values; :func:`~tplib.cluster.fit.fit_calibration`
    re-derives them (procedure in its docstring) and a test checks they agree, so they
    cannot drift.
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
        for name in _EFFICIENCIES:
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
