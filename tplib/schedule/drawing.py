"""Drawing a schedule as a stage x step grid, and the errors that show one.

:func:`draw_schedule` prints the compute actions of each stage at the steps of an
as-soon-as-possible run in which compute takes one step and everything else none.
:func:`schedule_error` builds a :class:`~tplib.schedule.ScheduleError` whose message is
that grid with the faulty actions marked ``>F b0 t2<``: a validator's complaint shows
where in the pipeline it happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tplib.schedule.actions import WORK, Action, Kind, Schedule, ScheduleError
from tplib.schedule.engine import run

__all__ = ["SERVES", "draw_schedule", "schedule_error", "unit_cost"]

_GRID_STEPS = 24  # error messages show at most this many steps around the faulty action

# Which compute action a send or receive serves: the grid draws compute only, so a faulty
# send or receive is drawn on the forward or backward it belongs to.
SERVES = {Kind.SA: Kind.F, Kind.RA: Kind.F, Kind.SG: Kind.B, Kind.RG: Kind.B}


def unit_cost(a: Action) -> float:
    """One step per forward, backward or weight gradient, nothing else: the grid's clock."""
    return 1.0 if a.kind in WORK else 0.0


def _anchor(acts: Sequence[Action], i: int) -> int | None:
    """Index of the compute action that draws action ``i`` on the grid."""
    a = acts[i]
    if a.kind in WORK:
        return i
    want = SERVES.get(a.kind)
    if want is not None:
        for j, c in enumerate(acts):
            if c.kind == want and c.unit == a.unit:
                return j
    later = [j for j in range(i + 1, len(acts)) if acts[j].kind in WORK]
    earlier = [j for j in range(i) if acts[j].kind in WORK]
    # A send or receive without its compute action is drawn on the next one; the update
    # at the end of a stage on its last.
    if want is None:
        return earlier[-1] if earlier else (later[0] if later else None)
    return later[0] if later else (earlier[-1] if earlier else None)


def _grid(schedule: Schedule, marks: Iterable[tuple[int, int]], max_steps: int | None) -> str:
    timed, done = run(schedule, unit_cost)
    cells: dict[tuple[int, int], tuple[int, int]] = {}  # (stage, step) -> (stage, index)
    for k, acts in enumerate(schedule.actions):
        step = 0
        for i, a in enumerate(acts):
            if i < done[k]:
                step = int(timed[k][i].start)
            if a.kind in WORK:
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


def draw_schedule(
    schedule: Schedule,
    mark: Action | Iterable[Action] | None = None,
    *,
    max_steps: int | None = None,
) -> str:
    """The schedule as a stage x step table of its compute actions, at the steps of an
    as-soon-as-possible run (compute takes one step, communication none). Cells equal
    to a ``mark`` action are drawn ``>F b0 t2<`` (a marked send or receive marks its
    forward or backward, a marked update the stage's last compute action). ``max_steps``
    limits the width to a window around the mark."""
    wanted = {mark} if isinstance(mark, Action) else set(mark or ())
    marks = [
        (k, i) for k, acts in enumerate(schedule.actions) for i, a in enumerate(acts) if a in wanted
    ]
    return _grid(schedule, marks, max_steps)


def schedule_error(
    schedule: Schedule, positions: Sequence[tuple[int, int]], reason: str
) -> ScheduleError:
    """The error for the actions at ``positions`` ((stage, index) pairs), with the grid."""
    where = ", ".join(f"stage {k} action #{i}" for k, i in positions)
    grid = _grid(schedule, positions, _GRID_STEPS)
    text = f"{reason} [{where}]" if where else reason
    return ScheduleError(
        f"schedule {schedule.name!r} is invalid: {text}\n{grid}",
        [schedule.actions[k][i] for k, i in positions],
    )
