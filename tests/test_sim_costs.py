"""Tests for tplib.sim.costs: the cache of per-unit costs, the ring all-reduce, and
virtual stages: where a placement puts the parts, and the simulator pricing chunks
through placed costs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tests.unit_costs import ConstantCosts, UnsplitCosts
from tplib.plan import Plan
from tplib.schedule import Action, Kind, make_schedule
from tplib.schedule.chunks import interleaved, v_shape
from tplib.sim.costs import Parts, memo, place, ring_allreduce
from tplib.sim.simulate import SliceModelCosts, simulate, simulate_schedule


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


# ---- virtual stages: where the parts sit, and the simulator pricing chunks ---------------


def test_parts_follow_the_interleaved_placement_round_the_wrap() -> None:
    parts = Parts(interleaved(3, 2))  # parts 0 1 2 on ranks 0 1 2, parts 3 4 5 again
    assert (parts.n_stages, parts.n_chunks) == (3, 2)
    assert parts.part(0, 1) == 3 and parts.part(2, 0) == 2
    assert parts.neighbour(2, 0, 1) == 0  # the wrap: part 2 on rank 2 feeds part 3 on rank 0
    assert parts.neighbour(0, 0, -1) is None and parts.neighbour(2, 1, 1) is None
    # Activations go to the next part's rank, gradients to the previous part's.
    assert parts.link(2, Action(Kind.SA, 2, 0, 0)) == (2, 0)
    assert parts.link(0, Action(Kind.RA, 0, 0, 0, chunk=1)) == (2, 0)
    assert parts.link(0, Action(Kind.SG, 0, 0, 0, chunk=1)) == (0, 2)
    assert parts.link(2, Action(Kind.RG, 2, 0, 0)) == (0, 2)
    assert parts.link(1, Action(Kind.SA, 1, 0, 0, chunk=1)) == (1, 2)
    with pytest.raises(ValueError, match="no peer"):
        parts.link(2, Action(Kind.SA, 2, 0, 0, chunk=1))  # the model's last part
    assert Parts.of_stages(3) == Parts((0, 1, 2)) != parts


def test_the_v_shape_turn_receives_nothing() -> None:
    parts = Parts(v_shape(3))  # parts 0 1 2 down ranks 0 1 2, parts 3 4 5 up ranks 2 1 0
    assert not parts.receives(2, Action(Kind.F, 2, 0, 0, chunk=1))  # part 3 after part 2, same rank
    assert not parts.receives(2, Action(Kind.B, 2, 0, 0))  # part 2's gradient from part 3
    assert not parts.receives(0, Action(Kind.F, 0, 0, 0))  # the model's first part
    assert not parts.receives(0, Action(Kind.B, 0, 0, 0, chunk=1))  # its last part, beside it
    assert parts.receives(1, Action(Kind.F, 1, 0, 0, chunk=1))  # part 4 from part 3 on rank 2
    assert parts.receives(1, Action(Kind.B, 1, 0, 0))


def test_costs_without_placed_price_one_part_per_rank_only() -> None:
    costs = UnsplitCosts()
    assert place(costs, (0, 1, 2)) is costs
    with pytest.raises(ValueError, match="PlacedCosts") as info:
        simulate_schedule("looped-bfs", 2, Plan.gpipe(2, 8), costs)
    assert "UnsplitCosts" in str(info.value) and "2 chunks per rank" in str(info.value)


@pytest.mark.parametrize(
    ("n_stages", "n_chunks", "m"), [(4, 2, 8), (2, 2, 4), (3, 3, 6), (4, 2, 12)]
)
@pytest.mark.parametrize("name", ["interleaved-1f1b", "looped-bfs"])
def test_virtual_stages_cut_the_bubble_by_v(
    name: str, n_stages: int, n_chunks: int, m: int
) -> None:
    """Megatron's result on equal microbatches with full groups of K: a stage computes
    m (F + B), and the fill and drain cost (K - 1) (F + B) / v, since each of the K - 1
    parts a microbatch passes before the last stage is 1/v of a stage."""
    f, b = 1.0, 2.0  # a whole stage's forward and backward; a chunk's is 1/v of them
    s = make_schedule(name, n_stages, Plan.gpipe(m, 8), n_chunks=n_chunks)
    r = simulate(s, ConstantCosts(f, b))
    assert r.latency == pytest.approx((m + (n_stages - 1) / n_chunks) * (f + b), rel=1e-12)
    assert r.n_chunks == n_chunks and np.allclose(r.busy, m * (f + b))
    by_name = simulate_schedule(
        name, n_stages, Plan.gpipe(m, 8), ConstantCosts(f, b), n_chunks=n_chunks
    )
    assert (by_name.latency, by_name.placement) == (r.latency, s.placement)


def test_two_stages_two_chunks_by_hand() -> None:
    """looped-bfs, K = 2, v = 2, two microbatches; a chunk's F takes 1, its B 2 (' marks
    chunk 1, whose part on rank 1 is the model's last)::

        time    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14
        rank 0  F0  F1  F0' F1' .   .   .   B1' B1' B0' B0' B1  B1  B0  B0
        rank 1  .   F0  F1  F0' F1' B1' B1' B0' B0' B1  B1  B0  B0
    """
    r = simulate(make_schedule("looped-bfs", 2, Plan.gpipe(2, 8), n_chunks=2), ConstantCosts(2, 4))
    tl = r.timeline[r.timeline.kind.isin(["F", "B"])]
    starts = {(row.stage, row.kind, row.b, row.chunk): row.start for row in tl.itertuples()}
    assert starts[0, "F", 1, 1] == 3 and starts[1, "F", 1, 1] == 4
    assert starts[1, "B", 1, 1] == 5 and starts[0, "B", 0, 1] == 9
    assert starts[1, "B", 0, 0] == 11 and starts[0, "B", 0, 0] == 13
    assert r.latency == 15.0


def test_blocking_sends_stay_with_the_chunk_that_sends() -> None:
    """Rank K-1's chunk 0 sends its output across the wrap; its chunk 1 holds the model's
    last part and sends nothing: only chunk 0's forwards carry a send's time."""
    s = make_schedule("interleaved-1f1b", 2, Plan.gpipe(2, 8), n_chunks=2)
    r = simulate(s, ConstantCosts(2.0, 4.0, t_send=0.5, blocking_sends=True))
    tl = r.timeline[r.timeline.stage == 1]
    fwd, sent = _times(tl[tl.kind == "F"], "start"), _times(tl[tl.kind == "SA"], "end")
    assert set(sent) == {(0, 0), (1, 0)}
    assert all(sent[u] - fwd[u] == pytest.approx(1.0 + 0.5) for u in sent)
    # Rank 1: 2 units x 2 chunks x (F 1 + B 2), two activations and four gradients sent.
    assert r.busy[1] == pytest.approx(12.0 + 6 * 0.5)
    # The timeline names each action's chunk, as the schedule does.
    ran = {(row.stage, row.kind, row.b, row.chunk) for row in r.timeline.itertuples()}
    assert ran == {(a.stage, str(a.kind), a.b, a.chunk) for acts in s.actions for a in acts}


def _times(rows: pd.DataFrame, column: str) -> dict[tuple[int, int], float]:
    """``column`` of each timeline row, by (b, chunk)."""
    keys = zip(rows["b"].tolist(), rows["chunk"].tolist(), strict=True)
    return dict(zip(keys, rows[column].tolist(), strict=True))


def test_a_slice_model_prices_a_chunk_as_its_share_of_a_stage() -> None:
    costs = SliceModelCosts(FlatCost(), fwd_fraction=0.25)
    plan = Plan.gpipe(1, 8)
    chunked = place(costs, interleaved(2, 4))
    assert chunked.compute(0, Action(Kind.F, 0, 0, 0, chunk=3), plan) == pytest.approx(0.25 / 4)
    assert chunked.compute(0, Action(Kind.B, 0, 0, 0, chunk=1), plan) == pytest.approx(0.75 / 4)
    assert place(costs, (0, 1)).compute(0, Action(Kind.F, 0, 0, 0), plan) == 0.25


class FlatCost:
    """One second per slice, whatever its shape."""

    max_batch_slice_size = None

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        return np.ones_like(np.asarray(length, dtype=float))
