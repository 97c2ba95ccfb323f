"""Tests for tplib.cluster.memory: peak memory per GPU of a plan."""

from __future__ import annotations

import pytest

from tplib.cluster import ClusterCostModel, memory_per_gpu
from tplib.config import get_config, n_params_per_layer
from tplib.paper import SETTINGS, TERAPIPE, main_row
from tplib.plan import Plan


def test_paper_plans_fit_and_slicing_saves_scores() -> None:
    for s in SETTINGS.values():
        m = ClusterCostModel.for_setting(s)
        gpipe, tera = m.memory(s.gpipe_plan()), m.memory(main_row(s.index, TERAPIPE).plan)
        assert gpipe.fits, (s.index, str(gpipe))
        assert tera.total <= gpipe.total + 1  # token slicing stores fewer attention scores


def test_states_and_what_does_not_fit() -> None:
    # GPT3-175B on 24 stages x 8 GPUs: 4 layers of weights and Adam states per GPU.
    too_big = memory_per_gpu("GPT3-175B", n_stages=24, n_op=8, plan=Plan.gpipe(1, 2048))
    assert not too_big.fits and "does NOT fit" in str(too_big)
    # Mixed precision: 20 bytes per parameter (fp16 weights and grads, fp32 master weights,
    # grads, Adam m and v).
    one = memory_per_gpu("GPT3-1B", n_stages=24, n_op=1, plan=Plan.gpipe(1, 2048))
    assert one.states == pytest.approx(20 * n_params_per_layer(get_config("GPT3-1B")))


def test_token_slices_store_fewer_scores() -> None:
    """A slice of s tokens after c keeps s (c + s) scores: halves 1024 + 1024 keep
    1024^2 + 2048 * 1024 = 3/4 of the 2048^2 scores of one slice, per head and layer,
    at 6 bytes each (fp16 scores, fp32 probabilities)."""
    whole = memory_per_gpu("GPT3-1B", n_stages=24, n_op=1, plan=Plan.gpipe(1, 2048))
    halves = memory_per_gpu(
        "GPT3-1B", n_stages=24, n_op=1, plan=Plan.uniform(1, 2048, n_token_slices=2)
    )
    heads = 16
    saved = heads * (2048**2 - (1024**2 + 2048 * 1024)) * 6
    assert whole.activations - halves.activations == pytest.approx(saved)
