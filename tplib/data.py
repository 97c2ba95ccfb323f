"""Deterministic synthetic token batches.

Iteration latency and exactness do not depend on what the tokens say, so tplib trains on
seeded random token ids: every process and every reference run draws the same batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tplib.config import GPTConfig

__all__ = ["synthetic_batch"]


def synthetic_batch(
    cfg: GPTConfig, batch: int, seq_len: int, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``(tokens, targets)`` of shape ``(batch, seq_len)``; targets are tokens shifted by one."""
    if seq_len > cfg.seq_len:
        raise ValueError(
            f"seq_len={seq_len} exceeds the model's context of {cfg.seq_len} tokens (GPTConfig.seq_len)"
        )
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
