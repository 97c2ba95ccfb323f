"""Tests for tplib.nn.layer_ranges: balanced stages and the stage-range rules."""

from __future__ import annotations

import pytest

from tplib.nn.configs import get_config
from tplib.nn.layer_ranges import balanced_stages, check_stage_range, check_stage_ranges

TINY = get_config("tiny")  # 4 layers


def test_balanced_stages_give_earlier_stages_the_extra_layers() -> None:
    assert balanced_stages(4, 2) == ((0, 2), (2, 4))
    assert balanced_stages(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    with pytest.raises(ValueError, match="n_stages=5 must be between 1 and the model's 4"):
        balanced_stages(4, 5)


def test_a_stage_range_lies_inside_the_model() -> None:
    check_stage_range(TINY, 0, 4)
    for lo, hi in [(2, 9), (-1, 2), (2, 2), (3, 1)]:
        with pytest.raises(ValueError, match=rf"\[{lo}, {hi}\) is outside model tiny's layers"):
            check_stage_range(TINY, lo, hi)


@pytest.mark.parametrize(
    ("ranges", "n_stages", "message"),
    [
        ([(0, 2), (2, 4)], 3, r"give 2 stages for n_stages=3: give one layer range per stage"),
        ([(0, 2), (3, 4)], 2, r"stage 1 covers layers \[3, 4\) but must start at layer 2"),
        ([(1, 2), (2, 4)], 2, r"stage 0 covers layers \[1, 2\) but must start at layer 0"),
        ([(0, 2), (2, 2)], 2, r"stage 1 covers layers \[2, 2\) .* non-empty"),
        ([(0, 1), (1, 3)], 2, r"end at layer 3, not at the model's 4"),
    ],
)
def test_stage_ranges_must_cover_the_model(
    ranges: list[tuple[int, int]], n_stages: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_stage_ranges(TINY, ranges, n_stages)


def test_balanced_stages_pass_the_check() -> None:
    for k in range(1, 5):
        check_stage_ranges(TINY, balanced_stages(4, k), k)
