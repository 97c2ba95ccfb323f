"""What the synchronous and asynchronous generators share: the 1F1B order and the passes.

A generator places compute actions only. :func:`add_communication` inserts the sends and
receives around them; :func:`add_update` ends every stage of a synchronous schedule with
its gradient all-reduce (``AR``) and optimizer step (``OPT``), where an asynchronous
generator places the updates among the units itself. :func:`one_f_one_b_order` is the
order of sequence-level 1F1B, which ``1f1b``, ``1f1b-zb`` and ``2bw`` all run, and
:func:`check_whole_sequences` the rule every microbatch schedule holds its plan to.
"""

from __future__ import annotations

from dataclasses import replace

from tplib.plan import Plan, Unit
from tplib.schedule.actions import COMPUTE, UPDATE, Action, Kind, Schedule

__all__ = [
    "Order",
    "add_communication",
    "add_update",
    "check_whole_sequences",
    "one_f_one_b_order",
]

Order = list[tuple[Kind, Unit]]  # one stage's forwards and backwards, in the order it runs them


def one_f_one_b_order(k: int, n_stages: int, plan: Plan) -> Order:
    """Stage k's forwards and backwards under 1F1B (see
    :func:`tplib.schedule.generators.one_f_one_b`)."""
    fwd = list(plan.units())
    bwd = [
        Unit(b, t)
        for b in range(plan.n_batch_slices)
        for t in reversed(range(plan.n_token_slices(b)))
    ]
    index = {u: i for i, u in enumerate(fwd)}
    warmup = min(n_stages - k - 1 + plan.n_token_slices(0) - 1, len(fwd))
    order = [(Kind.F, u) for u in fwd[:warmup]]
    n_fwd = warmup
    for u in bwd:
        # One forward per backward in the steady state; more if u's own forward is
        # still ahead (a later batch slice with more token slices than the first).
        target = max(min(n_fwd + 1, len(fwd)), index[u] + 1)
        order += [(Kind.F, v) for v in fwd[n_fwd:target]]
        n_fwd = target
        order.append((Kind.B, u))
    return order


def check_whole_sequences(name: str, plan: Plan, token_sliced: str) -> None:
    """Refuse a plan with token slices for the microbatch schedule ``name``, naming its
    token-sliced form ``token_sliced``."""
    for b in range(plan.n_batch_slices):
        if plan.n_token_slices(b) != 1:
            raise ValueError(
                f"{name} needs one token slice per batch slice (microbatches), but batch slice "
                f"{b} of plan {plan} has {plan.n_token_slices(b)}: use {token_sliced!r} for "
                "token-sliced plans"
            )


def add_communication(schedule: Schedule) -> Schedule:
    """Insert sends and receives around a compute-only schedule's actions: RA before
    each F whose input comes from another stage, SA after each F whose output goes to
    one, RG before each B whose output gradient comes from another stage, SG after each
    B whose input gradient goes to one. Without virtual stages: RA and SG on stages
    k > 0, SA and RG on stages k < K-1; with them, the neighbouring part's stage
    decides, and two chunks of one stage talk without a message."""

    def remote(a: Action, step: int) -> bool:
        other = schedule.neighbour(a, step)
        return other is not None and other[0] != a.stage

    stages = []
    for k, acts in enumerate(schedule.actions):
        out: list[Action] = []
        for a in acts:
            if a.kind not in COMPUTE:
                if a.kind in UPDATE or a.kind is Kind.W:
                    # An asynchronous schedule's updates stay in place; W is local.
                    out.append(a)
                    continue
                raise ValueError(
                    f"add_communication got {a} on stage {k}: it expects a schedule of "
                    "forwards, backwards, weight gradients and updates"
                )
            forward = a.kind is Kind.F
            before, after = (Kind.RA, Kind.SA) if forward else (Kind.RG, Kind.SG)
            if remote(a, -1 if forward else 1):
                out.append(Action(before, k, a.b, a.t, chunk=a.chunk))
            out.append(a)
            if remote(a, 1 if forward else -1):
                out.append(Action(after, k, a.b, a.t, chunk=a.chunk))
        stages.append(tuple(out))
    return replace(schedule, actions=tuple(stages))


def add_update(schedule: Schedule) -> Schedule:
    """End every stage with its gradient all-reduce (``AR``) and optimizer step (``OPT``):
    a synchronous schedule updates the weights once, after the iteration's last backward."""
    stages = tuple(
        (*acts, Action(Kind.AR, k), Action(Kind.OPT, k)) for k, acts in enumerate(schedule.actions)
    )
    return replace(schedule, actions=stages)
