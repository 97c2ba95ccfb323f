"""Document sources and packed batches: rows that hold several documents, with their
boundaries and targets.

Two sources of documents:

- ``"corpus"``, real text offline: each ``.py`` file of the Python standard library
  (:func:`tplib.nn.corpus.corpus_files`, in that order; empty files skipped) is one
  document of bytes, vocabulary 256 (:func:`corpus_documents`). Files run from a few
  bytes to hundreds of kilobytes, so many are longer than a row.
- ``"lognormal"``, synthetic: seeded random token ids whose lengths are log-normal
  (:func:`lognormal_lengths`), the shape measured document lengths of web text and code
  follow, heavy right tail included. The median is ``seq_len / 8`` (:data:`MEDIAN_PER_ROW`:
  256 tokens at L = 2048), so a row holds about five documents on average (the mean is
  ``median * exp(sigma**2 / 2)``) and the token slices of a plan cross document boundaries
  at every sequence length, the small ones of CPU tests too. ``sigma = 1.0``
  (:data:`SIGMA`) spreads them over two orders of magnitude (the middle 95 % within a
  factor 7 of the median). Lengths are clipped to ``[1, seq_len]``: a synthetic document
  never needs splitting (about 2 % reach the clip at the defaults); the corpus's long
  files are what exercises ``split_long``.

Both sources' lengths come from :mod:`tplib.nn.doc_lengths`, which needs no torch: a
simulated study of packing draws the same lengths there.

:func:`packed_batch` draws one batch from a source, as :func:`tplib.nn.data.synthetic_batch`
does: batch i drawn with its own seed, independent of every other. Documents are drawn
until their tokens fill the batch's rows, then packed by :func:`tplib.packing.pack` into
exactly ``batch`` rows (documents that fit nowhere are left out), or with ``pad=True``
each alone in its row (:func:`tplib.packing.pad_each`). A document of tokens
``d[0..n-1]`` has targets ``d[1..n-1]`` then :data:`~tplib.documents.IGNORE`: its last
token predicts nothing, documents being independent. Padding is token 0 with ignored
targets. So a packed row's loss is the sum of its documents' losses run alone
(:meth:`PackedBatch.unpacked`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from tplib.documents import IGNORE, Documents
from tplib.nn.corpus import VOCAB_SIZE
from tplib.nn.doc_lengths import (
    MEDIAN_PER_ROW,
    SIGMA,
    SOURCES,
    corpus_files,
    lognormal_lengths,
)
from tplib.packing import Packing, pack, pad_each

__all__ = [
    "MEDIAN_PER_ROW",
    "SIGMA",
    "SOURCES",
    "PackedBatch",
    "corpus_documents",
    "lognormal_documents",
    "lognormal_lengths",
    "pack_documents",
    "packed_batch",
]


@functools.lru_cache(maxsize=2)
def _corpus_bytes(max_bytes: int | None, root: str | None) -> tuple[Tensor, ...]:
    """The corpus's documents as ``uint8``: the whole stdlib would be 90 MB in int64."""
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes}: a corpus needs at least one byte")
    docs, size = [], 0
    for path in corpus_files(Path(root) if root else None):
        data = path.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - size]
        if data:  # an empty file is no document
            docs.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    if not docs:
        raise RuntimeError(f"no standard-library sources found under {root or 'the stdlib'}")
    return tuple(docs)


def corpus_documents(max_bytes: int | None = None, root: str | None = None) -> list[Tensor]:
    """Each standard-library file under ``root`` (default: this interpreter's) as one
    document of int64 byte tokens, in :func:`~tplib.nn.corpus.corpus_files` order, empty
    files skipped, all of them or until ``max_bytes`` (the last one cut there). The files
    are read once per process and cached."""
    return [d.long() for d in _corpus_bytes(max_bytes, root)]


def lognormal_documents(lengths: Sequence[int], *, seed: int, vocab_size: int) -> list[Tensor]:
    """Documents of ``lengths`` seeded random token ids in ``[0, vocab_size)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (sum(lengths),), generator=g)
    return list(torch.split(ids, list(lengths)))


@dataclass(frozen=True)
class PackedBatch:
    """A batch of packed rows: ``tokens`` and ``targets`` of shape ``(batch, seq_len)``,
    int64, the rows' document boundaries (a trailing padding segment included) and the
    packing that placed them."""

    tokens: Tensor
    targets: Tensor
    documents: Documents
    packing: Packing

    def unpacked(self) -> list[tuple[Tensor, Tensor]]:
        """Each placed document (or piece) alone, row after row: ``(tokens (1, n),
        targets (1, n))``, its targets its next tokens then IGNORE. The reference a packed
        run's loss and gradients equal the sum of."""
        out = []
        for r, row in enumerate(self.packing.rows):
            lo = 0
            for p in row:
                x = self.tokens[r, lo : lo + p.length]
                y = torch.cat([x[1:], x.new_full((1,), IGNORE)])
                out.append((x[None].clone(), y[None]))
                lo += p.length
        return out


def pack_documents(
    docs: Sequence[Tensor],
    seq_len: int,
    *,
    rows: int | None = None,
    method: str = "ffd",
    split_long: bool = True,
    pad: bool = False,
) -> PackedBatch:
    """``docs`` (1-D int64 token tensors) packed into rows of ``seq_len`` tokens by
    :func:`~tplib.packing.pack` (or :func:`~tplib.packing.pad_each` with ``pad``), with
    their tokens, targets and boundaries."""
    lengths = [int(d.numel()) for d in docs]
    if pad:
        packing = pad_each(lengths, seq_len, rows=rows, split_long=split_long)
    else:
        packing = pack(lengths, seq_len, rows=rows, method=method, split_long=split_long)
    tokens = torch.zeros(packing.batch, seq_len, dtype=torch.int64)
    targets = torch.full((packing.batch, seq_len), IGNORE, dtype=torch.int64)
    for r, row in enumerate(packing.rows):
        lo = 0
        for p in row:
            piece = docs[p.doc][p.offset : p.offset + p.length]
            tokens[r, lo : lo + p.length] = piece
            targets[r, lo : lo + p.length - 1] = piece[1:]
            lo += p.length
    return PackedBatch(tokens, targets, packing.documents(), packing)


def packed_batch(
    source: str,
    *,
    batch: int,
    seq_len: int,
    seed: int,
    vocab_size: int,
    method: str = "ffd",
    split_long: bool = True,
    pad: bool = False,
) -> PackedBatch:
    """One batch of ``batch`` packed rows of ``seq_len`` tokens from ``source``
    (``"corpus"`` or ``"lognormal"``), drawn with ``seed`` alone: documents in a seeded
    order (a permutation of the corpus's files; seeded lengths and ids) until their tokens
    reach ``batch * seq_len``, packed into exactly ``batch`` rows (``pad``: each alone in
    a row, the first ``batch`` rows kept)."""
    if source not in SOURCES:
        raise ValueError(f"document source {source!r}: choose one of {SOURCES}")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch={batch}, seq_len={seq_len}: both must be positive")
    need = VOCAB_SIZE if source == "corpus" else 1
    if vocab_size < need:
        raise ValueError(
            f"document source {source!r} needs token ids up to {need - 1} but vocab_size "
            f"is {vocab_size}: raise vocab_size to at least {need}"
        )
    target = batch * seq_len
    if source == "corpus":
        corpus = _corpus_bytes(None, None)
        g = torch.Generator().manual_seed(seed)
        docs, total = [], 0
        for i in torch.randperm(len(corpus), generator=g).tolist():
            if total >= target:
                break
            docs.append(corpus[i].long())
            total += corpus[i].numel()
    else:
        lengths = _enough(seq_len, seed, target)
        docs = lognormal_documents(lengths, seed=seed, vocab_size=vocab_size)
    return pack_documents(docs, seq_len, rows=batch, method=method, split_long=split_long, pad=pad)


def _enough(seq_len: int, seed: int, target: int) -> list[int]:
    """The shortest prefix of seed's log-normal lengths whose sum reaches ``target``."""
    n = 2 * math.ceil(target / (seq_len * MEDIAN_PER_ROW)) + 8  # twice the need: the mean
    while True:  # exceeds the median, so one pass almost always does
        lengths = lognormal_lengths(n, seq_len=seq_len, seed=seed)
        cumulative = np.cumsum(lengths)
        if cumulative[-1] >= target:
            return lengths[: int(np.searchsorted(cumulative, target)) + 1]
        n *= 2
