"""The stdlib corpus: deterministic, real text, windows with targets shifted by one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tplib.nn.corpus import (
    VOCAB_SIZE,
    corpus_batch,
    corpus_digest,
    corpus_files,
    stdlib_corpus,
)


def _tree(root: Path) -> Path:
    """A stand-in stdlib: two modules, a package, and directories that must be skipped."""
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "site-packages" / "thirdparty").mkdir(parents=True)
    (root / "b.py").write_bytes(b"bbb")  # no final newline: the corpus adds one
    (root / "a.py").write_bytes(b"aaaa\n")
    (root / "pkg" / "mod.py").write_bytes(b"print('pkg')\n")
    (root / "notes.txt").write_bytes(b"not python\n")
    (root / "test" / "test_a.py").write_bytes(b"TEST\n")
    (root / "site-packages" / "thirdparty" / "x.py").write_bytes(b"THIRD\n")
    return root


def test_files_are_sorted_and_exclusions_skipped(tmp_path: Path) -> None:
    root = _tree(tmp_path / "lib")
    rel = [p.relative_to(root).as_posix() for p in corpus_files(root)]
    assert rel == ["a.py", "b.py", "pkg/mod.py"]


def test_corpus_is_the_files_concatenated_and_capped(tmp_path: Path) -> None:
    root = str(_tree(tmp_path / "lib"))
    whole = bytes(stdlib_corpus(1000, root).tolist())
    assert whole == b"aaaa\n\nbbb\nprint('pkg')\n\n"
    # Capped at 8 bytes: a.py with its separator (6 bytes), then 2 bytes of b.py.
    assert bytes(stdlib_corpus(8, root).tolist()) == b"aaaa\n\nbb"
    assert stdlib_corpus(8, root).dtype == torch.uint8


def test_windows_and_shifted_targets(tmp_path: Path) -> None:
    root = str(_tree(tmp_path / "lib"))
    text = b"aaaa\n\nbbb\nprint('pkg')\n\n"
    tokens, targets = corpus_batch(5, 4, seed=3, max_bytes=1000, root=root)
    assert tokens.shape == targets.shape == (5, 4)
    assert tokens.dtype == targets.dtype == torch.int64
    for row_tokens, row_targets in zip(tokens.tolist(), targets.tolist(), strict=True):
        window = bytes(row_tokens) + bytes(row_targets[-1:])
        assert window in text  # five consecutive bytes of the corpus
        assert row_targets[:-1] == row_tokens[1:]
    with pytest.raises(ValueError, match="needs windows of 100 bytes"):
        corpus_batch(1, 99, seed=0, max_bytes=1000, root=root)


def test_the_real_stdlib_corpus() -> None:
    text = stdlib_corpus()
    files = corpus_files()
    assert 2**20 < text.numel() <= 4 * 2**20
    # It starts with the first file, byte for byte, read independently.
    first = files[0].read_bytes()
    assert bytes(text[: len(first)].tolist()) == first
    assert stdlib_corpus() is text  # read once per process
    assert not any("site-packages" in p.parts for p in files)
    # Real Python: keywords are common, and everything is a byte.
    sample = bytes(text[:200_000].tolist())
    assert sample.count(b"def ") > 100 and sample.count(b"import ") > 10
    a, a_targets = corpus_batch(8, 64, seed=1)
    assert int(a.max()) < VOCAB_SIZE and int(a.min()) >= 0
    assert torch.equal(a[:, 1:], a_targets[:, :-1])
    assert torch.equal(a, corpus_batch(8, 64, seed=1)[0])  # deterministic
    assert not torch.equal(a, corpus_batch(8, 64, seed=2)[0])
    assert len(corpus_digest()) == 16
