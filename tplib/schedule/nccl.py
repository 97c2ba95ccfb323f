"""Point-to-point messages on NCCL: the order tplib posts them in, and a replay that
shows whether a schedule can deadlock there.

NCCL runs the messages between two ranks in the order they were posted, on one stream,
and a send completes only when its receive is posted (rendezvous). gloo buffers sends,
so a schedule that runs on CPU can hang on GPUs: under ``1f1b`` stage k posts ``SA b1``
then ``RG b0`` while stage k+1 posts ``SG b0`` then ``RA b1``; the heads of the two
streams are ``SA b1`` and ``SG b0``, and neither can match. The validator's engine
(:mod:`tplib.schedule.engine`) buffers sends and does not see it.

:func:`posting_plan` says when each stage posts each message:

- ``"naive"``: each message alone, at its place in the stage's list (what a runtime that
  walks the list does);
- ``"ordered"``: what tplib's runtime does. For each pair of stages that talk, the
  messages between them are put in one order both stages follow: a linear extension of
  what each stage's list forces (a stage posts its sends in its list's order, each
  after every receive it waits on before it), ties broken by when the buffered replay
  sends them. A stage posts its sends where its list has them; it posts each receive at
  its own place or, if its successor in that order is one of the stage's own sends
  coming earlier in the list, together with that send. Messages posted at one place, or
  at places with only messages between them, go out as one ``batch_isend_irecv`` per
  peer: the crossing pair of 1F1B is posted together on both sides. Both stages then
  post in the same order, so the heads of their streams always match.

:func:`run_nccl` replays a schedule under that model: each stage walks its list,
posting groups where the plan says; a receive waits until its message has completed,
sends never hold the stage up (the stream does); a synchronous schedule's ``AR`` waits
for the stage's sends. A group heads its pair's stream until all its messages are done,
and a message completes once both stages' stream heads hold it. :func:`check_nccl`
raises :class:`~tplib.schedule.ScheduleError` with the grid when a stage is stuck.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from tplib.schedule.actions import COMMUNICATION, SENDS, Action, Kind, Schedule
from tplib.schedule.drawing import schedule_error, unit_cost
from tplib.schedule.engine import Link, TimedAction, link_of, run

__all__ = [
    "Message",
    "PostGroup",
    "Posting",
    "PostingPlan",
    "check_nccl",
    "posting_plan",
    "run_nccl",
]

Posting = Literal["naive", "ordered"]
_POSTINGS: tuple[Posting, ...] = get_args(Posting)
PostingPlan = tuple[tuple["PostGroup", ...], ...]  # per stage, what it posts and where
Message = tuple[Link, int]  # a link and the message's index on it (FIFO)


def _peer_of(schedule: Schedule, a: Action) -> int:
    """The stage at the other end of a send's or receive's link."""
    _, src, dst = link_of(schedule, a)
    return dst if a.kind in SENDS else src


def _pairs(messages: list[list[tuple[int, Message]]]) -> list[tuple[int, int]]:
    """The pairs of stages (lower first) that exchange messages: neighbours, and with
    virtual stages the wrap from the last stage to the first."""
    return sorted({(min(s, d), max(s, d)) for mine in messages for _, ((_, s, d), _) in mine})


@dataclass(frozen=True)
class PostGroup:
    """Messages one stage posts at once to one peer, before running its action ``at``
    (one ``batch_isend_irecv``); ``actions`` are the stage's sends and receives."""

    at: int
    peer: int
    actions: tuple[Action, ...]


def _messages(schedule: Schedule) -> list[list[tuple[int, Message]]]:
    """Per stage, (index in its list, message) of each send and receive, in list order."""
    count: dict[tuple[str, Link], int] = defaultdict(int)
    out: list[list[tuple[int, Message]]] = []
    for acts in schedule.actions:
        mine = []
        for i, a in enumerate(acts):
            if a.kind in COMMUNICATION:
                link = link_of(schedule, a)
                side = "send" if a.kind in SENDS else "receive"
                mine.append((i, (link, count[side, link])))
                count[side, link] += 1
        out.append(mine)
    return out


def _consensus(
    schedule: Schedule,
    pair: tuple[int, int],
    messages: list[list[tuple[int, Message]]],
    issued: dict[Message, float],
) -> list[Message]:
    """The order both stages of ``pair`` post their messages in (see the module)."""
    before: dict[Message, set[Message]] = defaultdict(set)
    nodes: set[Message] = set()
    k, other = pair
    for side, peer in ((k, other), (other, k)):
        acts = schedule.actions[side]
        # A send comes after the side's previous send and every receive it waits on
        # before it. Receives among themselves are free: the side posts them ahead of
        # their places, in the agreed order, so with virtual stages a peer may send an
        # activation and a gradient in the other order than this side waits for them.
        last_send: Message | None = None
        waited: list[Message] = []
        for i, m in messages[side]:
            if _peer_of(schedule, acts[i]) != peer:
                continue
            nodes.add(m)
            if acts[i].kind in SENDS:
                before[m].update(waited)
                if last_send is not None:
                    before[m].add(last_send)
                last_send, waited = m, []
            else:
                waited.append(m)
    waiting = {m: len(before[m]) for m in nodes}
    after: dict[Message, list[Message]] = defaultdict(list)
    for m, deps in before.items():
        for d in deps:
            after[d].append(m)
    ready = [(issued.get(m, 0.0), m[0], m[1], m) for m in nodes if waiting[m] == 0]
    heapq.heapify(ready)
    order: list[Message] = []
    while ready:
        *_, m = heapq.heappop(ready)
        order.append(m)
        for n in after[m]:
            waiting[n] -= 1
            if waiting[n] == 0:
                heapq.heappush(ready, (issued.get(n, 0.0), n[0], n[1], n))
    if len(order) != len(nodes):
        stuck = sorted(set(nodes) - set(order))
        raise schedule_error(
            schedule,
            [],
            f"stages {k} and {other} wait on each other's messages before sending their own "
            f"({len(stuck)} messages, e.g. {stuck[0]}): no order of posting can run them",
        )
    return order


def posting_plan(schedule: Schedule, posting: Posting = "ordered") -> PostingPlan:
    """Per stage, the groups of messages it posts and where (see the module); the
    schedule must be valid."""
    if posting not in _POSTINGS:
        raise ValueError(f"posting={posting!r}: choose one of {list(_POSTINGS)}")
    acts = schedule.actions
    messages = _messages(schedule)
    at: list[dict[int, int]] = [{} for _ in acts]  # stage -> action index -> post index
    rank: list[dict[int, int]] = [{} for _ in acts]  # stage -> action index -> agreed rank
    if posting == "naive":
        for k, mine in enumerate(messages):
            at[k] = {i: i for i, _ in mine}
    else:
        timed, done = run(schedule, unit_cost)
        issued: dict[Message, float] = {}  # a send that never ran (a deadlock) goes last
        for k, mine in enumerate(messages):
            for i, m in mine:
                if acts[k][i].kind in SENDS:
                    issued[m] = timed[k][i].start if i < done[k] else math.inf
        for pair in _pairs(messages):
            order = _consensus(schedule, pair, messages, issued)
            for side in pair:
                index = {m: i for i, m in messages[side]}
                # Backward through the agreed order: a send is posted at its place, a
                # receive at its place or with the next message, whichever comes first,
                # so the side posts in the agreed order.
                nxt = len(acts[side])
                for n, m in enumerate(reversed(order)):
                    i = index[m]
                    at[side][i] = i if acts[side][i].kind in SENDS else min(i, nxt)
                    rank[side][i] = len(order) - n
                    nxt = at[side][i]
    merge = posting == "ordered"
    return tuple(_groups(schedule, k, at[k], rank[k], merge) for k in range(schedule.n_stages))


def _groups(
    schedule: Schedule, k: int, at: dict[int, int], rank: dict[int, int], merge: bool
) -> tuple[PostGroup, ...]:
    """One group per peer and posting place; with ``merge``, per run of places with only
    messages between them. A group's messages go in their agreed ``rank`` (list order
    without one)."""
    acts = schedule.actions[k]
    start: dict[int, int] = {}  # posting place -> the place its group is posted at
    previous = -1
    for place in sorted(set(at.values())):
        between = range(previous + 1, place)
        if not merge or previous < 0 or any(acts[j].kind not in COMMUNICATION for j in between):
            first = place
        start[place] = first
        previous = place
    members: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, place in at.items():
        members[start[place], _peer_of(schedule, acts[i])].append(i)
    return tuple(
        PostGroup(
            place, peer, tuple(acts[i] for i in sorted(indices, key=lambda i: (rank.get(i, 0), i)))
        )
        for (place, peer), indices in sorted(members.items())
    )


@dataclass
class _Posted:
    """A group on one side of a pair's stream: its messages, when it was posted, and
    when each of them completed."""

    messages: frozenset[Message]
    posted: float
    ends: dict[Message, float] = field(default_factory=dict)


Stream = tuple[int, int]  # (stage, peer): one side of a pair's stream


class _Streams:
    """Every pair's stream, one queue of posted groups per side (see the module)."""

    def __init__(self, transfer: dict[Message, float]) -> None:
        self.transfer = transfer
        self.queues: dict[Stream, deque[_Posted]] = defaultdict(deque)
        self.free: dict[Stream, float] = defaultdict(float)  # when the head may start
        self.done: dict[Message, float] = {}  # when each completed message completed

    def post(self, stream: Stream, messages: frozenset[Message], now: float) -> None:
        self.queues[stream].append(_Posted(messages, now))

    def advance(self, pair: tuple[int, int]) -> bool:
        """Match the heads of the two stages' streams, and retire complete groups."""
        mine, theirs = pair, (pair[1], pair[0])
        progress = False
        while self.queues[mine] and self.queues[theirs]:
            a, b = self.queues[mine][0], self.queues[theirs][0]
            start = max(a.posted, self.free[mine], b.posted, self.free[theirs])
            for m in (a.messages & b.messages) - a.ends.keys():
                a.ends[m] = b.ends[m] = self.done[m] = start + self.transfer[m]
                progress = True
            retired = False
            for stream, head in ((mine, a), (theirs, b)):
                if len(head.ends) == len(head.messages):
                    self.free[stream] = max(self.free[stream], *head.ends.values())
                    self.queues[stream].popleft()
                    retired = progress = True
            if not retired:
                break
        return progress


def run_nccl(
    schedule: Schedule,
    duration: Callable[[Action], float],
    posting: Posting | PostingPlan = "ordered",
) -> tuple[list[list[TimedAction]], list[int], str]:
    """Replay ``schedule`` under NCCL's rendezvous messages, posted as ``posting`` says (a
    rule's name, or a plan :func:`posting_plan` made): the timed actions per stage, each
    stage's count of actions run, and why stages are stuck ("" when none is)."""
    acts, n = schedule.actions, schedule.n_stages
    messages = _messages(schedule)
    pairs = _pairs(messages)
    key = [dict(mine) for mine in messages]  # stage -> action index -> message
    places: list[dict[int, list[tuple[int, frozenset[Message]]]]] = [{} for _ in range(n)]
    plan = posting_plan(schedule, posting) if isinstance(posting, str) else posting
    for k, groups in enumerate(plan):
        index = {a: i for i, a in enumerate(acts[k])}
        for g in groups:
            group = frozenset(key[k][index[a]] for a in g.actions)
            places[k].setdefault(g.at, []).append((g.peer, group))
    transfer = {
        key[k][i]: duration(a) for k in range(n) for i, a in enumerate(acts[k]) if a.kind in SENDS
    }
    streams = _Streams(transfer)
    pc, clock = [0] * n, [0.0] * n
    posted = [-1] * n  # the last place each stage posted at
    sent: list[list[Message]] = [[] for _ in range(n)]
    timed: list[list[TimedAction]] = [[] for _ in range(n)]
    progress = True
    while progress:
        progress = False
        for k in range(n):
            while pc[k] < len(acts[k]):
                i, a = pc[k], acts[k][pc[k]]
                if posted[k] < i:
                    for peer, group in places[k].get(i, ()):
                        streams.post((k, peer), group, clock[k])
                    posted[k] = i
                    progress = True
                start = clock[k]
                if a.kind in SENDS:  # the stream, not the stage, waits for its receive
                    sent[k].append(key[k][i])
                    end = start
                elif a.kind in COMMUNICATION:
                    m = key[k][i]
                    if m not in streams.done:
                        break
                    end = max(start + duration(a), streams.done[m])
                elif a.kind is Kind.AR and not schedule.asynchronous:
                    if any(m not in streams.done for m in sent[k]):
                        break  # the runtime completes a synchronous schedule's sends here
                    end = max([start + duration(a), *(streams.done[m] for m in sent[k])])
                else:
                    end = start + duration(a)
                clock[k] = end
                timed[k].append(TimedAction(k, a, start, end))
                pc[k] += 1
                progress = True
        for pair in pairs:
            progress |= streams.advance(pair)
    # A send ends when its message does, known only now.
    for k in range(n):
        timed[k] = [
            TimedAction(k, t.action, t.start, streams.done.get(key[k][i], t.end))
            if t.action.kind in SENDS
            else t
            for i, t in enumerate(timed[k])
        ]
    unsent = [[m for m in sent[k] if m not in streams.done] for k in range(n)]
    return timed, pc, _stuck(schedule, pc, unsent, streams, key)


def _stuck(
    schedule: Schedule,
    pc: list[int],
    unsent: list[list[Message]],
    streams: _Streams,
    key: list[dict[int, Message]],
) -> str:
    """Why the stages that did not finish are stuck: where each waits, and the heads of
    its streams."""
    lines = []
    for k, acts in enumerate(schedule.actions):
        if pc[k] == len(acts) and not unsent[k]:
            continue
        names = {m: str(acts[i]) for i, m in key[k].items()}  # as this stage posted them
        waits = f"at {acts[pc[k]]}" if pc[k] < len(acts) else "for its sends"
        heads = [
            f"its stream to stage {peer} is held by "
            + ", ".join(sorted(names[m] for m in q[0].messages if m not in q[0].ends))
            for (stage, peer), q in sorted(streams.queues.items())
            if stage == k and q
        ]
        lines.append(f"stage {k} waits {waits}" + (f" ({'; '.join(heads)})" if heads else ""))
    if not lines:
        return ""
    return (
        "deadlock on NCCL: "
        + "; ".join(lines)
        + ". NCCL runs the messages between two ranks in the order they were posted, and a "
        "send waits for its receive: the stages post the messages between them in orders "
        "whose heads never match"
    )


def check_nccl(schedule: Schedule, posting: Posting | PostingPlan = "ordered") -> None:
    """Raise :class:`~tplib.schedule.ScheduleError` (with the grid) if ``schedule``,
    posted as ``posting`` says (a rule, or a plan), deadlocks under NCCL's rendezvous
    messages."""
    _, pc, why = run_nccl(schedule, unit_cost, posting)
    if why:
        stuck = [(k, i) for k, i in enumerate(pc) if i < len(schedule.actions[k])]
        raise schedule_error(schedule, stuck, why)
