"""The clusters' hardware, as published specs: the paper's AWS p3.16xlarge nodes of 8 V100
GPUs, and NVIDIA's DGX A100 (80 GB) and DGX H100 nodes of 8 GPUs.

Nothing here is fitted or assumed; what the cluster model assumes about how well the
hardware is used lives in :class:`~tplib.cluster.calibration.Calibration`.

The two node designs differ where the cluster model looks:

- p3.16xlarge: NVLink 2.0 in a hybrid cube mesh (some GPU pairs have one link, some
  two, some none and go through host memory), one 25 Gb/s network port shared by the
  node's 8 GPUs, no GPUDirect RDMA;
- DGX: NVSwitch (every GPU reaches every other at its whole NVLink bandwidth) and one
  InfiniBand adapter per GPU (a "rail"), with GPUDirect RDMA.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CLUSTERS", "DGX_A100", "DGX_H100", "FP16", "FP32", "P3_16XLARGE", "Hardware"]

FP16, FP32 = 2, 4  # bytes per element


@dataclass(frozen=True)
class Hardware:
    """One cluster's nodes. The defaults are AWS p3.16xlarge: published specs (NVIDIA
    V100-SXM2 datasheet, AWS instance page, the DGX-1V hybrid cube-mesh NVLink topology
    that p3.16xlarge shares). ``peak_fp16`` is the dense tensor-core peak of the 16-bit
    formats the runs train in (fp16 on V100; fp16 and bf16 alike on A100 and H100)."""

    name: str = "p3.16xlarge"
    gpu: str = "V100-SXM2-16GB"
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
    # Network adapters per node; ``network`` is their sum. With one per GPU each GPU
    # sends on its own rail; with one per node the node's GPUs share it.
    nics_per_node: int = 1
    nvswitch: bool = False  # every local pair at the GPU's whole NVLink bandwidth
    gpudirect: bool = False  # GPUDirect RDMA: the adapter reads and writes GPU memory
    # NVLink links between GPU pairs: two fully connected quads 0-3 and 4-7 joined by
    # 0-4, 1-5, 2-6, 3-7; some pairs have two links. Pairs without a link (3-4, 0-5, ...)
    # go through host memory over PCIe, across the CPU sockets.
    nvlink_pairs: tuple[tuple[int, int, int], ...] = (
        (0, 1, 1), (0, 2, 1), (0, 3, 2), (0, 4, 2), (1, 2, 2), (1, 3, 1), (1, 5, 2),
        (2, 3, 1), (2, 6, 2), (3, 7, 2), (4, 5, 1), (4, 6, 1), (4, 7, 2), (5, 6, 2),
        (5, 7, 1), (6, 7, 1),
    )  # fmt: skip

    def links(self, a: int, b: int) -> int:
        """NVLink links between local GPUs ``a`` and ``b`` of a node (through the
        NVSwitches: all of a GPU's links)."""
        if self.nvswitch:
            return self.nvlink_links if a != b else 0
        for x, y, n in self.nvlink_pairs:
            if {x, y} == {a, b}:
                return n
        return 0


P3_16XLARGE = Hardware()

# NVIDIA DGX A100 80 GB (DGX A100 datasheet and user guide; A100 datasheet): A100-SXM4
# 80 GB, 312 TFLOPS dense fp16/bf16, 2,039 GB/s HBM2e, 108 SMs; 12 third-generation
# NVLinks of 25 GB/s per direction (600 GB/s per GPU both ways) into 6 NVSwitches;
# 8 single-port ConnectX-6 HDR InfiniBand adapters, 200 Gb/s each, for the compute
# fabric; PCIe 4.0 x16.
DGX_A100 = Hardware(
    name="dgx-a100",
    gpu="A100-SXM4-80GB",
    gpu_memory=80 * 2**30,
    peak_fp16=312e12,
    peak_fp32=19.5e12,
    hbm_bandwidth=2039e9,
    sms=108,
    nvlink_link=25e9,
    nvlink_links=12,
    pcie=31.5e9,
    network=8 * 200e9 / 8,
    nics_per_node=8,
    nvswitch=True,
    gpudirect=True,
    nvlink_pairs=(),
)

# NVIDIA DGX H100 (DGX H100 datasheet and user guide; H100 SXM5 datasheet): H100-SXM5
# 80 GB, 989 TFLOPS dense fp16/bf16 (1,979 with sparsity), 3.35 TB/s HBM3, 132 SMs;
# 18 fourth-generation NVLinks of 25 GB/s per direction (900 GB/s per GPU both ways)
# into 4 NVSwitches; 8 ConnectX-7 NDR InfiniBand ports, 400 Gb/s each, for the compute
# fabric; PCIe 5.0 x16.
DGX_H100 = Hardware(
    name="dgx-h100",
    gpu="H100-SXM5-80GB",
    gpu_memory=80 * 2**30,
    peak_fp16=989e12,
    peak_fp32=67e12,
    hbm_bandwidth=3350e9,
    sms=132,
    nvlink_link=25e9,
    nvlink_links=18,
    pcie=63e9,
    network=8 * 400e9 / 8,
    nics_per_node=8,
    nvswitch=True,
    gpudirect=True,
    nvlink_pairs=(),
)

# The clusters a layout search and ``tplib predict`` can price, by name.
CLUSTERS: dict[str, Hardware] = {h.name: h for h in (P3_16XLARGE, DGX_A100, DGX_H100)}
