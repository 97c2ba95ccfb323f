"""The packer against brute force: plain reference packers, the optimum found by search,
every token of every document counted, padding counted from the boundaries."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tplib.packing import Packing, Piece, pack, pad_each


def _random_cases(n_cases: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n_cases):
        seq_len = rng.randint(1, 40)
        lengths = [rng.randint(1, 2 * seq_len) for _ in range(rng.randint(1, 12))]
        cases.append((lengths, seq_len))
    return cases


def _reference_ffd(lengths: list[int], seq_len: int, rows: int | None) -> list[list[int]]:
    """First-fit decreasing written plainly: each row scanned in turn. Rows of pieces as
    (doc, offset) pairs are compared as their lengths' document ids."""
    pieces = [
        (d, o, min(seq_len, n - o)) for d, n in enumerate(lengths) for o in range(0, n, seq_len)
    ]
    pieces.sort(key=lambda p: p[2], reverse=True)  # stable
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(rows or 0)]
    for p in pieces:
        for row in out:
            if sum(q[2] for q in row) + p[2] <= seq_len:
                row.append(p)
                break
        else:
            if rows is None:
                out.append([p])
    return [[q[0] * 1000 + q[1] for q in row] for row in out]


def _reference_next_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    room = seq_len
    for d, n in enumerate(lengths):
        if n > room:
            out.append([])
            room = seq_len
        out[-1].append(d)
        room -= n
    return out


def _ids(packing: Packing) -> list[list[int]]:
    return [[p.doc * 1000 + p.offset for p in row] for row in packing.rows]


def _optimum(lengths: list[int], seq_len: int) -> int:
    """The fewest rows, by search over subsets: for each set of documents the fewest rows
    and, among those, the least-filled last row (exact for bin packing)."""
    n = len(lengths)
    best = [(n + 1, 0)] * (1 << n)
    best[0] = (0, seq_len)
    for mask in range(1, 1 << n):
        for i in range(n):
            if mask >> i & 1:
                rows, fill = best[mask ^ (1 << i)]
                nxt = (
                    (rows, fill + lengths[i])
                    if fill + lengths[i] <= seq_len
                    else (rows + 1, lengths[i])
                )
                best[mask] = min(best[mask], nxt)
    return best[-1][0]


def test_ffd_is_first_fit_decreasing_with_or_without_a_row_count() -> None:
    for lengths, seq_len in _random_cases(300, seed=1):
        assert _ids(pack(lengths, seq_len, split_long=True)) == _reference_ffd(
            lengths, seq_len, None
        )
        assert _ids(pack(lengths, seq_len, rows=3, split_long=True)) == _reference_ffd(
            lengths, seq_len, 3
        )


def test_greedy_is_next_fit_in_stream_order() -> None:
    for lengths, seq_len in _random_cases(300, seed=2):
        lengths = [min(n, seq_len) for n in lengths]
        rows = [[p.doc for p in row] for row in pack(lengths, seq_len, method="greedy").rows]
        assert rows == _reference_next_fit(lengths, seq_len)
    # With B rows the last one stays open: 5 closes row 0 and opens row 1; 8 and 7 fit
    # in no row (left out) but the stream's 2 still goes into the last.
    p = pack([6, 5, 8, 7, 2], 10, rows=2, method="greedy")
    assert [[q.doc for q in row] for row in p.rows] == [[0], [1, 4]]
    assert p.left_out == (2, 3)


def test_every_token_placed_once_or_its_document_left_out() -> None:
    for lengths, seq_len in _random_cases(200, seed=3):
        for method in ("ffd", "greedy"):
            for rows in (None, 2):
                p = pack(lengths, seq_len, rows=rows, method=method, split_long=True)
                assert all(n <= seq_len for n in p.row_lengths)
                assert rows is None or p.batch == rows
                seen = [np.zeros(n, dtype=int) for n in lengths]
                for piece in p.pieces:
                    seen[piece.doc][piece.offset : piece.offset + piece.length] += 1
                for d, counts in enumerate(seen):
                    if d in p.left_out:
                        assert counts.max() <= 1 and counts.min() == 0
                    else:
                        assert (counts == 1).all()
                assert rows is not None or p.left_out == ()


def test_ffd_is_optimal_when_every_document_is_over_a_third_of_a_row() -> None:
    rng = random.Random(4)
    for _ in range(150):
        seq_len = rng.randint(6, 40)
        lengths = [rng.randint(seq_len // 3 + 1, seq_len) for _ in range(rng.randint(1, 8))]
        assert pack(lengths, seq_len).batch == _optimum(lengths, seq_len)


def test_ffd_stays_within_its_bound_of_the_optimum() -> None:
    rng = random.Random(5)
    for _ in range(150):
        seq_len = rng.randint(4, 30)
        lengths = [rng.randint(1, seq_len) for _ in range(rng.randint(1, 8))]
        opt = _optimum(lengths, seq_len)
        assert opt <= pack(lengths, seq_len).batch <= 11 / 9 * opt + 6 / 9
    # The instance that reaches the bound: 9 full rows exist (the lengths add up to 9 L),
    # first-fit decreasing needs 11.
    e = 10
    lengths = [500 + e] * 6 + [250 + 2 * e] * 6 + [250 + e] * 6 + [250 - 2 * e] * 12
    assert sum(lengths) == 9 * 1000
    assert pack(lengths, 1000).batch == 11
    assert pack(lengths, 1000).padding_tokens == 2 * 1000


def test_long_documents_split_into_pieces_that_reassemble_them() -> None:
    p = pack([25, 3, 10], 10, split_long=True)
    pieces = sorted(p.pieces, key=lambda q: (q.doc, q.offset))
    assert pieces == [
        Piece(0, 0, 10),
        Piece(0, 10, 10),
        Piece(0, 20, 5),
        Piece(1, 0, 3),
        Piece(2, 0, 10),
    ]
    assert p.report().split == 1 and p.report().pieces == 5
    # Each piece is a document of its own: its own segment in the row's boundaries,
    # the last row's padding a segment too.
    docs = p.documents()
    assert [docs.lengths(r) for r in range(docs.batch)] == [(10,), (10,), (10,), (5, 3, 2)]
    # Laid out by the boundaries, the pieces of each document reassemble it.
    text = [np.arange(n) + 100 * d for d, n in enumerate([25, 3, 10])]
    rows = [
        np.concatenate([text[q.doc][q.offset : q.offset + q.length] for q in r]) for r in p.rows
    ]
    for d, n in enumerate([25, 3, 10]):
        back = sorted(
            (q.offset, rows[r][docs.bounds[r][j] : docs.bounds[r][j + 1]])
            for r, row in enumerate(p.rows)
            for j, q in enumerate(row)
            if q.doc == d
        )
        assert [o for o, _ in back] == list(range(0, n, 10))
        assert np.array_equal(np.concatenate([x for _, x in back]), text[d])


def test_padding_is_counted_from_the_rows() -> None:
    for lengths, seq_len in _random_cases(100, seed=6):
        for p in (
            pack(lengths, seq_len, split_long=True, method="greedy"),
            pack(lengths, seq_len, rows=3, split_long=True),
            pad_each(lengths, seq_len),
        ):
            docs = p.documents()
            pad = sum(
                docs.lengths(r)[-1]
                for r in range(docs.batch)
                if len(docs.lengths(r)) > len(p.rows[r])
            )
            report = p.report()
            assert report.padding_tokens == pad == p.batch * seq_len - report.real_tokens
            assert report.padding_fraction == pytest.approx(pad / (p.batch * seq_len))
            placed = sum(q.length for q in p.pieces)
            assert report.left_out_tokens == sum(lengths) - placed
            assert report.documents == len(lengths) and report.rows == p.batch


def test_pad_each_gives_every_piece_a_row_of_its_own() -> None:
    p = pad_each([3, 12, 5], 5)
    assert [[(q.doc, q.offset, q.length) for q in row] for row in p.rows] == [
        [(0, 0, 3)],
        [(1, 0, 5)],
        [(1, 5, 5)],
        [(1, 10, 2)],
        [(2, 0, 5)],
    ]
    assert p.padding_tokens == 2 + 3
    kept = pad_each([3, 12, 5], 5, rows=2)
    assert kept.batch == 2 and kept.left_out == (1, 2)
    more = pad_each([3], 5, rows=2)
    assert more.rows == ((Piece(0, 0, 3),), ()) and more.documents().bounds[1] == (0, 5)


def test_bad_input_is_refused_naming_the_rule() -> None:
    with pytest.raises(
        ValueError, match=r"document 1 has 11 tokens, .* never split unless split_long"
    ):
        pack([3, 11], 10)
    with pytest.raises(ValueError, match="document 2 has length 0: every document"):
        pack([3, 4, 0], 10)
    with pytest.raises(ValueError, match="document 0 has length -2"):
        pad_each([-2], 10)
    with pytest.raises(ValueError, match="no documents"):
        pack([], 10)
    with pytest.raises(ValueError, match="packing method 'bfd'"):
        pack([3], 10, method="bfd")
    with pytest.raises(ValueError, match="rows=0"):
        pack([3], 10, rows=0)
    with pytest.raises(ValueError, match="seq_len=0"):
        pack([3], 0)
    with pytest.raises(ValueError, match="row 0 holds 12 tokens"):
        Packing(((Piece(0, 0, 6), Piece(1, 0, 6)),), 10, (6, 6))
    with pytest.raises(ValueError, match=r"document 0 \(6 tokens\) is placed as \[\(0, 4\)\]"):
        Packing(((Piece(0, 0, 4),),), 10, (6,))
