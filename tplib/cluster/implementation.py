"""What the trained program does, beyond its layout: the cluster model's implementation.

The same layout costs differently under different training code. :class:`Implementation`
names the choices the cluster model prices, each as Megatron-LM names it:

- ``attention``: how the attention core runs.
  ``"unfused"`` is the paper's PyTorch: the scores are written out, then scaled, masked,
  softmaxed in fp32 and dropped out by separate kernels (:data:`ATTENTION_SCORE_BYTES`).
  ``"fused-softmax"`` is Megatron's written-out attention of 2021: one fused
  scale-mask-softmax kernel on fp16 scores, then dropout. ``"flash"`` is
  FlashAttention-2: no score is written; the forward does the causal half of the
  products, the backward recomputes the scores and does 2.5 times the forward's work
  (the FlashAttention-2 paper's count), at the calibration's ``flash_efficiency``.
- ``sequence_parallel`` (Korthikanti et al. 2022): the LayerNorms, dropouts and residual
  adds are split over the #Op group along the sequence; each all-reduce becomes a
  reduce-scatter and an all-gather of the same volume; a stage sends each GPU's shard.
- ``scatter_gather`` (Narayanan et al. 2021, section 4.1): a message between stages is
  split over the #Op GPUs, each sends its part on its own adapter, and the receivers
  all-gather over NVLink (otherwise one GPU sends it all and broadcasts it).
- ``distributed_optimizer``: the fp32 master weights and Adam moments are sharded over
  #Data; the gradients are reduce-scattered and the weights all-gathered (the volume of
  one all-reduce) and each GPU steps 1 / #Data of its parameters.
- ``overlap_grad_reduce``: the data-parallel reduction runs during the last backward of
  the iteration; only what outlasts it is exposed.
- ``ends``: the stages also compute the embedding (first) and the LM head with its loss
  (last), as a whole-model run does. The paper's tables price the N layers alone.
- ``layer_checkpoints``: full recomputation keeps every layer's input (Megatron's
  "uniform" method, one layer per checkpoint), not only the stage's (tplib's runtime).

:data:`PAPER` is the paper's implementation (the V100 tables); :data:`MEGATRON_2021` is
what the published Megatron A100 runs of the calibration used. A :class:`Platform` pairs
an implementation with the hardware it runs on (:data:`PAPER_PLATFORM`: the paper's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tplib.cluster.hardware import P3_16XLARGE, Hardware

__all__ = [
    "ATTENTIONS",
    "ATTENTION_SCORE_BYTES",
    "MEGATRON_2021",
    "PAPER",
    "RECOMPUTES",
    "Attention",
    "Implementation",
    "check_context_parallel",
    "check_recompute",
]

# What the cluster model prices: the runtime's modes (tplib.nn.configs) and selective
# recomputation (Korthikanti et al. 2022).
RECOMPUTES = ("none", "selective", "full")


def check_recompute(mode: str) -> None:
    """Raise ``ValueError`` unless the cluster model prices recomputation ``mode``."""
    if mode not in RECOMPUTES:
        raise ValueError(f"recompute={mode!r} is not a recompute mode: choose one of {RECOMPUTES}")


def check_context_parallel(n_cp: int, attention: str) -> None:
    """Raise ``ValueError`` unless ``n_cp`` context-parallel ranks can run ring attention
    (:mod:`tplib.cluster.context_parallel`) with ``attention``."""
    if isinstance(n_cp, bool) or not isinstance(n_cp, int) or n_cp < 1:
        raise ValueError(f"n_cp={n_cp!r}: #CP must be a whole number of ranks, at least 1")
    if n_cp > 1 and attention != "flash":
        raise ValueError(
            f"n_cp={n_cp} with attention={attention!r}: context parallelism runs ring "
            "attention over FlashAttention kernels; use attention='flash'"
        )


Attention = Literal["unfused", "fused-softmax", "flash"]
ATTENTIONS: tuple[Attention, ...] = ("unfused", "fused-softmax", "flash")

# Bytes of memory traffic per attention score (forward, backward) of the written-out
# attentions, dropout included. Unfused (the paper's): write the fp16 score, scale and
# mask it, an fp32 softmax, dropout. Fused softmax (Megatron's kernel): read the fp16
# score and write the fp16 probability (4), dropout reads it and writes it with a 1-byte
# mask (5); its backward reads the probability and the gradient and writes one (6), and
# dropout's backward reads the gradient and the mask and writes one (5).
ATTENTION_SCORE_BYTES: dict[str, tuple[float, float]] = {
    "unfused": (16.0, 32.0),
    "fused-softmax": (9.0, 11.0),
}


@dataclass(frozen=True)
class Implementation:
    """The training code's choices the cluster model prices (see the module docstring)."""

    attention: Attention = "unfused"
    sequence_parallel: bool = False
    scatter_gather: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    ends: bool = False
    layer_checkpoints: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"attention={self.attention!r} is not an attention: choose one of {ATTENTIONS}"
            )


PAPER = Implementation()
MEGATRON_2021 = Implementation(
    attention="fused-softmax", scatter_gather=True, ends=True, layer_checkpoints=True
)


@dataclass(frozen=True)
class Platform:
    """Where a layout runs and what code runs it: the nodes' ``hardware`` and the training
    code's ``implementation`` (the calibration, the fitted part, travels apart)."""

    hardware: Hardware = P3_16XLARGE
    implementation: Implementation = PAPER


PAPER_PLATFORM = Platform()
