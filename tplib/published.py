"""Published Megatron-LM runs on modern clusters, as data: the references the DGX cluster
models are calibrated on.

:data:`NARAYANAN_2021` is Table 1 of Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (SC21): weak-scaling runs of GPT models
on DGX A100 80 GB nodes, all with sequence length 2048, vocabulary 51,200, full activation
recomputation, fp16, and their FLOP formula (:func:`tplib.search.megatron.narayanan_flops`).
Tensor- and pipeline-parallel sizes, heads and microbatch are those of the authors'
reproduction script for that table; "interleaving" gives the layers per model chunk.

These values are REFERENCES. :data:`DGX_A100_CALIBRATION
<tplib.cluster.calibration.DGX_A100_CALIBRATION>`'s matrix-product efficiency is fitted
to their TFLOPS, and nothing else in tplib uses them as a reproduced number.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NARAYANAN_2021", "PublishedRun"]


@dataclass(frozen=True)
class PublishedRun:
    """One published training run: the model, its layout and what it achieved."""

    model: str  # the paper's name, by parameter count
    layers: int
    hidden: int
    heads: int
    tp: int  # tensor-parallel size (#Op)
    pp: int  # pipeline-parallel size (#Pipe)
    gpus: int
    batch: int  # global batch, sequences
    microbatch: int
    layers_per_chunk: int | None  # interleaved 1F1B's chunk size; None: 1F1B
    tflops_per_gpu: float  # achieved, by the paper's FLOP formula
    cluster: str = "dgx-a100"
    seq_len: int = 2048
    vocab: int = 51200
    recompute: str = "full"
    source: str = "Narayanan et al. 2021, Table 1"

    @property
    def interleave(self) -> int:
        """v, the model chunks per pipeline stage (1 without interleaving)."""
        if self.layers_per_chunk is None:
            return 1
        return self.layers // (self.pp * self.layers_per_chunk)


def _row(
    model: str,
    layers: int,
    hidden: int,
    heads: int,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    microbatch: int,
    layers_per_chunk: int | None,
    tflops: float,
) -> PublishedRun:
    return PublishedRun(
        model, layers, hidden, heads, tp, pp, gpus, batch, microbatch, layers_per_chunk, tflops
    )


NARAYANAN_2021: tuple[PublishedRun, ...] = (
    _row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, None, 137),
    _row("3.6B", 30, 3072, 32, 2, 1, 64, 512, 16, None, 138),
    _row("7.5B", 36, 4096, 32, 4, 1, 128, 512, 16, None, 142),
    _row("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 8, None, 135),
    _row("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 4, None, 138),
    _row("76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 2, 5, 140),
    _row("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 2, 5, 148),
    _row("310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 1, 3, 155),
    _row("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 1, 1, 163),
    _row("1008B", 128, 25600, 160, 8, 64, 3072, 3072, 1, None, 163),
)
