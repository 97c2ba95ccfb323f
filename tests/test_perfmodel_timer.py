"""Tests for tplib.perfmodel.timer: one real profile of the tiny config checks the
measuring path end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tplib.nn.context
import tplib.nn.dropout
from tplib.nn.configs import get_config
from tplib.nn.context import ATTENTION_IMPLS
from tplib.nn.linear import Linear
from tplib.perfmodel import (
    ATTENTIONS,
    Profile,
    ProfileError,
    StageTimer,
    profile_pipeline,
    profile_stage,
)
from tplib.perfmodel.conditions import IMPLS

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


def test_the_profiles_attention_names_are_the_contexts() -> None:
    # tplib.perfmodel.profile cannot import torch to read them.
    assert IMPLS == ATTENTION_IMPLS
    assert set(ATTENTIONS) == {"default", "math", *ATTENTION_IMPLS}


def test_measured_table_is_complete_and_positive(measured: Profile) -> None:
    assert measured.device == "cpu" and measured.precision == "fp32"
    assert (measured.attention, measured.dropout) == ("default", 0.0)
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
    bf16 = StageTimer(TINY, 1, seq_len=32, precision="bf16", repeats=1, warmup=0)
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
    from tplib.nn.wgrad import DeferredWeightGrads
    from tplib.perfmodel.timer import WGRAD_REPEATS, StageTimer

    runs: list[object] = []
    compute = DeferredWeightGrads.compute

    def counted(self: DeferredWeightGrads, units: object) -> None:
        runs.append(units)
        compute(self, units)  # type: ignore[arg-type]

    monkeypatch.setattr(DeferredWeightGrads, "compute", counted)
    timer = StageTimer(get_config("tiny"), 1, seq_len=16, repeats=1, warmup=0)
    share = timer.wgrad_fraction(1, 16)
    assert len(runs) == WGRAD_REPEATS == 3 and 0 < share < 1


def _spy(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Count the calls of ``module.name``, which still does its work."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("layers", [(0, 2), (1, 3), (2, 4)])
def test_timer_trains_with_the_models_dropout(
    monkeypatch: pytest.MonkeyPatch, layers: tuple[int, int]
) -> None:
    """A model that drops is timed dropping (keyed masks) through the written-out
    attention, as the runtime's executor trains it; dropout=0 times it without."""
    masks = _spy(monkeypatch, tplib.nn.dropout, "keep")
    written_out = _spy(monkeypatch, tplib.nn.context, "math_attention")
    drops = TINY.with_(dropout=0.1)
    timer = StageTimer(drops, 0, seq_len=16, stage=layers, repeats=1, warmup=0)
    assert (timer.dropout, timer.attention_timed) == (0.1, "math")
    assert timer(1, 8, 8) > 0
    # Per layer: the probabilities and the two residual branches; plus the embeddings.
    n = layers[1] - layers[0]
    assert len(written_out) == n and len(masks) == 3 * n + (layers[0] == 0)
    masks.clear()
    written_out.clear()
    plain = StageTimer(drops, 0, seq_len=16, stage=layers, dropout=0.0, repeats=1, warmup=0)
    assert (plain.dropout, plain.attention_timed) == (0.0, "default")
    assert plain(1, 8, 8) > 0
    assert masks == [] and written_out == []


def test_timer_runs_bf16_as_a_run_does() -> None:
    """bf16: float32 parameters, the products computed in bfloat16 under autocast, the
    K/V context in bfloat16 (the runtime executor's), float32 between stages."""
    timer = StageTimer(TINY, 1, seq_len=16, precision="bf16", repeats=1, warmup=0)
    assert all(p.dtype == torch.float32 for p in timer.stage.parameters())
    outputs: list[torch.dtype] = []
    for m in timer.stage.modules():
        if isinstance(m, Linear):
            m.register_forward_hook(lambda m, i, o: outputs.append(o.dtype))
    assert timer(1, 8, 8) > 0
    assert outputs and set(outputs) == {torch.bfloat16}
    ctx = timer._context(1)
    assert {t.dtype for t in ctx.buffers()} == {torch.bfloat16}
    x, _, grad = timer._inputs(1, 8)
    assert x.dtype == torch.float32 and grad is not None and grad.dtype == torch.float32
    assert timer.optimizer_time(repeats=1) > 0


def test_timer_refuses_what_no_run_does() -> None:
    with pytest.raises(ProfileError, match=r"precision 'fp16' needs device='cuda'"):
        StageTimer(TINY, 1, seq_len=16, precision="fp16")
    with pytest.raises(ProfileError, match=r"unknown precision 'fp8'"):
        StageTimer(TINY, 1, seq_len=16, precision="fp8")
    with pytest.raises(ProfileError, match=r"attention 'flash' on cpu: choose one of"):
        StageTimer(TINY, 1, seq_len=16, attention="flash")
    with pytest.raises(
        ProfileError, match=r"attention='split' with dropout=0.1: .*writes attention out"
    ):
        StageTimer(TINY, 1, seq_len=16, attention="split", dropout=0.1)
    with pytest.raises(ProfileError, match=r"dropout=1.0: must be a rate in \[0, 1\)"):
        StageTimer(TINY, 1, seq_len=16, dropout=1.0)
    named = StageTimer(TINY, 1, seq_len=16, attention="masked", repeats=1, warmup=0)
    assert named.attention_timed == "masked" and named(1, 8, 8) > 0


def test_profile_records_what_it_timed() -> None:
    drops = TINY.with_(dropout=0.1)
    kw: dict[str, object] = {"seq_len": 16, "granularity": 4, "repeats": 1, "progress": False}
    prof = profile_stage(drops, precision="bf16", threads=1, **kw)  # type: ignore[arg-type]
    assert (prof.precision, prof.attention, prof.dropout) == ("bf16", "math", 0.1)
    assert prof.config == drops  # the model as given: a run of it drops
    plain = profile_stage(drops, dropout=0.0, attention="split", threads=1, **kw)  # type: ignore[arg-type]
    assert (plain.precision, plain.attention, plain.dropout) == ("fp32", "split", 0.0)
