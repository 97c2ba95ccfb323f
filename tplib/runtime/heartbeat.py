"""Where each rank of a torchrun job is, published to the agents' store, so that the ranks
left standing can say what a rank that died was doing.

A :class:`~tplib.runtime.LocalPool` keeps every rank's
:class:`~tplib.runtime.rank.Progress` in memory shared with the process that started
the ranks, and reports it when one dies. Under torchrun the ranks are processes on
several nodes and share nothing but the agents' TCPStore. So a :class:`Heartbeat`
thread in each rank writes its progress there every :data:`_PERIOD_S`, with a count that
goes up at every write: one small store write per rank a quarter second, however many
actions the rank runs (a write per action would cost a store round trip per action).

When a rank's receive breaks (its peer's connection closed) or times out, or torchrun's
agent stops it (SIGTERM: a rank of its node died), :func:`watch` reads every rank's
entry for up to :data:`_SILENT_AFTER_S`. A rank whose count does not move has exited, been
killed or frozen, and :func:`lost_message` names it with what it was doing when it last
wrote (:class:`RankLostError`). A rank that is alive but stuck keeps beating: then
:func:`doing_message` says what every rank is doing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from tplib.runtime.rank import Progress, rank_label, spans
from tplib.runtime.runconfig import RunConfig

__all__ = [
    "Beat",
    "Heartbeat",
    "RankLostError",
    "doing_message",
    "lost_message",
    "read_beats",
    "silent_ranks",
    "watch",
]

_PERIOD_S = 0.25
# Four periods: a live rank writes at least twice meanwhile, even with its store write
# or its thread's wake-up delayed by a busy node.
_SILENT_AFTER_S = 4 * _PERIOD_S
_LISTED = 8  # ranks named one per line; the rest as spans


class RankLostError(ConnectionError):
    """Ranks of a torchrun job stopped reporting (exited, killed or frozen); the message
    says what each was doing when it last reported."""


@dataclass(frozen=True)
class Beat:
    """One rank's entry: its write count and its :class:`Progress` cells."""

    count: int
    iteration: int
    position: int

    def encode(self) -> str:
        return f"{self.count} {self.iteration} {self.position}"

    @classmethod
    def decode(cls, data: bytes | str) -> Beat:
        text = data.decode() if isinstance(data, bytes) else data
        count, iteration, position = (int(x) for x in text.split())
        return cls(count, iteration, position)


def _key(prefix: str, rank: int) -> str:
    return f"{prefix}/{rank}"


class Heartbeat:
    """Writes ``rank``'s cells of ``progress`` to ``store`` under ``prefix`` every
    ``period_s``, from a daemon thread. The store client is the thread's own: the main
    thread's may be blocked in a wait of its own."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        progress: Progress,
        period_s: float = _PERIOD_S,
    ) -> None:
        self.store, self.prefix, self.rank = store, prefix, rank
        self.progress, self.period_s = progress, period_s
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{rank}", daemon=True)

    def beat(self) -> None:
        self.count += 1
        iteration, position = self.progress.where(self.rank)
        self.store.set(_key(self.prefix, self.rank), Beat(self.count, iteration, position).encode())

    def start(self) -> Heartbeat:
        """The first write now, in this thread: a rank that has started has an entry."""
        self.beat()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat()
            except Exception:  # the store is gone (its agent ended): nobody to tell
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.period_s)


def read_beats(store: dist.Store, prefix: str, world_size: int) -> list[Beat]:
    """Every rank's entry, in rank order (each must exist: ``get`` waits for a missing
    one until the store's timeout)."""
    values = store.multi_get([_key(prefix, r) for r in range(world_size)])
    return [Beat.decode(v) for v in values]


def silent_ranks(first: Sequence[Beat], last: Sequence[Beat]) -> list[int]:
    """The ranks that wrote nothing between two reads of every entry."""
    return [r for r, (a, b) in enumerate(zip(first, last, strict=True)) if a.count == b.count]


def watch(
    store: dist.Store,
    prefix: str,
    world_size: int,
    wait_s: float = _SILENT_AFTER_S,
    poll_s: float = _PERIOD_S / 2,
) -> tuple[list[int], list[Beat]]:
    """The ranks that write nothing for ``wait_s`` (less once every rank has written),
    and every rank's last entry."""
    first = last = read_beats(store, prefix, world_size)
    deadline = time.monotonic() + wait_s
    while (silent := silent_ranks(first, last)) and time.monotonic() < deadline:
        time.sleep(poll_s)
        last = read_beats(store, prefix, world_size)
    return silent, last


def _progress(run: RunConfig, beats: Sequence[Beat]) -> Progress:
    progress = Progress.local(run.parallelism.world_size)
    for r, beat in enumerate(beats):
        progress.set(r, beat.iteration, beat.position)
    return progress


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def lost_message(
    run: RunConfig,
    rank: int,
    own: tuple[int, int],
    cause: BaseException,
    beats: Sequence[Beat],
    silent: Sequence[int],
    per_node: int,
) -> str:
    """What :class:`RankLostError` says on ``rank`` (at ``own``: its iteration and
    position) when ``silent`` ranks stopped writing: each of them (its node under
    torchrun's uniform ``per_node`` ranks a node) and what it was doing, then what this
    rank was doing when ``cause`` stopped it."""
    progress = _progress(run, beats)
    lines = [
        f"{rank_label(run, r)} on node {r // per_node} stopped reporting (it exited, was "
        f"killed or froze) while {progress.describe(run, r)}"
        for r in silent[:_LISTED]
    ]
    if len(silent) > _LISTED:
        lines.append(f"and {len(silent) - _LISTED} more stopped: rank(s) {spans(silent[_LISTED:])}")
    progress.set(rank, *own)
    lines.append(
        f"{rank_label(run, rank)}, which reports this, was {progress.describe(run, rank)} "
        f"when it failed: {_first_line(cause)}"
    )
    return "\n".join(lines)


def doing_message(run: RunConfig, beats: Sequence[Beat]) -> str:
    """What every rank was doing, each still writing (the first :data:`_LISTED` ranks of
    a large job)."""
    progress = _progress(run, beats)
    lines = [f"  {rank_label(run, r)} was {progress.describe(run, r)}" for r in range(len(beats))]
    more = [f"  and {len(lines) - _LISTED} more ranks"] if len(lines) > _LISTED else []
    return "\n".join(["Every rank still reports; what each was doing:", *lines[:_LISTED], *more])
