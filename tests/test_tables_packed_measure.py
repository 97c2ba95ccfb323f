"""The packed-sequences study measured on local processes (a small run of every scheme)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tplib.measure.options import Profiling
from tplib.runtime import LocalPool
from tplib.tables.packed_measure import SCHEMES, measure


def test_every_scheme_runs_and_counts_its_real_tokens(
    pools: Callable[[int], LocalPool],
) -> None:
    df = measure(
        seq_len=64, batch=2, model="tiny", sources=("lognormal",), rounds=1, iters=1, warmup=1,
        granularity=8, profiling=Profiling(granularity=16), link=(1e9, 1e-5), pool=pools(2),
        progress=False,
    ).df  # fmt: skip
    assert list(df.scheme) == list(SCHEMES)
    by = df.set_index("scheme")
    # Log-normal documents of median L / 8: a padded row holds one, a packed row many.
    assert by.padding_fraction["pad"] > 0.5 > by.padding_fraction["packed-uniform"]
    assert by.real_tokens["packed-unmasked"] == by.real_tokens["packed-dp"]
    assert by.speedup_over_pad["pad"] == 1.0 and by.plan_ms.notna()["packed-dp"]
    # The same batches: attending across documents changes the loss, masking does not
    # depend on the plan.
    assert by.loss_vs_masked["packed-unmasked"] != 0.0
    assert by.loss["packed-dp"] == pytest.approx(by.loss["packed-uniform"], rel=1e-5)
    assert (df.latency_round_min <= df.latency_round_max).all()


def test_bad_parameters_are_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match=r"schemes=\['padded'\]"):
        measure(schemes=["padded"])
    with pytest.raises(ValueError, match=r"sources=\['web'\]"):
        measure(sources=["web"])
    with pytest.raises(ValueError, match="a grid that divides the rows"):
        measure(seq_len=2048, granularity=48)
