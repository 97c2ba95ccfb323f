"""Deterministic token batches: synthetic by default, real text on request.

Iteration latency and exactness do not depend on what the tokens say, so tplib trains on
seeded random token ids: every process and every reference run draws the same batch.
Statistical efficiency does depend on it: :func:`training_batch` also serves byte-level
text of the Python standard library's sources (:mod:`tplib.nn.corpus`), available offline.

Rows of whole documents come from :func:`document_batch`: the documents of a
:data:`DOCUMENT_SOURCES` source (each stdlib file, or seeded log-normal lengths,
:mod:`tplib.nn.doc_sources`) placed into rows by a :data:`PACKINGS` method
(:mod:`tplib.packing`), with their boundaries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tplib.nn.configs import GPTConfig
from tplib.packing import DOCUMENT_SOURCES, PACKINGS

if TYPE_CHECKING:
    from tplib.nn.doc_sources import PackedBatch

__all__ = [
    "DOCUMENT_SOURCES",
    "PACKINGS",
    "batch_rows",
    "document_batch",
    "synthetic_batch",
    "training_batch",
]


def document_batch(
    cfg: GPTConfig, source: str, batch: int, seq_len: int, seed: int, packing: str = "ffd"
) -> PackedBatch:
    """Iteration ``seed``'s ``batch`` rows of ``seq_len`` tokens of whole documents from
    ``source`` (documents longer than a row are cut into rows' lengths, each piece its
    own document), with their boundaries and :data:`~tplib.documents.IGNORE` targets."""
    if source not in DOCUMENT_SOURCES:
        raise ValueError(f"document source {source!r}: choose one of {DOCUMENT_SOURCES}")
    if packing not in PACKINGS:
        raise ValueError(f"packing {packing!r}: choose one of {PACKINGS}")
    _check_length(cfg, seq_len)
    from tplib.nn.doc_sources import packed_batch  # the corpus is read on first use

    return packed_batch(
        source.removesuffix("-documents"),
        batch=batch,
        seq_len=seq_len,
        seed=seed,
        vocab_size=cfg.vocab_size,
        method="ffd" if packing == "pad" else packing,
        split_long=True,
        pad=packing == "pad",
    )


def batch_rows(
    cfg: GPTConfig,
    source: str,
    batch: int,
    seq_len: int,
    iterations: range,
    data_seed: int,
    rows: slice,
) -> tuple[Tensor, Tensor]:
    """``rows`` of the batch of each of ``iterations`` (iteration i's batch drawn with
    seed ``data_seed + i``), one iteration's after another: a replica's share of the
    iterations a pass over the schedule runs."""
    pairs = [training_batch(cfg, source, batch, seq_len, data_seed + i) for i in iterations]
    return torch.cat([x[rows] for x, _ in pairs]), torch.cat([y[rows] for _, y in pairs])


def training_batch(
    cfg: GPTConfig, source: str, batch: int, seq_len: int, seed: int
) -> tuple[Tensor, Tensor]:
    """A run's batch from ``source``: "synthetic" (:func:`synthetic_batch`) or "stdlib"
    (:func:`tplib.nn.corpus.corpus_batch`, bytes: needs a vocabulary of at least 256)."""
    if source == "synthetic":
        return synthetic_batch(cfg, batch, seq_len, seed=seed)
    if source == "stdlib":
        if cfg.vocab_size < 256:
            raise ValueError(
                f"data source 'stdlib' is bytes (256 token ids) but the model's vocab_size is "
                f"{cfg.vocab_size}: override vocab_size to at least 256"
            )
        _check_length(cfg, seq_len)
        from tplib.nn.corpus import corpus_batch  # reads the sources on first use

        return corpus_batch(batch, seq_len, seed)
    raise ValueError(f"data source {source!r}: choose 'synthetic' or 'stdlib'")


def synthetic_batch(
    cfg: GPTConfig, batch: int, seq_len: int, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``(tokens, targets)`` of shape ``(batch, seq_len)``; targets are tokens shifted by one."""
    _check_length(cfg, seq_len)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _check_length(cfg: GPTConfig, seq_len: int) -> None:
    if seq_len > cfg.seq_len:
        raise ValueError(
            f"seq_len={seq_len} exceeds the model's context of {cfg.seq_len} tokens (GPTConfig.seq_len)"
        )
