"""Document lengths of the two document sources, without torch.

:mod:`tplib.nn.doc_sources` makes documents of tokens; a simulated study of packing
(:mod:`tplib.tables.packed_sequences`) needs only how long they are. Both read their
lengths here, so the simulated documents are the measured ones' lengths, and this module
imports numpy alone:

- the ``"corpus"`` source: :func:`corpus_files`, the standard library's ``.py`` files in
  a fixed order (the order :mod:`tplib.nn.corpus` concatenates them in), and
  :func:`corpus_lengths`, their sizes in bytes with the empty files skipped: the lengths
  of :func:`~tplib.nn.doc_sources.corpus_documents`, one byte one token, read from the
  file system without reading the files;
- the ``"lognormal"`` source: :func:`lognormal_lengths`, whose median is ``seq_len *``
  :data:`MEDIAN_PER_ROW` and shape :data:`SIGMA` (their reasons are in
  :mod:`tplib.nn.doc_sources`).

:func:`document_stream` gives either source's lengths as an endless seeded stream, for a
run of many batches.
"""

from __future__ import annotations

import functools
import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = [
    "MEDIAN_PER_ROW",
    "SIGMA",
    "SOURCES",
    "corpus_files",
    "corpus_lengths",
    "document_stream",
    "lognormal_lengths",
    "stdlib_root",
]

SOURCES = ("corpus", "lognormal")
MEDIAN_PER_ROW = 1 / 8  # the log-normal median as a share of seq_len: 256 at L = 2048
SIGMA = 1.0  # the log-normal's shape: the standard deviation of log(length)
# Directories whose sources are not the library itself: installed packages, test suites
# (which carry deliberately malformed and odd-encoded files), the IDE, byte-code caches.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)


def stdlib_root() -> Path:
    """This interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files under ``root`` (default: this interpreter's
    stdlib), sorted by their path relative to it, excluded directories left out."""
    root = root or stdlib_root()
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=4)
def corpus_lengths(root: Path | None = None) -> tuple[int, ...]:
    """Each corpus document's length in tokens (bytes), in :func:`corpus_files` order,
    empty files skipped as the corpus's documents skip them. Listed once per process and
    cached, as the corpus's documents are read once."""
    sizes = [p.stat().st_size for p in corpus_files(root)]
    lengths = tuple(n for n in sizes if n > 0)
    if not lengths:
        raise RuntimeError(f"no standard-library sources found under {root or stdlib_root()}")
    return lengths


def lognormal_lengths(
    n: int,
    *,
    seq_len: int,
    seed: int,
    median: float | None = None,
    sigma: float = SIGMA,
) -> list[int]:
    """``n`` document lengths, log-normal with ``median`` (default ``seq_len *``
    :data:`MEDIAN_PER_ROW`) and ``sigma``, rounded and clipped to ``[1, seq_len]``; drawn
    by a numpy generator seeded with ``seed`` (so the first ``m`` of ``n`` are the ``m``
    drawn alone)."""
    median = seq_len * MEDIAN_PER_ROW if median is None else median
    if n < 0 or seq_len < 1 or median <= 0 or sigma < 0:
        raise ValueError(
            f"n={n}, seq_len={seq_len}, median={median}, sigma={sigma}: a count >= 0, a "
            "row of >= 1 token, a positive median and sigma >= 0"
        )
    draws = np.random.default_rng(seed).lognormal(math.log(median), sigma, n)
    return [int(x) for x in np.clip(np.rint(draws), 1, seq_len)]


def document_stream(source: str, *, seq_len: int, seed: int) -> Iterator[int]:
    """``source``'s documents' lengths in a seeded order, without end: the corpus's files
    in a numpy permutation seeded with ``seed`` (a new one each pass), or the log-normal
    lengths of ``seed`` (drawn again, twice as many, when used up: the first draws of a
    seed stay the same)."""
    if source not in SOURCES:
        raise ValueError(f"document source {source!r}: choose one of {SOURCES}")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: a row holds at least one token")
    return _corpus_stream(seed) if source == "corpus" else _lognormal_stream(seq_len, seed)


def _corpus_stream(seed: int) -> Iterator[int]:
    lengths = np.asarray(corpus_lengths())
    rng = np.random.default_rng(seed)
    while True:
        yield from lengths[rng.permutation(len(lengths))].tolist()


def _lognormal_stream(seq_len: int, seed: int) -> Iterator[int]:
    n, done = 1024, 0
    while True:
        yield from lognormal_lengths(n, seq_len=seq_len, seed=seed)[done:]
        done, n = n, 2 * n
