"""torch 2.13's own schedules (tplib.runtime.torchorders), read from torch itself in this
process: every one imports, validates, passes NCCL's rendezvous replay and simulates;
beside tplib's schedule of the same design it is the same order, or the relationship
found below holds. And torch's own checks accept what tplib exports: its validator, its
lowering (whose result imports back as the schedule exported) and its simulator of
sends and receives.

Costs: :class:`UniformCosts`' defaults, a stage's forward 1 and backward 2, of which the
weight gradients (a split schedule's ``W``) are 1; a chunk of v costs 1/v of that.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from tplib.plan import Plan
from tplib.runtime.torchorders import (
    TORCH_SCHEDULES,
    UniformCosts,
    torch_order,
    torch_orders_table,
    torch_schedule,
)
from tplib.schedule import Kind, Schedule, from_torch, make_schedule, schedule_names, to_torch
from tplib.schedule.nccl import check_nccl
from tplib.sim.simulate import simulate

COSTS = UniformCosts()
CASES = [(k, m) for k in (2, 3, 4) for m in (k, 2 * k, 2 * k + 1)]


def _latency(schedule: Schedule) -> float:
    return simulate(schedule, COSTS.placed(schedule.placement)).latency


def _tplib(name: str, k: int, m: int, v: int) -> Schedule:
    return make_schedule(name, k, Plan.gpipe(m, 1), n_chunks=v if v > 1 else None)


@pytest.mark.parametrize("name", list(TORCH_SCHEDULES))
def test_every_torch_schedule_imports_validates_and_simulates(name: str) -> None:
    multi = TORCH_SCHEDULES[name].multi
    imported = 0
    for k, m in CASES:
        try:
            schedule = torch_schedule(name, k, m)  # validated
        except ValueError as exc:
            # torch's own limits: DualPipeV needs M >= 2K, Interleaved rounds must divide M.
            assert f"torch's {name} refuses K={k}, M={m}" in str(exc)
            continue
        assert (schedule.n_stages, schedule.n_chunks) == (k, 2 if multi else 1)
        assert schedule.plan.n_batch_slices == m
        check_nccl(schedule)
        assert _latency(schedule) > 0
        if multi:  # the compute-only order and the lowered one it executes agree
            assert torch_schedule(name, k, m, form="pipeline_order") == schedule
        imported += 1
    assert imported >= 3


@pytest.mark.parametrize(
    ("torch_name", "ours"),
    [
        ("Schedule1F1B", "1f1b"),
        ("ScheduleInterleaved1F1B", "interleaved-1f1b"),
        ("ScheduleLoopedBFS", "looped-bfs"),
    ],
)
def test_three_of_torchs_schedules_are_tplibs_action_for_action(torch_name: str, ours: str) -> None:
    v = 2 if TORCH_SCHEDULES[torch_name].multi else 1
    compared = 0
    for k, m in CASES:
        try:
            theirs = torch_schedule(torch_name, k, m)
        except ValueError:
            continue
        mine = _tplib(ours, k, m, v)
        assert (theirs.actions, theirs.placement) == (mine.actions, mine.placement), (k, m)
        compared += 1
    assert compared >= 6


def test_gpipe_runs_its_backwards_in_the_other_order_in_the_same_time() -> None:
    """torch's GPipe runs backwards from microbatch 0, tplib's from the last. A stage's
    backward waits only for its own microbatch's gradient, and by then every forward is
    done, so the latency is the same: (M + K - 1)(F + B) under uniform costs."""
    for k, m in CASES:
        theirs, mine = torch_schedule("ScheduleGPipe", k, m), _tplib("gpipe", k, m, 1)
        for a, b in zip(theirs.actions, mine.actions, strict=True):
            assert [x for x in a if x.kind is Kind.F] == [x for x in b if x.kind is Kind.F]
            backwards = [x for x in a if x.kind is Kind.B]
            assert backwards == [x for x in b if x.kind is Kind.B][::-1]
            assert [x.b for x in backwards] == list(range(m))
        assert _latency(theirs) == _latency(mine) == (m + k - 1) * 3.0


# The most microbatches at which torch's ZBV is slower than tplib's, by K (found; below).
ZBV_SLOWER_UP_TO = {2: 2, 3: 3, 4: 5}


def test_zbv_in_torch_is_never_faster_slower_with_few_microbatches() -> None:
    """torch's ZBV builds the order of max(M, 2K-1) microbatches and blanks those past M.
    From 2K-1 microbatches there is no blank, and its latency is tplib's ``zbv`` (a list
    scheduler: another order, the same time). Below, the blanks stay in the order: it is
    slower up to the M in ``ZBV_SLOWER_UP_TO``, and just as fast for the M between, where
    the blank steps fall on steps the rank would wait anyway (K=3 at M=4, K=4 at M=6)."""
    for k, up_to in ZBV_SLOWER_UP_TO.items():
        for m in range(1, 2 * k + 3):
            theirs, mine = torch_schedule("ScheduleZBVZeroBubble", k, m), _tplib("zbv", k, m, 2)
            assert theirs.actions != mine.actions
            slower = _latency(theirs) > _latency(mine)
            assert slower == (m <= up_to) and _latency(theirs) >= _latency(mine), (k, m)


def test_1f1bs_pipeline_order_numbers_the_last_ranks_microbatches_from_1() -> None:
    """torch 2.13's Schedule1F1B._get_pipeline_order (a description: its loop does not
    read it) starts the last rank's forward count at 1; GPipe's describes what runs."""
    rows = torch_order("Schedule1F1B", 2, 4, form="pipeline_order")
    assert [a for a in rows[1] if a is not None and "F" in a] == ["1F1", "1F2", "1F3", "1F4"]
    with pytest.raises(ValueError, match=r"torch stage 1 runs the forwards of microbatches \[1"):
        from_torch(rows, 1)
    order = torch_order("ScheduleGPipe", 3, 4, form="pipeline_order")
    assert from_torch(order, 1, name="ScheduleGPipe") == torch_schedule("ScheduleGPipe", 3, 4)


def _torch_actions(rows: list[list[Any]]) -> dict[int, list[Any]]:
    return {
        r: [torch_schedules._Action.from_str(str(a)) for a in row] for r, row in enumerate(rows)
    }


EXPORTED = [
    (name, v)
    for name in schedule_names(asynchronous=False)
    for v in (
        (2,) if name.endswith("zbv") else (1, 3) if "interleaved" in name or "bfs" in name else (1,)
    )
]


@pytest.mark.parametrize(("name", "v"), EXPORTED)
def test_torchs_own_checks_accept_what_tplib_exports(name: str, v: int) -> None:
    schedule = _tplib(name, 3, 6, v)
    n_parts, placement = schedule.n_parts, schedule.placement
    only = _torch_actions(to_torch(schedule, "compute_only"))
    mapping = torch_schedules._validate_schedule(only, 3, n_parts, 6)
    assert mapping == dict(enumerate(placement))
    # torch's lowering adds its own messages: tplib reads that back as what it exported.
    lowered = torch_schedules._add_send_recv(
        {r: list(row) for r, row in only.items()}, lambda s: placement[s], n_parts
    )
    assert from_torch(lowered, 1, name=name) == schedule
    comms = to_torch(schedule, "compute_comms")
    bookkeeping = ("UNSHARD", "RESHARD", "REDUCE_GRAD")  # torch's simulator knows none
    plain = [[a for a in filter(None, row) if a.kind not in bookkeeping] for row in comms]
    torch_schedules._simulate_comms_compute(_torch_actions(plain), lambda s: placement[s], n_parts)


def test_the_table_prices_torchs_schedules_beside_tplibs() -> None:
    table = torch_orders_table(4, 8).set_index("torch_schedule")
    assert list(table.index) == list(TORCH_SCHEDULES)
    assert table["validates"].all() and table["nccl_ok"].all()
    assert table.loc["ScheduleGPipe", "latency"] == (8 + 4 - 1) * 3.0
    # Megatron's interleaved bubble: (K-1)(F+B)/v on top of M(F+B).
    assert table.loc["ScheduleInterleaved1F1B", "latency"] == 8 * 3.0 + 3 * 3.0 / 2
    same = table[table["same_order"]].index
    assert set(same) == {"Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS"}
    paired = table[table["tplib_schedule"].notna()]
    assert (paired["latency"] == paired["tplib_latency"]).all()  # M = 8 >= 2K - 1
    refused = torch_orders_table(4, 4, names=["ScheduleDualPipeV"]).iloc[0]
    assert not refused["validates"] and "refuses K=4, M=4" in refused["note"]


def test_bad_names_and_chunk_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown torch schedule 'GPipe'"):
        torch_order("GPipe", 2, 4)
    with pytest.raises(ValueError, match=r"n_chunks=3 with ScheduleZBVZeroBubble: .* exactly 2"):
        torch_order("ScheduleZBVZeroBubble", 2, 4, 3)
    with pytest.raises(ValueError, match=r"n_chunks=2 with Schedule1F1B: .* exactly 1"):
        torch_order("Schedule1F1B", 2, 4, 2)


def test_uniform_costs_price_a_chunk_as_its_share_of_the_stage() -> None:
    placed = COSTS.placed((0, 1, 0, 1, 0, 1))
    assert placed == UniformCosts(n_chunks=3) and placed.placed((0, 1, 0, 1, 0, 1)) == placed
    assert COSTS.placed((0, 1)) == COSTS
