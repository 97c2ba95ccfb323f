"""Schedule generators: short pure functions ``(n_stages, plan) -> Schedule``.

Each generator places the compute actions (``F``, ``B``) of one iteration. Two passes
(:mod:`tplib.schedule.passes`) then complete it: ``add_communication`` inserts the sends
and receives around them, and ``add_update`` ends every stage with its gradient
all-reduce (``AR``) and optimizer step (``OPT``), so the schedule describes the whole
iteration. :func:`tplib.schedule.registry.make_schedule` builds one by name and validates it.

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
"""

from __future__ import annotations

from collections import deque

from tplib.plan import Plan, Unit
from tplib.schedule.actions import WHOLE_SEQUENCE, Action, Kind, Schedule
from tplib.schedule.passes import (
    Order,
    add_communication,
    add_update,
    check_whole_sequences,
    one_f_one_b_order,
)

__all__ = ["gpipe", "one_f_one_b", "one_f_one_b_zb", "terapipe", "terapipe_zb"]


def _check_stages(n_stages: int) -> None:
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages}: a pipeline needs at least one stage")


def _complete(name: str, n_stages: int, plan: Plan, orders: list[Order]) -> Schedule:
    """The schedule whose stage k runs the compute actions ``orders[k]``, completed by
    the communication and update passes."""
    acts = tuple(
        tuple(Action(kind, k, u.b, u.t) for kind, u in order) for k, order in enumerate(orders)
    )
    return add_update(add_communication(Schedule(name, n_stages, plan, acts)))


def _fill_drain_order(plan: Plan) -> Order:
    """Every forward in plan order, then every backward in reverse."""
    fwd = list(plan.units())
    # Reversing the forward order runs each sequence's token slices last-to-first, which
    # is what the K/V-context gradients need.
    return [(Kind.F, u) for u in fwd] + [(Kind.B, u) for u in reversed(fwd)]


def _fill_drain(name: str, n_stages: int, plan: Plan) -> Schedule:
    _check_stages(n_stages)
    return _complete(name, n_stages, plan, [_fill_drain_order(plan)] * n_stages)


def gpipe(n_stages: int, plan: Plan) -> Schedule:
    """GPipe fill-drain over microbatches: the paper's "w/o TeraPipe" baseline."""
    check_whole_sequences("gpipe", plan, "terapipe")
    return _fill_drain("gpipe", n_stages, plan)


def terapipe(n_stages: int, plan: Plan) -> Schedule:
    """TeraPipe fill-drain over batch x token slices: forwards in plan order, then
    backwards in reverse, each sequence's token slices last-to-first."""
    return _fill_drain("terapipe", n_stages, plan)


def terapipe_zb(n_stages: int, plan: Plan) -> Schedule:
    """TeraPipe with split backwards: fill-drain forwards and input-gradient backwards
    (``B``) as in ``terapipe``, then each sequence's weight gradients as one ``W`` over
    all its token slices, in the order the sequences' backwards finished.

    ``B`` is all the previous stage waits for, so the gradients reach stage 0 a ``W``
    sooner per unit, and stage k > 0 computes its weight gradients while the stages
    before it still run their backwards: in the drain, where a stage of ``terapipe``
    idles. Clock cycles on K=3 stages for the plan ``[(1, [2, 2])] * 2`` (two sequences
    of two token slices), one step per action, free communication::

        step    |    0        1        2        3        4        5        6        7        8        9       10       11       12       13
        --------+------------------------------------------------------------------------------------------------------------------------------
        stage 0 | F b0 t0  F b0 t1  F b1 t0  F b1 t1                                      B b1 t1  B b1 t0  B b0 t1  B b0 t0  W b1     W b0
        stage 1 |          F b0 t0  F b0 t1  F b1 t0  F b1 t1                    B b1 t1  B b1 t0  B b0 t1  B b0 t0  W b1     W b0
        stage 2 |                   F b0 t0  F b0 t1  F b1 t0  F b1 t1  B b1 t1  B b1 t0  B b0 t1  B b0 t0  W b1     W b0
    """
    _check_stages(n_stages)
    order = _fill_drain_order(plan)
    order += [(Kind.W, Unit(b, WHOLE_SEQUENCE)) for b in reversed(range(plan.n_batch_slices))]
    return _complete("terapipe-zb", n_stages, plan, [order] * n_stages)


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
    orders = [one_f_one_b_order(k, n_stages, plan) for k in range(n_stages)]
    return _complete("1f1b", n_stages, plan, orders)


def one_f_one_b_zb(n_stages: int, plan: Plan) -> Schedule:
    """Sequence-level 1F1B with split backwards: the forwards and input-gradient
    backwards (``B``) of ``1f1b``, in its order; each sequence's weight gradients as one
    ``W`` over its token slices, placed where the stage would otherwise wait.

    The placement runs 1F1B's order on a clock where a forward or backward takes one
    step and a ``W`` one step per token slice of its sequence. A stage whose next
    forward or backward is not ready (its input has not arrived) runs its oldest pending
    ``W`` instead; stage k also runs one before a forward once more than K-k are pending,
    which bounds what it keeps for them until its last forward (in the drain they wait for
    the stage's gaps, or its end). Clock cycles on K=3
    stages for the plan ``[(1, [2])] * 4`` (four sequences of one token slice), one step
    per action, free communication: 15 steps, where ``1f1b`` with its two-step backwards
    takes 18::

        step    |    0        1        2        3        4        5        6        7        8        9       10       11       12       13       14
        --------+---------------------------------------------------------------------------------------------------------------------------------------
        stage 0 | F b0 t0  F b1 t0  F b2 t0                    B b0 t0  F b3 t0  B b1 t0  W b0     W b1     B b2 t0  W b2              B b3 t0  W b3
        stage 1 |          F b0 t0  F b1 t0           B b0 t0  F b2 t0  B b1 t0  F b3 t0  W b0     B b2 t0  W b1     W b2     B b3 t0  W b3
        stage 2 |                   F b0 t0  B b0 t0  F b1 t0  B b1 t0  W b0     F b2 t0  B b2 t0  W b1     F b3 t0  B b3 t0  W b2     W b3
    """
    _check_stages(n_stages)
    queues = [deque(one_f_one_b_order(k, n_stages, plan)) for k in range(n_stages)]
    orders: list[Order] = [[] for _ in range(n_stages)]
    pending: list[deque[int]] = [deque() for _ in range(n_stages)]  # sequences awaiting W
    finished: dict[tuple[Kind, int, Unit], float] = {}  # (kind, stage, unit) -> end step
    clock = [0.0] * n_stages
    Move = tuple[float, int, tuple[Kind, Unit], float]  # (start, stage, action, end)

    def propose(k: int) -> Move | None:
        if queues[k]:
            kind, u = queues[k][0]
            src = k - 1 if kind is Kind.F else k + 1
            ready = finished.get((kind, src, u)) if 0 <= src < n_stages else 0.0
            force = kind is Kind.F and len(pending[k]) > n_stages - k
            if ready is not None and (ready <= clock[k] or not pending[k]) and not force:
                start = max(clock[k], ready)
                return (start, k, (kind, u), start + 1)
        if pending[k]:
            b = pending[k][0]
            w = (Kind.W, Unit(b, WHOLE_SEQUENCE))
            return (clock[k], k, w, clock[k] + plan.n_token_slices(b))
        return None

    # A stage's next move changes only with its own moves and its neighbours' results:
    # kept until then, so a step asks a few stages, not K.
    moves = [propose(k) for k in range(n_stages)]
    left = sum(map(len, queues)) + n_stages * plan.n_batch_slices  # W: one per sequence
    while left:
        _, k, (kind, u), end = min(m for m in moves if m is not None)
        orders[k].append((kind, u))
        clock[k] = end
        left -= 1
        affected = [k]
        if kind is Kind.W:
            pending[k].popleft()
        else:
            queues[k].popleft()
            finished[kind, k, u] = end
            if kind is Kind.B and u.t == 0:
                pending[k].append(u.b)
            neighbour = k + 1 if kind is Kind.F else k - 1
            if 0 <= neighbour < n_stages:
                affected.append(neighbour)
        for j in affected:
            moves[j] = propose(j)
    return _complete("1f1b-zb", n_stages, plan, orders)
