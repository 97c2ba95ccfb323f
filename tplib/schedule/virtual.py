"""Generators with virtual pipeline stages: each rank runs ``v`` chunks of the model.

A generator here places the forwards, backwards and weight gradients of every chunk of
every stage (rank), for a placement of the model's ``v * K`` parts on the K stages
(:mod:`tplib.schedule.chunks`); the passes of :mod:`tplib.schedule.passes` then add the
messages (none between two chunks of one stage) and the update. The unit is a (batch
slice, token slice) as everywhere in tplib, so each order runs TeraPipe's token slices
as well as whole sequences: the registry names the token-sliced forms
(``terapipe-interleaved``, ``terapipe-bfs``, ``terapipe-zbv``) apart from the
microbatch forms (``interleaved-1f1b``, ``looped-bfs``, ``zbv``), which refuse token
slices as ``gpipe`` does.

A sequence's token slices keep their order on every chunk: forwards first to last,
backwards last to first (the K/V context), so a generator's backward order walks the
batch slices in turn, each one's token slices in reverse.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tplib.plan import Plan, Unit
from tplib.schedule.actions import WHOLE_SEQUENCE, Action, Kind, Schedule
from tplib.schedule.chunks import Placement, interleaved, v_shape
from tplib.schedule.drawing import unit_cost
from tplib.schedule.engine import run
from tplib.schedule.passes import add_communication, add_update, check_whole_sequences

__all__ = [
    "CHUNKED",
    "ChunkOrder",
    "interleaved_1f1b",
    "looped_bfs",
    "zbv",
]

ChunkOrder = list[tuple[Kind, int, Unit]]  # one stage's (kind, chunk, unit) in run order


def _check(n_stages: int, n_chunks: int) -> None:
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages}: a pipeline needs at least one stage")
    if n_chunks < 1:
        raise ValueError(f"n_chunks={n_chunks}: each stage holds at least one chunk")


def _complete(
    name: str, n_stages: int, plan: Plan, placement: Placement, orders: list[ChunkOrder]
) -> Schedule:
    acts = tuple(
        tuple(Action(kind, k, u.b, u.t, chunk=c) for kind, c, u in order)
        for k, order in enumerate(orders)
    )
    return add_update(add_communication(Schedule(name, n_stages, plan, acts, 1, placement)))


def _backward_units(plan: Plan) -> list[Unit]:
    """Batch slice by batch slice, each one's token slices last to first."""
    return [
        Unit(b, t)
        for b in range(plan.n_batch_slices)
        for t in reversed(range(plan.n_token_slices(b)))
    ]


def _rounds(units: list[Unit], n_stages: int, chunks: list[int]) -> list[tuple[int, Unit]]:
    """Megatron's virtual order: the units in groups of K, each group through every chunk
    in ``chunks``' order before the next group starts."""
    out = []
    for g in range(0, len(units), n_stages):
        out += [(c, u) for c in chunks for u in units[g : g + n_stages]]
    return out


def interleaved_1f1b(
    n_stages: int, plan: Plan, n_chunks: int, name: str = "interleaved-1f1b"
) -> Schedule:
    """Megatron's interleaved 1F1B over the units of ``plan`` with ``n_chunks`` (v) chunks
    per stage, placed as :func:`~tplib.schedule.chunks.interleaved` (chunk c of stage k is
    part c*K + k).

    The forward order takes the units in groups of K, each group through chunk 0, then
    chunk 1, ..., then the next group; the backward order the same groups (in backward
    unit order) through the chunks in reverse. Stage k warms up with the forwards that
    come before the first backward's own in the forward order, then (K-k-1)*2 more
    (K-k-1 when v = 1, which is ``1f1b``): with microbatches Megatron's (v-1)*K +
    (K-k-1)*2; with token slices the first backward is the first sequence's last slice
    on the last chunk, further on. Then it alternates one forward and one backward, then
    drains the backwards; a backward whose forward has not run on the stage yet is
    preceded by the missing forwards. Megatron's rule: at least K units (microbatches)
    per iteration. A last group of fewer than K units can leave that order stuck; each
    stuck stage then warms up one forward more, until none is.
    Clock cycles on K=2 stages, v=2, for the plan ``[(1, [8])] * 4``, one step per
    action, free communication::

        step    |     0           1           2           3           4           5           6           7           8           9           10          11          12          13          14          15          16          17
        --------+------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------
        stage 0 | F b0 t0     F b1 t0     F b0 t0 c1  F b1 t0 c1  F b2 t0     B b0 t0 c1  F b3 t0     B b1 t0 c1  F b2 t0 c1  B b0 t0     F b3 t0 c1  B b1 t0                 B b2 t0 c1              B b3 t0 c1  B b2 t0     B b3 t0
        stage 1 |             F b0 t0     F b1 t0     F b0 t0 c1  B b0 t0 c1  F b1 t0 c1  B b1 t0 c1  F b2 t0     B b0 t0     F b3 t0     B b1 t0     F b2 t0 c1  B b2 t0 c1  F b3 t0 c1  B b3 t0 c1  B b2 t0     B b3 t0
    """
    _check(n_stages, n_chunks)
    n_units = plan.n_units
    if n_units < n_stages:
        raise ValueError(
            f"{name} on K={n_stages} stages needs at least {n_stages} units per iteration "
            f"(Megatron's rule: the microbatches of a group go through every chunk in turn, "
            f"and a group is K of them), but plan {plan} has {n_units}"
        )
    placement = interleaved(n_stages, n_chunks)
    # Megatron's warm-up counts the forwards before the first backward's own, (v-1)K
    # with microbatches, then 2 per stage still ahead (1 with one chunk, as 1f1b). With
    # token slices the first backward is the first sequence's last slice on the last
    # chunk, further into the forward order.
    fwd = _rounds(list(plan.units()), n_stages, list(range(n_chunks)))
    first = _backward_units(plan)[0]
    ahead = fwd.index((n_chunks - 1, first))
    per_stage = 2 if n_chunks > 1 else 1
    warmups = [ahead + per_stage * (n_stages - k - 1) for k in range(n_stages)]
    while True:
        orders = [
            _interleaved_order(k, n_stages, n_chunks, plan, warmups[k]) for k in range(n_stages)
        ]
        schedule = _complete(name, n_stages, plan, placement, orders)
        # A last group of fewer than K units can leave the order stuck: one more
        # warm-up forward on each stuck stage until none is.
        _, done = run(schedule, unit_cost)
        stuck = [k for k in range(n_stages) if done[k] < len(schedule.actions[k])]
        if not stuck or all(warmups[k] >= plan.n_units * n_chunks for k in stuck):
            return schedule
        for k in stuck:
            warmups[k] += 1


def _interleaved_order(k: int, n_stages: int, n_chunks: int, plan: Plan, warmup: int) -> ChunkOrder:
    """Stage k's order under :func:`interleaved_1f1b`, warming up with ``warmup`` forwards."""
    fwd = _rounds(list(plan.units()), n_stages, list(range(n_chunks)))
    bwd = _rounds(_backward_units(plan), n_stages, list(reversed(range(n_chunks))))
    index = {cu: i for i, cu in enumerate(fwd)}
    n_fwd = min(warmup, len(fwd))
    order: ChunkOrder = [(Kind.F, c, u) for c, u in fwd[:n_fwd]]
    for c, u in bwd:
        # One forward per backward; more if the backward's own forward is still ahead.
        target = max(min(n_fwd + 1, len(fwd)), index[c, u] + 1)
        order += [(Kind.F, fc, fu) for fc, fu in fwd[n_fwd:target]]
        n_fwd = target
        order.append((Kind.B, c, u))
    return order


def looped_bfs(n_stages: int, plan: Plan, n_chunks: int, name: str = "looped-bfs") -> Schedule:
    """Breadth-first over the chunks (torch's ``LoopedBFS``), placed as
    :func:`~tplib.schedule.chunks.interleaved`: every stage runs all units' forwards on
    chunk 0, then on chunk 1, ..., then all backwards on chunk v-1, then v-2, ..., each
    chunk's backwards in the reverse of its forward order (each sequence's token slices
    last to first). Fill-drain per chunk: as much memory as GPipe, a bubble cut by v.
    Clock cycles on K=2 stages, v=2, for the plan ``[(1, [8])] * 2``, one step per
    action, free communication::

        step    |     0           1           2           3           4           5           6           7           8           9
        --------+------------------------------------------------------------------------------------------------------------------------
        stage 0 | F b0 t0     F b1 t0     F b0 t0 c1  F b1 t0 c1                          B b1 t0 c1  B b0 t0 c1  B b1 t0     B b0 t0
        stage 1 |             F b0 t0     F b1 t0     F b0 t0 c1  F b1 t0 c1  B b1 t0 c1  B b0 t0 c1  B b1 t0     B b0 t0
    """
    _check(n_stages, n_chunks)
    fwd = list(plan.units())
    order: ChunkOrder = [(Kind.F, c, u) for c in range(n_chunks) for u in fwd]
    order += [(Kind.B, c, u) for c in reversed(range(n_chunks)) for u in reversed(fwd)]
    return _complete(name, n_stages, plan, interleaved(n_stages, n_chunks), [order] * n_stages)


def zbv(n_stages: int, plan: Plan, n_chunks: int = 2, name: str = "zbv") -> Schedule:
    """V-shape zero bubble (ZB-V): two chunks per stage in a V
    (:func:`~tplib.schedule.chunks.v_shape`: parts k and 2K-1-k on stage k), backwards
    split into ``B`` (input gradients) and ``W`` (each sequence's weight gradients at
    once, per chunk).

    The order is found by list scheduling on a clock where ``F`` and ``B`` take one step
    and a ``W`` one step per token slice of its sequence: each stage, whenever it is
    free, runs a ready ``B`` (chunk 0 first: its gradient feeds the previous stage), else
    a ready ``F`` (chunk 1 first: it brings a unit nearer its backward) while it holds
    fewer than 2(K + M - 1) units' activations (M: the most token slices of a sequence;
    1F1B's peak, in half-size chunks), else its oldest pending ``W``; stages move in the
    order of their start times. Clock cycles on K=2 stages for the plan
    ``[(1, [8])] * 3``, one step per action (``W`` too), free communication: 19 steps,
    of which each stage works 18::

        step    |     0           1           2           3           4           5           6           7           8           9           10          11          12          13          14          15          16          17          18
        --------+------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------
        stage 0 | F b0 t0     F b1 t0     F b2 t0     F b0 t0 c1  B b0 t0 c1  W b0 c1     F b1 t0 c1  B b0 t0     B b1 t0 c1  W b0        W b1 c1     B b1 t0     W b1        F b2 t0 c1  B b2 t0 c1  W b2 c1                 B b2 t0     W b2
        stage 1 |             F b0 t0     F b0 t0 c1  F b1 t0     F b1 t0 c1  B b0 t0 c1  B b0 t0     W b0 c1     F b2 t0     B b1 t0 c1  B b1 t0     W b0        F b2 t0 c1  W b1 c1     W b1        B b2 t0 c1  B b2 t0     W b2 c1     W b2
    """
    if n_chunks != 2:
        raise ValueError(f"{name} holds two chunks per stage in a V, not n_chunks={n_chunks}")
    _check(n_stages, n_chunks)
    placement = v_shape(n_stages)
    orders = _list_schedule(n_stages, plan, placement)
    return _complete(name, n_stages, plan, placement, orders)


def _list_schedule(n_stages: int, plan: Plan, placement: Placement) -> list[ChunkOrder]:
    """ZB-V's order (see :func:`zbv`), from a list-scheduling run on unit costs.

    Each stage's next move is kept until something it waits on changes: its own last
    move, the forward of the part before one of its chunks, or the backward of the part
    after one. So a step costs a few stages' proposals, not K (K = 48 took seconds)."""
    n_parts = len(placement)
    part_of: dict[tuple[int, int], int] = {}  # (stage, chunk) -> part
    seen = [0] * n_stages
    for p, k in enumerate(placement):
        part_of[k, seen[k]] = p
        seen[k] += 1
    fwd_queue = [[deque(plan.units()) for _ in range(2)] for _ in range(n_stages)]
    bwd_queue = [[deque(_backward_units(plan)) for _ in range(2)] for _ in range(n_stages)]
    pending: list[deque[tuple[int, int]]] = [deque() for _ in range(n_stages)]  # (chunk, b)
    held = [0] * n_stages  # units forwarded whose W has not run
    cap = 2 * (n_stages + max(len(ts) for ts in plan.token_slices) - 1)
    done: dict[tuple[Kind, int, Unit], float] = {}  # (kind, part, unit) -> end step
    clock = [0.0] * n_stages
    orders: list[ChunkOrder] = [[] for _ in range(n_stages)]
    left = 2 * 3 * plan.n_units * n_stages  # F, B and W (a W per unit's slice) per chunk

    def ready(kind: Kind, p: int, u: Unit) -> float | None:
        if kind is Kind.F:
            return done.get((Kind.F, p - 1, u)) if p > 0 else 0.0
        mine = done.get((Kind.F, p, u))
        if mine is None or p == n_parts - 1:
            return mine
        after = done.get((Kind.B, p + 1, u))
        return None if after is None else max(mine, after)

    Move = tuple[float, int, tuple[Kind, int, Unit], float]

    def propose(k: int) -> Move | None:
        now = clock[k]
        cands: list[tuple[int, float, tuple[Kind, int, Unit]]] = []  # (priority, ready, move)
        for c in (0, 1):
            if bwd_queue[k][c]:
                u = bwd_queue[k][c][0]
                r = ready(Kind.B, part_of[k, c], u)
                if r is not None:
                    cands.append((c, r, (Kind.B, c, u)))
        if held[k] < cap:
            for c in (1, 0):
                if fwd_queue[k][c]:
                    u = fwd_queue[k][c][0]
                    r = ready(Kind.F, part_of[k, c], u)
                    if r is not None:
                        cands.append((2 + (1 - c), r, (Kind.F, c, u)))
        now_ready = [x for x in cands if x[1] <= now]
        if now_ready:
            return (now, k, min(now_ready, key=lambda x: x[0])[2], now + 1)
        if pending[k]:
            c, b = pending[k][0]
            w = (Kind.W, c, Unit(b, WHOLE_SEQUENCE))
            return (now, k, w, now + plan.n_token_slices(b))
        if cands:
            _, r, move = min(cands, key=lambda x: (x[1], x[0]))
            return (r, k, move, r + 1)
        return None

    moves = {k: propose(k) for k in range(n_stages)}
    while left:
        live = [m for m in moves.values() if m is not None]
        if not live:
            # Every stage waits for a forward its cap holds back: let them hold one more.
            cap += 1
            moves = {k: propose(k) for k in range(n_stages)}
            continue
        _, k, (kind, c, u), end = min(live, key=lambda m: (m[0], m[1]))
        orders[k].append((kind, c, u))
        clock[k] = end
        affected = {k}
        if kind is Kind.W:
            pending[k].popleft()
            held[k] -= plan.n_token_slices(u.b)
            left -= plan.n_token_slices(u.b)
        else:
            (fwd_queue if kind is Kind.F else bwd_queue)[k][c].popleft()
            p = part_of[k, c]
            done[kind, p, u] = end
            left -= 1
            if kind is Kind.F:
                held[k] += 1
                if p + 1 < n_parts:
                    affected.add(placement[p + 1])
            else:
                if u.t == 0:
                    pending[k].append((c, u.b))
                if p > 0:
                    affected.add(placement[p - 1])
        for j in affected:
            moves[j] = propose(j)
    return orders


def _microbatches(generator: Callable[..., Schedule], name: str, token_sliced: str) -> Generator:
    def build(n_stages: int, plan: Plan, n_chunks: int) -> Schedule:
        check_whole_sequences(name, plan, token_sliced)
        return generator(n_stages, plan, n_chunks, name=name)

    build.__doc__ = f"{name}: :func:`{generator.__name__}` over whole sequences."
    return build


def _token_sliced(generator: Callable[..., Schedule], name: str) -> Generator:
    def build(n_stages: int, plan: Plan, n_chunks: int) -> Schedule:
        return generator(n_stages, plan, n_chunks, name=name)

    build.__doc__ = f"{name}: :func:`{generator.__name__}` over batch x token slices."
    return build


Generator = Callable[[int, Plan, int], Schedule]

# The registry's entries: (name, generator, the fewest and most chunks it takes, whether
# it runs token slices).
CHUNKED: tuple[tuple[str, Generator, int, int | None, bool], ...] = (
    (
        "interleaved-1f1b",
        _microbatches(interleaved_1f1b, "interleaved-1f1b", "terapipe-interleaved"),
        1,
        None,
        False,
    ),
    (
        "terapipe-interleaved",
        _token_sliced(interleaved_1f1b, "terapipe-interleaved"),
        1,
        None,
        True,
    ),
    ("looped-bfs", _microbatches(looped_bfs, "looped-bfs", "terapipe-bfs"), 1, None, False),
    ("terapipe-bfs", _token_sliced(looped_bfs, "terapipe-bfs"), 1, None, True),
    ("zbv", _microbatches(zbv, "zbv", "terapipe-zbv"), 2, 2, False),
    ("terapipe-zbv", _token_sliced(zbv, "terapipe-zbv"), 2, 2, True),
)
