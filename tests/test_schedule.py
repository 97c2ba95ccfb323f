"""Tests for tplib.schedule: typed actions, generators, the completing passes, validator,
replay, grid and CSV."""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
from collections.abc import Callable
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tplib.schedule.generators as generators_module
from tplib.plan import Plan
from tplib.schedule import (
    REGISTRY,
    UPDATE,
    WHOLE_SEQUENCE,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    add_communication,
    add_update,
    draw_schedule,
    gpipe,
    make_schedule,
    one_f_one_b,
    replay,
    schedule_names,
    terapipe,
    validate,
)
from tplib.schedule.generators import one_f_one_b_zb, terapipe_zb

# One chunk per stage; the schedules with virtual stages: tests/test_schedule_virtual.py.
SYNCHRONOUS = sorted(n for n in schedule_names(asynchronous=False) if not REGISTRY[n].chunked)

PLANS = [
    Plan.from_paper("[(1, [8])]"),
    Plan.from_paper("[(1, [8])] * 4"),
    Plan.from_paper("[(2, [8]), (1, [8])]"),
    Plan.from_paper("[(1, [3, 3, 2])] * 2"),
    Plan.from_paper("[(1, [8]), (1, [1, 1, 1, 5])]"),  # differing M per batch slice
    Plan.from_paper("[(2, [2, 6]), (1, [1] * 8), (3, [4, 4])]"),
]


@st.composite
def plans(draw: st.DrawFn, *, max_token_slices: int = 4) -> Plan:
    """Random batch splits with a random token slicing per batch slice."""
    seq_len = draw(st.integers(1, 8))
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    slicings = []
    for _ in sizes:
        cuts = draw(
            st.sets(st.integers(1, seq_len - 1), max_size=max_token_slices - 1)
            if seq_len > 1
            else st.just(set())
        )
        bounds = [0, *sorted(cuts), seq_len]
        slicings.append(tuple(hi - lo for lo, hi in pairwise(bounds)))
    return Plan(tuple(sizes), tuple(slicings))


def compute(s: Schedule, k: int) -> list[str]:
    return [str(a) for a in s.compute_actions(k)]


def with_stage(s: Schedule, k: int, acts: list[Action]) -> Schedule:
    actions = list(s.actions)
    actions[k] = tuple(acts)
    return dataclasses.replace(s, actions=tuple(actions))


def from_compute(n_stages: int, plan: Plan, orders: list[list[str]]) -> Schedule:
    """A schedule from hand-written compute orders, with communication and update added."""
    acts = [[Action.parse(text, k) for text in order] for k, order in enumerate(orders)]
    return add_update(add_communication(Schedule("hand", n_stages, plan, tuple(map(tuple, acts)))))


def assert_caught(s: Schedule, marked: str, *words: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(s)
    message = str(info.value)
    assert "stage 0 |" in message and "step" in message, message  # the grid is printed
    assert f">{marked}<" in message, message  # with the faulty action marked
    for word in words:
        assert word in message.splitlines()[0], message  # and explained on the first line
    return info.value


# ---- generators validate ---------------------------------------------------------------


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_generators_validate(name: str, n_stages: int, plan: Plan) -> None:
    sliced = any(plan.n_token_slices(b) > 1 for b in range(plan.n_batch_slices))
    if sliced and not REGISTRY[name].token_slices:
        with pytest.raises(ValueError, match="use 'terapipe'"):
            make_schedule(name, n_stages, plan)
        return
    s = make_schedule(name, n_stages, plan)
    assert s.name == name and s.n_stages == n_stages and s.plan == plan
    validate(s)


@settings(max_examples=60, deadline=None)
@given(plan=plans(), n_stages=st.integers(1, 4), name=st.sampled_from(["terapipe", "1f1b"]))
def test_random_plans_validate(plan: Plan, n_stages: int, name: str) -> None:
    validate(REGISTRY[name].generator(n_stages, plan))


@settings(max_examples=30, deadline=None)
@given(plan=plans(max_token_slices=1), n_stages=st.integers(1, 4))
def test_random_microbatch_plans_validate_under_gpipe(plan: Plan, n_stages: int) -> None:
    validate(gpipe(n_stages, plan))


# ---- exact action lists ----------------------------------------------------------------


def test_gpipe_exact() -> None:
    s = gpipe(2, Plan.gpipe(batch=2, seq_len=4))
    assert [str(a) for a in s.actions[0]] == [
        "F b0 t0", "SA b0 t0", "F b1 t0", "SA b1 t0",
        "RG b1 t0", "B b1 t0", "RG b0 t0", "B b0 t0", "AR", "OPT",
    ]  # fmt: skip
    assert [str(a) for a in s.actions[1]] == [
        "RA b0 t0", "F b0 t0", "RA b1 t0", "F b1 t0",
        "B b1 t0", "SG b1 t0", "B b0 t0", "SG b0 t0", "AR", "OPT",
    ]  # fmt: skip


def test_terapipe_exact() -> None:
    s = terapipe(2, Plan.from_paper("[(1, [1, 1]), (1, [2])]"))
    expected = ["F b0 t0", "F b0 t1", "F b1 t0", "B b1 t0", "B b0 t1", "B b0 t0"]
    assert compute(s, 0) == compute(s, 1) == expected
    assert [str(a) for a in s.actions[1]][:3] == ["RA b0 t0", "F b0 t0", "RA b0 t1"]


def test_1f1b_exact_token_sliced() -> None:
    s = one_f_one_b(3, Plan.from_paper("[(1, [1, 1])] * 2"))
    assert compute(s, 0) == [
        "F b0 t0", "F b0 t1", "F b1 t0", "F b1 t1",
        "B b0 t1", "B b0 t0", "B b1 t1", "B b1 t0",
    ]  # fmt: skip
    assert compute(s, 1) == [
        "F b0 t0", "F b0 t1", "F b1 t0", "B b0 t1",
        "F b1 t1", "B b0 t0", "B b1 t1", "B b1 t0",
    ]  # fmt: skip
    assert compute(s, 2) == [
        "F b0 t0", "F b0 t1", "B b0 t1", "F b1 t0",
        "B b0 t0", "F b1 t1", "B b1 t1", "B b1 t0",
    ]  # fmt: skip


def test_1f1b_exact_microbatches_is_pipedream_flush() -> None:
    s = one_f_one_b(2, Plan.gpipe(batch=3, seq_len=4))
    assert compute(s, 0) == ["F b0 t0", "F b1 t0", "B b0 t0", "F b2 t0", "B b1 t0", "B b2 t0"]
    assert compute(s, 1) == ["F b0 t0", "B b0 t0", "F b1 t0", "B b1 t0", "F b2 t0", "B b2 t0"]


def test_1f1b_runs_missing_forwards_before_a_backward() -> None:
    # Batch slice 1 has more token slices than batch slice 0, so its last slice's
    # backward needs forwards beyond the one-per-backward rhythm.
    s = one_f_one_b(2, Plan.from_paper("[(1, [4]), (1, [1, 1, 1, 1])]"))
    assert compute(s, 1) == [
        "F b0 t0", "B b0 t0", "F b1 t0", "F b1 t1", "F b1 t2", "F b1 t3",
        "B b1 t3", "B b1 t2", "B b1 t1", "B b1 t0",
    ]  # fmt: skip
    assert compute(s, 0)[:3] == ["F b0 t0", "F b1 t0", "B b0 t0"]
    validate(s)


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4, 6])
def test_1f1b_warmup(n_stages: int, plan: Plan) -> None:
    s = one_f_one_b(n_stages, plan)
    for k in range(n_stages):
        kinds = [a.kind for a in s.compute_actions(k)]
        leading = kinds.index(Kind.B)
        warmup = (n_stages - k - 1) + (plan.n_token_slices(0) - 1)
        # The warmup forwards, then the steady state opens with one more forward.
        assert leading == min(warmup + 1, plan.n_units)


def test_docstring_tables_match_generators() -> None:
    plan = Plan.from_paper("[(1, [2, 2])] * 3")
    doc = generators_module.__doc__ or ""
    for name in ("terapipe", "1f1b"):
        assert textwrap.indent(draw_schedule(REGISTRY[name].generator(2, plan)), "    ") in doc


# ---- errors from generators --------------------------------------------------------------


def test_gpipe_rejects_token_slices() -> None:
    with pytest.raises(ValueError, match="terapipe"):
        gpipe(2, Plan.from_paper("[(1, [2, 2])]"))


def test_unknown_schedule_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="zero-bubble") as info:
        make_schedule("zero-bubble", 2, PLANS[0])
    for name in schedule_names():
        assert name in str(info.value)


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_stage_count_must_be_positive(name: str) -> None:
    with pytest.raises(ValueError, match="n_stages"):
        make_schedule(name, 0, PLANS[0])


def test_add_communication_wants_no_communication() -> None:
    with pytest.raises(
        ValueError, match="expects a schedule of forwards, backwards, weight gradients and updates"
    ):
        add_communication(terapipe(2, PLANS[0]))


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_every_stage_ends_with_its_update(name: str) -> None:
    s = make_schedule(name, 3, PLANS[2])
    for k, acts in enumerate(s.actions):
        assert acts[-2:] == (Action(Kind.AR, k), Action(Kind.OPT, k))
        assert sum(a.kind in UPDATE for a in acts) == 2


# ---- mutations the validator must catch ------------------------------------------------

TOKEN_PLAN = Plan.from_paper("[(1, [1, 1])] * 2")


def test_catches_backward_before_its_forward() -> None:
    s = terapipe(3, TOKEN_PLAN)
    acts = list(s.actions[1])
    f = acts.index(Action(Kind.F, 1, 1, 1))
    b = acts.index(Action(Kind.B, 1, 1, 1))
    acts[f], acts[b] = acts[b], acts[f]
    assert_caught(with_stage(s, 1, acts), "B b1 t1", "B b1 t1", "F b1 t1")


def test_catches_token_slices_forward_out_of_order() -> None:
    s = terapipe(3, TOKEN_PLAN)
    acts = list(s.actions[0])
    i, j = acts.index(Action(Kind.F, 0, 0, 0)), acts.index(Action(Kind.F, 0, 0, 1))
    acts[i], acts[j] = acts[j], acts[i]
    assert_caught(with_stage(s, 0, acts), "F b0 t1", "F b0 t1", "K/V")


def test_catches_token_slices_backward_in_forward_order() -> None:
    s = one_f_one_b(3, TOKEN_PLAN)
    acts = list(s.actions[2])
    i, j = acts.index(Action(Kind.B, 2, 1, 1)), acts.index(Action(Kind.B, 2, 1, 0))
    acts[i], acts[j] = acts[j], acts[i]
    assert_caught(with_stage(s, 2, acts), "B b1 t0", "B b1 t0", "last-to-first")


def test_catches_missing_send() -> None:
    s = terapipe(3, TOKEN_PLAN)
    acts = [a for a in s.actions[0] if a != Action(Kind.SA, 0, 1, 0)]
    assert_caught(with_stage(s, 0, acts), "F b1 t0", "SA b1 t0", "lacks")


def test_catches_duplicated_action() -> None:
    s = terapipe(3, TOKEN_PLAN)
    acts = list(s.actions[1])
    acts.insert(5, acts[1])
    assert str(acts[1]) == "F b0 t0"
    assert_caught(with_stage(s, 1, acts), "F b0 t0", "F b0 t0", "twice")


def test_catches_fifo_mismatch_between_stages() -> None:
    plan = Plan.gpipe(batch=2, seq_len=4)
    s = from_compute(
        2,
        plan,
        [
            ["F b1 t0", "F b0 t0", "B b1 t0", "B b0 t0"],  # sends b1 first ...
            ["F b0 t0", "F b1 t0", "B b1 t0", "B b0 t0"],  # ... but receives b0 first
        ],
    )
    error = assert_caught(s, "F b0 t0", "FIFO", "RA b0 t0", "SA b1 t0")
    assert Action(Kind.RA, 1, 0, 0) in error.actions


def test_catches_deadlock() -> None:
    # Stage 0 waits for b0's gradient before sending b1's activation, which stage 1
    # needs before it runs b0 backward: each waits on the other.
    s = from_compute(
        2,
        Plan.gpipe(batch=2, seq_len=4),
        [
            ["F b0 t0", "B b0 t0", "F b1 t0", "B b1 t0"],
            ["F b0 t0", "F b1 t0", "B b0 t0", "B b1 t0"],
        ],
    )
    error = assert_caught(s, "B b0 t0", "deadlock", "RG b0 t0", "RA b1 t0")
    assert ">F b1 t0<" in str(error)
    with pytest.raises(ScheduleError, match="deadlock"):
        replay(s, lambda a: 1.0)


def test_catches_a_missing_or_misplaced_update() -> None:
    s = terapipe(2, TOKEN_PLAN)
    without = with_stage(s, 1, list(s.actions[1][:-2]))
    assert_caught(without, "B b0 t0", "stage 1 must end with AR, OPT")
    early = with_stage(s, 0, [Action(Kind.AR, 0), *s.actions[0][:-2], Action(Kind.OPT, 0)])
    assert_caught(early, "B b0 t0", "stage 0 must end with AR, OPT")
    twice = with_stage(s, 0, [*s.actions[0][:-1], Action(Kind.AR, 0), Action(Kind.OPT, 0)])
    assert_caught(twice, "B b0 t0", "AR appears twice")


def test_catches_receive_from_nowhere_and_foreign_units() -> None:
    s = terapipe(2, TOKEN_PLAN)
    extra = with_stage(s, 0, [Action(Kind.RA, 0, 0, 0), *s.actions[0]])
    assert_caught(extra, "F b0 t0", "RA b0 t0", "has none")
    foreign = with_stage(s, 1, [*s.actions[1], Action(Kind.F, 1, 5, 0)])
    with pytest.raises(ScheduleError, match="not in the plan"):
        validate(foreign)


# ---- replay, grid, text and CSV --------------------------------------------------------


@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_replay_fill_drain_makespan(n_stages: int) -> None:
    plan = PLANS[3]
    timed = replay(terapipe(n_stages, plan), lambda a: 1.0 if a.kind in "FB" else 0.0)
    # The update runs last on each stage, after its own last backward.
    for ta in timed:
        if ta.action.kind in UPDATE:
            assert ta.start == max(t.end for t in timed if t.stage == ta.stage)
    assert max(ta.end for ta in timed) == 2 * (plan.n_units + n_stages - 1)
    assert len(timed) == sum(len(acts) for acts in terapipe(n_stages, plan).actions)


def test_replay_with_transfer_times() -> None:
    s = terapipe(2, PLANS[0])
    timed = replay(s, lambda a: 1.0 if a.kind in ("F", "B") else 0.5)
    got = {(ta.stage, str(ta.action)): (ta.start, ta.end) for ta in timed}
    assert got[(0, "SA b0 t0")] == (1.0, 1.5)
    assert got[(1, "F b0 t0")] == (1.5, 2.5)  # waits for the activation to arrive
    assert got[(0, "RG b0 t0")] == (1.0, 4.0)  # the send did not hold stage 0 up
    assert got[(0, "B b0 t0")] == (4.0, 5.0)


def test_draw_schedule_marks_an_action() -> None:
    s = one_f_one_b(3, TOKEN_PLAN)
    grid = draw_schedule(s, Action(Kind.RG, 0, 0, 1))  # a receive marks its backward
    assert ">B b0 t1<" in grid and grid.count(">") == 1
    assert len(grid.splitlines()) == 2 + 3
    narrow = draw_schedule(s, Action(Kind.B, 0, 1, 0), max_steps=4)
    assert ">B b1 t0<" in narrow and "..." in narrow


@given(
    kind=st.sampled_from(sorted(set(Kind) - UPDATE)),
    stage=st.integers(0, 99),
    b=st.integers(0, 999),
    t=st.integers(0, 999),
)
def test_action_text_round_trip(kind: Kind, stage: int, b: int, t: int) -> None:
    a = Action(kind, stage, b, t)
    assert Action.parse(str(a), stage) == a


@pytest.mark.parametrize("kind", sorted(UPDATE))
def test_update_actions_have_no_unit(kind: Kind) -> None:
    a = Action(kind, 3)
    assert str(a) == kind.value and Action.parse(kind.value, 3) == a
    with pytest.raises(ValueError, match="takes no unit"):
        Action(kind, 0, 0, 0)


def test_kinds_are_typed_and_compare_as_text() -> None:
    assert Action(Kind.F, 0, 0, 0).kind is Kind.F  # text is turned into the enum
    assert Kind.SA == "SA" and f"{Kind.OPT}" == "OPT"
    assert {k.value for k in Kind} == {"F", "B", "SA", "RA", "SG", "RG", "W", "AR", "OPT"}


def test_action_rejects_bad_text() -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("X b0 t0", 0)
    with pytest.raises(ValueError, match="unknown action kind 'X'"):
        Action("X", 0, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        Action(Kind.F, 0, -1, 0)


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_csv_round_trip_buffer(name: str) -> None:
    plan = Plan((1, 2), ((8,), (8,)), latency=1.25, t_max=0.1, eps=1e-3)
    s = make_schedule(name, 3, plan)
    buf = io.StringIO()
    s.to_csv(buf)
    buf.seek(0)
    assert Schedule.from_csv(buf) == s


def test_csv_round_trip_file(tmp_path: object) -> None:
    s = one_f_one_b(4, PLANS[5])
    path = f"{tmp_path}/sched.csv"
    s.to_csv(path)
    assert Schedule.from_csv(path) == s
    with open(path) as f:
        text = f.read()
    assert "stage,index,kind,b,t,v" in text and "\n3,0,RA,0,0,-1\n" in text
    assert "AR,-1,-1,-1" in text and "OPT,-1,-1,-1" in text


# ---- split backwards: W actions, terapipe-zb and 1f1b-zb -----------------------------

ZB_NAMES = ("terapipe-zb", "1f1b-zb")
ZB_PLANS = [
    Plan((1, 1), ((7, 1, 8), (3, 13))),  # uneven slices, M differs per batch slice
    Plan.uniform(4, 16, n_token_slices=4),
    Plan.gpipe(4, 16),  # microbatches: one token slice each
    Plan((2, 1, 3), ((16,), (16,), (16,))),  # microbatches of different sizes
    Plan.from_paper("[(2, [2, 6]), (1, [1] * 8), (3, [4, 4])]"),
    Plan.from_paper("[(1, [8]), (1, [1, 1, 1, 5])]"),
]


def pending_w(s: Schedule, k: int) -> list[tuple[Action, set[int]]]:
    """Each work action of stage k with the sequences whose last B (t0) has run and
    whose W has not, just before the action."""
    out: list[tuple[Action, set[int]]] = []
    waiting: set[int] = set()
    for a in s.actions[k]:
        if a.kind not in (Kind.F, Kind.B, Kind.W):
            continue
        out.append((a, set(waiting)))
        if a.kind is Kind.B and a.t == 0:
            waiting.add(a.b)
        elif a.kind is Kind.W:
            waiting.discard(a.b)
    return out


def test_whole_sequence_w_text_round_trip() -> None:
    w = Action.parse("W b0", 2)
    assert w == Action(Kind.W, 2, 0, WHOLE_SEQUENCE)
    assert w.whole_sequence and str(w) == "W b0"
    unit = Action.parse("W b1 t2", 0)
    assert unit == Action(Kind.W, 0, 1, 2)
    assert not unit.whole_sequence and str(unit) == "W b1 t2"
    assert Action.parse(str(unit), 0) == unit and Action.parse(str(w), 2) == w
    # Only W takes a whole sequence, and a W names no weight version.
    assert not Action(Kind.B, 0, 1, 0).whole_sequence
    with pytest.raises(ValueError, match="non-negative"):
        Action(Kind.B, 0, 1, WHOLE_SEQUENCE)
    with pytest.raises(ValueError, match="non-negative"):
        Action(Kind.W, 0, -1, WHOLE_SEQUENCE)
    with pytest.raises(ValueError, match="weight version"):
        Action(Kind.W, 0, 0, 0, v=1)
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("W b0 t1 v0", 0)


@pytest.mark.parametrize("name", ZB_NAMES)
def test_zero_bubble_csv_round_trip(name: str) -> None:
    s = make_schedule(name, 3, Plan((1, 1), ((7, 1, 8), (3, 13))))
    buf = io.StringIO()
    s.to_csv(buf)
    text = buf.getvalue()
    assert ",W,1,-1,-1\n" in text  # a whole-sequence W is written with t = -1
    buf.seek(0)
    back = Schedule.from_csv(buf)
    assert back == s and back.split_backward
    validate(back)


@pytest.mark.parametrize("plan", ZB_PLANS, ids=str)
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ZB_NAMES)
def test_zero_bubble_schedules_validate(name: str, n_stages: int, plan: Plan) -> None:
    s = make_schedule(name, n_stages, plan)
    assert s.split_backward and not make_schedule(name.removesuffix("-zb"), 1, plan).split_backward
    base = REGISTRY[name.removesuffix("-zb")].generator(n_stages, plan)
    for k in range(n_stages):
        # The forwards and backwards are the unsplit schedule's, in its order ...
        assert compute(s, k) == compute(base, k)
        # ... and every sequence's weight gradients are one whole-sequence W.
        ws = [a for a in s.actions[k] if a.kind is Kind.W]
        assert all(a.whole_sequence for a in ws)
        assert sorted(a.b for a in ws) == list(range(plan.n_batch_slices))
    validate(s)


@settings(max_examples=60, deadline=None)
@given(plan=plans(), n_stages=st.integers(1, 4), name=st.sampled_from(ZB_NAMES))
def test_random_plans_validate_under_zero_bubble(plan: Plan, n_stages: int, name: str) -> None:
    validate(REGISTRY[name].generator(n_stages, plan))


def test_terapipe_zb_exact() -> None:
    s = terapipe_zb(2, Plan.from_paper("[(1, [1, 1]), (1, [2])]"))
    expected = ["F b0 t0", "F b0 t1", "F b1 t0", "B b1 t0", "B b0 t1", "B b0 t0"]
    for k in range(2):
        work = [str(a) for a in s.actions[k] if a.kind in (Kind.F, Kind.B, Kind.W)]
        # W after every B, sequences in the order their backwards finished.
        assert work == [*expected, "W b1", "W b0"]


def _documented(function: Callable[[int, Plan], Schedule]) -> tuple[str, int, Plan]:
    doc = inspect.getdoc(function) or ""
    m = re.search(r"on K=(\d+)\s+stages\s+for\s+the\s+plan\s+``([^`]+)``", doc)
    assert m is not None, f"{function.__name__}'s docstring names no K and plan"
    return doc, int(m[1]), Plan.from_paper(m[2])


@pytest.mark.parametrize("function", [terapipe_zb, one_f_one_b_zb], ids=lambda f: f.__name__)
def test_zero_bubble_docstring_tables_match_generators(
    function: Callable[[int, Plan], Schedule],
) -> None:
    doc, n_stages, plan = _documented(function)
    table = textwrap.indent(draw_schedule(function(n_stages, plan)), "    ")
    assert table in doc, f"{function.__name__}'s clock table is not draw_schedule's:\n{table}"


def test_1f1b_zb_docstring_step_counts() -> None:
    # "15 steps, where 1f1b with its two-step backwards takes 18"
    _, n_stages, plan = _documented(one_f_one_b_zb)
    zb = replay(one_f_one_b_zb(n_stages, plan), lambda a: 1.0 if a.kind in "FBW" else 0.0)
    assert max(ta.end for ta in zb) == 15
    base = replay(one_f_one_b(n_stages, plan), lambda a: {"F": 1.0, "B": 2.0}.get(a.kind, 0.0))
    assert max(ta.end for ta in base) == 18


BOUND_PLANS = [*ZB_PLANS, Plan.gpipe(8, 4), Plan.uniform(6, 8, n_token_slices=2)]


def _assert_1f1b_zb_bound(s: Schedule) -> None:
    """Stage k runs a forward with at most K-k sequences waiting for their W; until its
    last forward, at most K-k+1 wait (one B between two forwards adds one)."""
    n = s.n_stages
    for k in range(n):
        work = pending_w(s, k)
        last_forward = max(i for i, (a, _) in enumerate(work) if a.kind is Kind.F)
        for i, (a, waiting) in enumerate(work):
            if a.kind is Kind.F:
                assert len(waiting) <= n - k, (k, str(a), waiting)
            if i <= last_forward:
                assert len(waiting) <= n - k + 1, (k, str(a), waiting)


@pytest.mark.parametrize("plan", BOUND_PLANS, ids=str)
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4, 6])
def test_1f1b_zb_bounds_the_pending_weight_gradients(n_stages: int, plan: Plan) -> None:
    _assert_1f1b_zb_bound(one_f_one_b_zb(n_stages, plan))


def test_1f1b_zb_bound_is_reached() -> None:
    """The bound binds: on 8 microbatches stages 1 and 2 reach it. There the forcing
    rule is what runs their W between forwards: without it (tried by editing the
    generator) the three stages ran forwards with 5, 6 and 7 sequences' W waiting."""
    s = one_f_one_b_zb(3, Plan.gpipe(8, 4))
    peaks = [max(len(w) for a, w in pending_w(s, k) if a.kind is Kind.F) for k in range(3)]
    assert peaks[1:] == [2, 1]  # = K - k on stages 1 and 2
    # After the last forward nothing forces a W: the drain may hold more (not bounded).
    k1 = pending_w(one_f_one_b_zb(1, Plan.from_paper("[(1, [1] * 5)] + [(1, [5])] * 6")), 0)
    assert max(len(w) for _, w in k1) > 2


@settings(max_examples=60, deadline=None)
@given(plan=plans(), n_stages=st.integers(1, 6))
def test_1f1b_zb_bound_on_random_plans(plan: Plan, n_stages: int) -> None:
    _assert_1f1b_zb_bound(one_f_one_b_zb(n_stages, plan))


ZB_PLAN = Plan.from_paper("[(1, [1, 1])] * 2")


def _terapipe_zb_stage(k: int, work: list[str]) -> Schedule:
    """terapipe-zb on 2 stages of ZB_PLAN with stage k's W actions replaced by ``work``
    (appended after its backwards, before its update)."""
    s = terapipe_zb(2, ZB_PLAN)
    acts = [a for a in s.actions[k] if a.kind is not Kind.W]
    update = acts[-2:]
    return with_stage(s, k, [*acts[:-2], *(Action.parse(w, k) for w in work), *update])


def test_zero_bubble_mixed_w_validates() -> None:
    # A sequence's W per unit (in any order after each B) or whole: both are complete.
    validate(_terapipe_zb_stage(1, ["W b0 t1", "W b1", "W b0 t0"]))
    s = terapipe_zb(2, ZB_PLAN)
    acts = list(s.actions[0])
    # A per-unit W may run as soon as its own unit's B has: before the sequence's t0.
    acts.remove(Action(Kind.W, 0, 1, WHOLE_SEQUENCE))
    acts.insert(acts.index(Action(Kind.B, 0, 1, 1)) + 1, Action(Kind.W, 0, 1, 1))
    acts.insert(acts.index(Action(Kind.B, 0, 1, 0)) + 1, Action(Kind.W, 0, 1, 0))
    validate(with_stage(s, 0, acts))


def test_catches_a_missing_w() -> None:
    s = _terapipe_zb_stage(0, ["W b1"])
    assert_caught(s, "B b0 t0", "stage 0 never computes the weight gradients", "b=0, t=0")
    partial = _terapipe_zb_stage(1, ["W b1", "W b0 t0"])  # b0 t1 left out
    assert_caught(partial, "B b0 t1", "stage 1 never computes", "b=0, t=1")


def test_catches_a_w_twice() -> None:
    error = assert_caught(_terapipe_zb_stage(0, ["W b1", "W b0", "W b1"]), "W b1", "already")
    assert error.actions == (Action(Kind.W, 0, 1, WHOLE_SEQUENCE),) * 2
    assert_caught(_terapipe_zb_stage(1, ["W b0", "W b1 t1", "W b1", "W b1 t1"]), "W b1", "already")


def test_catches_a_unit_w_and_its_sequences_w() -> None:
    s = _terapipe_zb_stage(0, ["W b1", "W b0 t1", "W b0"])
    error = assert_caught(s, "W b0 t1", "W b0 on stage 0", "b=0, t=1", "already computed")
    assert Action(Kind.W, 0, 0, 1) in error.actions and Action(Kind.W, 0, 0, -1) in error.actions


def test_catches_a_w_before_its_b() -> None:
    s = terapipe_zb(2, ZB_PLAN)
    acts = list(s.actions[1])
    w = acts.pop(acts.index(Action(Kind.W, 1, 0, WHOLE_SEQUENCE)))
    # After b0's last slice's backward but before its first's: the sequence is unfinished.
    acts.insert(acts.index(Action(Kind.B, 1, 0, 1)) + 1, w)
    assert_caught(with_stage(s, 1, acts), "W b0", "W b0 on stage 1 runs before B b0 t0")
    acts = [a for a in s.actions[0] if a != Action(Kind.W, 0, 1, WHOLE_SEQUENCE)]
    acts.insert(0, Action(Kind.W, 0, 1, 0))
    acts.insert(acts.index(Action(Kind.B, 0, 1, 1)) + 1, Action(Kind.W, 0, 1, 1))
    assert_caught(with_stage(s, 0, acts), "W b1 t0", "W b1 t0 on stage 0 runs before B b1 t0")


@pytest.mark.parametrize("bad", ["W b2", "W b0 t2", "W b5 t0"])
def test_catches_a_w_of_a_unit_not_in_the_plan(bad: str) -> None:
    s = _terapipe_zb_stage(0, ["W b1", "W b0", bad])
    assert_caught(s, bad, bad, "not in the plan")
