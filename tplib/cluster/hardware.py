"""The paper's hardware, as published specs: AWS p3.16xlarge nodes of 8 V100 GPUs.

Nothing here is fitted or assumed; what the cluster model assumes about how well the
hardware is used lives in :class:`~tplib.cluster.calibration.Calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CLUSTERS", "FP16", "FP32", "P3_16XLARGE", "Hardware"]

FP16, FP32 = 2, 4  # bytes per element


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

# The clusters a layout search can price, by instance name.
CLUSTERS: dict[str, Hardware] = {"p3.16xlarge": P3_16XLARGE}
