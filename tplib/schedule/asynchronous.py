"""Asynchronous schedules: many iterations without a flush, each unit on a weight version.

PipeDream and PipeDream-2BW keep the pipeline full across iterations. A stage updates
its weights while other units are still in flight, so every forward and backward names
the weight version it uses (``v``: the stage's weights after ``v`` updates), the same
for a unit's forward and backward and for every token slice of a sequence. The schedule
spans ``n_iterations`` iterations: its plan is the iteration's plan repeated, and each
stage's list interleaves the updates (``AR``, ``OPT``) with the units.

``pipedream`` (Narayanan et al., 2019): each iteration is one minibatch (a plan of one
batch slice, possibly cut into token slices), and every stage updates after each
minibatch's backward. Stage k keeps K-k-1 minibatches ahead (1F1B by minibatch), so
minibatch t's forward on stage k sees the weights after t-(K-k-1) updates and its
backward uses that stashed version: per-stage delay K-k-1. With vertical sync, minibatch
t uses on every stage the version it entered stage 0 with: a common delay of K-1.

``2bw`` (Narayanan et al., 2021): each iteration is m microbatches (the plan's batch
slices) whose gradients are summed, under 1F1B across iterations; iteration t runs on
version max(t-1, 0) on every stage, so W(t+1) = W(t) - lr * grad f(W(t-1)) and a stage
holds two versions: the latest and the shadow the in-flight microbatches use.

:func:`held_versions` counts, from the schedule alone, how many versions each stage must
hold at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

from tplib.plan import Plan, Unit
from tplib.schedule.actions import NO_VERSION, Action, Kind, Schedule
from tplib.schedule.passes import Order, add_communication, one_f_one_b_order

__all__ = ["held_versions", "min_microbatches", "pipedream", "repeat_plan", "two_bw"]


def repeat_plan(plan: Plan, n_iterations: int) -> Plan:
    """``plan``'s batch slices ``n_iterations`` times over: the units of that many
    iterations, batch slice ``i * m + b`` being batch slice ``b`` of iteration ``i``."""
    if n_iterations < 1:
        raise ValueError(f"n_iterations={n_iterations}: a run has at least one iteration")
    return Plan(plan.batch_slices * n_iterations, plan.token_slices * n_iterations)


def _check(name: str, n_stages: int, n_iterations: int) -> None:
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages}: a pipeline needs at least one stage")
    if n_iterations < 1:
        raise ValueError(
            f"{name} over n_iterations={n_iterations}: an asynchronous schedule spans at "
            "least one iteration"
        )


def _forward(plan: Plan, b: int) -> Order:
    return [(Kind.F, Unit(b, t)) for t in range(plan.n_token_slices(b))]


def _backward(plan: Plan, b: int) -> Order:
    return [(Kind.B, Unit(b, t)) for t in reversed(range(plan.n_token_slices(b)))]


def _ends_iteration(kind: Kind, u: Unit, m: int) -> bool:
    """Whether ``kind`` on ``u`` is its iteration's last backward, which the update follows
    (backwards go batch slice by batch slice, each one's token slices last to first)."""
    return kind is Kind.B and u.t == 0 and (u.b + 1) % m == 0


def _versions(
    orders: Sequence[Order], m: int, rule: Callable[[int, int, int], int]
) -> list[dict[int, int]]:
    """Each stage's version per batch slice: ``rule(k, i, latest)`` for iteration ``i``,
    where ``latest`` is the number of updates stage k made before the batch slice's first
    forward there (updates follow each iteration's last backward)."""
    out = []
    for k, order in enumerate(orders):
        versions: dict[int, int] = {}
        done = 0  # updates made so far on this stage
        for kind, u in order:
            if kind is Kind.F and u.b not in versions:
                versions[u.b] = rule(k, u.b // m, done)
            if _ends_iteration(kind, u, m):
                done += 1
        out.append(versions)
    return out


def _build(
    name: str,
    n_stages: int,
    plan: Plan,
    n_iterations: int,
    orders: Sequence[Order],
    versions: Sequence[dict[int, int]],
) -> Schedule:
    """The schedule whose stage k runs ``orders[k]`` with the given versions, an update
    (``AR``, ``OPT``) after each iteration's last backward, and the communication."""
    m = plan.n_batch_slices // n_iterations
    stages = []
    for k, order in enumerate(orders):
        acts: list[Action] = []
        for kind, u in order:
            acts.append(Action(kind, k, u.b, u.t, versions[k][u.b]))
            if _ends_iteration(kind, u, m):
                acts += [Action(Kind.AR, k), Action(Kind.OPT, k)]
        stages.append(tuple(acts))
    return add_communication(Schedule(name, n_stages, plan, tuple(stages), n_iterations))


def pipedream(
    n_stages: int, plan: Plan, n_iterations: int, *, vertical_sync: bool = False
) -> Schedule:
    """PipeDream with weight stashing over ``n_iterations`` minibatches (``plan`` is one
    minibatch: one batch slice, any token slices); see the module docstring."""
    name = "pipedream"
    _check(name, n_stages, n_iterations)
    if plan.n_batch_slices != 1:
        raise ValueError(
            f"pipedream given plan {plan} with {plan.n_batch_slices} batch slices: PipeDream "
            "updates after every minibatch, so an iteration is one batch slice (cut into "
            "token slices if you like); use '2bw' to sum the gradients of several "
            "microbatches per update"
        )
    units = repeat_plan(plan, n_iterations)
    orders = []
    for k in range(n_stages):
        ahead = min(n_stages - k - 1, n_iterations)  # minibatches in flight past the one
        order: Order = []
        for t in range(ahead):
            order += _forward(units, t)
        for t in range(n_iterations):
            if t + ahead < n_iterations:
                order += _forward(units, t + ahead)
            order += _backward(units, t)
        orders.append(order)
    latest = _versions(orders, 1, lambda k, i, done: done)
    # Vertical sync: every stage uses the version the minibatch entered stage 0 with.
    versions = [dict(latest[0]) for _ in range(n_stages)] if vertical_sync else latest
    return _build(name, n_stages, units, n_iterations, orders, versions)


def two_bw(n_stages: int, plan: Plan, n_iterations: int) -> Schedule:
    """PipeDream-2BW over ``n_iterations`` iterations of ``plan``'s m batch slices
    (microbatches); see the module docstring. Raises ``ValueError`` when m is too small
    for iteration t's microbatches to find version t-1 on every stage."""
    name = "2bw"
    _check(name, n_stages, n_iterations)
    need = min_microbatches(n_stages, plan.token_slices[0])
    m = plan.n_batch_slices
    if m < need:
        raise ValueError(
            f"2bw with m={m} microbatches per iteration on {n_stages} stages: iteration t "
            f"runs on version t-1, which each stage makes after iteration t-1's last "
            f"backward, so under 1F1B at least m={need} microbatches of "
            f"{len(plan.token_slices[0])} token slices must separate them (the paper's "
            "m >= d, here exact for this schedule)"
        )
    units = repeat_plan(plan, n_iterations)
    orders = [one_f_one_b_order(k, n_stages, units) for k in range(n_stages)]
    versions = _versions(orders, m, lambda k, i, done: max(i - 1, 0))
    return _build(name, n_stages, units, n_iterations, orders, versions)


@cache  # a search over simulated orders: seconds for deep pipelines, asked again and again
def min_microbatches(n_stages: int, token_slices: tuple[int, ...]) -> int:
    """The fewest microbatches per iteration (each cut into ``token_slices``) with which
    every forward of 2BW's 1F1B order finds its version already made on its stage.
    Enough microbatches stay enough with more (a test checks it against every m on small
    pipelines), so a bisection finds the fewest."""
    lo, hi = 0, 4 * n_stages + len(token_slices) + 1  # hi is enough: 1F1B keeps <= K in flight
    if not _enough(n_stages, token_slices, hi):
        raise AssertionError("1F1B keeps a bounded number of units in flight")  # pragma: no cover
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _enough(n_stages, token_slices, mid) else (mid, hi)
    return hi


def _enough(n_stages: int, token_slices: tuple[int, ...], m: int) -> bool:
    """Whether ``m`` microbatches per iteration give every forward its version in time.
    Three iterations exercise the steady state: iteration 2 needs version 1. A
    sequence's later token slices run after its first, on as many updates or more, so
    the first forward of each batch slice decides."""
    units = Plan((1,) * (3 * m), (token_slices,) * (3 * m))
    orders = [one_f_one_b_order(k, n_stages, units) for k in range(n_stages)]
    made = _versions(orders, m, lambda k, i, done: done)  # updates before each entered
    return all(max(b // m - 1, 0) <= v for stage in made for b, v in stage.items())


def held_versions(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most weight versions it must hold at once: the latest, plus every
    older one a later forward or backward still uses. 1 for synchronous schedules."""
    out = []
    for acts in schedule.actions:
        last_use: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.v != NO_VERSION:
                last_use[a.v] = i
        most, latest = 1, 0
        for i, a in enumerate(acts):
            if a.kind is Kind.OPT:
                latest += 1
            stashed = {v for v, j in last_use.items() if v < latest and j > i}
            most = max(most, 1 + len(stashed))
        out.append(most)
    return tuple(out)
