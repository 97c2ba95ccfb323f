"""NCCL's rendezvous messages (tplib.schedule.nccl): every registered schedule, posted as
the runtime posts it, completes; posted naively, 1F1B deadlocks as NCCL would make it.

NCCL needs a GPU per rank, which no machine here has, so this replay is the evidence
that the runtime's posting cannot hang there."""

from __future__ import annotations

import itertools

import pytest

from tplib.plan import Plan
from tplib.schedule import (
    COMMUNICATION,
    RECEIVES,
    SENDS,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    make_schedule,
    schedule_names,
)
from tplib.schedule.drawing import unit_cost
from tplib.schedule.nccl import check_nccl, posting_plan, run_nccl

STAGES = (1, 2, 3, 4, 6)
PLANS = [
    *(Plan.uniform(b, 16, n_token_slices=m) for b in (1, 2, 4, 8) for m in (1, 2, 4)),
    Plan((1, 2), ((5, 11), (16,))),
    Plan((1, 1), ((5, 11), (2, 6, 8))),
    Plan((2, 1, 1), ((1, 15), (16,), (4, 4, 8))),
]
ALL = schedule_names()


def _schedules(name: str) -> list[Schedule]:
    out = []
    for k, plan in itertools.product(STAGES, PLANS):
        try:
            out.append(make_schedule(name, k, plan, n_iterations=3))
        except ValueError:  # too few units for the asynchronous schedules' pipeline
            continue
    return out


@pytest.mark.parametrize("name", ALL)
def test_every_schedule_posted_in_order_completes_on_nccl(name: str) -> None:
    schedules = _schedules(name)
    assert len(schedules) >= 10, f"{name}: too few of the grid's points made a schedule"
    for schedule in schedules:
        check_nccl(schedule)


def _naive_deadlocks(name: str) -> int:
    count = 0
    for schedule in _schedules(name):
        try:
            check_nccl(schedule, "naive")
        except ScheduleError:
            count += 1
    return count


@pytest.mark.parametrize(
    ("name", "deadlocks"),
    [
        *(("gpipe", False), ("terapipe", False), ("terapipe-zb", False)),
        *(("1f1b", True), ("1f1b-zb", True), ("pipedream", True), ("2bw", True)),
    ],
)
def test_posting_each_message_alone_deadlocks_what_sends_ahead_of_receives(
    name: str, deadlocks: bool
) -> None:
    """The replay can fail: fill-drain schedules send everything before they receive, so
    they run even posted naively; the others hang there, as NCCL would make them."""
    assert (_naive_deadlocks(name) > 0) == deadlocks


def test_naive_1f1b_deadlocks_on_the_crossing_pair() -> None:
    schedule = make_schedule("1f1b", 2, Plan.uniform(4, 16, n_token_slices=1))
    with pytest.raises(ScheduleError) as caught:
        check_nccl(schedule, "naive")
    text = str(caught.value)
    assert "deadlock on NCCL" in text
    assert "stage 0 waits at RG b0 t0 (its stream to stage 1 is held by SA b1 t0)" in text
    assert "stage 1 waits at RA b1 t0 (its stream to stage 0 is held by SG b0 t0)" in text


def test_the_crossing_pair_is_posted_together_on_both_sides() -> None:
    schedule = make_schedule("1f1b", 2, Plan.uniform(4, 16, n_token_slices=1))
    plan = posting_plan(schedule)
    together = [{str(a) for a in g.actions} for g in plan[0]]
    assert {"SA b1 t0", "RG b0 t0"} in together
    assert {"SG b0 t0", "RA b1 t0"} in [{str(a) for a in g.actions} for g in plan[1]]


@pytest.mark.parametrize("name", ALL)
def test_the_posting_plan_posts_each_message_once_where_it_can(name: str) -> None:
    """Each send and receive in exactly one group, to its peer; a send never before its
    own place unless only messages lie between (its tensor is ready), a receive never
    after its own place (the stage waits on it there)."""
    for schedule in _schedules(name)[::3]:
        for k, groups in enumerate(posting_plan(schedule)):
            acts = schedule.actions[k]
            index = {a: i for i, a in enumerate(acts)}
            posted = [a for g in groups for a in g.actions]
            assert sorted(map(index.__getitem__, posted)) == [
                i for i, a in enumerate(acts) if a.kind in COMMUNICATION
            ]
            for g in groups:
                for a in g.actions:
                    i = index[a]
                    toward = {Kind.SA: 1, Kind.RG: 1}.get(a.kind, -1)
                    peer = schedule.neighbour(a, toward)  # the neighbouring part's stage
                    assert peer is not None and peer[0] == g.peer != k
                    assert g.at <= i
                    if a.kind in SENDS:
                        assert all(acts[j].kind in COMMUNICATION for j in range(g.at, i))
                    assert a.kind in RECEIVES or a.kind in SENDS


def test_a_schedule_that_waits_before_it_sends_has_no_order() -> None:
    """Two stages that each receive before they send cannot run on any transport."""
    plan = Plan.uniform(1, 16, n_token_slices=1)
    s0 = (
        Action(Kind.F, 0, 0, 0),
        Action(Kind.RG, 0, 0, 0),
        Action(Kind.SA, 0, 0, 0),
        Action(Kind.B, 0, 0, 0),
    )
    s1 = (
        Action(Kind.RA, 1, 0, 0),
        Action(Kind.F, 1, 0, 0),
        Action(Kind.B, 1, 0, 0),
        Action(Kind.SG, 1, 0, 0),
    )
    bad = Schedule("crossed", 2, plan, (s0, s1))
    with pytest.raises(ScheduleError, match="wait on each other's messages"):
        posting_plan(bad)


def test_the_nccl_replay_times_sends_until_their_receive() -> None:
    """A send's end is its message's: when its receive is posted, not when it is sent."""
    schedule = make_schedule("gpipe", 2, Plan.uniform(2, 16, n_token_slices=1))

    def duration(a: Action) -> float:  # stage 1's forwards are slow; messages are free
        if a.kind is Kind.F and a.stage == 1:
            return 3.0
        return unit_cost(a)

    timed, done, why = run_nccl(schedule, duration)
    assert not why and done == [len(a) for a in schedule.actions]
    sends = {str(t.action): t for t in timed[0] if t.action.kind is Kind.SA}
    # SA b0 meets RA b0, posted at once; SA b1, sent at 2, waits for stage 1 to post
    # RA b1 after its 3-step F b0, which started when SA b0 arrived at 1.
    assert (sends["SA b0 t0"].start, sends["SA b0 t0"].end) == (1.0, 1.0)
    assert (sends["SA b1 t0"].start, sends["SA b1 t0"].end) == (2.0, 4.0)
    buffered = {str(t.action): t for t in timed[0]}
    assert buffered["F b1 t0"].end == 2.0  # the stage itself never waited on its send
