"""Tests for tplib.planner.seq1f1b: equal-FLOP slicing checked by summing FLOPs token by
token, the choice of k against every k priced one by one, and the DP never slower."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from tplib.nn.configs import get_config
from tplib.plan import Plan
from tplib.planner import (
    FlopModel,
    NothingFitsError,
    TableCost,
    best_seq1f1b,
    compare_with_dp,
    equal_flop_slices,
    peak_bytes,
    pipeline_latency,
    seq1f1b_plan,
)

GPT = FlopModel.of(get_config("GPT3-1B"))  # 24 h^2 per token, 4 h per (query, key) pair


def token_flops(flops: FlopModel, seq_len: int) -> np.ndarray:
    """Each token's FLOPs, summed from its own work: the products, and one attention
    term per key at or before it."""
    keys = np.arange(seq_len) + 1
    return flops.linear + flops.attention * keys


@pytest.mark.parametrize(
    ("flops", "seq_len", "k", "g"),
    [(GPT, 2048, 4, 8), (GPT, 8192, 7, 16), (FlopModel(1.0, 1.0), 1024, 5, 8), (GPT, 64, 8, 8)],
)
def test_slices_have_equal_flops_within_one_grid_step(
    flops: FlopModel, seq_len: int, k: int, g: int
) -> None:
    lengths = equal_flop_slices(flops, seq_len, k, g)
    assert sum(lengths) == seq_len and len(lengths) == k
    assert all(s > 0 and s % g == 0 for s in lengths)
    per_token = token_flops(flops, seq_len)
    bounds = np.cumsum((0, *lengths))
    work = [per_token[a:b].sum() for a, b in itertools.pairwise(bounds)]
    step = g * per_token[-1]  # the most FLOPs one grid step holds
    assert max(abs(x - per_token.sum() / k) for x in work) <= step
    # Later tokens attend to more keys: slices shrink along the sequence.
    assert all(a >= b - g for a, b in itertools.pairwise(lengths))
    assert flops.slice_flops(np.array(lengths), bounds[:-1]) == pytest.approx(work)


def test_one_slice_is_the_whole_sequence() -> None:
    assert equal_flop_slices(GPT, 2048, 1, 8) == (2048,)


def test_without_attention_the_slices_are_uniform() -> None:
    linear = FlopModel(5.0, 0.0)
    assert equal_flop_slices(linear, 2048, 8, 8) == (256,) * 8
    lengths = equal_flop_slices(linear, 2048, 6, 8)  # 2048 / 6 is off the grid
    assert max(lengths) - min(lengths) <= 8


def test_every_slice_is_at_least_one_grid_step() -> None:
    # Attention-heavy: the targets crowd at the start; one step each still.
    lengths = equal_flop_slices(FlopModel(0.0, 1.0), 64, 8, 8)
    assert lengths == (8,) * 8


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="n_slices=9 exceeds the 8 grid steps"):
        equal_flop_slices(GPT, 64, 9, 8)
    with pytest.raises(ValueError, match="n_slices=0"):
        equal_flop_slices(GPT, 64, 0, 8)
    with pytest.raises(ValueError, match="granularity g=24"):
        equal_flop_slices(GPT, 64, 2, 24)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"FlopModel\.linear"):
            FlopModel(bad, 1.0)
    with pytest.raises(ValueError, match="a token must cost FLOPs"):
        FlopModel(0.0, 0.0)


def test_the_plan_keeps_the_batch_split_and_slices_each_alike() -> None:
    p = seq1f1b_plan(GPT, seq_len=2048, batch_slices=(2, 1, 1), n_slices=4)
    assert p.batch_slices == (2, 1, 1)
    assert p.token_slices == (equal_flop_slices(GPT, 2048, 4, 8),) * 3


def analytic(b: int, length: np.ndarray, context: np.ndarray, pair: float) -> np.ndarray:
    """An overhead per slice, work per token and per (query, key) pair."""
    length = np.asarray(length, float)
    return 2e-3 + 1e-5 * b * length + pair * b * length * (context + (length + 1) / 2)


def table(n: int, g: int, bmax: int, pair: float) -> TableCost:
    k, j = np.meshgrid(np.arange(n + 1) * g, np.arange(n + 1) * g, indexing="ij")
    return TableCost(np.stack([analytic(b, k, j, pair) for b in range(1, bmax + 1)]), g)


def test_best_k_is_the_fastest_of_every_k() -> None:
    cost = table(32, 8, 2, 4e-9)
    p = best_seq1f1b(cost, GPT, seq_len=256, batch=4, n_stages=6, batch_slice_size=2)
    each = [
        pipeline_latency(seq1f1b_plan(GPT, seq_len=256, batch_slices=(2, 2), n_slices=k), cost, 6)
        for k in range(1, 33)
    ]
    assert p.latency == pytest.approx(min(each))
    assert p.n_token_slices(0) == int(np.argmin(each)) + 1
    assert p.batch_slices == (2, 2)
    given = best_seq1f1b(cost, GPT, seq_len=256, batch=4, n_stages=6, n_slices=3)
    assert given.n_token_slices(0) == 3 and given.batch_slices == (1,) * 4


class Kept:
    """Bytes kept per token, under fill-drain."""

    fixed, in_flight = 0.0, None

    def kept(self, b: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        return b * np.asarray(length, float) * (1 + np.asarray(context, float) + length)

    def working(self, b: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(length))


def test_best_k_within_memory() -> None:
    cost, mem = table(32, 8, 1, 4e-9), Kept()
    kw: dict[str, Any] = {"seq_len": 256, "batch": 2, "n_stages": 6}
    free = best_seq1f1b(cost, GPT, **kw)
    peaks = {
        k: peak_bytes(seq1f1b_plan(GPT, seq_len=256, batch_slices=(1, 1), n_slices=k), mem)
        for k in range(1, 33)
    }
    capacity = peak_bytes(free, mem) * 0.9
    p = best_seq1f1b(cost, GPT, **kw, memory=mem, capacity=capacity)
    fits = [k for k in peaks if peaks[k] <= capacity]
    assert p.n_token_slices(0) in fits and peak_bytes(p, mem) <= capacity
    assert p.latency is not None and free.latency is not None and p.latency >= free.latency
    with pytest.raises(NothingFitsError, match="smallest peak") as info:
        best_seq1f1b(cost, GPT, **kw, memory=mem, capacity=min(peaks.values()) / 2)
    assert info.value.smallest_peak == pytest.approx(min(peaks.values()))


@pytest.mark.parametrize(("pair", "batch", "k"), [(4e-9, 3, 8), (0.0, 2, 4), (5e-8, 2, 24)])
def test_the_dp_is_never_slower_than_seq1f1b(pair: float, batch: int, k: int) -> None:
    cost = table(16, 8, 2, pair)
    r = compare_with_dp(cost, GPT, seq_len=128, batch=batch, n_stages=k)
    assert r.dp_latency == pytest.approx(pipeline_latency(r.dp, cost, k))
    assert r.seq1f1b_latency == pytest.approx(pipeline_latency(r.seq1f1b, cost, k))
    assert r.margin == pytest.approx(r.seq1f1b_latency / r.dp_latency - 1)
    assert r.margin >= -1e-12
    assert isinstance(r.seq1f1b, Plan) and r.seq1f1b.batch_slices == (1,) * batch
