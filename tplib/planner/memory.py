"""What the memory-aware planner asks of a memory model, and the peak it holds plans to.

A :class:`SliceMemory` says, in bytes on one GPU of the stage that needs the most:

- ``kept(b, l, c)``: what a unit (a slice of b sequences, l tokens after c of context)
  keeps from its forward to its backward (its activations; under full recomputation
  only its input);
- ``working(b, l, c)``: what the unit needs besides, only while its backward runs (the
  activations full recomputation rebuilds, attention scores a fused backward writes out
  over its c + l keys);
- ``fixed``: what no plan changes (weights, optimizer state, K/V context buffers, the
  allocator's reserve);
- ``in_flight``: the schedule's rule for which units are held at once.

The rules (:func:`peak_bytes`):

- ``in_flight = None``, fill-drain (``gpipe``, ``terapipe``): every unit is held before
  the first backward, so ``peak = fixed + sum_u kept(u) + max_u working(u)``, the
  accounting of :func:`tplib.cluster.memory.memory_per_gpu` (an upper bound on a replay,
  where the unit with the most working bytes may run its backward after others freed
  theirs).
- ``in_flight = w``: sequence-level 1F1B. A stage holds at most ``w + M`` units at once,
  M the most token slices of one batch slice: tplib's ``1f1b`` on K stages runs
  ``K - 1 + M - 1`` warm-up forwards on stage 0 and backwards each batch slice's token
  slices in reverse, so ``w = K - 1`` (with M = 1 this is Megatron's 1F1B, K units).
  ``peak = fixed + (sum of the w + M largest kept) + max_u working(u)``: a bound that
  holds whatever units those are.

:func:`memory_grids` asks the model once per batch-slice size for every cell of the
planner's grid and refuses a NaN, infinite or negative answer by naming the slice.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tplib.plan import Plan, grid_size

__all__ = ["NothingFitsError", "SliceMemory", "memory_grids", "peak_bytes", "unit_bytes"]


class SliceMemory(Protocol):
    """Bytes on one GPU, as the memory-aware planner asks them (see the module
    docstring). ``kept`` and ``working`` broadcast over numpy arrays of lengths and
    contexts, as :meth:`~tplib.sim.costs.SliceCostModel.slice_time` does."""

    @property
    def fixed(self) -> float:
        """Bytes no plan changes: weights, optimizer state, K/V buffers, reserve."""
        ...

    @property
    def in_flight(self) -> int | None:
        """None: fill-drain, every unit at once; w: 1F1B, at most w + M units."""
        ...

    def kept(self, batch_slice_size: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Bytes a unit keeps from its forward to its backward."""
        ...

    def working(self, batch_slice_size: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        """Bytes a unit needs besides while its backward runs."""
        ...


class NothingFitsError(ValueError):
    """No plan fits the memory capacity. ``smallest_peak`` is the least peak any plan
    attains (fill-drain), or a lower bound on it (1F1B: see the message)."""

    def __init__(self, message: str, smallest_peak: float) -> None:
        super().__init__(message)
        self.smallest_peak = smallest_peak


def _checked(x: np.ndarray, what: str, b: int, length: np.ndarray, context: np.ndarray) -> None:
    bad = ~np.isfinite(x) | (x < 0)
    if bad.any():
        i = np.flatnonzero(bad.ravel())[0]
        raise ValueError(
            f"memory model gave {x.ravel()[i]} {what} bytes at batch={b}, "
            f"length={np.broadcast_to(length, x.shape).ravel()[i]}, "
            f"context={np.broadcast_to(context, x.shape).ravel()[i]}: bytes must be "
            "finite and non-negative"
        )


def unit_bytes(
    memory: SliceMemory, b: int, length: np.ndarray, context: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, working) bytes of slices of ``b`` sequences, validated."""
    out = []
    for what, ask in (("kept", memory.kept), ("working", memory.working)):
        x = np.broadcast_to(np.asarray(ask(b, length, context), dtype=float), np.shape(length))
        _checked(x, what, b, length, context)
        out.append(x)
    return out[0], out[1]


def check_rule(memory: SliceMemory) -> int | None:
    """``memory.in_flight``, refused unless None or an integer >= 0, and ``fixed``
    refused unless finite and >= 0."""
    w, fixed = memory.in_flight, memory.fixed
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
        raise ValueError(
            f"memory model's in_flight={w!r}: use None (fill-drain) or the units w >= 0 a "
            "1F1B stage holds beside one batch slice's token slices (K - 1)"
        )
    if not (np.isfinite(fixed) and fixed >= 0):
        raise ValueError(f"memory model's fixed={fixed!r} bytes: must be finite and >= 0")
    return w


def peak_bytes(plan: Plan, memory: SliceMemory) -> float:
    """The peak bytes of ``plan`` under ``memory``'s rule (see the module docstring):
    what the memory-aware planner holds its plans to."""
    w = check_rule(memory)
    kept, working = [], []
    for size, tokens in zip(plan.batch_slices, plan.token_slices, strict=True):
        length = np.asarray(tokens)
        k, wk = unit_bytes(memory, size, length, np.cumsum(length) - length)
        kept.append(k)
        working.append(wk)
    k_all, w_all = np.concatenate(kept), np.concatenate(working)
    if w is not None:
        held = min(w + max(map(len, plan.token_slices)), len(k_all))
        k_all = np.sort(k_all)[len(k_all) - held :]
    return float(memory.fixed + k_all.sum() + w_all.max())


def memory_grids(
    memory: SliceMemory, *, seq_len: int, max_batch_slice_size: int, granularity: int
) -> tuple[np.ndarray, np.ndarray]:
    """``kept[b, k, j]`` and ``working[b, k, j]``: the bytes of a slice of ``b``
    sequences, ``k * g`` tokens long after ``j * g``, on the planner's grid (as
    :func:`~tplib.planner.cost_table.slice_time_table`; inf off it)."""
    n = grid_size(seq_len, granularity)
    k, j = np.nonzero(np.add.outer(np.arange(n + 1), np.arange(n + 1)) <= n)
    k, j = k[k > 0], j[k > 0]
    shape = (max_batch_slice_size + 1, n + 1, n + 1)
    kept, working = np.full(shape, np.inf), np.full(shape, np.inf)
    for b in range(1, max_batch_slice_size + 1):
        kept[b, k, j], working[b, k, j] = unit_bytes(memory, b, k * granularity, j * granularity)
    return kept, working
