"""Tests for tplib.perfmodel.contention: the benchmark of stages working at once runs on
real processes, pairs every alone round with a together round, and fails with a clear
error, leaving no process behind."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tplib.perfmodel import ProfileError
from tplib.perfmodel.contention import Contention, _rounds, measure_contention


def test_rounds_alternate_alone_and_together() -> None:
    assert _rounds(2, 3) == [0, 1, None, None, 1, 0, 0, 1, None]


def test_factors_are_the_median_of_paired_ratios() -> None:
    c = Contention(
        alone=((1.0, 2.0, 1.0), (2.0, 2.0, 2.0)),
        together=((1.5, 2.0, 1.1), (2.0, 3.0, 2.2)),
        threads=1,
        seq_len=64,
        granularity=16,
    )
    assert c.ratios[0] == pytest.approx((1.5, 1.0, 1.1))
    assert c.factors == pytest.approx((1.1, 1.1))
    assert "stage 1: x1.100 (pairs 1.000..1.500" in c.describe()
    assert c.columns() == {
        "contention_factors": "1.1000 / 1.1000",
        "contention_pairs_min": 1.0,
        "contention_pairs_max": pytest.approx(1.5),
        "contention_rounds": 3,
    }


def test_two_stages_measured_on_real_processes() -> None:
    c = measure_contention("tiny", 2, seq_len=64, granularity=16, threads=1, rounds=2)
    assert [len(a) for a in c.alone] == [2, 2] and [len(t) for t in c.together] == [2, 2]
    assert all(x > 0 for side in (c.alone, c.together) for stage in side for x in stage)
    assert all(0.2 < f < 5.0 for f in c.factors)
    assert not mp.active_children()


def test_bad_input_fails_before_any_process_starts() -> None:
    with pytest.raises(ProfileError, match="granularity"):
        measure_contention("tiny", 2, seq_len=64, granularity=24, threads=1)
    with pytest.raises(ProfileError, match="rounds=0"):
        measure_contention("tiny", 2, seq_len=64, granularity=16, threads=1, rounds=0)
    with pytest.raises(ProfileError, match="exceeds"):
        measure_contention("tiny", 2, seq_len=10**6, granularity=16, threads=1)
    with pytest.raises(ValueError, match="stage"):
        measure_contention("tiny", 2, seq_len=64, granularity=16, threads=1, stage_ranges=[(0, 1)])


def test_a_run_out_of_time_raises_and_leaves_no_process() -> None:
    # Workers need seconds to import torch: half a second is too little.
    with pytest.raises(RuntimeError, match="contention benchmark"):
        measure_contention("tiny", 2, seq_len=64, granularity=16, threads=1, timeout=0.5)
    assert not mp.active_children()
