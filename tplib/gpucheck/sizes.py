"""What the GPU check measures, and at which sizes: a GPU's (:data:`GPU`) or, in the
rehearsal on the CPU, small ones (:data:`DRY`); and the targets the measurements are held to."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DRY", "GPU", "MEMORY_CASES", "MEMORY_TARGET", "MFU_TARGET", "SLICING_TARGET", "Sizes"]


@dataclass(frozen=True)
class Sizes:
    """What the steps measure, on a GPU or (the rehearsal) on the CPU."""

    device: str
    model: str  # Figure 3, slicing, dropout, efficiency
    fig3_tokens: tuple[int, ...]
    fig3_dtype: str
    seq_len: int  # slicing and dropout
    stage_layers: int
    slices: tuple[int, ...]
    precision: str  # slicing, dropout, memory
    efficiency_batch: int
    efficiency_seq_len: int
    memory_model: str
    memory_overrides: tuple[tuple[str, object], ...]
    memory_batch: int
    memory_seq_len: int
    repeats: int
    warmup: int
    multi_rank_model: str = "tiny"


GPU = Sizes(
    device="cuda",
    model="GPT3-1B",
    fig3_tokens=tuple(2**i for i in range(12)),  # 1 ... 2048: the paper's Figure 3
    fig3_dtype="float16",  # the paper's V100 runs
    seq_len=2048,
    stage_layers=2,
    slices=(8, 16),
    precision="bf16",
    efficiency_batch=4,
    efficiency_seq_len=2048,
    memory_model="GPT3-1B",
    memory_overrides=(("n_layer", 4), ("dropout", 0.0)),
    memory_batch=4,
    memory_seq_len=1024,
    repeats=10,
    warmup=3,
)
DRY = Sizes(
    device="cpu",
    model="tiny",
    fig3_tokens=(1, 4, 16, 64),
    fig3_dtype="float32",
    seq_len=64,
    stage_layers=2,
    slices=(8, 16),
    precision="bf16",
    efficiency_batch=2,
    efficiency_seq_len=64,
    memory_model="tiny",
    memory_overrides=(),
    memory_batch=4,
    memory_seq_len=16,
    repeats=2,
    warmup=1,
)
MEMORY_CASES = tuple((s, r) for s in ("gpipe", "1f1b", "terapipe") for r in ("none", "full"))
SLICING_TARGET = 1.10  # sliced / whole at 8 slices
MFU_TARGET = 0.40
MEMORY_TARGET = 0.10
