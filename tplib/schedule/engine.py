"""The event engine: when each action of a schedule runs, given each action's duration.

Communication semantics, which the validator checks and the runtime implements: a send
never blocks its sender (its duration is the message's time on the link); a receive
blocks until the matching send's message has arrived; each directed link carries one
kind of message (activations, or gradients, from one stage to another: k -> k+1 and
k+1 -> k without virtual stages; with them, between the stages of neighbouring parts,
the wrap from stage K-1 to stage 0 included) and matches them in FIFO order. Every
other action runs on its stage's own clock, one after another.

:func:`run` is the engine itself. It never raises: actions stuck behind a receive whose
send never comes are reported back, and :func:`tplib.schedule.replay` turns that into a
deadlock error with the schedule's grid.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from tplib.schedule.actions import RECEIVES, SENDS, Action, Kind, Schedule

__all__ = ["Link", "TimedAction", "link_of", "run"]

Link = tuple[str, int, int]  # (message kind "A" or "G", source stage, destination stage)


@dataclass(frozen=True)
class TimedAction:
    """An action with the times :func:`run` gave it."""

    stage: int
    action: Action
    start: float
    end: float


def link_of(schedule: Schedule, a: Action) -> Link:
    """The directed link send or receive ``a`` of ``schedule`` uses: to or from the stage
    that holds the neighbouring part of the model; stage -1 past the model's ends (an
    invalid schedule's: nothing arrives there, nothing comes from there)."""
    kind = a.kind
    toward = 1 if kind is Kind.SA or kind is Kind.RG else -1  # the peer's part, from a's
    other = schedule.neighbour(a, toward)
    peer = -1 if other is None else other[0]
    if kind is Kind.SA or kind is Kind.SG:
        return ("A" if kind is Kind.SA else "G", a.stage, peer)
    return ("A" if kind is Kind.RA else "G", peer, a.stage)


def run(
    schedule: Schedule, duration: Callable[[Action], float]
) -> tuple[list[list[TimedAction]], list[int]]:
    """Time every action that can run; return them per stage and each stage's count of
    actions run (fewer than its list means it is stuck on a receive)."""
    n = schedule.n_stages
    done = [0] * n
    clock = [0.0] * n
    timed: list[list[TimedAction]] = [[] for _ in range(n)]
    arrivals: dict[Link, list[float]] = defaultdict(list)
    received: Counter[Link] = Counter()
    # The only cross-stage dependency is a receive on its send, so processing stages in
    # any order that respects it gives the same times: no event queue is needed.
    progress = True
    while progress:
        progress = False
        for k, acts in enumerate(schedule.actions):
            while done[k] < len(acts):
                a = acts[done[k]]
                start = clock[k]
                if a.kind in RECEIVES:
                    link = link_of(schedule, a)
                    i = received[link]
                    if i >= len(arrivals[link]):
                        break  # blocked until the matching send is issued
                    received[link] += 1
                    end = max(start + duration(a), arrivals[link][i])
                    clock[k] = end
                elif a.kind in SENDS:
                    end = start + duration(a)
                    # Sends are asynchronous: the stage's clock stays.
                    arrivals[link_of(schedule, a)].append(end)
                else:
                    end = start + duration(a)
                    clock[k] = end
                timed[k].append(TimedAction(k, a, start, end))
                done[k] += 1
                progress = True
    return timed, done
