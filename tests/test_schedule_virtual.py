"""Virtual pipeline stages (tplib.schedule.chunks, tplib.schedule.virtual): placements,
chunked actions, and the interleaved, breadth-first and V-shape generators, validated,
replayed on NCCL's rendezvous messages and held to their definitions."""

from __future__ import annotations

import io
import itertools
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tplib.plan import Plan, Unit
from tplib.schedule import (
    REGISTRY,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    draw_schedule,
    make_schedule,
    schedule_names,
    validate,
)
from tplib.schedule import virtual as virtual_module
from tplib.schedule.chunks import check_placement, interleaved, part_of, rank_chunk, v_shape
from tplib.schedule.engine import link_of
from tplib.schedule.nccl import check_nccl
from tplib.schedule.passes import add_communication, add_update
from tplib.schedule.validate import replay

CHUNKED = [n for n in schedule_names() if REGISTRY[n].chunked]
MICROBATCH_PLANS = [Plan.gpipe(b, 8) for b in (1, 2, 3, 4, 5, 8)] + [Plan((2, 1, 3), ((8,),) * 3)]
TOKEN_PLANS = [
    Plan.uniform(2, 8, n_token_slices=2),
    Plan((1, 1), ((3, 5), (1, 1, 6))),  # uneven slices, M differs per batch slice
    Plan((1, 2, 1), ((8,), (2, 6), (4, 4))),
    Plan.uniform(4, 8, n_token_slices=4),
]


def buildable(name: str, n_stages: int, plan: Plan, n_chunks: int) -> Schedule | None:
    entry = REGISTRY[name]
    sliced = any(plan.n_token_slices(b) > 1 for b in range(plan.n_batch_slices))
    if sliced and not entry.token_slices:
        return None
    if entry.max_chunks is not None and n_chunks > entry.max_chunks:
        return None
    if n_chunks < entry.min_chunks:
        return None
    if "interleaved" in name and plan.n_units < n_stages:
        return None
    return make_schedule(name, n_stages, plan, n_chunks=n_chunks)


# ---- placements ------------------------------------------------------------------------


def test_interleaved_placement_is_megatrons() -> None:
    assert interleaved(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    # Chunk c of rank r holds part c*K + r.
    for r, c in itertools.product(range(4), range(3)):
        assert part_of(interleaved(4, 3), r, c) == c * 4 + r
        assert rank_chunk(interleaved(4, 3), c * 4 + r) == (r, c)


def test_v_shape_returns_to_the_first_rank() -> None:
    assert v_shape(3) == (0, 1, 2, 2, 1, 0)
    for r in range(3):
        assert part_of(v_shape(3), r, 1) == 2 * 3 - 1 - r
    assert rank_chunk(v_shape(3), 5) == (0, 1)  # the last part sits beside the first


def test_a_placement_must_give_every_rank_the_same_chunk_count() -> None:
    with pytest.raises(ValueError, match=r"\[2, 1\] parts"):
        check_placement((0, 0, 1), 2)
    with pytest.raises(ValueError, match=r"ranks are 0\.\.1"):
        check_placement((0, 2), 2)
    with pytest.raises(ValueError, match="chunk"):
        Schedule("x", 2, Plan.gpipe(1, 8), ((Action(Kind.F, 0, 0, 0, chunk=1),), ()))


# ---- chunked actions and schedules -----------------------------------------------------


def test_an_action_prints_and_parses_its_chunk() -> None:
    a = Action(Kind.B, 1, 2, 3, chunk=1)
    assert str(a) == "B b2 t3 c1"
    assert Action.parse("B b2 t3 c1", 1) == a
    assert str(Action(Kind.W, 0, 1, -1, chunk=2)) == "W b1 c2"
    assert Action.parse("W b1 c2", 0) == Action(Kind.W, 0, 1, -1, chunk=2)
    assert str(Action(Kind.F, 0, 0, 0)) == "F b0 t0"  # chunk 0 is left out
    with pytest.raises(ValueError, match="all of its rank's chunks"):
        Action(Kind.AR, 0, chunk=1)


@pytest.mark.parametrize("name", CHUNKED)
def test_csv_round_trip_keeps_chunks_and_placement(name: str) -> None:
    s = make_schedule(
        name, 3, Plan.gpipe(6, 8) if not REGISTRY[name].token_slices else TOKEN_PLANS[1]
    )
    buf = io.StringIO()
    s.to_csv(buf)
    assert "# placement: " in buf.getvalue() and "stage,index,kind,b,t,v,chunk" in buf.getvalue()
    buf.seek(0)
    assert Schedule.from_csv(buf) == s


def test_communication_follows_the_placement() -> None:
    """Interleaved on K=2: activations go 0->1, wrap 1->0 and go 0->1 again; the V keeps
    the turn on stage K-1 (no message) and ends on stage 0."""
    plan = Plan.gpipe(2, 8)
    s = make_schedule("interleaved-1f1b", 2, plan, n_chunks=2)
    links = {link_of(s, a) for acts in s.actions for a in acts if a.kind is Kind.SA}
    assert links == {("A", 0, 1), ("A", 1, 0)}
    assert any(a.kind is Kind.RA and a.chunk == 1 for a in s.actions[0])  # the wrap
    v = make_schedule("zbv", 3, plan)
    turn = {(a.kind, a.chunk) for a in v.actions[2] if a.kind in (Kind.SA, Kind.RA)}
    assert turn == {(Kind.RA, 0), (Kind.SA, 1)}  # chunk 0 hands chunk 1 its input locally
    assert not any(a.kind is Kind.SA for a in v.actions[0] if a.chunk == 1)  # the loss


# ---- the generators --------------------------------------------------------------------


@pytest.mark.parametrize("n_chunks", [1, 2, 3])
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", CHUNKED)
def test_generators_validate_and_run_on_nccl(name: str, n_stages: int, n_chunks: int) -> None:
    built = 0
    for plan in MICROBATCH_PLANS + TOKEN_PLANS:
        s = buildable(name, n_stages, plan, n_chunks)
        if s is None:
            continue
        assert s.n_chunks == n_chunks and s.n_parts == n_chunks * n_stages
        validate(s)
        check_nccl(s)
        built += 1
    assert built or REGISTRY[name].max_chunks == 2 != n_chunks


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 2), min_size=1, max_size=6),
    cuts=st.lists(st.sampled_from([(8,), (4, 4), (1, 7), (2, 2, 4), (3, 1, 1, 3)]), min_size=6),
    n_stages=st.integers(1, 4),
    n_chunks=st.integers(1, 3),
    name=st.sampled_from(["terapipe-interleaved", "terapipe-bfs", "terapipe-zbv"]),
)
def test_random_token_plans_validate(
    sizes: list[int], cuts: list[tuple[int, ...]], n_stages: int, n_chunks: int, name: str
) -> None:
    plan = Plan(tuple(sizes), tuple(cuts[: len(sizes)]))
    s = buildable(name, n_stages, plan, 2 if name == "terapipe-zbv" else n_chunks)
    if s is not None:
        validate(s)
        check_nccl(s)


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for plan, k in itertools.product(MICROBATCH_PLANS + TOKEN_PLANS, (1, 2, 3, 4)):
        if plan.n_units < k:
            continue
        one = make_schedule("terapipe-interleaved", k, plan, n_chunks=1)
        ref = make_schedule("1f1b", k, plan)
        assert one.actions == ref.actions


@pytest.mark.parametrize(
    ("n_stages", "n_chunks", "m"), [(2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 6)]
)
def test_interleaved_warmup_is_megatrons_on_full_groups(
    n_stages: int, n_chunks: int, m: int
) -> None:
    """With microbatches in full groups of K, stage k runs (K-k-1)*2 + (v-1)*K forwards
    before its first backward, then one forward per backward (Narayanan et al., 2021)."""
    s = make_schedule("interleaved-1f1b", n_stages, Plan.gpipe(m, 8), n_chunks=n_chunks)
    for k in range(n_stages):
        kinds = [a.kind for a in s.compute_actions(k)]
        warmup = (n_stages - k - 1) * 2 + (n_chunks - 1) * n_stages
        assert kinds.index(Kind.B) == min(warmup + 1, m * n_chunks)
        steady = kinds[warmup : 2 * (m * n_chunks) - warmup]
        assert steady == [Kind.F, Kind.B] * (len(steady) // 2)


@pytest.mark.parametrize(
    ("n_stages", "plan"),
    [
        (3, Plan.uniform(2, 16, n_token_slices=8)),
        (4, Plan.uniform(2, 16, n_token_slices=8)),
        (2, Plan.uniform(1, 16, n_token_slices=8)),
        (2, Plan((1, 1, 1), ((6, 5, 5),) * 3)),
        (4, Plan.uniform(4, 16, n_token_slices=4)),
    ],
    ids=str,
)
def test_interleaving_many_token_slices_is_no_slower_than_1f1b(n_stages: int, plan: Plan) -> None:
    """With more token slices per sequence than stages, the warm-up runs up to the first
    sequence's last slice on the last chunk (its first backward) before 1F1B's
    alternation: two chunks of half a stage's work then finish no later than sequence-level
    1F1B on whole stages (one step per forward, two per backward, shared by the chunks)."""

    def latency(name: str, v: int) -> float:
        s = make_schedule(name, n_stages, plan, n_chunks=v)
        timed = replay(s, lambda a: {Kind.F: 1.0 / v, Kind.B: 2.0 / v}.get(a.kind, 0.0))
        return max(t.end for t in timed)

    assert latency("terapipe-interleaved", 2) <= latency("1f1b", 1)


def test_interleaved_order_walks_groups_of_k_through_the_chunks() -> None:
    s = make_schedule("interleaved-1f1b", 2, Plan.gpipe(4, 8), n_chunks=2)
    fwd = [(a.b, a.chunk) for a in s.compute_actions(0) if a.kind is Kind.F]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    bwd = [(a.b, a.chunk) for a in s.compute_actions(0) if a.kind is Kind.B]
    assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]


def test_looped_bfs_runs_each_chunk_breadth_first() -> None:
    s = make_schedule("looped-bfs", 2, Plan.gpipe(3, 8), n_chunks=2)
    order = [(str(a.kind), a.chunk, a.b) for a in s.compute_actions(1)]
    assert order == [
        *(("F", 0, b) for b in range(3)),
        *(("F", 1, b) for b in range(3)),
        *(("B", 1, b) for b in reversed(range(3))),
        *(("B", 0, b) for b in reversed(range(3))),
    ]


def test_zbv_is_nearly_bubble_free_and_bounded() -> None:
    """On unit costs, ZB-V keeps each stage busy but for a few steps, where 1F1B idles
    2(K-1) of its 3m-step iteration, and holds no more chunk-units than 2K."""
    k, m = 4, 8
    plan = Plan.gpipe(m, 8)
    s = make_schedule("zbv", k, plan)
    timed = replay(s, lambda a: 1.0 if a.kind in (Kind.F, Kind.B, Kind.W) else 0.0)
    span = max(t.end for t in timed)
    work = 2 * m * 3  # two chunks, F + B + W each
    assert span <= work + k  # 1F1B with split backwards would take work + 2 (K - 1) * 2
    for acts in s.actions:
        held = peak = 0
        for a in acts:
            held += (a.kind is Kind.F) - (a.kind is Kind.W)
            peak = max(peak, held)
        assert peak <= 2 * k


def test_microbatch_forms_refuse_token_slices_and_name_the_other() -> None:
    plan = TOKEN_PLANS[0]
    for micro, sliced in [
        ("interleaved-1f1b", "terapipe-interleaved"),
        ("looped-bfs", "terapipe-bfs"),
        ("zbv", "terapipe-zbv"),
    ]:
        with pytest.raises(ValueError, match=f"use '{sliced}'"):
            make_schedule(micro, 2, plan)


def test_bad_chunk_counts_and_too_few_units_are_refused() -> None:
    with pytest.raises(ValueError, match="n_chunks=3 with schedule 'zbv': it holds exactly 2"):
        make_schedule("zbv", 2, Plan.gpipe(4, 8), n_chunks=3)
    with pytest.raises(ValueError, match="n_chunks=2 with schedule '1f1b': it holds exactly 1"):
        make_schedule("1f1b", 2, Plan.gpipe(4, 8), n_chunks=2)
    with pytest.raises(ValueError, match="at least 4 units per iteration"):
        make_schedule("interleaved-1f1b", 4, Plan.gpipe(3, 8), n_chunks=2)


def test_docstring_tables_match_generators() -> None:
    for name, plan in [
        ("interleaved-1f1b", "[(1, [8])] * 4"),
        ("looped-bfs", "[(1, [8])] * 2"),
        ("zbv", "[(1, [8])] * 3"),
    ]:
        grid = draw_schedule(make_schedule(name, 2, Plan.from_paper(plan)))
        assert textwrap.indent(grid, " " * 8) in (virtual_module.__doc__ or "") + "".join(
            f.__doc__ or ""
            for f in (
                virtual_module.interleaved_1f1b,
                virtual_module.looped_bfs,
                virtual_module.zbv,
            )
        )


# ---- the validator on chunks -----------------------------------------------------------


def test_validator_catches_a_chunk_that_runs_before_its_local_input() -> None:
    """In the V, stage K-1's chunk 1 takes its input from chunk 0 on the same stage."""
    s = make_schedule("zbv", 2, Plan.gpipe(2, 8))
    acts = list(s.actions[1])
    i = acts.index(Action(Kind.F, 1, 0, 0))
    j = acts.index(Action(Kind.F, 1, 0, 0, chunk=1))
    acts[i], acts[j] = acts[j], acts[i]
    bad = Schedule(s.name, 2, s.plan, (s.actions[0], tuple(acts)), 1, s.placement)
    with pytest.raises(ScheduleError, match="activation of the part before it, held on this stage"):
        validate(bad)


def test_validator_catches_a_message_to_a_chunk_on_the_same_stage() -> None:
    s = make_schedule("zbv", 2, Plan.gpipe(1, 8))
    acts = list(s.actions[1])
    acts.insert(acts.index(Action(Kind.F, 1, 0, 0, chunk=1)), Action(Kind.RA, 1, 0, 0, chunk=1))
    bad = Schedule(s.name, 2, s.plan, (s.actions[0], tuple(acts)), 1, s.placement)
    with pytest.raises(ScheduleError, match="has it on its own stage"):
        validate(bad)


def test_validator_catches_chunks_crossed_on_a_link() -> None:
    """Two units' activations on the wrap link, received in the other order."""
    plan = Plan.gpipe(2, 8)
    order = [
        [(Kind.F, 0, 0), (Kind.F, 0, 1), (Kind.F, 1, 1), (Kind.F, 1, 0)],
        [(Kind.F, 0, 0), (Kind.F, 0, 1), (Kind.F, 1, 0), (Kind.F, 1, 1)],
    ]
    order = [o + [(Kind.B, c, b) for kind, c, b in reversed(o)] for o in order]
    acts = tuple(
        tuple(Action(kind, k, b, 0, chunk=c) for kind, c, b in o) for k, o in enumerate(order)
    )
    s = add_update(add_communication(Schedule("x", 2, plan, acts, 1, interleaved(2, 2))))
    with pytest.raises(ScheduleError, match="FIFO"):
        validate(s)


def test_every_unit_on_every_chunk() -> None:
    s = make_schedule("looped-bfs", 2, Plan.gpipe(2, 8), n_chunks=3)
    for k in range(2):
        got = {(a.chunk, a.unit) for a in s.compute_actions(k) if a.kind is Kind.F}
        assert got == {(c, Unit(b, 0)) for c in range(3) for b in range(2)}
