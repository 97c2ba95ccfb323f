"""Each torchrun rank's progress in a store: written by a thread a few times a second,
read back by the ranks left when one dies, which name the ranks whose writes stopped and
what those were doing (an in-memory store here; torchrun's agents' TCPStore in
tests/test_pool.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch.distributed as dist

from tplib.runtime import Data, Parallelism, RunConfig, Timing
from tplib.runtime.heartbeat import (
    Beat,
    Heartbeat,
    doing_message,
    lost_message,
    read_beats,
    silent_ranks,
    watch,
)
from tplib.runtime.rank import Progress
from tplib.schedule import Kind

RUN = RunConfig(
    parallelism=Parallelism(n_stages=2),
    data=Data(batch=2, seq_len=64),
    slicing=16,
    timing=Timing(steps=20, timeout_s=5),
)
FAST = 0.02  # a heartbeat period for tests


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(FAST / 2)


def test_beats_read_back() -> None:
    assert Beat.decode(Beat(7, 3, -2).encode()) == Beat(7, 3, -2)
    assert Beat.decode(b"1 0 12") == Beat(1, 0, 12)


def test_a_heartbeat_writes_where_its_rank_is_until_stopped() -> None:
    store, progress = dist.HashStore(), Progress.local(2)
    store.set("p/0", Beat(1, 0, 0).encode())
    beat = Heartbeat(store, "p", 1, progress, period_s=FAST).start()
    try:
        # The first write is made by start() itself, before it returns.
        assert read_beats(store, "p", 2)[1] == Beat(1, 0, Progress.IDLE)
        progress.set(1, 3, 17)
        _until(lambda: read_beats(store, "p", 2)[1].iteration == 3)
        latest = read_beats(store, "p", 2)[1]
        assert (latest.iteration, latest.position) == (3, 17) and latest.count > 1
    finally:
        beat.stop()
    stopped = read_beats(store, "p", 2)[1]
    time.sleep(5 * FAST)
    assert read_beats(store, "p", 2)[1] == stopped
    assert read_beats(store, "p", 2)[0] == Beat(1, 0, 0)  # another rank's entry untouched


def test_silent_ranks_are_those_whose_count_did_not_move() -> None:
    first = [Beat(1, 0, 5), Beat(4, 0, 5), Beat(9, 2, 1)]
    last = [Beat(2, 0, 5), Beat(4, 0, 5), Beat(10, 2, 1)]
    assert silent_ranks(first, last) == [1]  # moved count, same place: alive and stuck


def test_watch_names_the_rank_that_stopped_writing() -> None:
    store = dist.HashStore()
    beats = [Heartbeat(store, "p", r, Progress.local(3), period_s=FAST).start() for r in (0, 2)]
    store.set("p/1", Beat(5, 2, 40).encode())  # rank 1 wrote, then died
    try:
        start = time.monotonic()
        silent, last = watch(store, "p", 3, wait_s=20 * FAST, poll_s=FAST)
        assert silent == [1] and last[1] == Beat(5, 2, 40)
        assert time.monotonic() - start >= 20 * FAST  # a silent rank is given the whole wait
        store.set("p/1", Beat(6, 2, 41).encode())
        another = Heartbeat(store, "p", 1, Progress.local(3), period_s=FAST).start()
        start = time.monotonic()
        silent, _ = watch(store, "p", 3, wait_s=30.0, poll_s=FAST)
        assert silent == [] and time.monotonic() - start < 10.0  # done once all have moved
        another.stop()
    finally:
        for b in beats:
            b.stop()


def _position(stage: int, kind: Kind, b: int, t: int) -> int:
    actions = RUN.schedule.actions[stage]
    return next(i for i, a in enumerate(actions) if (a.kind, a.b, a.t) == (kind, b, t))


def test_the_message_names_the_silent_rank_and_what_it_was_doing() -> None:
    waiting = _position(1, Kind.RA, 1, 3)
    sending = _position(0, Kind.SA, 1, 7)
    beats = [Beat(30, 2, 0), Beat(12, 3, waiting)]  # rank 0's own entry is old
    cause = ConnectionError("stage 0 (rank 0) lost its peer after 0.0 s\nsecond line")
    message = lost_message(RUN, 0, (3, sending), cause, beats, [1], per_node=2)
    assert message.splitlines() == [
        "rank 1 (stage 1, replica 0) on node 0 stopped reporting (it exited, was killed or "
        "froze) while waiting for the activation of b1 t3 (RA b1 t3) from stage 0, action "
        f"{waiting + 1} of 130 on stage 1, iteration 4 of 20",
        # What this rank was doing is its own progress, not its last written entry.
        f"rank 0 (stage 0, replica 0), which reports this, was running SA b1 t7, action "
        f"{sending + 1} of 130 on stage 0, iteration 4 of 20 when it failed: "
        "ConnectionError: stage 0 (rank 0) lost its peer after 0.0 s",
    ]


def test_many_silent_ranks_are_listed_up_to_eight() -> None:
    run = RunConfig(
        parallelism=Parallelism(n_stages=2, n_data=8),
        data=Data(batch=16, seq_len=16),
        timing=Timing(timeout_s=5),
    )
    beats = [Beat(1, 0, Progress.SETUP)] * run.parallelism.world_size
    silent = list(range(1, 13))
    message = lost_message(run, 0, (0, Progress.SETUP), RuntimeError(), beats, silent, 4)
    lines = message.splitlines()
    assert len(lines) == 10
    assert lines[0].startswith("rank 1 (stage 1, replica 0) on node 0 stopped reporting")
    assert "while building its stage and process groups" in lines[0]
    assert lines[7].startswith("rank 8 (stage 0, replica 4) on node 2 ")
    assert lines[8] == "and 4 more stopped: rank(s) 9-12"
    assert lines[9].endswith("when it failed: RuntimeError: ")


def test_every_rank_still_reporting_says_what_each_does() -> None:
    stuck = _position(1, Kind.F, 0, 0)
    text = doing_message(RUN, [Beat(3, 0, Progress.BARRIER), Beat(9, 0, stuck)])
    assert text.splitlines() == [
        "Every rank still reports; what each was doing:",
        "  rank 0 (stage 0, replica 0) was at the barrier before iteration 1 of 20",
        f"  rank 1 (stage 1, replica 0) was running F b0 t0, action {stuck + 1} of 130 on "
        "stage 1, iteration 1 of 20",
    ]


@pytest.mark.parametrize("world", [9, 40])
def test_a_large_job_lists_eight_ranks_doing(world: int) -> None:
    run = RunConfig(
        parallelism=Parallelism(n_stages=1, n_data=world),
        data=Data(batch=world, seq_len=16),
        timing=Timing(timeout_s=5),
    )
    lines = doing_message(run, [Beat(1, 0, Progress.IDLE)] * world).splitlines()
    assert len(lines) == 10 and lines[-1] == f"  and {world - 8} more ranks"
