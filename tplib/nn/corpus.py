"""Real text, offline: the Python standard library's own sources as a byte-level corpus.

Throughput does not depend on what the tokens say, but statistical efficiency (how fast
the loss falls per update, PipeDream-2BW's Figure 5) does: random token ids have nothing
to learn. Every machine that runs tplib has one real text corpus at hand without a
download: the ``.py`` files of the interpreter's standard library. :func:`stdlib_corpus`
reads them in a fixed order (sorted by their path under the stdlib directory; site
packages, test suites and IDLE left out), concatenated and capped at ``max_bytes``;
:func:`corpus_batch` draws windows from it with a seeded generator, as
:func:`tplib.nn.data.synthetic_batch` draws random ids. Tokens are bytes: vocabulary 256.

The corpus is the same on every machine with the same Python version; :func:`corpus_digest`
names it, so a result can say which text it trained on.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from torch import Tensor

from tplib.nn.doc_lengths import corpus_files, stdlib_root

__all__ = [
    "VOCAB_SIZE",
    "corpus_batch",
    "corpus_digest",
    "corpus_files",
    "stdlib_corpus",
]

VOCAB_SIZE = 256  # byte-level tokens
_DEFAULT_MAX_BYTES = 4 * 2**20  # a few MB: minutes of CPU training never see it twice


@functools.lru_cache(maxsize=4)
def _corpus_bytes(max_bytes: int, root: str | None) -> bytes:
    if max_bytes < 2:
        raise ValueError(f"max_bytes={max_bytes}: a corpus needs at least two bytes")
    parts, size = [], 0
    for path in corpus_files(Path(root) if root else None):
        data = path.read_bytes() + b"\n"  # files end apart even without a final newline
        parts.append(data[: max_bytes - size])
        size += len(parts[-1])
        if size >= max_bytes:
            break
    if size < 2:
        raise RuntimeError(f"no standard-library sources found under {root or stdlib_root()}")
    return b"".join(parts)


def stdlib_corpus(max_bytes: int = _DEFAULT_MAX_BYTES, root: str | None = None) -> Tensor:
    """The corpus as a 1-D ``uint8`` tensor: the files of :func:`corpus_files`, each
    followed by a newline, concatenated until ``max_bytes`` (the last one cut there).
    Read once per process and cached; treat the tensor as read-only."""
    return _corpus_tensor(max_bytes, root)


@functools.lru_cache(maxsize=4)
def _corpus_tensor(max_bytes: int, root: str | None) -> Tensor:
    data = bytearray(_corpus_bytes(max_bytes, root))  # writable: torch wants that
    return torch.frombuffer(data, dtype=torch.uint8)


def corpus_digest(max_bytes: int = _DEFAULT_MAX_BYTES, root: str | None = None) -> str:
    """The first 16 hex digits of the corpus's SHA-256: which text a run trained on."""
    return hashlib.sha256(_corpus_bytes(max_bytes, root)).hexdigest()[:16]


def corpus_batch(
    batch: int,
    seq_len: int,
    seed: int,
    *,
    max_bytes: int = _DEFAULT_MAX_BYTES,
    root: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(tokens, targets)``, int64 of shape ``(batch, seq_len)``: ``batch`` windows of
    ``seq_len + 1`` consecutive bytes of the corpus, their starts drawn uniformly by a
    ``torch.Generator`` seeded with ``seed``; targets are the tokens shifted by one."""
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch={batch}, seq_len={seq_len}: both must be positive")
    text = stdlib_corpus(max_bytes, root)
    n = text.numel()
    if seq_len + 1 > n:
        raise ValueError(
            f"seq_len={seq_len} needs windows of {seq_len + 1} bytes but the corpus has "
            f"{n}: raise max_bytes or shorten the sequences"
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - seq_len, (batch,), generator=g)
    windows = text[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
