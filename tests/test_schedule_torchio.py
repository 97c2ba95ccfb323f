"""torch.distributed.pipelining's action CSV (tplib.schedule.torchio): torch's grammar
parsed and printed, tplib's schedules exported in both formats and read back unchanged,
torch orders imported (bubbles, combined actions, mixed full and split backwards) and
bad ones refused with the rule they break. No torch here: torch's own orders are
tests/test_runtime_torchorders.py's."""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path

import pytest

from tplib.plan import Plan
from tplib.schedule import (
    REGISTRY,
    WHOLE_SEQUENCE,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    make_schedule,
    schedule_names,
)
from tplib.schedule.chunks import interleaved, v_shape
from tplib.schedule.torchio import (
    TorchAction,
    from_torch,
    parse_torch_action,
    read_torch,
    read_torch_csv,
    to_torch,
    write_torch_csv,
)

SYNCHRONOUS = schedule_names(asynchronous=False)


def _csv(rows: list[list[str]]) -> io.StringIO:
    return io.StringIO("".join(",".join(row) + "\r\n" for row in rows))


@pytest.mark.parametrize(
    ("text", "stage", "kind", "microbatch"),
    [
        ("0F0", 0, "F", 0),
        ("1I0", 1, "I", 0),
        ("1W12", 1, "W", 12),
        ("0B1", 0, "B", 1),
        ("2SEND_F1", 2, "SEND_F", 1),
        ("1RECV_B0", 1, "RECV_B", 0),
        ("0UNSHARD", 0, "UNSHARD", -1),
        ("3RESHARD", 3, "RESHARD", -1),
        ("10REDUCE_GRAD", 10, "REDUCE_GRAD", -1),
    ],
)
def test_torch_actions_parse_and_print_back(
    text: str, stage: int, kind: str, microbatch: int
) -> None:
    a = parse_torch_action(f" {text} ")
    assert a == TorchAction(stage, kind, microbatch)
    assert a is not None
    assert str(a) == text


def test_a_combined_action_holds_its_parts_in_order() -> None:
    a = parse_torch_action("(0F3;3B1)OVERLAP_F_B")
    assert a is not None and a.kind == "OVERLAP_F_B"
    assert a.leaves == (TorchAction(0, "F", 3), TorchAction(3, "B", 1))
    assert str(a) == "(0F3;3B1)OVERLAP_F_B"
    assert parse_torch_action("") is None and parse_torch_action("  ") is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("0F", "F needs a microbatch index"),
        ("0UNSHARD1", "UNSHARD takes no microbatch"),
        ("F0", "cannot parse torch action 'F0'"),
        ("0X0", "cannot parse torch action '0X0'"),
        ("0F0x", "cannot parse torch action '0F0x'"),  # torch's own regex lets it through
        ("(0F0;0SEND_F0)OVERLAP_F_B", "its parts forwards and backwards"),
        ("(0F0;1B0)FOO", "a combined action is"),
        ("()OVERLAP_F_B", "a combined action is"),
    ],
)
def test_bad_torch_actions_are_refused_naming_the_rule(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        parse_torch_action(text)


# ---- export ------------------------------------------------------------------------------


def test_1f1b_exports_as_torch_writes_it() -> None:
    """Stage k warms up with K-k-1 forwards, then one forward per backward (worked out by
    hand), in csv's default dialect as torch's _dump_csv writes."""
    buf = io.StringIO()
    write_torch_csv(to_torch(make_schedule("1f1b", 2, Plan.gpipe(3, 4))), buf)
    assert buf.getvalue() == "0F0,0F1,0B0,0F2,0B1,0B2\r\n1F0,1B0,1F1,1B1,1F2,1B2\r\n"


def test_a_split_schedule_exports_its_backwards_as_i_and_w() -> None:
    rows = to_torch(make_schedule("terapipe-zb", 2, Plan.gpipe(2, 4)))
    assert [[str(a) for a in row] for row in rows] == [
        ["0F0", "0F1", "0I1", "0I0", "0W1", "0W0"],
        ["1F0", "1F1", "1I1", "1I0", "1W1", "1W0"],
    ]


def test_compute_comms_adds_messages_reduce_grad_and_fsdp_bracket() -> None:
    rows = to_torch(make_schedule("1f1b", 2, Plan.gpipe(2, 4)), "compute_comms")
    assert [" ".join(map(str, row)) for row in rows] == [
        "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD",
        "1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD",
    ]


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zbv", "looped-bfs"])
def test_receives_follow_their_senders_order_on_each_pair_of_ranks(name: str) -> None:
    """Between two ranks torch's untagged messages are one FIFO: activations and gradients
    mixed, as virtual stages make them. Every receive precedes its consumer, and each
    rank receives from each peer in the order the peer sends."""
    schedule = make_schedule(name, 3, Plan.gpipe(6, 4), n_chunks=2)
    rows = to_torch(schedule, "compute_comms")
    p = schedule.placement
    sent: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    got: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    mixed = set()
    for r, row in enumerate(rows):
        cells = [str(a) for a in row]
        for a in filter(None, row):
            if a.kind in ("SEND_F", "SEND_B"):
                to = a.stage + (1 if a.kind == "SEND_F" else -1)
                sent[r, p[to]].append((to, a.microbatch))
            if a.kind in ("RECV_F", "RECV_B"):
                frm = a.stage + (-1 if a.kind == "RECV_F" else 1)
                got[p[frm], r].append((a.stage, a.microbatch))
                mixed.add((p[frm], r, a.kind))
                consumer = f"{a.stage}{'F' if a.kind == 'RECV_F' else 'I'}{a.microbatch}"
                if consumer not in cells:
                    consumer = consumer.replace("I", "B")
                assert cells.index(str(a)) < cells.index(consumer)
    assert sent == got and sent
    assert any((s, r, "RECV_B") in mixed for s, r, _ in mixed)  # a pair carries both kinds


@pytest.mark.parametrize("name", SYNCHRONOUS)
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_every_synchronous_schedule_round_trips_through_torch_csv(name: str, fmt: str) -> None:
    entry = REGISTRY[name]
    chunks = [None] if not entry.chunked else ([2] if entry.max_chunks == 2 else [1, 2, 3])
    tried = 0
    for k in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 8):
            for v in chunks:
                plan = Plan.gpipe(2 * m, 8, 2)  # microbatches of two sequences
                try:
                    schedule = make_schedule(name, k, plan, n_chunks=v)
                except ValueError:
                    continue  # fewer microbatches than the schedule takes
                buf = io.StringIO()
                write_torch_csv(to_torch(schedule, fmt), buf)  # type: ignore[arg-type]
                buf.seek(0)
                order = read_torch(buf)
                assert order.fmt == (fmt if k > 1 else "compute_only")
                back = order.to_schedule(8, microbatch=2, name=name)
                assert back == schedule, (name, k, m, v)
                tried += 1
    assert tried >= 10


def test_a_file_round_trips_too(tmp_path: Path) -> None:
    schedule = make_schedule("zbv", 2, Plan.gpipe(4, 16), n_chunks=2)
    path = tmp_path / "zbv.csv"
    write_torch_csv(to_torch(schedule, "compute_comms"), path)
    assert from_torch(path, 16, name="zbv") == schedule
    assert from_torch(str(path), 16, name="zbv") == schedule
    assert len(read_torch_csv(path)) == 2


def test_token_slices_are_refused_with_the_reason() -> None:
    schedule = make_schedule("terapipe", 2, Plan.uniform(2, 8, n_token_slices=2))
    with pytest.raises(ValueError, match="carry no key/value context"):
        to_torch(schedule)


@pytest.mark.parametrize("name", schedule_names(asynchronous=True))
def test_asynchronous_schedules_are_refused_with_the_reason(name: str) -> None:
    schedule = make_schedule(name, 2, Plan.gpipe(2 if name == "2bw" else 1, 8), n_iterations=2)
    with pytest.raises(ValueError, match=r"asynchronous .* single version of the weights"):
        to_torch(schedule, "compute_comms")


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="torch's CSV formats are"):
        to_torch(make_schedule("gpipe", 2, Plan.gpipe(2, 8)), "simple")  # type: ignore[arg-type]


# ---- import ------------------------------------------------------------------------------


class _Fake:
    """A stand-in for torch's _Action: import reads actions by their str()."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def test_a_pipeline_order_with_bubbles_and_a_combined_action() -> None:
    """One rank, two stages (parts 0 and 1); the combined action runs its forward, then its
    backward; torch's pipeline_order is a dict of action objects and None bubbles."""
    order = {
        0: [
            _Fake("0F0"),
            None,
            _Fake("1F0"),
            _Fake("0F1"),
            _Fake("(1F1;1B0)OVERLAP_F_B"),
            _Fake("0B0"),
            None,
            _Fake("1B1"),
            _Fake("0B1"),
        ]
    }
    read = read_torch(order)
    assert (read.n_ranks, read.n_chunks, read.n_microbatches) == (1, 2, 2)
    assert read.n_combined == 1 and not read.split_backward
    schedule = read.to_schedule(4, name="v")
    f, b = Kind.F, Kind.B
    want = [(f, 0, 0), (f, 0, 1), (f, 1, 0), (f, 1, 1), (b, 0, 1), (b, 0, 0), (b, 1, 1), (b, 1, 0)]
    assert schedule.actions[0] == (
        *(Action(kind, 0, mb, 0, chunk=c) for kind, mb, c in want),
        Action(Kind.AR, 0),
        Action(Kind.OPT, 0),
    )


def test_a_full_backward_among_split_ones_becomes_b_then_its_w() -> None:
    schedule = from_torch([["0F0", "0F1", "0B0", "0I1", "0W1"]], 4)
    w = WHOLE_SEQUENCE
    assert schedule.actions[0][:6] == (
        Action(Kind.F, 0, 0, 0),
        Action(Kind.F, 0, 1, 0),
        Action(Kind.B, 0, 0, 0),
        Action(Kind.W, 0, 0, w),
        Action(Kind.B, 0, 1, 0),
        Action(Kind.W, 0, 1, w),
    )


def test_the_placement_is_where_each_stage_runs() -> None:
    looped = [["0F0", "2F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]]
    assert read_torch(looped).placement == interleaved(2, 2) == (0, 1, 0, 1)
    vee = [["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"]]
    assert read_torch(vee).placement == v_shape(2) == (0, 1, 1, 0)
    assert read_torch(vee).to_schedule(4).placement == (0, 1, 1, 0)


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ([["0F0", "0B0"], ["0F0", "1F0", "1B0", "0B0"]], "stage 0 runs on rank 0 and on rank 1"),
        ([["0F0", "0B0"], ["2F0", "2B0"]], r"torch stages \[1\] run nothing"),
        ([["0F0", "2F0", "0B0", "2B0"], ["1F0", "1B0"]], "gives the 2 ranks"),
        # Schedule1F1B's pipeline_order in torch 2.13: the last rank counts from 1.
        (
            [["0F0", "0F1", "0B0", "0B1"], ["1F1", "1B0", "1F2", "1B1"]],
            r"torch stage 1 runs the forwards of microbatches \[1, 2\]",
        ),
        ([["0F0", "0B0"], ["1F0", "1F1", "1B0", "1B1"]], "every stage runs microbatches 0..0"),
        ([["0UNSHARD", "0RESHARD"], ["1UNSHARD"]], "nothing to import"),
    ],
)
def test_a_malformed_order_is_refused_naming_the_rule(rows: list[list[str]], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        read_torch(rows)


def _comms(rank0: str, rank1: str) -> list[list[str]]:
    return [rank0.split(), rank1.split()]


GOOD0 = "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"
GOOD1 = "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"


def test_consistent_messages_are_accepted_then_replaced_by_tplibs() -> None:
    read = read_torch(_comms(GOOD0, GOOD1))
    assert read.fmt == "compute_comms"
    assert read.to_schedule(4, name="1f1b") == make_schedule("1f1b", 2, Plan.gpipe(2, 4))


@pytest.mark.parametrize(
    ("rank0", "rank1", "says"),
    [
        (GOOD0.replace("0RECV_B0 0B0", "0B0 0RECV_B0"), GOOD1, "before the compute it feeds"),
        (GOOD0.replace("0F0 0SEND_F0", "0SEND_F0 0F0"), GOOD1, "after the compute it sends"),
        (
            GOOD0,
            GOOD1.replace("1RECV_F0 1F0", "1RECV_F1 1RECV_F0 1F0").replace("1RECV_F1 1F1", "1F1"),
            "received in the order sent",
        ),
        (GOOD0.replace(" 0SEND_F1", ""), GOOD1, r"sent .* \[\('F', 1, 1\)\] .* missing"),
        (
            GOOD0,
            GOOD1.replace("1RECV_F1", "1RECV_F1 1RECV_F1"),
            r"received .* \[\('F', 1, 1\)\] .* repeated",
        ),
        (GOOD0 + " 0SEND_B0", GOOD1, "no neighbour stage -1 on another rank"),
        (GOOD0 + " 1SEND_F0", GOOD1, "stage 1 is not on rank 0"),
    ],
)
def test_inconsistent_messages_are_refused(rank0: str, rank1: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        read_torch(_comms(rank0, rank1))


def test_an_order_that_would_mismatch_its_messages_fails_validation() -> None:
    """Rank 0 waits for microbatch 1's gradient first, rank 1 sends microbatch 0's first:
    the same messages, crossed. tplib's validator names the FIFO rule, with the grid."""
    rows = [["0F0", "0F1", "0B1", "0B0"], ["1F0", "1F1", "1B0", "1B1"]]
    with pytest.raises(ScheduleError, match="FIFO order"):
        from_torch(rows, 4)
    assert isinstance(from_torch(rows, 4, validate=False), Schedule)


def test_a_pipeline_order_with_missing_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"pipeline_order has ranks \[0, 2\]"):
        read_torch({0: ["0F0", "0B0"], 2: ["1F0", "1B0"]})
