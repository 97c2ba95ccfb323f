"""Asynchronous schedules as data: the versions the papers define, and the rules the
validator holds them to."""

from __future__ import annotations

import dataclasses
import io

import pytest

from tplib.plan import Plan
from tplib.schedule import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    held_versions,
    make_schedule,
    validate,
)
from tplib.schedule.asynchronous import _enough, min_microbatches, repeat_plan

MINIBATCH = Plan((2,), ((4, 4),))  # PipeDream: one batch slice, two token slices


def _versions(schedule: Schedule, kind: Kind = Kind.F) -> dict[tuple[int, int], int]:
    """(stage, batch slice) -> the version its ``kind`` actions use (all the same)."""
    out: dict[tuple[int, int], set[int]] = {}
    for k, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind is kind:
                out.setdefault((k, a.b), set()).add(a.v)
    assert all(len(v) == 1 for v in out.values()), "token slices disagree on the version"
    return {key: v.pop() for key, v in out.items()}


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_pipedream_stashes_per_stage_delay(k: int) -> None:
    s = make_schedule("pipedream", k, MINIBATCH, n_iterations=10)
    # Minibatch t's forward on stage k sees the weights after t - (K-k-1) updates, and its
    # backward uses the same stashed version.
    want = {(stage, t): max(0, t - (k - stage - 1)) for stage in range(k) for t in range(10)}
    assert _versions(s, Kind.F) == want
    assert _versions(s, Kind.B) == want
    assert held_versions(s) == tuple(k - stage for stage in range(k))


@pytest.mark.parametrize("k", [2, 4])
def test_vertical_sync_uses_the_entry_version_everywhere(k: int) -> None:
    s = make_schedule("pipedream", k, MINIBATCH, n_iterations=10, vertical_sync=True)
    want = {(stage, t): max(0, t - (k - 1)) for stage in range(k) for t in range(10)}
    assert _versions(s, Kind.F) == want == _versions(s, Kind.B)
    assert held_versions(s) == (k,) * k


@pytest.mark.parametrize(("k", "tokens"), [(1, (8,)), (2, (8,)), (4, (8,)), (4, (2, 6))])
def test_2bw_runs_iteration_t_on_version_t_minus_1(k: int, tokens: tuple[int, ...]) -> None:
    m = 4
    plan = Plan((1,) * m, (tokens,) * m)
    s = make_schedule("2bw", k, plan, n_iterations=5)
    assert s.plan == repeat_plan(plan, 5) and s.n_iterations == 5
    want = {(stage, b): max(b // m - 1, 0) for stage in range(k) for b in range(5 * m)}
    assert _versions(s, Kind.F) == want == _versions(s, Kind.B)
    assert held_versions(s) == (2,) * k
    for acts in s.actions:  # one update per iteration, after its last backward
        assert sum(a.kind is Kind.OPT for a in acts) == 5


def test_flushed_schedules_hold_one_version() -> None:
    for name in ("gpipe", "terapipe", "1f1b"):
        plan = Plan((1, 1), ((8,), (8,)))
        assert held_versions(make_schedule(name, 3, plan)) == (1, 1, 1)


def test_2bw_needs_enough_microbatches() -> None:
    # 1F1B keeps K-1 microbatches ahead on stage 0: with fewer per iteration, iteration
    # t's first forward comes before stage 0 has made version t-1.
    assert [min_microbatches(k, (8,)) for k in (1, 2, 3, 4, 8)] == [1, 1, 2, 3, 7]
    with pytest.raises(ValueError, match=r"2bw with m=2 microbatches .* 4 stages.* m=3"):
        make_schedule("2bw", 4, Plan((1, 1), ((8,), (8,))), n_iterations=3)
    make_schedule("2bw", 4, Plan((1,) * 3, ((8,),) * 3), n_iterations=3)


def test_pipedream_refuses_several_batch_slices() -> None:
    with pytest.raises(ValueError, match=r"pipedream given plan .* 2 batch slices.*'2bw'"):
        make_schedule("pipedream", 2, Plan((1, 1), ((8,), (8,))), n_iterations=3)


def test_vertical_sync_needs_versions() -> None:
    for name in ("1f1b", "2bw", "terapipe"):
        with pytest.raises(ValueError, match=f"vertical_sync=True with schedule '{name}'"):
            make_schedule(name, 2, Plan((1, 1), ((8,), (8,))), vertical_sync=True)


def _edit(s: Schedule, stage: int, index: int, action: Action | None) -> Schedule:
    acts = [list(a) for a in s.actions]
    if action is None:
        del acts[stage][index]
    else:
        acts[stage][index] = action
    return dataclasses.replace(s, actions=tuple(tuple(a) for a in acts))


def _index(s: Schedule, stage: int, text: str) -> int:
    return [str(a) for a in s.actions[stage]].index(text)


def test_validator_holds_versions_to_their_rules() -> None:
    s = make_schedule("pipedream", 2, MINIBATCH, n_iterations=4)
    # A backward on another version than its forward.
    i = _index(s, 0, "B b1 t1 v0")
    with pytest.raises(ScheduleError, match="share one weight version"):
        validate(_edit(s, 0, i, Action(Kind.B, 0, 1, 1, 1)))
    # A version the stage has not made yet.
    i = _index(s, 1, "F b0 t0 v0")
    with pytest.raises(ScheduleError, match="uses weight version 3, but the stage has made only 0"):
        validate(_edit(s, 1, i, Action(Kind.F, 1, 0, 0, 3)))
    # A forward without a version among versioned ones.
    with pytest.raises(ScheduleError, match="names no weight version"):
        validate(_edit(s, 1, i, Action(Kind.F, 1, 0, 0)))
    # An update dropped: four iterations need four.
    i = [n for n, a in enumerate(s.actions[0]) if a.kind is Kind.OPT][-1]
    with pytest.raises(ScheduleError, match="updates 3 times over 4 iterations"):
        validate(_edit(_edit(s, 0, i, None), 0, i - 1, None))


def test_validator_wants_each_update_after_its_iteration() -> None:
    s = make_schedule("2bw", 2, Plan((1, 1), ((8,), (8,))), n_iterations=3)
    acts = list(s.actions[1])
    first_opt = next(n for n, a in enumerate(acts) if a.kind is Kind.OPT)
    # Move update 0 before iteration 0's last backward.
    moved = (
        acts[: first_opt - 3]
        + acts[first_opt - 1 : first_opt + 1]
        + acts[first_opt - 3 : first_opt - 1]
        + acts[first_opt + 1 :]
    )
    bad = dataclasses.replace(s, actions=(s.actions[0], tuple(moved)))
    with pytest.raises(ScheduleError, match="update #0 on stage 1 runs before"):
        validate(bad)


def test_synchronous_schedules_still_end_with_their_update() -> None:
    s = make_schedule("1f1b", 2, Plan((1, 1), ((8,), (8,))))
    with pytest.raises(ScheduleError, match="must end with AR, OPT"):
        validate(_edit(s, 0, len(s.actions[0]) - 1, None))


def test_versions_print_parse_and_round_trip() -> None:
    a = Action.parse("F b3 t1 v2", stage=1)
    assert (a.kind, a.b, a.t, a.v) == (Kind.F, 3, 1, 2) and str(a) == "F b3 t1 v2"
    with pytest.raises(ValueError, match="only forwards and backwards use a weight version"):
        Action(Kind.SA, 0, 0, 0, 1)
    s = make_schedule("2bw", 3, Plan((1, 1), ((4, 4), (4, 4))), n_iterations=3)
    buf = io.StringIO()
    s.to_csv(buf)
    buf.seek(0)
    back = Schedule.from_csv(buf)
    assert back == s and back.n_iterations == 3 and back.asynchronous


@pytest.mark.parametrize("token_slices", [(8,), (4, 4), (2, 3, 3), (1, 1, 1, 1, 4)])
def test_enough_microbatches_stay_enough_so_the_bisection_finds_the_fewest(
    token_slices: tuple[int, ...],
) -> None:
    for k in range(1, 7):
        enough = [_enough(k, token_slices, m) for m in range(1, 4 * k + len(token_slices) + 2)]
        fewest = enough.index(True) + 1
        assert all(enough[fewest - 1 :]), (k, enough)
        assert min_microbatches(k, token_slices) == fewest
