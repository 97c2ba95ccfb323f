"""GPipe's partitioning by cost against brute force, and its errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tplib.partition import cluster_chain
from tplib.partition.balance import balance, cell_costs


def brute_force(costs: list[float], k: int) -> tuple[float, float]:
    """(least sum of squared cell costs, least largest cell among those) over every cut."""
    n, found = len(costs), []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        cells = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        found.append((sum(c * c for c in cells), max(cells)))
    lo = min(s for s, _ in found)
    return lo, min(m for s, m in found if s <= lo * (1 + 1e-9))


@pytest.mark.parametrize("seed", range(40))
def test_balance_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    k = int(rng.integers(1, n + 1))
    costs = rng.choice([0.5, 1.0, 2.0, 3.0, 7.0], size=n).tolist()  # ties on purpose
    ranges = balance(costs, k)
    cells = cell_costs(costs, ranges)
    assert [lo for lo, _ in ranges] == [0, *(hi for _, hi in ranges[:-1])]
    assert ranges[-1][1] == n and all(hi > lo for lo, hi in ranges)
    squares, peak = brute_force(costs, k)
    assert sum(c * c for c in cells) == pytest.approx(squares)
    assert max(cells) == pytest.approx(peak)


def test_heavy_ends_take_fewer_blocks() -> None:
    """The embeddings and, more, the LM head make the end stages' blocks fewer."""
    chain = cluster_chain("GPT3-1B", microbatch=1)
    ranges = balance(chain, 4)
    sizes = [hi - lo for lo, hi in ranges]
    assert sizes[-1] < max(sizes) and sum(sizes) == 24
    # Hand case: a head worth four blocks ends up alone.
    assert balance([1, 1, 1, 1, 4], 2) == ((0, 4), (4, 5))


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="n_stages=6 is more than the chain's 5 layers"):
        balance([1.0] * 5, 6)
    with pytest.raises(ValueError, match="n_stages=0"):
        balance([1.0], 0)
    with pytest.raises(ValueError, match="finite and non-negative"):
        balance([1.0, -1.0], 2)
