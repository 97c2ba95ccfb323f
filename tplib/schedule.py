"""Pipeline schedules as data: each stage's ordered list of actions.

A schedule tells every pipeline stage k in ``0..K-1`` what to do, in order: run a
unit (batch slice b, token slice t) forward (``F``) or backward (``B``), send an
activation to stage k+1 (``SA``) or receive one from stage k-1 (``RA``), send a
gradient to stage k-1 (``SG``) or receive one from stage k+1 (``RG``). It is plain
data, so one representation serves the runtime (which interprets it), the simulator
(which replays it with costs), the plots and the tests.

Generators are short pure functions ``(n_stages, plan) -> Schedule``. They place the
compute actions only; :func:`add_communication` then inserts the sends and receives,
and :func:`validate` checks the result before anything executes. :func:`replay`
times a schedule under given action costs; :func:`format_grid` prints it.

Clock cycles of ``terapipe`` on K=2 stages for the plan ``[(1, [2, 2])] * 3`` (three
batch slices of one sequence, each cut into two token slices), one step per compute
action, free communication. Fill-drain: all forwards, then all backwards, each
sequence's token slices last-to-first::

    step    |    0        1        2        3        4        5        6        7        8        9       10       11       12       13
    --------+------------------------------------------------------------------------------------------------------------------------------
    stage 0 | F b0 t0  F b0 t1  F b1 t0  F b1 t1  F b2 t0  F b2 t1                    B b2 t1  B b2 t0  B b1 t1  B b1 t0  B b0 t1  B b0 t0
    stage 1 |          F b0 t0  F b0 t1  F b1 t0  F b1 t1  F b2 t0  F b2 t1  B b2 t1  B b2 t0  B b1 t1  B b1 t0  B b0 t1  B b0 t0

``1f1b`` (PipeDream-Flush) on the same plan: stage k warms up with (K-k-1) + (M-1)
forwards (M = 2 token slices), then alternates one forward and one backward, batch
slice by batch slice, so a stage holds at most three units' activations, not six::

    step    |    0        1        2        3        4        5        6        7        8        9       10       11       12       13
    --------+------------------------------------------------------------------------------------------------------------------------------
    stage 0 | F b0 t0  F b0 t1  F b1 t0           B b0 t1  F b1 t1  B b0 t0  F b2 t0  B b1 t1  F b2 t1  B b1 t0           B b2 t1  B b2 t0
    stage 1 |          F b0 t0  F b0 t1  B b0 t1  F b1 t0  B b0 t0  F b1 t1  B b1 t1  F b2 t0  B b1 t0  F b2 t1  B b2 t1  B b2 t0

Communication semantics (what the validator and :func:`replay` assume, and what the
runtime implements): a send never blocks its sender; a receive blocks until the
matching send has been issued; each directed link carries one kind of message
(k -> k+1 activations, k+1 -> k gradients) and matches them in FIFO order.
"""

from __future__ import annotations

import csv
import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

from tplib.plan import Plan, Unit

__all__ = [
    "KINDS",
    "SCHEDULES",
    "Action",
    "Schedule",
    "ScheduleError",
    "TimedAction",
    "add_communication",
    "format_grid",
    "gpipe",
    "make_schedule",
    "one_f_one_b",
    "replay",
    "terapipe",
    "validate",
]

KINDS = ("F", "B", "SA", "RA", "SG", "RG")
COMPUTE = frozenset({"F", "B"})
SENDS = frozenset({"SA", "SG"})
RECEIVES = frozenset({"RA", "RG"})

# Which compute action a communication action serves (the grid shows compute only,
# so a faulty send or receive is drawn on the compute action it belongs to).
_SERVES = {"F": "F", "B": "B", "SA": "F", "RA": "F", "SG": "B", "RG": "B"}

_ACTION_RE = re.compile(r"^\s*(F|B|SA|RA|SG|RG)\s+b(\d+)\s+t(\d+)\s*$")


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message shows the grid with the faulty action marked."""

    def __init__(self, message: str, actions: Sequence[Action] = ()) -> None:
        super().__init__(message)
        self.actions = tuple(actions)


@dataclass(frozen=True)
class Action:
    """One step of one stage: ``kind`` applied to unit (``b``, ``t``) on ``stage``."""

    kind: str
    stage: int
    b: int
    t: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}: known kinds are {KINDS}")
        if min(self.stage, self.b, self.t) < 0:
            raise ValueError(
                f"action {self.kind} b{self.b} t{self.t} on stage {self.stage}: "
                "stage and unit indices must be non-negative"
            )

    @property
    def unit(self) -> Unit:
        return Unit(self.b, self.t)

    def __str__(self) -> str:
        # The stage is the row the action sits in, so the compact form leaves it out.
        return f"{self.kind} b{self.b} t{self.t}"

    @classmethod
    def parse(cls, text: str, stage: int) -> Action:
        """Inverse of ``str``: ``Action.parse("F b0 t2", stage=1)``."""
        m = _ACTION_RE.match(text)
        if m is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected '<kind> b<batch slice> t<token slice>' "
                f"with kind one of {KINDS}, e.g. 'F b0 t2'"
            )
        return cls(m[1], stage, int(m[2]), int(m[3]))


@dataclass(frozen=True)
class TimedAction:
    """An action with the times :func:`replay` gave it."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Schedule:
    """A named schedule: ``actions[k]`` is stage k's ordered list of actions."""

    name: str
    n_stages: int
    plan: Plan
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(acts) for acts in self.actions))
        if self.n_stages < 1:
            raise ValueError(f"n_stages={self.n_stages}: a schedule needs at least one stage")
        if len(self.actions) != self.n_stages:
            raise ValueError(
                f"schedule {self.name!r} has n_stages={self.n_stages} but action lists "
                f"for {len(self.actions)} stages: give exactly one list per stage"
            )
        for k, acts in enumerate(self.actions):
            for a in acts:
                if a.stage != k:
                    raise ValueError(
                        f"action {a} labelled stage {a.stage} sits in stage {k}'s list"
                    )

    def compute_actions(self, stage: int) -> tuple[Action, ...]:
        """Stage ``stage``'s forwards and backwards, in order, without communication."""
        return tuple(a for a in self.actions[stage] if a.kind in COMPUTE)

    def __str__(self) -> str:
        return f"{self.name} on {self.n_stages} stages, plan {self.plan}\n{format_grid(self)}"

    # ---- CSV -------------------------------------------------------------------------

    def to_csv(self, path_or_buffer: str | os.PathLike[str] | IO[str]) -> None:
        """Write one row per action (stage, index, kind, b, t) after ``# key: value``
        comment lines holding the name, stage count and plan (``pandas.read_csv(...,
        comment="#")`` reads the rows)."""
        meta = {"name": self.name, "n_stages": str(self.n_stages), "plan": self.plan.to_paper()}
        for key in ("latency", "t_max", "eps"):
            value = getattr(self.plan, key)
            if value is not None:
                meta[f"plan_{key}"] = repr(float(value))
        with _open(path_or_buffer, "w") as f:
            for key, value in meta.items():
                f.write(f"# {key}: {value}\n")
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["stage", "index", "kind", "b", "t"])
            for k, acts in enumerate(self.actions):
                for i, a in enumerate(acts):
                    writer.writerow([k, i, a.kind, a.b, a.t])

    @classmethod
    def from_csv(cls, path_or_buffer: str | os.PathLike[str] | IO[str]) -> Schedule:
        """Read what :meth:`to_csv` wrote."""
        with _open(path_or_buffer, "r") as f:
            lines = f.read().splitlines()
        meta: dict[str, str] = {}
        body = []
        for line in lines:
            if line.startswith("#"):
                key, _, value = line[1:].partition(":")
                meta[key.strip()] = value.strip()
            elif line.strip():
                body.append(line)
        for key in ("name", "n_stages", "plan"):
            if key not in meta:
                raise ValueError(f"schedule CSV lacks the '# {key}: ...' header line")
        base = Plan.from_paper(meta["plan"])
        plan = Plan(
            base.batch_slices,
            base.token_slices,
            *(
                float(meta[f"plan_{k}"]) if f"plan_{k}" in meta else None
                for k in ("latency", "t_max", "eps")
            ),
        )
        n_stages = int(meta["n_stages"])
        rows = sorted(
            (int(r["stage"]), int(r["index"]), r["kind"], int(r["b"]), int(r["t"]))
            for r in csv.DictReader(body)
        )
        actions: list[list[Action]] = [[] for _ in range(n_stages)]
        for k, i, kind, b, t in rows:
            if not 0 <= k < n_stages or i != len(actions[k]):
                raise ValueError(
                    f"schedule CSV row stage={k} index={i} is out of place: "
                    "indices must run 0, 1, ... on each stage"
                )
            actions[k].append(Action(kind, k, b, t))
        return cls(meta["name"], n_stages, plan, tuple(tuple(a) for a in actions))


@contextmanager
def _open(path_or_buffer: str | os.PathLike[str] | IO[str], mode: str) -> Iterator[IO[str]]:
    if isinstance(path_or_buffer, (str, os.PathLike)):
        with open(path_or_buffer, mode, newline="", encoding="utf-8") as f:
            yield f
    else:
        yield path_or_buffer  # a caller's buffer: use it, leave it open


# ---- generators ----------------------------------------------------------------------


def _check_stages(n_stages: int) -> None:
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages}: a pipeline needs at least one stage")


def _fill_drain(name: str, n_stages: int, plan: Plan) -> Schedule:
    _check_stages(n_stages)
    fwd = list(plan.units())
    # Reversing the forward order runs each sequence's token slices last-to-first, which
    # is what the K/V-context gradients need.
    order = [("F", u) for u in fwd] + [("B", u) for u in reversed(fwd)]
    acts = tuple(tuple(Action(kind, k, u.b, u.t) for kind, u in order) for k in range(n_stages))
    return add_communication(Schedule(name, n_stages, plan, acts))


def gpipe(n_stages: int, plan: Plan) -> Schedule:
    """GPipe fill-drain over microbatches: the paper's "w/o TeraPipe" baseline."""
    for b in range(plan.n_batch_slices):
        if plan.n_token_slices(b) != 1:
            raise ValueError(
                f"gpipe needs one token slice per batch slice (microbatches), but batch slice "
                f"{b} of plan {plan} has {plan.n_token_slices(b)}: use 'terapipe' for "
                "token-sliced plans"
            )
    return _fill_drain("gpipe", n_stages, plan)


def terapipe(n_stages: int, plan: Plan) -> Schedule:
    """TeraPipe fill-drain over batch x token slices: forwards in plan order, then
    backwards in reverse, each sequence's token slices last-to-first."""
    return _fill_drain("terapipe", n_stages, plan)


def one_f_one_b(n_stages: int, plan: Plan) -> Schedule:
    """PipeDream-Flush (1F1B) over batch x token slices (sequence-level 1F1B).

    Stage k runs (K-k-1) + (M-1) warmup forwards, M being the first batch slice's token
    slice count, then alternates one forward (while any remain) and one backward, then
    drains the remaining backwards. Backwards go batch slice by batch slice, each one's
    token slices in reverse. A backward whose forward has not run yet on this stage is
    preceded by the missing forwards, which keeps plans with different M per batch slice
    valid. With M = 1 this is the standard PipeDream-Flush / Megatron 1F1B.
    """
    _check_stages(n_stages)
    fwd = list(plan.units())
    bwd = [
        Unit(b, t)
        for b in range(plan.n_batch_slices)
        for t in reversed(range(plan.n_token_slices(b)))
    ]
    index = {u: i for i, u in enumerate(fwd)}
    stages = []
    for k in range(n_stages):
        warmup = min(n_stages - k - 1 + plan.n_token_slices(0) - 1, len(fwd))
        order = [("F", u) for u in fwd[:warmup]]
        n_fwd = warmup
        for u in bwd:
            # One forward per backward in the steady state; more if u's own forward is
            # still ahead (a later batch slice with more token slices than the first).
            target = max(min(n_fwd + 1, len(fwd)), index[u] + 1)
            order += [("F", v) for v in fwd[n_fwd:target]]
            n_fwd = target
            order.append(("B", u))
        stages.append(tuple(Action(kind, k, u.b, u.t) for kind, u in order))
    return add_communication(Schedule("1f1b", n_stages, plan, tuple(stages)))


def add_communication(schedule: Schedule) -> Schedule:
    """Insert sends and receives around a compute-only schedule's actions: RA before
    each F on stages k > 0, SA after each F on stages k < K-1, RG before each B on
    stages k < K-1, SG after each B on stages k > 0."""
    last = schedule.n_stages - 1
    stages = []
    for k, acts in enumerate(schedule.actions):
        out: list[Action] = []
        for a in acts:
            if a.kind not in COMPUTE:
                raise ValueError(
                    f"add_communication got {a} on stage {k}: it expects a schedule of "
                    "forwards and backwards only"
                )
            before, after = ("RA", "SA") if a.kind == "F" else ("RG", "SG")
            has_before = k > 0 if a.kind == "F" else k < last
            has_after = k < last if a.kind == "F" else k > 0
            if has_before:
                out.append(Action(before, k, a.b, a.t))
            out.append(a)
            if has_after:
                out.append(Action(after, k, a.b, a.t))
        stages.append(tuple(out))
    return Schedule(schedule.name, schedule.n_stages, schedule.plan, tuple(stages))


SCHEDULES: dict[str, Callable[[int, Plan], Schedule]] = {
    "gpipe": gpipe,
    "terapipe": terapipe,
    "1f1b": one_f_one_b,
}


def make_schedule(name: str, n_stages: int, plan: Plan) -> Schedule:
    """Build the schedule registered as ``name`` and validate it."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: known schedules are {sorted(SCHEDULES)}")
    schedule = SCHEDULES[name](n_stages, plan)
    validate(schedule)
    return schedule


# ---- replay --------------------------------------------------------------------------


def _link(a: Action) -> tuple[str, int, int]:
    """The directed link (message kind, source stage, destination stage) ``a`` uses."""
    if a.kind in ("SA", "RA"):
        src = a.stage if a.kind == "SA" else a.stage - 1
        return ("A", src, src + 1)
    src = a.stage if a.kind == "SG" else a.stage + 1
    return ("G", src, src - 1)


def _replay(
    schedule: Schedule, duration: Callable[[Action], float]
) -> tuple[list[list[TimedAction]], list[int]]:
    """Time every action that can run; return them per stage and each stage's count of
    actions run (fewer than its list means it is stuck on a receive)."""
    n = schedule.n_stages
    done = [0] * n
    clock = [0.0] * n
    timed: list[list[TimedAction]] = [[] for _ in range(n)]
    arrivals: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    received: Counter[tuple[str, int, int]] = Counter()
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
                    link = _link(a)
                    i = received[link]
                    if i >= len(arrivals[link]):
                        break  # blocked until the matching send is issued
                    received[link] += 1
                    end = max(start + duration(a), arrivals[link][i])
                    clock[k] = end
                elif a.kind in SENDS:
                    end = start + duration(a)
                    arrivals[_link(a)].append(end)  # sends are asynchronous: clock stays
                else:
                    end = start + duration(a)
                    clock[k] = end
                timed[k].append(TimedAction(k, a, start, end))
                done[k] += 1
                progress = True
    return timed, done


def replay(schedule: Schedule, duration: Callable[[Action], float]) -> list[TimedAction]:
    """Time a schedule: each action starts when the previous action on its stage has
    finished, a send does not hold its stage up (its duration is the transfer), and a
    receive ends once the matching send's transfer has arrived. Returns the timed
    actions stage by stage, in each stage's order; raises :class:`ScheduleError` on
    deadlock."""
    timed, done = _replay(schedule, duration)
    stuck = [k for k in range(schedule.n_stages) if done[k] < len(schedule.actions[k])]
    if stuck:
        raise _error(schedule, [(k, done[k]) for k in stuck], _deadlock_reason(schedule, done))
    return [ta for stage in timed for ta in stage]


def _unit_cost(a: Action) -> float:
    return 1.0 if a.kind in COMPUTE else 0.0


def _deadlock_reason(schedule: Schedule, done: list[int]) -> str:
    waits = []
    for k, acts in enumerate(schedule.actions):
        if done[k] < len(acts):
            a = acts[done[k]]
            src = _link(a)[1]
            waits.append(f"stage {k} waits at {a} for stage {src}")
    return (
        "deadlock: " + "; ".join(waits) + ". Each of these receives' matching send comes "
        "after a blocked receive (or never comes); reorder so sends precede what waits on them"
    )


# ---- grid ----------------------------------------------------------------------------


def _anchor(acts: Sequence[Action], i: int) -> int | None:
    """Index of the compute action that draws action ``i`` on the grid."""
    a = acts[i]
    if a.kind in COMPUTE:
        return i
    want = _SERVES[a.kind]
    for j, c in enumerate(acts):
        if c.kind == want and c.unit == a.unit:
            return j
    later = [j for j in range(i + 1, len(acts)) if acts[j].kind in COMPUTE]
    earlier = [j for j in range(i) if acts[j].kind in COMPUTE]
    return later[0] if later else (earlier[-1] if earlier else None)


def _grid(schedule: Schedule, marks: Iterable[tuple[int, int]], max_steps: int | None) -> str:
    timed, done = _replay(schedule, _unit_cost)
    cells: dict[tuple[int, int], tuple[int, int]] = {}  # (stage, step) -> (stage, index)
    for k, acts in enumerate(schedule.actions):
        step = 0
        for i, a in enumerate(acts):
            if i < done[k]:
                step = int(timed[k][i].start)
            if a.kind in COMPUTE:
                # Actions after a deadlock never ran: draw them one step apart after
                # the last step that did.
                while (k, step) in cells:
                    step += 1
                cells[(k, step)] = (k, i)
                step += 1
    marked = set()
    for k, i in marks:
        j = _anchor(schedule.actions[k], i)
        if j is not None:
            marked.add((k, j))
    n_steps = max((s for _, s in cells), default=-1) + 1
    lo, hi = 0, n_steps
    if max_steps is not None and n_steps > max_steps:
        # Show a window around the first marked cell so big schedules stay readable.
        at = min((s for (k, s), pos in cells.items() if pos in marked), default=0)
        lo = max(0, min(at - max_steps // 2, n_steps - max_steps))
        hi = lo + max_steps
    texts = {ks: str(schedule.actions[pos[0]][pos[1]]) for ks, pos in cells.items()}
    width = max((len(s) for s in texts.values()), default=1) + 2
    label = max(len("step"), len(f"stage {schedule.n_stages - 1}"))
    # Elided steps are shown as "..." at the row ends.
    before = "..." if lo > 0 else ""
    head = before + "".join(f"{s:^{width}}" for s in range(lo, hi))
    rows = [f"{'step':<{label}} |{head.rstrip()}", f"{'-' * label}-+" + "-" * len(head)]
    for k in range(schedule.n_stages):
        line = []
        for s in range(lo, hi):
            pos = cells.get((k, s))
            if pos is None:
                line.append(" " * width)
            elif pos in marked:
                line.append(f">{texts[(k, s)]}<".ljust(width))
            else:
                line.append(f" {texts[(k, s)]} ".ljust(width))
        tail = " ..." if hi < n_steps else ""
        rows.append(
            f"{'stage ' + str(k):<{label}} |{' ' * len(before)}{''.join(line).rstrip()}{tail}"
        )
    return "\n".join(rows)


def format_grid(
    schedule: Schedule,
    mark: Action | Iterable[Action] | None = None,
    *,
    max_steps: int | None = None,
) -> str:
    """The schedule as a stage x step table of its compute actions, at the steps of an
    as-soon-as-possible run (compute takes one step, communication none). Cells equal
    to a ``mark`` action are drawn ``>F b0 t2<`` (a marked send or receive marks its
    forward or backward). ``max_steps`` limits the width to a window around the mark."""
    wanted = {mark} if isinstance(mark, Action) else set(mark or ())
    marks = [
        (k, i) for k, acts in enumerate(schedule.actions) for i, a in enumerate(acts) if a in wanted
    ]
    return _grid(schedule, marks, max_steps)


# ---- validation ----------------------------------------------------------------------

_GRID_STEPS = 24  # error messages show at most this many steps around the faulty action


def _error(schedule: Schedule, positions: Sequence[tuple[int, int]], reason: str) -> ScheduleError:
    where = ", ".join(f"stage {k} action #{i}" for k, i in positions)
    grid = _grid(schedule, positions, _GRID_STEPS)
    text = f"{reason} [{where}]" if where else reason
    return ScheduleError(
        f"schedule {schedule.name!r} is invalid: {text}\n{grid}",
        [schedule.actions[k][i] for k, i in positions],
    )


def _expected_kinds(k: int, n_stages: int) -> tuple[str, ...]:
    kinds = ["F", "B"]
    if k > 0:
        kinds += ["RA", "SG"]
    if k < n_stages - 1:
        kinds += ["SA", "RG"]
    return tuple(kinds)


def _check_counts(schedule: Schedule) -> None:
    plan, n = schedule.plan, schedule.n_stages
    units = set(plan.units())
    for k, acts in enumerate(schedule.actions):
        kinds = _expected_kinds(k, n)
        seen: dict[tuple[str, Unit], int] = {}
        for i, a in enumerate(acts):
            if a.unit not in units:
                raise _error(
                    schedule,
                    [(k, i)],
                    f"{a} on stage {k} names a unit that is not in the plan {plan}",
                )
            if a.kind not in kinds:
                side = "previous" if a.kind in ("RA", "SG") else "next"
                raise _error(
                    schedule,
                    [(k, i)],
                    f"{a} on stage {k} talks to a {side} stage, but stage {k} of {n} has none",
                )
            if (a.kind, a.unit) in seen:
                raise _error(
                    schedule,
                    [(k, seen[(a.kind, a.unit)]), (k, i)],
                    f"{a} appears twice on stage {k}: each action runs exactly once",
                )
            seen[(a.kind, a.unit)] = i
        for u in plan.units():
            for kind in ("F", "B", "RA", "SA", "RG", "SG"):
                if kind in kinds and (kind, u) not in seen:
                    related = [i for i, a in enumerate(acts) if a.unit == u]
                    want = Action(kind, k, u.b, u.t)
                    # Draw the mark on the compute action that lacks its send/receive.
                    anchor = [i for i in related if acts[i].kind == _SERVES[kind]] or related
                    raise _error(
                        schedule,
                        [(k, i) for i in anchor[:1]],
                        f"stage {k} lacks {want}: every stage "
                        f"needs {', '.join(kinds)} for every unit of the plan",
                    )


_KV_FORWARD = "a token slice's forward needs the K/V context of the slice before it"
_KV_BACKWARD = (
    "token slices go backward last-to-first, each feeding its K/V-context gradient "
    "to the slice before it"
)


def _needs(a: Action, plan: Plan, n_stages: int) -> Iterator[tuple[Action, str]]:
    """The actions that must come before ``a`` on its own stage, and why."""
    k, b, t = a.stage, a.b, a.t
    if a.kind == "F":
        if t > 0:
            yield Action("F", k, b, t - 1), _KV_FORWARD
        if k > 0:
            yield Action("RA", k, b, t), "a forward needs its received activation"
    elif a.kind == "B":
        yield Action("F", k, b, t), "a unit's backward needs its forward"
        if t + 1 < plan.n_token_slices(b):
            yield Action("B", k, b, t + 1), _KV_BACKWARD
        if k < n_stages - 1:
            yield Action("RG", k, b, t), "a backward needs its received gradient"
    elif a.kind == "SA":
        yield Action("F", k, b, t), "an activation is sent after its forward"
    elif a.kind == "SG":
        yield Action("B", k, b, t), "a gradient is sent after its backward"


def _check_order(schedule: Schedule) -> None:
    for k, acts in enumerate(schedule.actions):
        seen: set[Action] = set()
        for i, a in enumerate(acts):
            for need, why in _needs(a, schedule.plan, schedule.n_stages):
                if need not in seen:
                    raise _error(schedule, [(k, i)], f"{a} on stage {k} runs before {need}: {why}")
            seen.add(a)


def _check_fifo(schedule: Schedule) -> None:
    links: dict[tuple[str, int, int], dict[str, list[tuple[int, int]]]] = defaultdict(
        lambda: {"send": [], "recv": []}
    )
    for k, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.kind not in COMPUTE:
                links[_link(a)]["send" if a.kind in SENDS else "recv"].append((k, i))
    for (msg, src, dst), ends in sorted(links.items()):
        for n, (s, r) in enumerate(zip(ends["send"], ends["recv"], strict=False)):
            sent, got = schedule.actions[s[0]][s[1]], schedule.actions[r[0]][r[1]]
            if sent.unit != got.unit:
                what = "activations" if msg == "A" else "gradients"
                raise _error(
                    schedule,
                    [r, s],
                    f"receive #{n} on link {src}->{dst} is {got} on stage {dst} but send #{n} "
                    f"is {sent} on stage {src}: {what} on a link match in FIFO order, so both "
                    "stages must name units in the same order",
                )


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, respects every
    dependency and cannot deadlock under the communication semantics above."""
    _check_counts(schedule)
    _check_order(schedule)
    _check_fifo(schedule)
    replay(schedule, _unit_cost)
