"""Packing variable-length documents into rows of ``L`` tokens: which document goes where.

A batch of TeraPipe holds rows of ``seq_len`` (L) tokens; real text comes in documents of
every length. Padding each document to L (what pipeline systems without document masks
do, :func:`pad_each`) wastes the rest of its row. Packing puts several documents into one
row, one after another, and pads only what is left at the row's end; the document mask of
:class:`tplib.documents.Documents` keeps them independent, so a packed row's loss is the
sum of its documents' losses run alone.

:func:`pack` places documents by their lengths alone (the tokens never matter here):

- ``"ffd"``, first-fit decreasing: the longest document first, each into the first row
  with room for it. Ties keep stream order, so the packing is deterministic. FFD never
  uses more than ``11/9 OPT + 6/9`` rows (Dósa 2007), and usually the optimum.
- ``"greedy"``, next-fit over the stream, what a streaming loader holding one row buffer
  does: documents in stream order fill the current row; the first that does not fit
  closes it and opens the next. Rows hold documents in stream order.

With ``rows=None`` the packing opens as many rows as every document needs; with
``rows=B`` it has exactly B rows, and a document that fits in none of them is *left out*
(:attr:`Packing.left_out`: the next batch's, or dropped). Under greedy the B-th row never
closes: later documents still go into it while they fit.

A document longer than L is refused unless ``split_long``: then it is cut into pieces of
L tokens (the last piece the remainder), each packed as a document of its own, with fresh
context: its positions restart and it sees nothing of the piece before it. A document
of a split whose other pieces were placed is still reported left out if any piece was not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from tplib.documents import Documents

__all__ = [
    "DOCUMENT_SOURCES",
    "METHODS",
    "PACKINGS",
    "Packing",
    "PackingReport",
    "Piece",
    "pack",
    "pad_each",
    "piece_lengths",
]

METHODS = ("ffd", "greedy")
# How a run's rows are filled (tplib.runtime.parts.Data.packing): packed by a METHOD, or
# "pad", one document per row; and the sources of whole documents it names.
PACKINGS = (*METHODS, "pad")
DOCUMENT_SOURCES = ("corpus-documents", "lognormal-documents")


@dataclass(frozen=True)
class Piece:
    """Tokens ``[offset, offset + length)`` of document ``doc``: the whole document, or,
    where it was split, one piece of it."""

    doc: int
    offset: int
    length: int


@dataclass(frozen=True)
class PackingReport:
    """What a packing holds and wastes, for a table or a log line."""

    documents: int
    rows: int
    seq_len: int
    real_tokens: int
    padding_tokens: int
    padding_fraction: float
    pieces: int
    split: int  # documents cut into more than one piece
    left_out: int  # documents with a piece in no row
    left_out_tokens: int


@dataclass(frozen=True)
class Packing:
    """Rows of pieces, each row's pieces in the order they sit in it, then its padding.

    ``lengths`` are the documents' lengths the packing was made from; a document not in
    ``left_out`` has all its tokens placed exactly once. Checked when built.
    """

    rows: tuple[tuple[Piece, ...], ...]
    seq_len: int
    lengths: tuple[int, ...]
    left_out: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len}: a row holds at least one token")
        placed: list[list[Piece]] = [[] for _ in self.lengths]
        for r, row in enumerate(self.rows):
            if sum(p.length for p in row) > self.seq_len:
                raise ValueError(
                    f"row {r} holds {sum(p.length for p in row)} tokens: more than "
                    f"seq_len={self.seq_len}"
                )
            for p in row:
                inside = 0 <= p.doc < len(self.lengths) and p.offset >= 0
                if not inside or p.length < 1 or p.offset + p.length > self.lengths[p.doc]:
                    raise ValueError(f"row {r}: {p} is not a piece of one of the documents")
                placed[p.doc].append(p)
        out = set(self.left_out)
        for d, pieces in enumerate(placed):
            covered = sorted((p.offset, p.offset + p.length) for p in pieces)
            if d not in out and not _tiles(covered, self.lengths[d]):
                raise ValueError(
                    f"document {d} ({self.lengths[d]} tokens) is placed as {covered}: a "
                    "document not left out is placed whole, each token exactly once"
                )

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def row_lengths(self) -> tuple[int, ...]:
        """Real tokens per row (the rest of the row is padding)."""
        return tuple(sum(p.length for p in row) for row in self.rows)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """Every placed piece, row after row."""
        return tuple(p for row in self.rows for p in row)

    @property
    def real_tokens(self) -> int:
        return sum(self.row_lengths)

    @property
    def padding_tokens(self) -> int:
        return self.batch * self.seq_len - self.real_tokens

    @property
    def padding_fraction(self) -> float:
        """Padding's share of the rows' tokens (0 for no rows)."""
        return self.padding_tokens / (self.batch * self.seq_len) if self.rows else 0.0

    @cached_property
    def split(self) -> int:
        """Documents cut into more than one piece (longer than ``seq_len``)."""
        return sum(n > self.seq_len for n in self.lengths)

    def documents(self) -> Documents:
        """The rows' boundaries: each piece a document, then a padding segment where the
        row is not full (a row of no piece is one padding segment)."""
        rows = []
        for row, used in zip(self.rows, self.row_lengths, strict=True):
            pad = self.seq_len - used
            rows.append([p.length for p in row] + ([pad] if pad else []))
        return Documents.from_lengths(rows, self.seq_len)

    def report(self) -> PackingReport:
        return PackingReport(
            documents=len(self.lengths),
            rows=self.batch,
            seq_len=self.seq_len,
            real_tokens=self.real_tokens,
            padding_tokens=self.padding_tokens,
            padding_fraction=self.padding_fraction,
            pieces=len(self.pieces),
            split=self.split,
            left_out=len(self.left_out),
            left_out_tokens=sum(self.lengths) - self.real_tokens,
        )


def _tiles(covered: list[tuple[int, int]], n: int) -> bool:
    """Whether sorted ranges ``covered`` tile ``[0, n)``, one after another."""
    ends = [0] + [hi for _, hi in covered]
    return ends[-1] == n and all(lo == e for (lo, _), e in zip(covered, ends, strict=False))


def piece_lengths(n: int, seq_len: int) -> list[int]:
    """A document of ``n`` tokens cut into pieces of ``seq_len`` (the last the rest), as
    ``split_long`` cuts it."""
    return [min(seq_len, n - o) for o in range(0, n, seq_len)]


def _pieces(lengths: Sequence[int], seq_len: int, split_long: bool) -> list[Piece]:
    """Each document as a piece, or cut into pieces of ``seq_len`` with ``split_long``;
    bad input refused before any packing."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: a row holds at least one token")
    if len(lengths) == 0:
        raise ValueError("no documents to pack: give at least one document length")
    out = []
    for d, n in enumerate(lengths):
        if int(n) != n or n <= 0:
            raise ValueError(
                f"document {d} has length {n}: every document has a whole number >= 1 of tokens"
            )
        n = int(n)
        if n > seq_len and not split_long:
            raise ValueError(
                f"document {d} has {n} tokens, more than a row's seq_len={seq_len}: a "
                "document is never split unless split_long=True (pieces of seq_len tokens, "
                "each with fresh context)"
            )
        offsets = range(0, n, seq_len)
        out += [Piece(d, o, m) for o, m in zip(offsets, piece_lengths(n, seq_len), strict=True)]
    return out


def _check_rows(rows: int | None) -> None:
    if rows is not None and rows < 1:
        raise ValueError(f"rows={rows}: a batch holds at least one row (or None: as needed)")


def pack(
    lengths: Sequence[int],
    seq_len: int,
    *,
    rows: int | None = None,
    method: str = "ffd",
    split_long: bool = False,
) -> Packing:
    """Documents of ``lengths`` packed into rows of ``seq_len`` tokens by ``method``
    (``"ffd"`` or ``"greedy"``, see the module's docstring): ``rows=None`` as many rows
    as they need, ``rows=B`` exactly B rows and the rest left out."""
    if method not in METHODS:
        raise ValueError(f"packing method {method!r}: choose one of {METHODS}")
    _check_rows(rows)
    pieces = _pieces(lengths, seq_len, split_long)
    if method == "ffd":
        order = sorted(pieces, key=lambda p: -p.length)  # stable: ties keep stream order
        placed, left = _first_fit(order, seq_len, rows)
    else:
        placed, left = _next_fit(pieces, seq_len, rows)
    return Packing(
        tuple(tuple(row) for row in placed),
        seq_len,
        tuple(int(n) for n in lengths),
        tuple(sorted({p.doc for p in left})),
    )


def _first_fit(
    pieces: list[Piece], seq_len: int, rows: int | None
) -> tuple[list[list[Piece]], list[Piece]]:
    """Each piece into the lowest-numbered row with room: a max-tree over the rows' free
    room finds it in log(rows) steps (the stdlib corpus makes thousands of rows). With
    ``rows=None`` every piece may open a row, so there are as many rows as pieces at most,
    and the first empty row is the next one to open."""
    n_rows = rows if rows is not None else len(pieces)
    size = 1
    while size < n_rows:
        size *= 2
    free = [0] * (2 * size)  # free[size + r]: room left in row r; inner nodes: the max
    free[size : size + n_rows] = [seq_len] * n_rows
    for i in range(size - 1, 0, -1):
        free[i] = max(free[2 * i], free[2 * i + 1])
    placed: list[list[Piece]] = [[] for _ in range(n_rows)]
    left = []
    for p in pieces:
        if free[1] < p.length:
            left.append(p)
            continue
        i = 1
        while i < size:  # down to the leftmost leaf with room
            i = 2 * i if free[2 * i] >= p.length else 2 * i + 1
        placed[i - size].append(p)
        free[i] -= p.length
        while i > 1:
            i //= 2
            free[i] = max(free[2 * i], free[2 * i + 1])
    if rows is None:
        placed = [row for row in placed if row]  # the opened rows, a prefix
    return placed, left


def _next_fit(
    pieces: list[Piece], seq_len: int, rows: int | None
) -> tuple[list[list[Piece]], list[Piece]]:
    placed: list[list[Piece]] = [[]]
    used = 0
    left = []
    for p in pieces:
        if used + p.length > seq_len:
            if rows is not None and len(placed) == rows:
                left.append(p)  # the last row stays open for the stream's shorter ones
                continue
            placed.append([])
            used = 0
        placed[-1].append(p)
        used += p.length
    if rows is not None:
        placed += [[] for _ in range(rows - len(placed))]
    return placed, left


def pad_each(
    lengths: Sequence[int], seq_len: int, *, rows: int | None = None, split_long: bool = True
) -> Packing:
    """What systems without document masks do: every document (or, with ``split_long``,
    every piece of one) alone in a row of its own, padded to ``seq_len``. ``rows=B`` keeps
    the first B rows in stream order (all-padding rows where there are fewer pieces) and
    leaves the rest out."""
    _check_rows(rows)
    pieces = _pieces(lengths, seq_len, split_long)
    n = len(pieces) if rows is None else rows
    placed = [(p,) for p in pieces[:n]] + [() for _ in range(n - len(pieces))]
    return Packing(
        tuple(placed),
        seq_len,
        tuple(int(x) for x in lengths),
        tuple(sorted({p.doc for p in pieces[n:]})),
    )
