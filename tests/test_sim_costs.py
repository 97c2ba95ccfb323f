"""Tests for tplib.sim.costs: the cache of per-unit costs and the ring all-reduce."""

from __future__ import annotations

import numpy as np
import pytest

from tplib.sim.costs import memo, ring_allreduce


class Counting:
    """A cost model whose computation counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    @memo
    def cost(self, size: int, lengths: np.ndarray) -> float:
        self.calls += 1
        return float(size * np.sum(lengths))


def test_memo_computes_each_distinct_question_once() -> None:
    m = Counting()
    assert m.cost(2, np.array([1, 2])) == 6.0
    assert m.cost(2, np.array([1, 2])) == 6.0  # an equal, new array: the same question
    assert m.calls == 1
    assert m.cost(3, np.array([1, 2])) == 9.0
    assert m.cost(2, np.array([2, 1])) == 6.0  # another array value: asked again
    assert m.cost(2, np.array([[1, 2]])) == 6.0  # another shape: asked again
    assert m.cost(2, np.array([1.0, 2.0])) == 6.0  # another dtype: asked again
    assert m.calls == 5


def test_memo_keeps_one_cache_per_instance() -> None:
    a, b = Counting(), Counting()
    a.cost(1, np.array([5]))
    b.cost(1, np.array([5]))
    assert (a.calls, b.calls) == (1, 1)


def test_ring_allreduce_by_hand() -> None:
    # 4 ranks: 2 (4 - 1) = 6 steps, each moving a quarter of 1 GB at 1 GB/s.
    assert ring_allreduce(1e9, 4, 1e9) == pytest.approx(1.5)
    assert ring_allreduce(1e9, 4, 1e9, step_latency=1e-3) == pytest.approx(1.5 + 6e-3)
    # 2 ranks: each sends its half and receives the other's, twice: the whole buffer once.
    assert ring_allreduce(8.0, 2, 4.0, step_latency=0.5) == pytest.approx(2.0 + 1.0)
    # One rank has nothing to reduce with.
    assert ring_allreduce(1e9, 1, 1e9, step_latency=1.0) == 0.0
    np.testing.assert_array_equal(ring_allreduce(np.array([1.0, 2.0]), 1, 1.0), [0.0, 0.0])
    np.testing.assert_allclose(ring_allreduce(np.array([4.0, 8.0]), 4, 1.0), [6.0, 12.0])
