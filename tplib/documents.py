"""Document boundaries of packed rows: which tokens of a row belong to which document.

A packed row of ``L`` tokens holds several documents one after another (and, where the
packer left room, a tail of padding, which is a segment like any other whose targets are
all ignored). :class:`Documents` holds each row's cumulative boundaries
``(0, e_1, ..., e_n = L)``: document j is tokens ``[e_j, e_{j+1})``. The rows of a batch
travel with their boundaries: a batch slice takes its rows' (:meth:`Documents.rows`).

Within a document attention is causal and position ids count from 0; across documents
nothing is seen. A token slice ``[start, end)`` of a row therefore cuts it into
*segments* (:meth:`Documents.segments`), one per document it touches: the segment's
queries attend causally to its own keys and to the keys of the same document before the
slice, ``[document start, segment start)``, which earlier slices wrote into the K/V
context. Every other key of the context is invisible to them.

Boundaries are refused before any work when they do not start at 0, do not end at the
row's length, go backwards or repeat (a document of length 0).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["IGNORE", "Documents", "Segment", "check_bounds", "pairs_prefix"]

IGNORE = -100  # a target the loss skips: a document's last token, padding


def check_bounds(bounds: Sequence[int], seq_len: int, row: int = 0) -> tuple[int, ...]:
    """``bounds`` as a tuple, or ``ValueError`` naming the rule it breaks: cumulative
    document lengths of one row start at 0, rise strictly (no document of length 0) and
    end at the row's ``seq_len``."""
    out = tuple(int(b) for b in bounds)
    if len(out) < 2 or out[0] != 0:
        raise ValueError(
            f"row {row}: document boundaries {out} must start at 0 and hold at least one "
            "document (0, ..., L)"
        )
    for a, b in itertools.pairwise(out):
        if b <= a:
            rule = "a document of length 0" if b == a else "boundaries out of order"
            raise ValueError(
                f"row {row}: document boundaries {out} go from {a} to {b}: {rule}; "
                "boundaries must rise strictly"
            )
    if out[-1] != seq_len:
        rule = "beyond" if out[-1] > seq_len else "short of"
        raise ValueError(
            f"row {row}: document lengths add up to {out[-1]}, {rule} the row's "
            f"{seq_len} tokens: a row's documents (and padding) must fill it exactly"
        )
    return out


@dataclass(frozen=True)
class Segment:
    """The part of one document a token slice holds: tokens ``[lo, hi)`` of its row,
    in the document that starts at ``doc_start`` (so ``lo - doc_start`` tokens of
    context)."""

    row: int
    lo: int
    hi: int
    doc_start: int

    @property
    def context(self) -> int:
        return self.lo - self.doc_start


@dataclass(frozen=True)
class Documents:
    """Per row, the cumulative boundaries ``(0, ..., seq_len)`` of its documents."""

    bounds: tuple[tuple[int, ...], ...]
    seq_len: int

    def __post_init__(self) -> None:
        if not self.bounds:
            raise ValueError("Documents of no rows: a batch holds at least one row")
        checked = tuple(check_bounds(b, self.seq_len, r) for r, b in enumerate(self.bounds))
        object.__setattr__(self, "bounds", checked)

    @classmethod
    def from_lengths(cls, lengths: Iterable[Sequence[int]], seq_len: int) -> Documents:
        """Boundaries from each row's document lengths (which must add up to ``seq_len``)."""
        rows = []
        for r, row in enumerate(lengths):
            if any(int(n) <= 0 for n in row):
                raise ValueError(
                    f"row {r}: document lengths {tuple(row)} hold a length <= 0: every "
                    "document has at least one token"
                )
            acc = [0]
            for n in row:
                acc.append(acc[-1] + int(n))
            rows.append(tuple(acc))
        return cls(tuple(rows), seq_len)

    @classmethod
    def whole(cls, batch: int, seq_len: int) -> Documents:
        """Rows of one document each: what an unpacked batch is."""
        return cls(((0, seq_len),) * batch, seq_len)

    @property
    def batch(self) -> int:
        return len(self.bounds)

    def lengths(self, row: int) -> tuple[int, ...]:
        b = self.bounds[row]
        return tuple(y - x for x, y in itertools.pairwise(b))

    def rows(self, first: int, n: int) -> Documents:
        """The boundaries of rows ``[first, first + n)``: a batch slice's."""
        if not (first >= 0 and n >= 1 and first + n <= self.batch):
            raise ValueError(f"rows [{first}, {first + n}) outside the batch of {self.batch}")
        return Documents(self.bounds[first : first + n], self.seq_len)

    def segments(self, start: int, end: int) -> list[Segment]:
        """The segments of token slice ``[start, end)``, row by row, first to last."""
        out = []
        for r, b in enumerate(self.bounds):
            j = bisect.bisect_right(b, start) - 1  # the document holding ``start``
            while j + 1 < len(b) and b[j] < end:
                out.append(Segment(r, max(start, b[j]), min(end, b[j + 1]), b[j]))
                j += 1
        return out

    @cached_property
    def _doc_starts(self) -> np.ndarray:
        """``(batch, seq_len)``: the start of the document each token is in."""
        out = np.empty((self.batch, self.seq_len), dtype=np.int64)
        for r, b in enumerate(self.bounds):
            out[r] = np.repeat(np.asarray(b[:-1]), self.lengths(r))
        return out

    def starts(self, start: int, length: int) -> np.ndarray:
        """``(batch, length)``: where the document of each token ``[start, start +
        length)`` begins."""
        return self._doc_starts[:, start : start + length]

    def positions(self, start: int, length: int) -> np.ndarray:
        """``(batch, length)`` position ids of tokens ``[start, start + length)``: each
        counts from the start of its own document."""
        return np.arange(start, start + length) - self.starts(start, length)

    def pairs_prefix(self) -> np.ndarray:
        """``(batch, seq_len + 1)``: per row, :func:`pairs_prefix`."""
        return np.stack([pairs_prefix(b) for b in self.bounds])

    def rounded_boundaries(self, step: int) -> tuple[tuple[int, ...], ...]:
        """Per row, its document boundaries rounded to the nearest multiple of ``step``
        tokens (halves up), sorted, repeats merged, those at the row's ends dropped."""
        L = self.seq_len
        return tuple(
            tuple(sorted({(x + step // 2) // step * step for x in b[1:-1]} - {0, L}))
            for b in self.bounds
        )

    def is_whole(self) -> bool:
        """Every row one document: attention is plain causal attention."""
        return all(len(b) == 2 for b in self.bounds)


def pairs_prefix(bounds: Sequence[int]) -> np.ndarray:
    """``P[x]``: the query-key pairs document-masked causal attention computes for the
    row's tokens ``[0, x)``, each token seeing itself and its document's earlier tokens.
    A slice ``[s, e)`` computes ``P[e] - P[s]`` pairs, whatever the slicing."""
    b = np.asarray(bounds, dtype=np.int64)
    seen = np.arange(1, b[-1] + 1) - np.repeat(b[:-1], np.diff(b))  # per token: keys seen
    return np.concatenate([[0], np.cumsum(seen)])
