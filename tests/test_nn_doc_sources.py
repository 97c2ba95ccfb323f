"""Packed batches: targets by the document rule, rows that unpack into their documents,
one batch per seed, the sources' documents and lengths."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tplib.documents import IGNORE
from tplib.nn.doc_sources import (
    MEDIAN_PER_ROW,
    PackedBatch,
    corpus_documents,
    lognormal_lengths,
    pack_documents,
    packed_batch,
)


def _docs(lengths: list[int]) -> list[torch.Tensor]:
    """Documents whose every token says where it comes from: 100 * (doc + 1) + position."""
    return [100 * (d + 1) + torch.arange(n) for d, n in enumerate(lengths)]


@pytest.mark.parametrize("pad", [False, True])
def test_targets_are_each_documents_next_tokens_then_ignore(pad: bool) -> None:
    b = pack_documents(_docs([7, 3, 12, 1, 5]), 8, rows=5, pad=pad)
    assert b.tokens.shape == b.targets.shape == (5, 8)
    for r in range(5):
        for lo, hi in zip(b.documents.bounds[r], b.documents.bounds[r][1:], strict=False):
            x, y = b.tokens[r, lo:hi], b.targets[r, lo:hi]
            if (x == 0).all():  # padding
                assert (y == IGNORE).all()
                continue
            # a piece of one document: consecutive tokens of it
            assert (torch.diff(x) == 1).all() and len(set((x // 100).tolist())) == 1
            assert torch.equal(y[:-1], x[1:]) and int(y[-1]) == IGNORE


def test_unpacked_documents_rebuild_the_rows_and_the_loss() -> None:
    lengths = [7, 3, 12, 1, 5, 2]
    docs = _docs(lengths)
    b = pack_documents(docs, 8, method="greedy")
    alone = b.unpacked()
    assert len(alone) == len(b.packing.pieces) == 7
    # Each is the piece of its document the packing placed, with the document rule's targets.
    for (x, y), p in zip(alone, b.packing.pieces, strict=True):
        piece = docs[p.doc][p.offset : p.offset + p.length]
        assert torch.equal(x[0], piece) and x.shape == (1, p.length)
        assert y[0].tolist() == [*piece[1:].tolist(), IGNORE]
    # Row after row, padded with 0 / IGNORE, they are the packed batch.
    it = iter(alone)
    for r, row in enumerate(b.packing.rows):
        xs, ys = zip(*[next(it) for _ in row], strict=True)
        pad = 8 - sum(p.length for p in row)
        assert torch.equal(b.tokens[r], torch.cat([*(x[0] for x in xs), torch.zeros(pad).long()]))
        assert torch.equal(
            b.targets[r], torch.cat([*(y[0] for y in ys), torch.full((pad,), IGNORE)])
        )
    # A per-token model's summed loss is the same packed or document by document.
    table = torch.randn(700, 700, generator=torch.Generator().manual_seed(0))
    packed = F.cross_entropy(table[b.tokens].flatten(0, 1), b.targets.flatten(), reduction="sum")
    unpacked = sum(F.cross_entropy(table[x[0]], y[0], reduction="sum") for x, y in alone)
    assert float(packed) == pytest.approx(float(unpacked), rel=1e-5)


@pytest.mark.parametrize("source", ["lognormal", "corpus"])
def test_a_batch_per_seed(source: str) -> None:
    def draw(seed: int, pad: bool = False) -> PackedBatch:
        return packed_batch(source, batch=3, seq_len=64, seed=seed, vocab_size=256, pad=pad)

    a, again, other = draw(7), draw(7), draw(8)
    assert torch.equal(a.tokens, again.tokens) and a.documents == again.documents
    assert not torch.equal(a.tokens, other.tokens)
    assert a.packing.batch == 3 and int(a.tokens.max()) < 256
    assert a.documents == a.packing.documents()
    # Enough documents were drawn to fill the rows: padding only where nothing fit.
    assert a.packing.real_tokens + a.packing.report().left_out_tokens >= 3 * 64
    padded = draw(7, pad=True)
    assert all(len(row) <= 1 for row in padded.packing.rows)


def test_lognormal_lengths_follow_their_parameters() -> None:
    lengths = np.array(lognormal_lengths(4000, seq_len=10**6, seed=1, median=300, sigma=0.7))
    logs = np.log(lengths)
    assert np.median(lengths) == pytest.approx(300, rel=0.05)
    assert logs.std() == pytest.approx(0.7, rel=0.05)
    # The default median is a share of the row; lengths are clipped to [1, seq_len].
    short = np.array(lognormal_lengths(4000, seq_len=64, seed=2))
    assert short.min() >= 1 and short.max() == 64
    assert np.median(short) == pytest.approx(64 * MEDIAN_PER_ROW, rel=0.1)
    assert 0.01 < (short == 64).mean() < 0.03  # P(Z > ln 8) = 1.9 %: the clipped tail
    assert lognormal_lengths(5, seq_len=64, seed=3) == lognormal_lengths(5, seq_len=64, seed=3)
    assert math.isclose(MEDIAN_PER_ROW * 2048, 256)


def test_corpus_documents_are_the_files(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "b.py").write_bytes(b"bbb")
    (tmp_path / "a.py").write_bytes(b"aaaa\n")
    (tmp_path / "empty.py").write_bytes(b"")
    (tmp_path / "pkg" / "m.py").write_bytes(b"m\n")
    docs = corpus_documents(root=str(tmp_path))
    assert [bytes(d.tolist()) for d in docs] == [b"aaaa\n", b"bbb", b"m\n"]
    assert all(d.dtype == torch.int64 for d in docs)
    capped = corpus_documents(max_bytes=7, root=str(tmp_path))
    assert [bytes(d.tolist()) for d in capped] == [b"aaaa\n", b"bb"]


def test_bad_sources_and_vocabularies_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"'corpus' needs token ids up to 255 but vocab_size is 128"
    ):
        packed_batch("corpus", batch=2, seq_len=16, seed=0, vocab_size=128)
    with pytest.raises(ValueError, match="document source 'wiki'"):
        packed_batch("wiki", batch=2, seq_len=16, seed=0, vocab_size=256)
    with pytest.raises(ValueError, match="batch=0"):
        packed_batch("lognormal", batch=0, seq_len=16, seed=0, vocab_size=256)
    with pytest.raises(ValueError, match=r"more than a row's seq_len=4: .* split_long"):
        pack_documents(_docs([5]), 4, split_long=False)
    b = packed_batch("lognormal", batch=2, seq_len=16, seed=0, vocab_size=5)
    assert int(b.tokens.max()) < 5
