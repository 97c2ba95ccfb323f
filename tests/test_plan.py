import itertools

import pytest
from hypothesis import given, settings
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


# ---- bad input, generated -------------------------------------------------------------
# Every property below runs a fixed number of derandomized examples (the same inputs on
# every run, so CI is reproducible) and asserts a ValueError whose message names what was
# wrong: never a TypeError, a MemoryError or a hang from deep inside.

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300)

# What may appear in a slicing scheme, plus the wrong things that look like it.
SCHEME_ALPHABET = "[](),+*- 0123456789"
JUNK = ["1.5", "'4'", "True", "None", "x", "{}", "2**3", "-", "(", "]", "[[]]", "()", "4 4"]


@st.composite
def valid_plans(draw: st.DrawFn) -> Plan:
    seq_len = draw(st.integers(1, 64))
    n_b = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n_b, max_size=n_b))
    slicings = []
    for _ in range(n_b):
        cuts = draw(st.sets(st.integers(1, seq_len - 1), max_size=5)) if seq_len > 1 else set()
        bounds = [0, *sorted(cuts), seq_len]
        slicings.append(tuple(b - a for a, b in itertools.pairwise(bounds)))
    return Plan(tuple(sizes), tuple(slicings))


def _parses_or_names_its_error(text: str) -> None:
    try:
        plan = Plan.from_paper(text)
    except ValueError as exc:
        assert str(exc), "an empty message names nothing"
        return
    # Accepted: it must be a whole plan (the constructor's rules hold).
    assert plan.batch >= 1 and all(sum(ts) == plan.seq_len for ts in plan.token_slices)


@FUZZ
@given(st.text(max_size=60))
def test_random_text_is_parsed_or_refused(text: str) -> None:
    _parses_or_names_its_error(text)


@FUZZ
@given(st.text(alphabet=SCHEME_ALPHABET, max_size=40))
def test_scheme_like_text_is_parsed_or_refused(text: str) -> None:
    _parses_or_names_its_error(text)


@FUZZ
@given(valid_plans(), st.data())
def test_mutated_valid_plans_are_parsed_or_refused(plan: Plan, data: st.DataObject) -> None:
    text = plan.to_paper()
    assert Plan.from_paper(text) == plan
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(text)))
        edit = data.draw(st.sampled_from(["delete", "insert", "junk"]))
        if edit == "delete":
            text = text[:i] + text[i + 1 :]
        elif edit == "insert":
            text = text[:i] + data.draw(st.sampled_from(SCHEME_ALPHABET)) + text[i:]
        else:
            text = text[:i] + data.draw(st.sampled_from(JUNK)) + text[i:]
    _parses_or_names_its_error(text)


@st.composite
def broken_schemes(draw: st.DrawFn) -> tuple[str, str]:
    """A scheme with one known defect, and a piece of text its error message must contain."""
    seq_len = draw(st.integers(2, 64))
    n_b = draw(st.integers(1, 3))
    items = [f"({draw(st.integers(1, 4))}, [{seq_len}])" for _ in range(n_b)]
    b = draw(st.integers(0, n_b - 1))
    defect = draw(
        st.sampled_from(
            ["length", "size", "sum", "literal", "nesting", "repeat", "huge", "pair", "empty"]
        )
    )
    if defect == "length":  # a zero or negative token length
        bad = draw(st.integers(-(10**6), 0))
        items[b] = f"(1, [{bad}, {seq_len - bad}])"
        expect = f"has length {bad}: lengths must be positive"
    elif defect == "size":  # a zero or negative batch slice size
        bad = draw(st.integers(-(10**6), 0))
        items[b] = f"({bad}, [{seq_len}])"
        expect = f"batch slice {b} has size {bad}: sizes must be positive"
    elif defect == "sum":  # one more batch slice, covering a different sequence length
        other = draw(st.integers(1, 64).filter(lambda n: n != seq_len))
        half = other // 2
        items.insert(b, f"(1, [{half}, {other - half}])" if half else f"(1, [{other}])")
        expect = f"different sequence lengths {sorted({seq_len, other})}"
    elif defect == "literal":  # a number that is not an integer literal
        literal = draw(st.sampled_from(["1.5", "'4'", "True", "None", "x", "2 ** 3", "1e3"]))
        items[b] = f"(1, [{literal}])"
        expect = f"unsupported element {literal!r}"
    elif defect == "nesting":  # a list or tuple where a number belongs
        inner = draw(st.sampled_from([f"[{seq_len}]", f"({seq_len},)", f"[[{seq_len}]]"]))
        items[b] = draw(st.sampled_from([f"(1, [{inner}])", f"({inner}, [{seq_len}])"]))
        expect = "must be whole numbers"
    elif defect == "repeat":  # a list repeated zero or fewer times
        bad = draw(st.integers(-(10**6), 0))
        items[b] = f"(1, [{seq_len}] * {bad})"
        expect = f"repeats a list {bad} times"
    elif defect == "huge":  # a repeat that would fill memory
        count = draw(st.integers(2**21, 10**15))
        items[b] = f"(1, [1] * {count})"
        expect = f"expands to {count + 1} numbers and lists"
    elif defect == "pair":  # a batch slice that is not a (size, [lengths]) pair
        items[b] = draw(
            st.sampled_from([f"(1, {seq_len})", f"(1, [{seq_len}], 2)", f"[{seq_len}]"])
        )
        expect = "is not a list of (batch size, [token lengths]) pairs"
    else:  # a batch slice with no token slices
        items[b] = "(1, [])"
        expect = f"batch slice {b} has no token slices"
    return "[" + ", ".join(items) + "]", expect


@FUZZ
@given(broken_schemes())
def test_broken_schemes_are_refused_naming_the_defect(case: tuple[str, str]) -> None:
    text, expect = case
    with pytest.raises(ValueError) as info:
        Plan.from_paper(text)
    assert expect in str(info.value), (text, str(info.value))


ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-2, 8), max_size=3),
)


@FUZZ
@given(ANYTHING, ANYTHING, ANYTHING, ANYTHING)
def test_uniform_builds_a_covering_plan_or_names_the_bad_argument(
    batch: object, seq_len: object, size: object, n: object
) -> None:
    try:
        plan = Plan.uniform(batch, seq_len, batch_slice_size=size, n_token_slices=n)  # type: ignore[arg-type]
    except ValueError as exc:
        named = [f"{k}={v!r}" for k, v in
                 {"batch": batch, "seq_len": seq_len, "batch_slice_size": size, "n_token_slices": n}.items()]  # fmt: skip
        assert any(s in str(exc) for s in named), str(exc)
        return
    plan.check_covers(batch, seq_len)  # type: ignore[arg-type]
    assert set(plan.batch_slices) == {size} and plan.n_token_slices(0) == n


@FUZZ
@given(
    st.lists(ANYTHING, max_size=3),
    st.lists(st.one_of(ANYTHING, st.lists(ANYTHING, max_size=3)), max_size=3),
)
def test_the_constructor_refuses_what_is_not_a_plan(
    sizes: list[object], slicings: list[object]
) -> None:
    try:
        plan = Plan(sizes, slicings)  # type: ignore[arg-type]
    except ValueError as exc:
        assert "batch slice" in str(exc) or "plan" in str(exc), str(exc)
        return
    assert all(type(b) is int and b > 0 for b in plan.batch_slices)
    assert all(type(s) is int and s > 0 for ts in plan.token_slices for s in ts)


def test_bad_input_messages_name_the_value_and_the_rule() -> None:
    with pytest.raises(ValueError, match=r"token slice 1 of batch slice 0 has length 2.5: .*whole"):
        Plan((1,), ((4, 2.5),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"batch slice 0 has size True: .*whole numbers"):
        Plan((True,), ((4,),))
    with pytest.raises(ValueError, match=r"token slices of batch slice 0 are '44', not a sequence"):
        Plan((1,), ("44",))  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"token slice 0 of batch slice 0 has length -5: .*positive"
    ):
        Plan.from_paper("[(1, [-5, 69])]")
    with pytest.raises(ValueError, match=r"'\[64\] \* 0' repeats a list 0 times"):
        Plan.from_paper("[(1, [64] * 0)] * 2")
    with pytest.raises(ValueError, match=r"expands to 1000000000001 numbers and lists, more than"):
        Plan.from_paper("[(1, [1] * 1_000_000_000_000)]")
    with pytest.raises(ValueError, match=r"unsupported element '2.5': the notation has integers"):
        Plan.from_paper("[(1, [2.5])]")
    with pytest.raises(ValueError, match=r"slicing scheme None is not a string"):
        Plan.from_paper(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"nested too deeply"):
        Plan.from_paper("[(1, [1]" + " + [1]" * 50_000 + ")]")
    with pytest.raises(ValueError, match=r"batch=0 must be a positive integer"):
        Plan.uniform(0, 8)
    with pytest.raises(ValueError, match=r"n_token_slices=1.5 must be a positive integer"):
        Plan.uniform(2, 8, n_token_slices=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seq_len='8' must be a positive integer"):
        Plan((1,), ((8,),)).check_covers(1, "8")  # type: ignore[arg-type]
