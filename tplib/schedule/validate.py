"""Checking a schedule before anything executes it, and replaying it with durations.

:func:`validate` raises :class:`~tplib.schedule.ScheduleError` unless a schedule is
complete (every stage runs every unit forward and backward once, with the sends and
receives its neighbours need, and updates once per iteration: a synchronous schedule
ends with ``AR``, ``OPT``), respects every dependency (a sequence's token slices run
forward first to last and backward last to first, through the K/V context), matches
sends and receives in FIFO order on every link, and cannot deadlock. An asynchronous
schedule's forwards and backwards must also name weight versions consistently: a unit's
forward and backward, and all token slices of a sequence, on one version that its stage
has already made; and each update must apply exactly its own iteration's gradients.
A schedule that splits its backwards (``W`` actions) must compute every unit's deferred
weight gradients exactly once on every stage, after the unit's ``B``: by a ``W`` of the
unit or one of its whole sequence, never both. Each error prints the grid with the
faulty action marked.

:func:`replay` times a valid schedule under given action durations: the engine of the
simulator and of the grid.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

from tplib.plan import Unit
from tplib.schedule.actions import (
    COMMUNICATION,
    COMPUTE,
    NO_VERSION,
    SENDS,
    UPDATE,
    Action,
    Kind,
    Schedule,
    covered_slices,
)
from tplib.schedule.drawing import SERVES, schedule_error, unit_cost
from tplib.schedule.engine import Link, TimedAction, link_of, run

__all__ = ["replay", "validate"]


def replay(schedule: Schedule, duration: Callable[[Action], float]) -> list[TimedAction]:
    """Time a schedule: each action starts when the previous action on its stage has
    finished, a send does not hold its stage up (its duration is the transfer), and a
    receive ends once the matching send's transfer has arrived. Returns the timed
    actions stage by stage, in each stage's order; raises
    :class:`~tplib.schedule.ScheduleError` on deadlock."""
    timed, done = run(schedule, duration)
    stuck = [k for k in range(schedule.n_stages) if done[k] < len(schedule.actions[k])]
    if stuck:
        positions = [(k, done[k]) for k in stuck]
        raise schedule_error(schedule, positions, _deadlock_reason(schedule, done))
    return [ta for stage in timed for ta in stage]


def _deadlock_reason(schedule: Schedule, done: list[int]) -> str:
    waits = []
    for k, acts in enumerate(schedule.actions):
        if done[k] < len(acts):
            a = acts[done[k]]
            waits.append(f"stage {k} waits at {a} for stage {link_of(schedule, a)[1]}")
    return (
        "deadlock: " + "; ".join(waits) + ". Each of these receives' matching send comes "
        "after a blocked receive (or never comes); reorder so sends precede what waits on them"
    )


def _unit_kinds(schedule: Schedule, k: int, chunk: int) -> tuple[Kind, ...]:
    """The kinds chunk ``chunk`` of stage k runs once per unit: the messages to and from
    the stages that hold the neighbouring parts (none between chunks of one stage)."""
    kinds = [Kind.F, Kind.B]
    probe = Action(Kind.F, k, 0, 0, chunk=chunk)
    before, after = schedule.neighbour(probe, -1), schedule.neighbour(probe, 1)
    if before is not None and before[0] != k:
        kinds += [Kind.RA, Kind.SG]
    if after is not None and after[0] != k:
        kinds += [Kind.SA, Kind.RG]
    return tuple(kinds)


def _check_counts(schedule: Schedule) -> None:
    plan = schedule.plan
    units = set(plan.units())
    if schedule.asynchronous and schedule.n_chunks > 1:
        raise schedule_error(
            schedule,
            [],
            f"schedule {schedule.name!r} names weight versions and holds "
            f"{schedule.n_chunks} chunks per stage: an asynchronous schedule keeps one",
        )
    for k, acts in enumerate(schedule.actions):
        chunk_kinds = [_unit_kinds(schedule, k, c) for c in range(schedule.n_chunks)]
        seen: dict[tuple[Kind, Unit, int], int] = {}
        for i, a in enumerate(acts):
            if a.kind is Kind.W:
                continue  # _check_weight_grads
            if a.kind not in UPDATE and a.unit not in units:
                raise schedule_error(
                    schedule,
                    [(k, i)],
                    f"{a} on stage {k} names a unit that is not in the plan {plan}",
                )
            if a.kind not in UPDATE and a.kind not in chunk_kinds[a.chunk]:
                side = "previous" if a.kind in (Kind.RA, Kind.SG) else "next"
                where = f"stage {k}" + (f" chunk {a.chunk}" if schedule.n_chunks > 1 else "")
                raise schedule_error(
                    schedule,
                    [(k, i)],
                    f"{a} on stage {k} talks to the stage of the {side} part of the model, "
                    f"but {where} (part {schedule.part(a)} of {schedule.n_parts}) has none "
                    "there, or has it on its own stage",
                )
            if a.kind in UPDATE and schedule.asynchronous:
                continue  # one per iteration: _check_updates counts them
            key = (a.kind, a.unit, a.chunk)
            if key in seen:
                raise schedule_error(
                    schedule,
                    [(k, seen[key]), (k, i)],
                    f"{a} appears twice on stage {k}: each action runs exactly once",
                )
            seen[key] = i
        for c, kinds in enumerate(chunk_kinds):
            for u in plan.units():
                for kind in kinds:
                    if (kind, u, c) in seen:
                        continue
                    related = [i for i, a in enumerate(acts) if a.unit == u and a.chunk == c]
                    want = Action(kind, k, u.b, u.t, chunk=c)
                    # Draw the mark on the compute action that lacks its send/receive.
                    serves = SERVES.get(kind, kind)
                    anchor = [i for i in related if acts[i].kind == serves] or related
                    raise schedule_error(
                        schedule,
                        [(k, i) for i in anchor[:1]],
                        f"stage {k} lacks {want}: every stage needs "
                        f"{', '.join(kinds)} for every unit of the plan"
                        + (", on each of its chunks" if schedule.n_chunks > 1 else ""),
                    )
        if schedule.split_backward:
            for c in range(schedule.n_chunks):
                _check_weight_grads(schedule, k, c)
        if schedule.asynchronous:
            _check_updates(schedule, k)
            continue
        ends = tuple(a.kind for a in acts[-2:])
        n_updates = sum(a.kind is Kind.OPT for a in acts)
        if ends != (Kind.AR, Kind.OPT) or n_updates != 1 or schedule.n_iterations != 1:
            last = [(k, len(acts) - 1)] if acts else []
            raise schedule_error(
                schedule,
                last,
                f"stage {k} must end with AR, OPT, its only update: a synchronous schedule "
                "all-reduces the gradients and steps the optimizer once, after every other "
                "action of its one iteration (add them with add_update); a schedule that "
                "updates while units are in flight names each unit's weight version",
            )


def _check_weight_grads(schedule: Schedule, k: int, chunk: int) -> None:
    """Chunk ``chunk`` of stage k of a split-backward schedule: each unit's weight
    gradients computed by exactly one ``W``, of the unit or of its whole sequence."""
    plan, acts = schedule.plan, schedule.actions[k]
    covered: dict[Unit, int] = {}  # unit -> index of the W that computes it
    for i, a in enumerate(acts):
        if a.kind is not Kind.W or a.chunk != chunk:
            continue
        if not 0 <= a.b < plan.n_batch_slices or (
            not a.whole_sequence and not 0 <= a.t < plan.n_token_slices(a.b)
        ):
            raise schedule_error(
                schedule, [(k, i)], f"{a} on stage {k} names a unit that is not in the plan {plan}"
            )
        for t in covered_slices(plan, a.b, a.t):
            u = Unit(a.b, t)
            if u in covered:
                raise schedule_error(
                    schedule,
                    [(k, covered[u]), (k, i)],
                    f"{a} on stage {k} computes the weight gradients of {u}, which "
                    f"{acts[covered[u]]} already computed: each unit's exactly once",
                )
            covered[u] = i
    for u in plan.units():
        if u not in covered:
            anchor = [
                i
                for i, a in enumerate(acts)
                if a.kind is Kind.B and a.unit == u and a.chunk == chunk
            ]
            raise schedule_error(
                schedule,
                [(k, i) for i in anchor[:1]],
                f"stage {k} never computes the weight gradients of unit {u}: a schedule with "
                "W actions needs a W of every unit, or of its whole sequence, after its B",
            )


def _check_updates(schedule: Schedule, k: int) -> None:
    """Stage k of an asynchronous schedule: one ``AR``, ``OPT`` per iteration, update i
    after iteration i's last backward and before iteration i+1's first (the gradients
    accumulate in one buffer), every forward and backward on a version, and a version
    only once the stage has made it (``v`` updates done)."""
    acts = schedule.actions[k]
    last_backward: dict[int, int] = {}  # iteration -> index of its last backward here
    for i, a in enumerate(acts):
        if a.kind in (Kind.B, Kind.W):
            last_backward[schedule.iteration_of(a.b)] = i
    made = 0  # updates done so far
    for i, a in enumerate(acts):
        if a.kind is Kind.OPT:
            if i == 0 or acts[i - 1].kind is not Kind.AR:
                raise schedule_error(
                    schedule, [(k, i)], f"OPT #{made} on stage {k} must follow its AR directly"
                )
            j = last_backward.get(made, -1)
            if j > i:
                raise schedule_error(
                    schedule,
                    [(k, i), (k, j)],
                    f"update #{made} on stage {k} runs before {acts[j]} of its iteration "
                    f"{made}: an update applies its whole iteration's gradients",
                )
            made += 1
        elif a.kind is Kind.B and schedule.iteration_of(a.b) != made:
            raise schedule_error(
                schedule,
                [(k, i)],
                f"{a} on stage {k} belongs to iteration {schedule.iteration_of(a.b)} but comes "
                f"after {made} updates: iteration i's backwards run between updates i-1 and "
                "i, whose gradients accumulate in one buffer",
            )
        if a.kind in COMPUTE:
            if a.v == NO_VERSION:
                raise schedule_error(
                    schedule,
                    [(k, i)],
                    f"{a} on stage {k} names no weight version, but other actions do: in a "
                    "schedule that updates while units are in flight, every forward and "
                    "backward names the version it uses",
                )
            if a.v > made:
                raise schedule_error(
                    schedule,
                    [(k, i)],
                    f"{a} on stage {k} uses weight version {a.v}, but the stage has made only "
                    f"{made} updates there (versions 0..{made})",
                )
    if made != schedule.n_iterations:
        raise schedule_error(
            schedule,
            [(k, len(acts) - 1)] if acts else [],
            f"stage {k} updates {made} times over {schedule.n_iterations} iterations: an "
            "asynchronous schedule updates once per iteration",
        )
    first: dict[int, int] = {}  # each batch slice's version: the same for all its actions
    for i, a in enumerate(acts):
        if a.kind in COMPUTE:
            v = first.setdefault(a.b, a.v)
            if a.v != v:
                j = next(j for j, c in enumerate(acts) if c.kind in COMPUTE and c.b == a.b)
                raise schedule_error(
                    schedule,
                    [(k, j), (k, i)],
                    f"{a} on stage {k} uses version {a.v} but {acts[j]} used {v}: a unit's "
                    "forward and backward, and all token slices of a sequence, share one "
                    "weight version",
                )


_KV_FORWARD = "a token slice's forward needs the K/V context of the slice before it"
_KV_BACKWARD = (
    "token slices go backward last-to-first, each feeding its K/V-context gradient "
    "to the slice before it"
)


def _needs(a: Action, schedule: Schedule) -> Iterator[tuple[Action, str]]:
    """The actions that must come before ``a`` on its own stage, and why."""
    k, b, t, c = a.stage, a.b, a.t, a.chunk
    before, after = schedule.neighbour(a, -1), schedule.neighbour(a, 1)
    if a.kind is Kind.F:
        if t > 0:
            yield Action(Kind.F, k, b, t - 1, chunk=c), _KV_FORWARD
        if before is not None and before[0] != k:
            yield Action(Kind.RA, k, b, t, chunk=c), "a forward needs its received activation"
        elif before is not None:
            yield (
                Action(Kind.F, k, b, t, chunk=before[1]),
                "a forward needs the activation of the part before it, held on this stage",
            )
    elif a.kind is Kind.B:
        yield Action(Kind.F, k, b, t, chunk=c), "a unit's backward needs its forward"
        if t + 1 < schedule.plan.n_token_slices(b):
            yield Action(Kind.B, k, b, t + 1, chunk=c), _KV_BACKWARD
        if after is not None and after[0] != k:
            yield Action(Kind.RG, k, b, t, chunk=c), "a backward needs its received gradient"
        elif after is not None:
            yield (
                Action(Kind.B, k, b, t, chunk=after[1]),
                "a backward needs the gradient of the part after it, held on this stage",
            )
    elif a.kind is Kind.W:
        # A whole sequence's backward ends with its first token slice.
        yield (
            Action(Kind.B, k, b, 0 if a.whole_sequence else t, chunk=c),
            ("weight gradients come from the backward they were deferred by"),
        )
    elif a.kind is Kind.SA:
        yield Action(Kind.F, k, b, t, chunk=c), "an activation is sent after its forward"
    elif a.kind is Kind.SG:
        yield Action(Kind.B, k, b, t, chunk=c), "a gradient is sent after its backward"


def _check_order(schedule: Schedule) -> None:
    for k, acts in enumerate(schedule.actions):
        seen: set[tuple[Kind, int, int, int]] = set()  # what ran, whatever its version
        for i, a in enumerate(acts):
            for need, why in _needs(a, schedule):
                if (need.kind, need.b, need.t, need.chunk) not in seen:
                    raise schedule_error(
                        schedule, [(k, i)], f"{a} on stage {k} runs before {need}: {why}"
                    )
            seen.add((a.kind, a.b, a.t, a.chunk))


def _check_fifo(schedule: Schedule) -> None:
    sends: dict[Link, list[tuple[int, int]]] = defaultdict(list)
    receives: dict[Link, list[tuple[int, int]]] = defaultdict(list)
    for k, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.kind in COMMUNICATION:
                (sends if a.kind in SENDS else receives)[link_of(schedule, a)].append((k, i))
    for link in sorted(set(sends) | set(receives)):
        msg, src, dst = link
        step = 1 if msg == "A" else -1  # the receiving part, from the sending one
        for n, (s, r) in enumerate(zip(sends[link], receives[link], strict=False)):
            sent, got = schedule.actions[s[0]][s[1]], schedule.actions[r[0]][r[1]]
            if sent.unit != got.unit or schedule.part(got) != schedule.part(sent) + step:
                what = "activations" if msg == "A" else "gradients"
                raise schedule_error(
                    schedule,
                    [r, s],
                    f"receive #{n} on link {src}->{dst} is {got} on stage {dst} but send #{n} "
                    f"is {sent} on stage {src}: {what} on a link match in FIFO order, so both "
                    "stages must name units (and chunks) in the same order",
                )


def validate(schedule: Schedule) -> None:
    """Raise :class:`~tplib.schedule.ScheduleError` unless ``schedule`` is complete,
    respects every dependency and cannot deadlock under the communication semantics of
    :mod:`tplib.schedule.engine`."""
    _check_counts(schedule)
    _check_order(schedule)
    _check_fifo(schedule)
    replay(schedule, unit_cost)
