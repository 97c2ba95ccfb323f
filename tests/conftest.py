"""Shared test helpers: the exactness criterion used across the suite, and the local
process pools the runtime tests share within a module."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tplib.runtime import LocalPool

try:
    from hypothesis import settings
except ImportError:  # a GPU node running gpu-check's tests needs no hypothesis
    pass
else:
    settings.register_profile("ci", deadline=None, print_blob=True)
    settings.load_profile("ci")


def assert_scaled_close(
    actual: torch.Tensor | None, expected: torch.Tensor | None, rel: float = 1e-5, what: str = ""
) -> None:
    """Differences within ``rel`` relative to the scale of ``expected`` (its largest
    magnitude). Both must exist: a missing gradient is a failure, not a pass."""
    assert actual is not None and expected is not None, f"{what}: a tensor is missing"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rel * max(scale, 1e-12), (
        f"{what}: max abs diff {err:.3e} > {rel} x scale {scale:.3e}"
    )


@pytest.fixture(scope="module")
def pools() -> Iterator[Callable[[int], LocalPool]]:
    """``pools(world)``: a pool of ``world`` local ranks, started once per test module."""
    made: dict[int, LocalPool] = {}

    def get(world: int) -> LocalPool:
        if world not in made:
            made[world] = LocalPool(world, timeout_s=60)
        return made[world]

    yield get
    for pool in made.values():
        pool.close()
