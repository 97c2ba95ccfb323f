"""Tests for tplib.measure (and the link measurement and stage profiles it builds on), on
the tiny model: every function runs end to end on real processes in well under a minute.
The accuracy target itself (the simulator within 10% on the "small" model) is a
measurement, not a unit test: ``notebooks/simulator_validation.ipynb``."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tplib import measure
from tplib.config import get_config
from tplib.launch import LocalPool, measure_link
from tplib.perfmodel import (
    Profile,
    ProfileError,
    build_profile,
    profile_pipeline,
    profile_stage,
    smooth_lengths,
)
from tplib.plan import Plan
from tplib.reproduce import notebooks_dir
from tplib.schedule import make_schedule
from tplib.simulate import simulate

# Other jobs on the machine make measure_run warn; that is its business, not these tests'.
pytestmark = pytest.mark.filterwarnings("ignore:.*cores were busy with other work")

TINY = get_config("tiny")
# Tables on the tiny model: short sequences, one timed iteration, no warm-up.
SMALL_RUN = {"model": "tiny", "model_overrides": (), "iters": 1, "warmup": 0, "progress": False}
FAST = measure.Profiling(rounds=1)


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip sampling the other jobs' load around each run (twice 0.25 s): the table
    tests check what the functions return, not this machine."""
    monkeypatch.setattr(measure, "busy_cores", lambda window_s=0.0: 0.0)


@pytest.fixture(scope="module")
def link() -> tuple[float, float]:
    return measure_link(n_bytes_list=(2**10, 2**16), repeats=3)


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalPool]:
    with LocalPool(2, timeout_s=60) as p:
        yield p


@pytest.fixture(scope="module")
def profiles() -> list[Profile]:
    return profile_pipeline("tiny", 2, seq_len=64, granularity=8, repeats=1, progress=False)


def test_measure_link_gives_positive_finite_numbers(link: tuple[float, float]) -> None:
    bandwidth, latency = link
    assert math.isfinite(bandwidth) and bandwidth > 0
    assert math.isfinite(latency) and latency > 0
    with pytest.raises(ValueError, match="two"):
        measure_link(n_bytes_list=(1024,))


def test_busy_cores_is_a_core_count() -> None:
    busy = measure.busy_cores(0.05)
    assert math.isnan(busy) or 0.0 <= busy <= (os.cpu_count() or 1)


def test_pipeline_profiles_time_the_real_stages(profiles: list[Profile]) -> None:
    assert [p.stage for p in profiles] == [(0, 2), (2, 4)]
    assert [p.n_layers for p in profiles] == [2, 2]
    for p in profiles:
        assert 0 < p.fwd_fraction < 1 and p.optimizer_time > 0
        assert p.threads >= 1
        s, c = np.array([8, 16, 8]), np.array([0, 8, 24])
        np.testing.assert_allclose(
            p.slice_time(1, s, c), p.compute_time(1, s, c) + p.comm_time(1, s), rtol=1e-12
        )
    with pytest.raises(ProfileError, match="layer range"):
        profile_stage("tiny", stage=(2, 9), seq_len=32, progress=False)


def test_smoothing_keeps_a_quadratic_and_damps_noise() -> None:
    g, n = 64, 16
    length = g * np.arange(1, n + 1)
    exact = 2e-3 + 1e-5 * length + 3e-9 * length**2
    np.testing.assert_allclose(smooth_lengths(exact, g), exact, rtol=1e-9)
    rng = np.random.default_rng(0)
    noisy = exact * (1 + rng.normal(0, 0.05, (20, n)))  # 5% timing noise, 20 tables
    smooth = np.array([smooth_lengths(row, g) for row in noisy])
    assert np.abs(smooth / exact - 1).mean() < 0.6 * np.abs(noisy / exact - 1).mean()
    assert (np.diff(smooth) > 0).all() and not (np.diff(noisy) > 0).all()
    np.testing.assert_array_equal(smooth_lengths(noisy[0, :3], g), noisy[0, :3])


def test_median_rounds_and_smoothed_tables_are_recorded() -> None:
    visits: dict[tuple[int, int, int], int] = {}

    def flaky(b: int, s: int, c: int) -> float:  # slow on every third visit
        visits[b, s, c] = visits.get((b, s, c), 0) + 1
        return (1e-3 + 1e-5 * s + 1e-7 * c) * (2.0 if visits[b, s, c] == 3 else 1.0)

    prof = build_profile(
        flaky, config=TINY, n_layers=1, seq_len=64, rounds=3, reduce="median", smooth=True
    )
    assert prof.reduce == "median" and len(prof.raw_times) == 1
    np.testing.assert_allclose(prof.raw_times[0], [1e-3 + 1e-5 * s for s in range(8, 65, 8)])
    np.testing.assert_allclose(prof.times[0], prof.raw_times[0], rtol=1e-9)  # already linear
    with pytest.raises(ProfileError, match="reduce"):
        build_profile(flaky, config=TINY, n_layers=1, seq_len=64, reduce="mean")


def test_stage_profile_survives_a_file_round_trip(profiles: list[Profile], tmp_path: Path) -> None:
    path = tmp_path / "stage.json"
    profiles[1].save(path)
    assert Profile.load(path) == profiles[1]


def test_local_costs_drive_the_simulator(
    profiles: list[Profile], link: tuple[float, float]
) -> None:
    costs = measure.local_costs(profiles, link)
    p = Plan.uniform(2, 64, n_token_slices=4)
    sim = simulate(make_schedule("terapipe", 2, p), costs)
    assert sim.latency > 0 and 0 < sim.bubble_fraction < 1
    # Forward and backward split the profiled slice time; sends cost the link, receives nothing.
    f, b = (
        sim.timeline.query(f"stage == 1 and kind == '{k}' and b == 0 and t == 2")
        for k in ("F", "B")
    )
    both = float((f.end - f.start).iloc[0] + (b.end - b.start).iloc[0])
    assert both == pytest.approx(
        float(profiles[1].compute_time(1, np.array([16]), np.array([32]))[0])
    )
    sends = sim.timeline[sim.timeline.kind == "SA"]
    assert ((sends.end - sends.start) > link[1]).all()
    # The tied embedding is all-reduced between the first and last stage.
    assert all(costs.allreduce(k) > 0 for k in range(2))
    assert costs.optimizer(0) == profiles[0].optimizer_time
    middle = profile_stage("tiny", seq_len=16, granularity=4, repeats=1, progress=False)
    with pytest.raises(ValueError, match="profile_pipeline"):
        measure.local_costs([middle, middle], link)


def test_shared_cores_stretch_only_what_runs_at_the_same_time(
    profiles: list[Profile], link: tuple[float, float]
) -> None:
    costs = measure.local_costs(profiles, link)
    gpipe = make_schedule("gpipe", 2, Plan.gpipe(1, 64))
    tera = make_schedule("terapipe", 2, Plan.uniform(1, 64, n_token_slices=8))
    for schedule in (gpipe, tera):
        alone = simulate(schedule, costs).latency
        for busy in (0.0, float("nan")):  # the stages fit in the cores, or the load is unknown
            shared = measure.simulate_shared(schedule, costs, cores=2, busy=busy)
            assert shared.latency == pytest.approx(alone)
        assert measure.simulate_shared(schedule, costs, cores=8, busy=4).latency == pytest.approx(
            alone
        )
    # One core taken: GPipe's stages on one sequence never overlap (but for the optimizer
    # step), TeraPipe's do, so TeraPipe loses more; with every core taken both slow down.
    slow = {
        s.name: measure.simulate_shared(s, costs, cores=2, busy=1).latency
        / simulate(s, costs).latency
        for s in (gpipe, tera)
    }
    assert 1.0 <= slow["gpipe"] < slow["terapipe"] <= 1.5 + 1e-9
    crowded = measure.simulate_shared(gpipe, costs, cores=2, busy=2).latency
    assert crowded / simulate(gpipe, costs).latency > 1.2 * slow["gpipe"]


def test_bottleneck_cost_plans_within_the_profile(profiles: list[Profile]) -> None:
    cost = measure.BottleneckCost(profiles)
    s, c = np.array([8, 32]), np.array([8, 16])
    slowest = np.maximum(profiles[0].compute_time(1, s, c), profiles[1].compute_time(1, s, c))
    np.testing.assert_allclose(cost.slice_time(1, s, c), slowest + profiles[0].comm_time(1, s))


def test_validate_simulator_on_tiny(link: tuple[float, float], pool: LocalPool) -> None:
    runs: dict[str, measure.Measured] = {}
    df = measure.validate_simulator(
        "tiny",
        seq_len=64,
        iters=2,
        profiling=FAST,
        link=link,
        pool=pool,
        progress=False,
        runs=runs,
    )
    for col in ("schedule", "plan", "latency", "latency_std", "latency_median",
                "simulated_latency", "err_latency", "bubble"):  # fmt: skip
        assert col in df.columns, col
    assert list(df.schedule) == ["gpipe", "terapipe"]
    assert (df.latency > 0).all() and (df.simulated_latency > 0).all()
    r = df.iloc[1]
    assert r.err_latency == pytest.approx(r.simulated_latency / r.latency_median - 1)
    assert len(runs["terapipe"].latencies) == 2
    assert set(runs["terapipe"].sim.timeline.kind) >= {"F", "B", "SA", "RA", "AR", "OPT"}


def _check_measured(df: pd.DataFrame, suffixes: tuple[str, ...]) -> None:
    for s in suffixes:
        for col in (f"latency{s}", f"latency{s}_std", f"latency{s}_median",
                    f"simulated_latency{s}", f"err_latency{s}"):  # fmt: skip
            assert col in df.columns, col
            assert df[col].notna().all(), col


@pytest.mark.usefixtures("quiet")
def test_main_results_measured(link: tuple[float, float], pool: LocalPool) -> None:
    fast = replace(FAST, granularity=16, batch_sizes=(1, 2))
    df = measure.main_results((1, 2), seq_len=64, profiling=fast, link=link, pool=pool, **SMALL_RUN)
    _check_measured(df, ("_gpipe", "_terapipe"))
    assert list(df.batch) == [1, 2] and "plan" in df.columns
    r = df.iloc[1]
    Plan.from_paper(r.plan).check_covers(2, 64)
    assert r.speedup == pytest.approx(r.latency_gpipe_median / r.latency_terapipe_median)
    assert r.simulated_speedup == pytest.approx(
        r.simulated_latency_gpipe / r.simulated_latency_terapipe
    )


@pytest.mark.usefixtures("quiet")
def test_dp_ablation_measured(link: tuple[float, float], pool: LocalPool) -> None:
    fast = replace(FAST, granularity=8)
    df = measure.dp_ablation((1, 4), seq_len=64, profiling=fast, link=link, pool=pool, **SMALL_RUN)
    _check_measured(df, ("",))
    assert list(df.algorithm) == ["#Slices=1", "#Slices=4", "DP"]
    assert df["rank"].min() == 1 and df.simulated_rank.min() == 1
    with pytest.raises(ValueError, match="grid"):
        measure.dp_ablation((3,), seq_len=64, profiling=fast, link=link, **SMALL_RUN)


@pytest.mark.usefixtures("quiet")
def test_seqlen_sweep_measured(link: tuple[float, float], pool: LocalPool) -> None:
    df = measure.seqlen_sweep(
        (32, 64), (2, 1), n_grid=4, profiling=FAST, link=link, pool=pool, **SMALL_RUN
    )
    _check_measured(df, ("_gpipe", "_terapipe"))
    assert list(zip(df.seq_len, df.batch, strict=True)) == [(32, 2), (64, 1)]
    with pytest.raises(ValueError, match="one batch size per"):
        measure.seqlen_sweep((32, 64), (1,), link=link, **SMALL_RUN)


def test_validation_notebook_runs_under_papermill(
    link: tuple[float, float], tmp_path: Path
) -> None:
    import papermill as pm

    params = {"model": "tiny", "seq_len": 64, "n_slices": 4, "iters": 2, "link": list(link)}
    pm.execute_notebook(
        str(notebooks_dir() / "simulator_validation.ipynb"),
        str(tmp_path / "executed.ipynb"),
        parameters={**params, "out_dir": str(tmp_path), "tag": "test"},
        kernel_name="python3",
        cwd=str(notebooks_dir()),
        progress_bar=False,
    )
    csv = tmp_path / "simulator_validation-test.csv"
    assert csv.exists() and (tmp_path / "simulator_validation-test.png").exists()
    df = pd.read_csv(csv)
    assert list(df.schedule) == ["gpipe", "terapipe"]
