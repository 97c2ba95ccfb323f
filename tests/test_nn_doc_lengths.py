"""The sources' lengths without torch: the corpus's lengths are its documents' lengths,
and a stream of either source is a seeded order of them."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest

from tplib.nn.doc_lengths import corpus_lengths, document_stream, lognormal_lengths
from tplib.nn.doc_sources import corpus_documents


def test_corpus_lengths_are_the_corpus_documents_lengths(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "b.py").write_bytes(b"bbb")
    (root / "a.py").write_bytes(b"aaaa\n")
    (root / "empty.py").write_bytes(b"")  # no document
    (root / "pkg" / "mod.py").write_bytes(b"print('pkg')\n")
    (root / "test" / "test_a.py").write_bytes(b"TEST\n")  # excluded
    documents = corpus_documents(root=str(root))
    assert corpus_lengths(root) == tuple(int(d.numel()) for d in documents) == (5, 3, 13)


def test_streams_are_seeded_orders_of_the_sources_lengths() -> None:
    # Past the first draw of 1024 log-normal lengths, the stream goes on with the same seed.
    stream = list(itertools.islice(document_stream("lognormal", seq_len=64, seed=3), 3000))
    assert stream == lognormal_lengths(3000, seq_len=64, seed=3)
    corpus = corpus_lengths()
    two_passes = list(
        itertools.islice(document_stream("corpus", seq_len=64, seed=1), 2 * len(corpus))
    )
    first, second = two_passes[: len(corpus)], two_passes[len(corpus) :]
    assert Counter(first) == Counter(second) == Counter(corpus)
    assert first != list(corpus) and first != second  # each pass its own order
    again = document_stream("corpus", seq_len=64, seed=1)
    assert list(itertools.islice(again, len(corpus))) == first
    with pytest.raises(ValueError, match=r"document source 'web': choose one of"):
        document_stream("web", seq_len=64, seed=0)
