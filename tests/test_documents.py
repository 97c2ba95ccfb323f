"""Document boundaries: validation, segments of a slice, position ids, attention pairs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tplib.documents import Documents, Segment, check_bounds, pairs_prefix


@pytest.mark.parametrize(
    ("bounds", "rule"),
    [
        ((0, 5, 12), "short of the row's 16 tokens"),
        ((0, 5, 20), "beyond the row's 16 tokens"),
        ((0, 5, 5, 16), "a document of length 0"),
        ((0, 9, 5, 16), "out of order"),
        ((3, 16), "must start at 0"),
        ((0,), "must start at 0"),
    ],
)
def test_bad_boundaries_are_refused_naming_the_rule(bounds: tuple[int, ...], rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        check_bounds(bounds, 16)
    with pytest.raises(ValueError, match=rule):
        Documents((bounds,), 16)


def test_lengths_of_zero_are_refused() -> None:
    with pytest.raises(ValueError, match="length <= 0"):
        Documents.from_lengths([[4, 0, 12]], 16)


def test_segments_cover_each_row_once_and_stay_in_documents() -> None:
    docs = Documents.from_lengths([[3, 5, 8], [16], [1, 1, 14]], 16)
    for start, end in itertools.combinations(range(17), 2):
        segments = docs.segments(start, end)
        for r, b in enumerate(docs.bounds):
            mine = [s for s in segments if s.row == r]
            # Contiguous, covering [start, end), each inside the document it names.
            assert next(s.lo for s in mine) == start and mine[-1].hi == end
            assert all(a.hi == c.lo for a, c in itertools.pairwise(mine))
            for s in mine:
                j = b.index(s.doc_start)
                assert b[j] <= s.lo < s.hi <= b[j + 1]


def test_segments_of_a_slice_across_a_boundary() -> None:
    docs = Documents.from_lengths([[3, 5, 8]], 16)
    assert docs.segments(2, 10) == [
        Segment(0, 2, 3, 0),
        Segment(0, 3, 8, 3),
        Segment(0, 8, 10, 8),
    ]
    assert [s.context for s in docs.segments(2, 10)] == [2, 0, 0]


def test_positions_restart_at_each_document() -> None:
    docs = Documents.from_lengths([[3, 5], [8]], 8)
    assert docs.positions(0, 8).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))]
    assert docs.positions(2, 3).tolist() == [[2, 0, 1], [2, 3, 4]]


def test_pairs_count_what_document_masked_attention_sees() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        cuts = sorted(rng.choice(np.arange(1, 24), size=rng.integers(0, 5), replace=False))
        bounds = (0, *map(int, cuts), 24)
        # Brute force: the (query, key) pairs of the mask, same document and key <= query.
        doc = np.searchsorted(bounds, np.arange(24), side="right")
        seen = (doc[:, None] == doc[None, :]) & (np.arange(24)[None, :] <= np.arange(24)[:, None])
        prefix = pairs_prefix(bounds)
        for x in range(25):
            assert prefix[x] == seen[:x].sum()
    whole = pairs_prefix((0, 24))
    assert [int(whole[x]) for x in range(25)] == [x * (x + 1) // 2 for x in range(25)]


def test_rows_are_a_batch_slices_boundaries() -> None:
    docs = Documents.from_lengths([[3, 5], [8], [2, 6]], 8)
    assert docs.rows(1, 2).bounds == ((0, 8), (0, 2, 8))
    with pytest.raises(ValueError, match="outside the batch of 3"):
        docs.rows(2, 2)
    assert Documents.whole(2, 8).is_whole() and not docs.is_whole()


def test_rounded_boundaries_drop_the_rows_ends_and_merge_repeats() -> None:
    docs = Documents.from_lengths([[3, 5, 8], [6, 6, 2, 2], [16]], 16)
    # 3 rounds to 0 and 14 to 16 (the ends, dropped); 6 and 12 to 8 and 16; 14 merges.
    assert docs.rounded_boundaries(8) == ((8,), (8,), ())
    assert docs.rounded_boundaries(4) == ((4, 8), (8, 12), ())
