"""Tests for tplib.perfmodel.timer: one real profile of the tiny config checks the
measuring path end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tplib.config import get_config
from tplib.perfmodel import (
    DTYPE_BYTES,
    DTYPES,
    Profile,
    ProfileError,
    StageTimer,
    profile_pipeline,
    profile_stage,
)

TINY = get_config("tiny")


@pytest.fixture(scope="module")
def measured() -> Profile:
    return profile_stage(
        "tiny",
        layers_per_stage=1,
        seq_len=64,
        max_batch_slice_size=2,
        granularity=8,
        repeats=3,
        threads=1,
        progress=False,
    )


def test_dtypes_agree_with_the_profiles_byte_sizes() -> None:
    assert DTYPES.keys() == DTYPE_BYTES.keys()
    for name, dtype in DTYPES.items():
        assert torch.empty((), dtype=dtype).element_size() == DTYPE_BYTES[name], name


def test_measured_table_is_complete_and_positive(measured: Profile) -> None:
    assert measured.device == "cpu" and measured.dtype == "float32"
    assert measured.batch_slice_sizes == (1, 2) and measured.max_batch_slice_size == 2
    assert measured.layers_per_stage == 1
    table = np.asarray(measured.times)
    assert table.shape == (2, 64 // 8)
    assert np.isfinite(table).all() and (table > 0).all()
    assert len(measured.coef) == 2 and np.isfinite(measured.coef).all()
    assert all(np.isfinite(e) and e >= 0 for e in measured.holdout_error)
    assert measured.torch_version == torch.__version__ and measured.created
    assert {fitted for *_, fitted in measured.samples} == {True, False}
    assert 0 < measured.fwd_fraction < 1 and measured.optimizer_time > 0


def test_slice_time_is_table_plus_fit_plus_comm(measured: Profile) -> None:
    s, c = np.array([8, 16, 8, 24]), np.array([0, 8, 24, 8])
    for i, b in enumerate(measured.batch_slice_sizes):
        table = np.asarray(measured.times[i])[s // 8 - 1]
        a = measured.coef[i]
        ctx = np.where(c > 0, np.maximum(a[0] + a[1] * s + a[2] * c + a[3] * s * c, 0), 0)
        link = b * s * TINY.hidden * 4 / measured.link_bandwidth + measured.link_latency
        np.testing.assert_allclose(measured.slice_time(b, s, c), table + ctx + 2 * link, rtol=1e-12)


def test_measured_profile_survives_a_file_round_trip(measured: Profile, tmp_path: Path) -> None:
    measured.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == measured


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
    with pytest.raises(ProfileError, match=r"stage layer range \[2, 9\) is outside"):
        StageTimer(TINY, 1, seq_len=32, stage=(2, 9))


def test_pipeline_stage_ranges_are_checked_before_timing() -> None:
    with pytest.raises(
        ValueError, match=r"stage 1 covers layers \[3, 4\) but must start at layer 2"
    ):
        profile_pipeline("tiny", 2, stage_ranges=[(0, 2), (3, 4)], seq_len=32)
    with pytest.raises(ValueError, match="give one layer range per stage"):
        profile_pipeline("tiny", 3, stage_ranges=[(0, 2), (2, 4)], seq_len=32)


def test_wgrad_fraction_takes_a_median_over_several_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # At repeats=1 a single run decided the share; one descheduled W made a profile that
    # broke its own fwd + wgrad < 1 rule. Each run computes the deferred W once.
    from tplib.perfmodel.timer import WGRAD_REPEATS, StageTimer
    from tplib.wgrad import DeferredWeightGrads

    runs: list[object] = []
    compute = DeferredWeightGrads.compute

    def counted(self: DeferredWeightGrads, units: object) -> None:
        runs.append(units)
        compute(self, units)  # type: ignore[arg-type]

    monkeypatch.setattr(DeferredWeightGrads, "compute", counted)
    timer = StageTimer(get_config("tiny"), 1, seq_len=16, repeats=1, warmup=0)
    share = timer.wgrad_fraction(1, 16)
    assert len(runs) == WGRAD_REPEATS == 3 and 0 < share < 1
