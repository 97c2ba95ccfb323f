"""Virtual pipeline stages: which rank holds which part of the model.

With virtual stages the model is cut into ``P = v * K`` consecutive *parts* (Megatron's
model chunks, torch.distributed.pipelining's stage indices) and each of the K ranks holds
``v`` of them, its *chunks*. A rank's chunks are numbered in model order: chunk c of
rank r is the c-th part, counting from the input, that rank r holds. A *placement* is
the rank of each part, ``placement[p]``; the data a schedule needs from it are
:func:`part_of` and :func:`rank_chunk`.

Two placements cover the schedules in use:

- :func:`interleaved` (Megatron's, and torch's ``Interleaved1F1B``/``LoopedBFS``): part
  ``c*K + r`` on rank r, so activations go round the ring of ranks v times; the step
  from rank K-1 back to rank 0 is the *wrap*.
- :func:`v_shape` (ZBV, DualPipeV): two chunks per rank, down the ranks and back up:
  part ``r`` and part ``2K-1-r`` on rank r, so the turn at rank K-1 stays on the rank
  and the model's last part sits on rank 0, beside the first.

With one chunk per rank both are the identity, ``placement[p] = p``: every schedule
without virtual stages.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "Placement",
    "check_placement",
    "identity",
    "interleaved",
    "n_chunks_of",
    "part_of",
    "rank_chunk",
    "v_shape",
]

Placement = tuple[int, ...]


def identity(n_stages: int) -> Placement:
    """One part per rank, in order: no virtual stages."""
    return tuple(range(n_stages))


def interleaved(n_stages: int, n_chunks: int) -> Placement:
    """Megatron's placement: part ``c*K + r`` on rank r."""
    _check_counts(n_stages, n_chunks)
    return tuple(p % n_stages for p in range(n_stages * n_chunks))


def v_shape(n_stages: int) -> Placement:
    """Two chunks per rank in a V: parts ``0..K-1`` down the ranks, ``K..2K-1`` back up."""
    _check_counts(n_stages, 2)
    return (*range(n_stages), *reversed(range(n_stages)))


def _check_counts(n_stages: int, n_chunks: int) -> None:
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages}: a pipeline needs at least one rank")
    if n_chunks < 1:
        raise ValueError(f"n_chunks={n_chunks}: each rank holds at least one chunk")


def check_placement(placement: Sequence[int], n_stages: int) -> None:
    """Refuse a placement that does not give every one of ``n_stages`` ranks the same
    number of parts."""
    counts = [0] * n_stages
    for p, r in enumerate(placement):
        if not 0 <= r < n_stages:
            raise ValueError(
                f"placement {tuple(placement)} puts part {p} on rank {r}: ranks are "
                f"0..{n_stages - 1}"
            )
        counts[r] += 1
    if not placement or len(set(counts)) != 1:
        raise ValueError(
            f"placement {tuple(placement)} gives the {n_stages} ranks {counts} parts: "
            "every rank holds the same number of chunks, at least one"
        )


def n_chunks_of(placement: Sequence[int], n_stages: int) -> int:
    """v: the chunks each rank holds."""
    return len(placement) // n_stages


def part_of(placement: Sequence[int], rank: int, chunk: int) -> int:
    """The part that chunk ``chunk`` of rank ``rank`` holds."""
    seen = -1
    for p, r in enumerate(placement):
        if r == rank:
            seen += 1
            if seen == chunk:
                return p
    raise ValueError(
        f"rank {rank} has no chunk {chunk} under placement {tuple(placement)} (it holds {seen + 1})"
    )


def rank_chunk(placement: Sequence[int], part: int) -> tuple[int, int]:
    """(rank, chunk) of part ``part``."""
    if not 0 <= part < len(placement):
        raise ValueError(f"part {part}: placement {tuple(placement)} has parts 0..")
    rank = placement[part]
    return rank, sum(1 for r in placement[:part] if r == rank)
