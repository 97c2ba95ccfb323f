"""Dropout whose masks depend on where an element is, not on when it is computed.

GPT-2 and GPT-3 train with dropout (p = 0.1) on the embeddings, on the attention
probabilities and on each residual branch. A pipeline computes a sequence in token
slices, on several stages and op ranks, in an order the schedule chooses, and with
recomputation computes some of it twice; torch's dropout draws its mask from a global
generator in call order, so none of these would drop the same elements as one device
computing the whole batch. Here every mask element is a hash of the element's coordinates:
the iteration's seed, the layer and site, the sequence's row in the global batch, its
token position (and, for attention, the key's position and the head) and the feature.
Any slicing, layout or recomputation of the same iteration therefore drops exactly the
same elements, and the exactness tests hold with dropout on.

The hash is a chain of 32-bit integer mixes (``lowbias32``, by Chris Wellons' hash
prospector): of the seed and site in Python integers, then of each coordinate on the
coordinates' own device in int64 tensors, so a mask needs no host-to-device copy (and no
synchronisation) on a GPU. It is a deterministic stand-in for a random generator,
statistically fine for dropout, and costs a few integer operations per element.

A :class:`DropoutKey` (the iteration's seed and the first sequence's global row) is
what the caller passes to the model to train with dropout; without one the model runs
without dropout (evaluation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SITE_ATTENTION",
    "SITE_EMBEDDING",
    "SITE_MLP",
    "SITE_PROBS",
    "DropoutKey",
    "StageDropout",
    "keep",
    "layer_site",
]

SITE_EMBEDDING, SITE_PROBS, SITE_ATTENTION, SITE_MLP = 0, 1, 2, 3
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class DropoutKey:
    """Which iteration (``seed``) and which sequences (global rows from ``first_row``)."""

    seed: int
    first_row: int = 0

    @staticmethod
    def for_iteration(seed: int, iteration: int, first_row: int = 0) -> DropoutKey:
        """The key of training iteration ``iteration`` of a run seeded ``seed``."""
        return DropoutKey(seed * 1_000_003 + iteration, first_row)

    def rows(self, batch: int, device: torch.device) -> Tensor:
        return torch.arange(self.first_row, self.first_row + batch, device=device)


def _mix_int(x: int) -> int:
    """lowbias32 of the low 32 bits of ``x``, in Python integers (see :func:`_mix`)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix_(x: Tensor) -> Tensor:
    """lowbias32 of ``x``, in place; every element must already lie in [0, 2^32).

    The same chain as :func:`_mix_int`. int64 products wrap modulo 2^64, which keeps the
    low 32 bits exact, and every value is masked back to 32 bits before the next shift.
    In place, because on the attention scores ``x`` is the full (batch, heads, queries,
    keys) tensor: each new temporary would be another allocation of its size."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(0x846CA68B).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def _key_hash(key: DropoutKey, site: int) -> int:
    """The hash of (seed, site), before any coordinate: Python integers, so that no
    tensor is made on the host and copied to the coordinates' device for every mask."""
    seed = _mix_int((key.seed & _MASK32) ^ ((key.seed >> 32) * 0x9E3779B9))
    return _mix_int(seed ^ site)


def keep(p: float, key: DropoutKey, site: int, *coords: Tensor) -> Tensor:
    """The keep mask (True: kept) of dropout with probability ``p`` over the broadcast
    of the integer coordinate tensors ``coords`` (e.g. rows, positions, features).

    Each coordinate is mixed in as it broadcasts: rows, heads and positions over their
    small shapes, and only the last coordinate over the mask's full size. A coordinate
    is masked to 32 bits before it broadcasts (the hash so far already fits), which is
    the same as masking their full-size XOR."""
    h: Tensor | int = _key_hash(key, site)
    for c in coords:
        h = _mix_(h ^ (c.to(torch.int64) & _MASK32))
    if isinstance(h, int):
        raise ValueError("keep() needs at least one coordinate tensor")
    threshold = int(p * 2**32)
    return h >= threshold


class StageDropout:
    """Dropout of one forward of a stage over b sequences and a slice of positions,
    keyed by where each element is (see :mod:`tplib.nn.dropout`).

    ``x`` (batch, tokens, ...) gives the sequences and the device; the hidden states
    dropped are at positions ``[start, start + length)``, by default ``x``'s tokens (a
    sequence-parallel rank gives its shard's: the same rows of the same masks)."""

    def __init__(
        self, p: float, key: DropoutKey, x: Tensor, start: int, *, length: int | None = None
    ) -> None:
        self.p, self.key, self.scale = p, key, 1.0 / (1.0 - p)
        self.rows = key.rows(x.shape[0], x.device)
        length = x.shape[1] if length is None else length
        self.positions = torch.arange(start, start + length, device=x.device)

    def _apply(self, x: Tensor, mask: Tensor) -> Tensor:
        # One pass fewer over the scores than x.masked_fill(~mask, 0) * scale, same values.
        return torch.where(mask, x * self.scale, 0.0)

    def hidden(self, x: Tensor, site: int) -> Tensor:
        """Hidden states (batch, length, hidden): whole on every op rank, or under
        sequence parallelism the rank's shard of the tokens."""
        features = torch.arange(x.shape[-1], device=x.device)
        mask = keep(
            self.p, self.key, site, self.rows[:, None, None], self.positions[:, None], features
        )
        return self._apply(x, mask)

    def probs(self, site: int, heads: Tensor) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """Attention probabilities (batch, heads, queries, keys); ``heads`` are the
        global indices of this rank's heads."""

        def drop(probs: Tensor, qpos: Tensor, kpos: Tensor) -> Tensor:
            rows = self.rows[:, None, None, None]
            mask = keep(self.p, self.key, site, rows, heads[:, None, None], qpos[:, None], kpos)
            return self._apply(probs, mask)

        return drop


def layer_site(layer: int, kind: int) -> int:
    """The site number of dropout ``kind`` in block ``layer`` (the embedding is 0)."""
    return 4 * (layer + 1) + kind
