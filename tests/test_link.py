"""Measuring the link between two local processes: the fit, and a real ping-pong (or exchange)."""

from __future__ import annotations

import math

import pytest

from tplib.runtime import fit_link, measure_link
from tplib.sim.costs import Link


def test_fit_recovers_a_known_link() -> None:
    sizes = [1e3, 1e5, 1e6, 4e6]
    seconds = [50e-6 + n / 2e9 for n in sizes]  # 50 us and 2 GB/s
    link = fit_link(sizes, seconds)
    assert link.latency == pytest.approx(50e-6, rel=1e-6)
    assert link.bandwidth == pytest.approx(2e9, rel=1e-6)
    assert link.time(1e6) == pytest.approx(50e-6 + 0.5e-3)


def test_noisy_fits_stay_physical() -> None:
    # The large message came out faster per byte than the small ones imply: the fit's
    # slope would go negative; the extreme sizes' slope is used instead.
    link = fit_link([1e3, 1e6], [1e-3, 0.9e-3])
    assert link.bandwidth > 0 and link.latency > 0


def test_fit_needs_two_sizes() -> None:
    with pytest.raises(ValueError, match="2 distinct message sizes"):
        fit_link([1e3], [1e-3])


@pytest.mark.parametrize("exchange", [False, True])
def test_measure_link_on_real_processes(exchange: bool) -> None:
    """A ping-pong, or both processes sending and receiving at once (a ring's shift)."""
    link = measure_link(n_bytes_list=(2**10, 2**16), repeats=3, exchange=exchange)
    assert isinstance(link, Link)
    assert math.isfinite(link.bandwidth) and link.bandwidth > 0
    assert math.isfinite(link.latency) and link.latency > 0
    with pytest.raises(ValueError, match="two"):
        measure_link(n_bytes_list=(1024,))
