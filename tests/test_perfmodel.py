"""Tests for tplib.perfmodel: Eq. 9's fit, held-out scoring, the Profile cost model, files.

Analytic profiles (``build_profile`` fed a known function) check the arithmetic exactly;
one real profile of the tiny config checks the measuring path end to end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tplib.config import get_config
from tplib.perfmodel import (
    Profile,
    ProfileError,
    StageTimer,
    build_profile,
    context_points,
    context_time,
    fit_context,
    profile_stage,
)
from tplib.planner import pipeline_latency, plan

TINY = get_config("tiny")
A = np.array([2e-4, 3e-6, 1e-6, 5e-9])  # Eq. 9's a0..a3 for b = 1 in the analytic profile


def analytic(b: int, s: int, c: int) -> float:
    """A stage whose times follow Eq. 9 exactly, with the overhead scaled by b."""
    base = b * (1e-3 + 2e-6 * s)
    return base + (b * float(context_time(A, s, c)) if c > 0 else 0.0)


def analytic_profile(batch_sizes: tuple[int, ...] = (1, 2), **kw: object) -> Profile:
    return build_profile(
        analytic, config=TINY, n_layers=1, seq_len=64, granularity=8,
        batch_sizes=batch_sizes, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def measured() -> Profile:
    return profile_stage(
        "tiny", n_layers=1, seq_len=64, max_batch=2, granularity=8, repeats=3,
        threads=1, progress=False,
    )  # fmt: skip


# ---- Eq. 9 ------------------------------------------------------------------------------


def test_fit_recovers_known_coefficients() -> None:
    fit_pts, _ = context_points(1024, 64)
    s, c = np.array(fit_pts, float).T
    exact = A[0] + A[1] * s + A[2] * c + A[3] * s * c
    np.testing.assert_allclose(fit_context(s, c, exact), A, rtol=1e-8)
    noisy = exact * (1 + np.random.default_rng(0).normal(0, 1e-4, exact.shape))
    np.testing.assert_allclose(fit_context(s, c, noisy), A, rtol=0.05)


def test_fit_needs_four_samples() -> None:
    with pytest.raises(ProfileError, match="4 coefficients"):
        fit_context(np.array([8, 16, 24]), np.array([8, 8, 8]), np.ones(3))


@pytest.mark.parametrize(("seq_len", "g"), [(32, 8), (64, 8), (1024, 64), (2048, 8)])
def test_context_points_are_disjoint_and_on_the_grid(seq_len: int, g: int) -> None:
    fit, held = context_points(seq_len, g)
    assert len(fit) >= 4 and held
    assert not set(fit) & set(held)
    for s, c in fit + held:
        assert s % g == 0 and c % g == 0 and s >= g and c >= g and s + c <= seq_len


def test_too_small_a_grid_is_refused() -> None:
    with pytest.raises(ProfileError, match="too few"):
        context_points(16, 8)
    with pytest.raises(ProfileError, match="divides L"):
        context_points(30, 8)


# ---- analytic profiles --------------------------------------------------------------------


def test_analytic_profile_fits_exactly() -> None:
    prof = analytic_profile()
    for i, b in enumerate(prof.batch_sizes):
        np.testing.assert_allclose(prof.coef[i], b * A, rtol=1e-6)
    assert max(prof.holdout_error) < 1e-9 and max(prof.holdout_error_ctx) < 1e-6
    s, c = np.meshgrid(np.arange(8, 65, 8), np.arange(0, 57, 8))
    keep = s + c <= 64
    s, c = s[keep], c[keep]
    for b in prof.batch_sizes:
        want = [analytic(b, si, ci) for si, ci in zip(s, c, strict=True)]
        np.testing.assert_allclose(prof.slice_time(b, s, c) - prof.comm_time(b, s), want, rtol=1e-6)


def test_holdout_error_is_measured_on_held_out_points_only() -> None:
    _, held = context_points(64, 8)
    held_set = set(held)

    def skewed(b: int, s: int, c: int) -> float:  # 10% slower, only where the fit never looks
        return analytic(b, s, c) * (1.1 if (s, c) in held_set else 1.0)

    prof = build_profile(skewed, config=TINY, n_layers=1, seq_len=64, batch_sizes=(1,))
    np.testing.assert_allclose(prof.coef[0], A, rtol=1e-6)  # the fit saw no skew
    assert prof.holdout_error[0] == pytest.approx(0.1 / 1.1, rel=1e-6)
    used = {(s, c) for _, s, c, _, fitted in prof.samples if fitted}
    unused = {(s, c) for _, s, c, _, fitted in prof.samples if not fitted}
    assert unused == held_set and not used & unused


def test_rounds_keep_the_least_time() -> None:
    calls: dict[tuple[int, int, int], int] = {}

    def flaky(b: int, s: int, c: int) -> float:  # a slow spell on each point's first visit
        calls[b, s, c] = calls.get((b, s, c), 0) + 1
        return analytic(b, s, c) * (3.0 if calls[b, s, c] == 1 else 1.0)

    prof = build_profile(flaky, config=TINY, n_layers=1, seq_len=64, rounds=2)
    assert set(calls.values()) == {2} and prof.rounds == 2
    np.testing.assert_allclose(prof.times[0], [analytic(1, s, 0) for s in range(8, 65, 8)])
    np.testing.assert_allclose(prof.coef[0], A, rtol=1e-6)


def test_comm_time_is_two_transfers_of_the_activations() -> None:
    prof = analytic_profile(bandwidth=1e9, latency=1e-5)
    nbytes = 2 * 16 * TINY.hidden * 4  # b * l * hidden * float32
    assert prof.comm_time(2, 16) == pytest.approx(2 * (nbytes / 1e9 + 1e-5))


def test_bad_measurements_are_refused() -> None:
    for bad in (math.nan, -1.0, math.inf):
        with pytest.raises(ProfileError, match="finite, non-negative"):
            build_profile(lambda b, s, c, v=bad: v, config=TINY, n_layers=1, seq_len=64)


# ---- a real profile ----------------------------------------------------------------------


def test_measured_table_is_complete_and_positive(measured: Profile) -> None:
    assert measured.device == "cpu" and measured.dtype == "float32"
    assert measured.batch_sizes == (1, 2) and measured.max_batch == 2
    table = np.asarray(measured.times)
    assert table.shape == (2, 64 // 8)
    assert np.isfinite(table).all() and (table > 0).all()
    assert len(measured.coef) == 2 and np.isfinite(measured.coef).all()
    assert all(np.isfinite(e) and e >= 0 for e in measured.holdout_error)
    assert measured.torch_version == torch.__version__ and measured.created
    assert {fitted for *_, fitted in measured.samples} == {True, False}


def test_slice_time_is_table_plus_fit_plus_comm(measured: Profile) -> None:
    s, c = np.array([8, 16, 8, 24]), np.array([0, 8, 24, 8])
    for i, b in enumerate(measured.batch_sizes):
        table = np.asarray(measured.times[i])[s // 8 - 1]
        a = measured.coef[i]
        ctx = np.where(c > 0, np.maximum(a[0] + a[1] * s + a[2] * c + a[3] * s * c, 0), 0)
        comm = 2 * (b * s * TINY.hidden * 4 / measured.bandwidth + measured.latency)
        np.testing.assert_allclose(measured.slice_time(b, s, c), table + ctx + comm, rtol=1e-12)


def test_profiling_restores_torch_threads(measured: Profile) -> None:
    assert measured.threads == 1
    before = torch.get_num_threads()
    profile_stage("tiny", seq_len=32, repeats=1, threads=1, progress=False)
    assert torch.get_num_threads() == before


def test_timer_builds_a_middle_stage_even_for_small_models() -> None:
    timer = StageTimer(TINY, TINY.n_layer, seq_len=32, repeats=1, warmup=0)
    assert not timer.stage.is_first and not timer.stage.is_last
    assert len(timer.stage.blocks) == TINY.n_layer
    assert timer(1, 8, 16) > 0
    bf16 = StageTimer(TINY, 1, seq_len=32, dtype="bfloat16", repeats=1, warmup=0)
    assert bf16(1, 8, 8) > 0
    with pytest.raises(ProfileError, match="context"):
        StageTimer(TINY, 1, seq_len=128)


# ---- files and the planner -----------------------------------------------------------------


def test_save_load_round_trip(measured: Profile, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    measured.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temp file left behind
    loaded = Profile.load(path)
    assert loaded == measured
    s, c = np.meshgrid(np.arange(8, 65, 8), np.arange(0, 57, 8))
    s, c = s[s + c <= 64], c[s + c <= 64]
    for b in (1, 2):
        np.testing.assert_array_equal(loaded.slice_time(b, s, c), measured.slice_time(b, s, c))


def test_requests_outside_the_profile_name_the_point(measured: Profile) -> None:
    with pytest.raises(ProfileError, match=r"batch size 3 was not profiled.*re-profile"):
        measured.slice_time(3, np.array([8]), np.array([0]))
    with pytest.raises(ProfileError, match="slice length 12 is off the profiled grid"):
        measured.slice_time(1, np.array([8, 12]), np.array([0, 8]))
    with pytest.raises(ProfileError, match="token 72 is beyond the profile's seq_len L=64"):
        measured.slice_time(1, np.array([8]), np.array([64]))
    with pytest.raises(ValueError, match="was not profiled"):  # the planner's error type
        plan(analytic_profile(batch_sizes=(2,)), seq_len=64, batch=2, n_stages=2)


@pytest.mark.parametrize(("bad", "match"), [(math.nan, "nan"), (-1e-3, "-0.001")])
def test_invalid_profile_files_are_refused(tmp_path: Path, bad: float, match: str) -> None:
    d = json.loads(json.dumps(analytic_profile().to_dict()))
    d["times"][1][2] = bad
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=rf"t\(b=2, l=24, c=0\) is {match}"):
        Profile.load(path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.load(path)
    path.write_text("[]")
    with pytest.raises(ProfileError, match="format"):
        Profile.load(path)


def test_planner_runs_on_a_loaded_profile(measured: Profile, tmp_path: Path) -> None:
    measured.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    for method in ("exact", "paper"):
        p = plan(loaded, seq_len=64, batch=3, n_stages=2, method=method)
        p.check_covers(3, 64)
        assert max(p.batch_slices) <= loaded.max_batch
    p = plan(loaded, seq_len=64, batch=3, n_stages=2)
    assert p.latency == pytest.approx(pipeline_latency(p, loaded, 2))
