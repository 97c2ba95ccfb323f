"""Tests for tplib.perfmodel's torch-free half (tplib.perfmodel.profile, .build): Eq. 9's
fit, held-out scoring, the Profile cost model and its files.

Analytic profiles (``build_profile`` fed a known function) check the arithmetic exactly;
tests/test_perfmodel_timer.py times a real stage.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tplib.nn.configs import get_config
from tplib.perfmodel import (
    DEFAULT_LINK_BANDWIDTH,
    DEFAULT_LINK_LATENCY,
    Profile,
    ProfileError,
    ProfileMismatchWarning,
    build_profile,
    context_points,
    context_time,
    fit_context,
)
from tplib.planner import pipeline_latency, plan_slices

TINY = get_config("tiny")
A = np.array([2e-4, 3e-6, 1e-6, 5e-9])  # Eq. 9's a0..a3 for b = 1 in the analytic profile
ROOT = Path(__file__).resolve().parents[1]


def analytic(b: int, s: int, c: int) -> float:
    """A stage whose times follow Eq. 9 exactly, with the overhead scaled by b."""
    base = b * (1e-3 + 2e-6 * s)
    return base + (b * float(context_time(A, s, c)) if c > 0 else 0.0)


def analytic_profile(batch_slice_sizes: tuple[int, ...] = (1, 2), **kw: Any) -> Profile:
    return build_profile(
        analytic,
        config=TINY,
        layers_per_stage=1,
        seq_len=64,
        granularity=8,
        batch_slice_sizes=batch_slice_sizes,
        **kw,
    )


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
    for i, b in enumerate(prof.batch_slice_sizes):
        np.testing.assert_allclose(prof.coef[i], b * A, rtol=1e-6)
    assert max(prof.holdout_error) < 1e-9 and max(prof.holdout_error_ctx) < 1e-6
    s, c = np.meshgrid(np.arange(8, 65, 8), np.arange(0, 57, 8))
    keep = s + c <= 64
    s, c = s[keep], c[keep]
    for b in prof.batch_slice_sizes:
        want = [analytic(b, int(si), int(ci)) for si, ci in zip(s, c, strict=True)]
        np.testing.assert_allclose(prof.slice_time(b, s, c) - prof.comm_time(b, s), want, rtol=1e-6)


def test_holdout_error_is_measured_on_held_out_points_only() -> None:
    _, held = context_points(64, 8)
    held_set = set(held)

    def skewed(b: int, s: int, c: int) -> float:  # 10% slower, only where the fit never looks
        return analytic(b, s, c) * (1.1 if (s, c) in held_set else 1.0)

    prof = build_profile(
        skewed, config=TINY, layers_per_stage=1, seq_len=64, batch_slice_sizes=(1,)
    )
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

    prof = build_profile(flaky, config=TINY, layers_per_stage=1, seq_len=64, rounds=2)
    assert set(calls.values()) == {2} and prof.rounds == 2
    np.testing.assert_allclose(prof.times[0], [analytic(1, s, 0) for s in range(8, 65, 8)])
    np.testing.assert_allclose(prof.coef[0], A, rtol=1e-6)


def test_comm_time_is_two_transfers_of_the_activations() -> None:
    prof = analytic_profile(link_bandwidth=1e9, link_latency=1e-5)
    nbytes = 2 * 16 * TINY.hidden * 4  # b * l * hidden * float32
    assert prof.comm_time(2, 16) == pytest.approx(2 * (nbytes / 1e9 + 1e-5))
    # The runtime sends the parameters' dtype: float32 under bf16 autocast, float16 in fp16.
    bf16 = analytic_profile(link_bandwidth=1e9, link_latency=1e-5, precision="bf16")
    assert bf16.comm_time(2, 16) == pytest.approx(2 * (nbytes / 1e9 + 1e-5))
    fp16 = analytic_profile(link_bandwidth=1e9, link_latency=1e-5, precision="fp16")
    assert fp16.comm_time(2, 16) == pytest.approx(2 * (nbytes / 2 / 1e9 + 1e-5))
    default = analytic_profile()
    assert (default.link_bandwidth, default.link_latency) == (2e9, 50e-6)
    assert (DEFAULT_LINK_BANDWIDTH, DEFAULT_LINK_LATENCY) == (2e9, 50e-6)


def test_bad_measurements_are_refused() -> None:
    for bad in (math.nan, -1.0, math.inf):

        def measure(b: int, s: int, c: int, v: float = bad) -> float:
            return v

        with pytest.raises(ProfileError, match="finite, non-negative"):
            build_profile(measure, config=TINY, layers_per_stage=1, seq_len=64)


def test_bad_profiles_are_refused() -> None:
    with pytest.raises(ProfileError, match=r"Profile.stage: stage layer range \[2, 9\)"):
        analytic_profile(stage=(2, 9))
    with pytest.raises(ProfileError, match=r"stage \[0, 2\) holds 2 layers, not .*=1"):
        analytic_profile(stage=(0, 2))
    with pytest.raises(ProfileError, match=r"precision 'fp8': choose one of \('fp32'"):
        analytic_profile(precision="fp8")
    with pytest.raises(ProfileError, match=r"attention 'flash': choose one of \('default'"):
        analytic_profile(attention="flash")
    for dropout in (1.0, -0.1, "0.1", True):
        with pytest.raises(ProfileError, match=r"dropout="):
            analytic_profile(dropout=dropout)
    # A stage that drops writes attention out; one that does not never does.
    with pytest.raises(ProfileError, match=r"attention 'default' with dropout=0.1: .*exactly"):
        analytic_profile(dropout=0.1)
    with pytest.raises(ProfileError, match=r"attention 'math' with dropout=0.0"):
        analytic_profile(attention="math")
    with pytest.raises(ProfileError, match="link_bandwidth=0"):
        analytic_profile(link_bandwidth=0)


# ---- files and the planner -----------------------------------------------------------------


def test_save_load_round_trip(tmp_path: Path) -> None:
    prof = analytic_profile(stage=(0, 1), smooth=True)
    path = tmp_path / "p.json"
    prof.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temp file left behind
    assert json.loads(path.read_text())["format"] == "tplib.profile/3"
    loaded = Profile.load(path)
    assert loaded == prof
    s, c = np.meshgrid(np.arange(8, 65, 8), np.arange(0, 57, 8))
    s, c = s[s + c <= 64], c[s + c <= 64]
    for b in (1, 2):
        np.testing.assert_array_equal(loaded.slice_time(b, s, c), prof.slice_time(b, s, c))


def test_format_1_files_still_load(tmp_path: Path) -> None:
    """Format 1 named the fields n_layers, batch_sizes, bandwidth and latency."""
    prof = analytic_profile(link_bandwidth=1e9, link_latency=1e-5)
    d = json.loads(json.dumps(prof.to_dict()))
    old = {"n_layers": 1, "batch_sizes": [1, 2], "bandwidth": 1e9, "latency": 1e-5}
    for new in ("layers_per_stage", "batch_slice_sizes", "link_bandwidth", "link_latency"):
        del d[new]
    d.update(old, format="tplib.profile/1")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    loaded = Profile.load(path)
    assert loaded == prof
    assert (loaded.layers_per_stage, loaded.batch_slice_sizes) == (1, (1, 2))
    assert (loaded.link_bandwidth, loaded.link_latency) == (1e9, 1e-5)
    d["format"] = "tplib.profile/0"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="format"):
        Profile.load(path)


@pytest.mark.parametrize(
    ("dtype", "precision"),
    [("float32", "fp32"), ("float16", "fp16"), ("bfloat16", "unknown"), (None, "fp32")],
)
def test_format_2_files_load_with_what_their_timer_timed(
    tmp_path: Path, dtype: str | None, precision: str
) -> None:
    """Format 2 recorded the dtype the stage was built in, and its timer never dropped and
    took the device's default attention. A bfloat16 stage is no run's precision (bf16 runs
    keep float32 weights under autocast): unknown."""
    d = json.loads(json.dumps(analytic_profile().to_dict()))
    for new in ("precision", "attention", "dropout"):
        del d[new]
    d["format"] = "tplib.profile/2"
    if dtype is not None:  # absent: the format's default, float32
        d["dtype"] = dtype
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(d))
    loaded = Profile.load(path)
    assert (loaded.precision, loaded.attention, loaded.dropout) == (precision, "default", 0.0)
    assert loaded.times == analytic_profile().times


def test_differences_name_what_was_timed_and_what_the_run_does() -> None:
    prof = analytic_profile()  # cpu, fp32, the default attention, no dropout
    assert prof.differences(precision="fp32", dropout=0.0, device="cpu") == []
    assert prof.differences(precision="fp16", dropout=0.1, device="cuda:1") == [
        "device: the profile timed 'cpu', the run 'cuda'",
        "precision: the profile timed 'fp32', the run 'fp16'",
        "attention: the profile timed 'default', the run 'math'",
        "dropout: the profile timed '0', the run '0.1'",
    ]
    gpu = Profile.from_dict(
        {**prof.to_dict(), "device": "cuda:0", "precision": "fp16", "attention": "math"}
        | {"dropout": 0.1}
    )
    assert gpu.differences(precision="fp16", dropout=0.1, device="cuda") == []
    named = Profile.from_dict({**prof.to_dict(), "attention": "masked"})
    assert named.differences(precision="fp32", dropout=0.0, device="cpu") == [
        "attention: the profile timed 'masked', the run 'default'"
    ]
    old = Profile.from_dict({**prof.to_dict(), "precision": "unknown"})
    assert old.differences(precision="bf16", dropout=0.0, device="cpu") == [
        "precision: the profile does not say (an older file), the run 'bf16'"
    ]


def test_check_run_warns_naming_both_and_how_to_reprofile() -> None:
    prof = analytic_profile()
    with pytest.warns(ProfileMismatchWarning) as caught:
        diffs = prof.check_run(precision="fp16", dropout=0.1, device="cuda", source="p.json")
    (warning,) = caught
    text = str(warning.message)
    assert text.startswith("p.json timed cpu, precision fp32, attention default, dropout 0, ")
    assert all(d in text for d in diffs) and len(diffs) == 4
    assert "python -m tplib profile --device cuda --dtype fp16 --dropout 0.1" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prof.check_run(precision="fp32", dropout=0.0, device="cpu") == []


def test_requests_outside_the_profile_name_the_point() -> None:
    prof = analytic_profile()
    with pytest.raises(ProfileError, match=r"batch size 3 was not profiled.*re-profile"):
        prof.slice_time(3, np.array([8]), np.array([0]))
    with pytest.raises(ProfileError, match="slice length 12 is off the profiled grid"):
        prof.slice_time(1, np.array([8, 12]), np.array([0, 8]))
    with pytest.raises(ProfileError, match="token 72 is beyond the profile's seq_len L=64"):
        prof.slice_time(1, np.array([8]), np.array([64]))
    with pytest.raises(ValueError, match="was not profiled"):  # the planner's error type
        plan_slices(analytic_profile(batch_slice_sizes=(2,)), seq_len=64, batch=2, n_stages=2)


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


def test_planner_runs_on_a_loaded_profile(tmp_path: Path) -> None:
    analytic_profile().save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded.max_batch_slice_size == 2
    for method in ("exact", "paper"):
        p = plan_slices(loaded, seq_len=64, batch=3, n_stages=2, method=method)
        p.check_covers(3, 64)
        assert max(p.batch_slices) <= loaded.max_batch_slice_size
    p = plan_slices(loaded, seq_len=64, batch=3, n_stages=2)
    assert p.latency == pytest.approx(pipeline_latency(p, loaded, 2))


def test_planning_from_a_profile_does_not_import_torch(
    fresh_python: Callable[..., str],
) -> None:
    """The profile, its builder and the planner are torch-free; the timer's names load on
    first use."""
    fresh_python("""
        import tplib.perfmodel, tplib.planner
        light("torch")
        tplib.perfmodel.StageTimer
        assert "torch" in sys.modules, "the timer loads on first use"
    """)


def test_weight_gradient_share_prices_whole_sequences() -> None:
    prof = analytic_profile()
    with pytest.raises(ProfileError, match="no weight-gradient measurement"):
        prof.wgrad_time(1, np.array([64]))
    measured = Profile.from_dict({**prof.to_dict(), "wgrad_fraction": 0.25})
    # A quarter of t(b, l, 0) of the analytic stage: b * (1e-3 + 2e-6 l).
    np.testing.assert_allclose(measured.wgrad_time(2, np.array([64])), 0.25 * 2 * (1e-3 + 128e-6))
    with pytest.raises(ProfileError, match="wgrad_fraction"):
        Profile.from_dict({**prof.to_dict(), "wgrad_fraction": 1 - prof.fwd_fraction})
