import pytest
from hypothesis import given
from hypothesis import strategies as st

from tplib.plan import Plan, Unit, grid_size

PAPER_SCHEMES = [
    "[(1, [2048])] * 16",
    "[(1, [776, 640, 632])] * 16",
    "[(1, [64] * 26 + [56] * 6 + [48])] * 2",
    "[(1, [120] * 4 + [112] * 6 + [104] * 8 + [64])] * 2",
    "[(1, [584, 568] + [512] * 6 + [496, 488, 472, 464])] * 4",
]


@pytest.mark.parametrize("text", PAPER_SCHEMES)
def test_paper_notation_round_trips(text: str) -> None:
    plan = Plan.from_paper(text)
    assert Plan.from_paper(plan.to_paper()) == plan


def test_paper_notation_means_what_the_paper_says() -> None:
    plan = Plan.from_paper("[(1, [776, 640, 632])] * 16")
    assert plan.batch == 16 and plan.seq_len == 2048
    assert plan.token_slices[5] == (776, 640, 632)
    assert Plan.from_paper("[(1, [64] * 26 + [56] * 6 + [48])] * 2").token_slices[0] == (
        64,
    ) * 26 + (56,) * 6 + (48,)
    assert (
        Plan.from_paper("[(1, [776, 640, 632])] * 16").to_paper() == "[(1, [776, 640, 632])] * 16"
    )


def test_units_and_offsets() -> None:
    plan = Plan((2, 1), ((3, 5), (8,)))
    assert list(plan.units()) == [Unit(0, 0), Unit(0, 1), Unit(1, 0)]
    assert (
        plan.batch_offset(1) == 2
        and plan.token_offset(0, 1) == 3
        and plan.token_bounds(0) == [0, 3, 8]
    )


@given(st.integers(1, 64), st.integers(1, 16))
def test_uniform_covers_the_sequence(seq_len: int, n: int) -> None:
    n = min(n, seq_len)
    plan = Plan.uniform(4, seq_len, batch_slice_size=2, n_token_slices=n)
    plan.check_covers(4, seq_len)
    assert max(plan.token_slices[0]) - min(plan.token_slices[0]) <= 1


def test_bad_plans_are_named() -> None:
    with pytest.raises(ValueError, match=r"token slice 1 of batch slice 0 has length 0"):
        Plan((1,), ((4, 0, 4),))
    with pytest.raises(ValueError, match=r"token slice 0 of batch slice 0 has length -2"):
        Plan((1,), ((-2, 10),))
    with pytest.raises(ValueError, match=r"batch slice 0 has size 0"):
        Plan((0,), ((4,),))
    with pytest.raises(ValueError, match=r"different sequence lengths \[8, 9\]"):
        Plan((1, 1), ((4, 4), (9,)))
    with pytest.raises(ValueError, match=r"sum to 7, not the sequence length 8"):
        Plan((1,), ((3, 4),)).check_covers(1, 8)
    with pytest.raises(ValueError, match=r"sum to 3, not the batch size 4"):
        Plan((1, 2), ((8,), (8,))).check_covers(4, 8)
    with pytest.raises(ValueError, match=r"cannot parse"):
        Plan.from_paper("[(1, [__import__('os')])]")


def test_grid_size_counts_steps_of_g_tokens() -> None:
    assert grid_size(2048, 8) == 256
    assert grid_size(64, 64) == 1
    for seq_len, g in [(20, 8), (4, 8), (64, 0), (0, 8)]:
        with pytest.raises(ValueError, match=rf"L={seq_len} is not a positive multiple of .*g={g}"):
            grid_size(seq_len, g)
