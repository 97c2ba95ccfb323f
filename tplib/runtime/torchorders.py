"""torch.distributed.pipelining's own schedules, read from torch and priced by tplib.

:func:`torch_order` asks torch 2.13 itself for a schedule's order, in one process, with
no process group and no GPU: the schedule classes need only a few attributes of their
stages (rank, group size, stage count), so lightweight stand-ins take the stages' place.

- The multi-stage classes (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``)
  compute every rank's order when built: ``pipeline_order`` (compute only) and
  ``pipeline_order_with_comms``, lowered with sends and receives, which is what their
  runtime executes.
- The single-stage ones (``ScheduleGPipe``, ``Schedule1F1B``) run their own loop in
  ``_step_microbatches``, which is called here with a stand-in stage that records each
  forward and backward asked of it: what torch executes. Their ``pipeline_order`` is a
  description only, and 2.13's for 1F1B numbers the last rank's forwards 1..M instead of
  0..M-1 (:func:`tplib.schedule.torchio.read_torch` refuses it, naming the stage).

:func:`torch_schedule` imports an order as a tplib :class:`~tplib.schedule.Schedule`
(validated); :func:`torch_orders_table` prices each of torch's schedules under
:class:`UniformCosts` beside tplib's schedule of the same name, where tplib has one.
What the comparison finds (K = 2..4, forward 1, backward 2 of which 1 is ``W``):

- ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` and ``ScheduleLoopedBFS`` are tplib's
  ``1f1b``, ``interleaved-1f1b`` and ``looped-bfs``, action for action;
- ``ScheduleGPipe`` runs its backwards in microbatch order, 0 first, where tplib's
  ``gpipe`` runs them last first: the same latency, since every backward of a stage
  waits only for its own microbatch's gradient, and all forwards are done by then;
- ``ScheduleZBVZeroBubble`` builds its order for max(M, 2K-1) microbatches and blanks
  those past M. From 2K-1 microbatches on it takes the time of tplib's ``zbv`` (list
  scheduling, another order); with fewer it keeps the blanks and is never faster, slower
  for the fewest (K=2: M <= 2, K=3: M <= 3, K=4: M <= 5). At K=6 tplib's greedy order is
  the slower, by 1 (of 30-43) at M = 9, 10, 12, 13, though neither holds more than 2K
  microbatches' activations on a rank: the list scheduler's choices, not its cap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from tplib.plan import Plan
from tplib.schedule import (
    SENDS,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    make_schedule,
    registered,
)
from tplib.schedule.chunks import Placement
from tplib.schedule.nccl import check_nccl
from tplib.schedule.torchio import from_torch

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "TORCH_SCHEDULES",
    "TorchSchedule",
    "UniformCosts",
    "torch_order",
    "torch_orders_table",
    "torch_schedule",
]

Form = Literal["executed", "pipeline_order"]


@dataclass(frozen=True)
class TorchSchedule:
    """One of torch's schedule classes: whether it places several stages per rank, the
    chunk counts it takes, and tplib's schedule of the same design (None: none)."""

    cls: str
    multi: bool
    min_chunks: int
    max_chunks: int | None
    tplib: str | None


TORCH_SCHEDULES: dict[str, TorchSchedule] = {
    s.cls: s
    for s in (
        TorchSchedule("ScheduleGPipe", False, 1, 1, "gpipe"),
        TorchSchedule("Schedule1F1B", False, 1, 1, "1f1b"),
        TorchSchedule("ScheduleInterleaved1F1B", True, 1, None, "interleaved-1f1b"),
        TorchSchedule("ScheduleLoopedBFS", True, 1, None, "looped-bfs"),
        TorchSchedule("ScheduleInterleavedZeroBubble", True, 1, None, None),
        TorchSchedule("ScheduleZBVZeroBubble", True, 2, 2, "zbv"),
        TorchSchedule("ScheduleDualPipeV", True, 2, 2, None),
    )
}


@dataclass(frozen=True)
class UniformCosts:
    """Every action of a kind costs the same: a stage's forward ``t_f``, its backward
    ``t_b`` (of which ``t_w`` is the weight gradients, a ``W`` of a split schedule), a
    message ``t_send`` on the link; receives, the all-reduce and the optimizer step are
    free. With ``n_chunks`` v chunks per rank (:meth:`placed`) a chunk holds 1/v of the
    stage's layers and its work costs 1/v as much; a message costs the same."""

    t_f: float = 1.0
    t_b: float = 2.0
    t_w: float = 1.0
    t_send: float = 0.0
    n_chunks: int = 1

    @property
    def blocking_sends(self) -> bool:
        return False

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        return (self.t_f if action.kind is Kind.F else self.t_b) / self.n_chunks

    def weight_grad(self, stage: int, action: Action, plan: Plan) -> float:
        return self.t_w / self.n_chunks  # a whole microbatch: its only token slice

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return self.t_send if action.kind in SENDS else 0.0

    def allreduce(self, stage: int) -> float:
        return 0.0

    def optimizer(self, stage: int) -> float:
        return 0.0

    def placed(self, placement: Placement) -> UniformCosts:
        """These costs for a schedule of ``placement`` (idempotent)."""
        ranks = max(placement, default=-1) + 1
        return replace(self, n_chunks=max(1, len(placement) // max(ranks, 1)))


class _StandIn:
    """What torch's schedule classes read of a stage; a single-stage schedule's loop also
    calls the compute methods, recorded in torch's action form."""

    def __init__(self, index: int, n_stages: int, n_ranks: int) -> None:
        self.stage_index, self.num_stages = index, n_stages
        self.group_size, self.group_rank = n_ranks, index % n_ranks
        self.submod = None
        self.is_first, self.is_last = index == 0, False  # not last: no loss to compute
        self.calls: list[str] = []

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.calls.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb: int, **kwargs: Any) -> None:
        kind = "B" if kwargs.get("full_backward", True) else "I"
        self.calls.append(f"{self.stage_index}{kind}{mb}")

    def perform_reduce_grad(self, *args: Any) -> None:
        self.calls.append(f"{self.stage_index}REDUCE_GRAD")

    def no_messages(self, mb: int) -> list[Any]:
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = no_messages

    def clear_runtime_states(self) -> None:
        pass


def _entry(name: str) -> TorchSchedule:
    entry = TORCH_SCHEDULES.get(name)
    if entry is None:
        raise ValueError(f"unknown torch schedule {name!r}: known ones are {list(TORCH_SCHEDULES)}")
    return entry


def _chunks(entry: TorchSchedule, n_chunks: int | None) -> int:
    v = (2 if entry.multi else 1) if n_chunks is None else n_chunks
    top = entry.max_chunks
    if v < entry.min_chunks or (top is not None and v > top):
        allowed = f"exactly {top}" if top == entry.min_chunks else f"at least {entry.min_chunks}"
        raise ValueError(f"n_chunks={v} with {entry.cls}: it places {allowed} stage(s) per rank")
    return v


def torch_order(
    name: str,
    n_stages: int,
    n_microbatches: int,
    n_chunks: int | None = None,
    *,
    form: Form = "executed",
) -> list[list[str | None]]:
    """Each rank's actions of torch's schedule class ``name`` (e.g. "ScheduleGPipe") on
    ``n_stages`` ranks with ``n_chunks`` stages each (default: 2 for the multi-stage
    classes), in torch's text form (None: a bubble step). ``form``: what torch executes,
    or the class's ``pipeline_order``."""
    from torch.distributed.pipelining import schedules

    entry = _entry(name)
    v = _chunks(entry, n_chunks)
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(f"n_stages={n_stages}, n_microbatches={n_microbatches}: both at least 1")
    cls = getattr(schedules, entry.cls)
    n_parts = n_stages * v

    def build(stages: Any) -> Any:
        try:
            return cls(stages, n_microbatches)
        except (ValueError, RuntimeError, AssertionError) as exc:
            raise ValueError(
                f"torch's {entry.cls} refuses K={n_stages}, M={n_microbatches}, v={v}: {exc}"
            ) from None

    def text(order: Sequence[Any]) -> list[str | None]:
        return [None if a is None else str(a) for a in order]

    if entry.multi:
        made = build([_StandIn(r, n_parts, n_stages) for r in range(v)])
        orders = made.pipeline_order_with_comms if form == "executed" else made.pipeline_order
        return [text(orders[r]) for r in range(n_stages)]
    if form == "pipeline_order":
        made = build(_StandIn(0, n_parts, n_stages))
        return [text(made.pipeline_order[r]) for r in range(n_stages)]
    rows: list[list[str | None]] = []
    for rank in range(n_stages):
        stand_in = _StandIn(rank, n_parts, n_stages)
        made = build(stand_in)
        made._stage_forward_initialized = True  # no shapes to infer: nothing is computed
        made._step_microbatches()
        rows.append(list(stand_in.calls))
    return rows


def torch_schedule(
    name: str,
    n_stages: int,
    n_microbatches: int,
    n_chunks: int | None = None,
    *,
    seq_len: int = 1,
    form: Form = "executed",
) -> Schedule:
    """:func:`torch_order` as a validated tplib schedule of microbatches of one sequence of
    ``seq_len`` tokens, named after torch's class."""
    rows = torch_order(name, n_stages, n_microbatches, n_chunks, form=form)
    return from_torch(rows, seq_len, name=name)


def _priced(schedule: Schedule, costs: UniformCosts) -> tuple[float, float]:
    from tplib.sim.simulate import simulate

    result = simulate(schedule, costs.placed(schedule.placement))
    return result.latency, result.bubble_fraction


def torch_orders_table(
    n_stages: int = 4,
    n_microbatches: int = 8,
    n_chunks: int = 2,
    costs: UniformCosts = UniformCosts(),
    *,
    names: Sequence[str] = tuple(TORCH_SCHEDULES),
) -> pd.DataFrame:
    """Each of torch's schedules on ``n_stages`` ranks and ``n_microbatches``
    microbatches (the multi-stage ones with ``n_chunks`` stages per rank where they take
    it): whether its order validates and passes NCCL's rendezvous check, its simulated
    latency and bubble under ``costs``, and tplib's schedule of the same design on the
    same K, v and M beside it; ``same_order`` says whether the two are one schedule,
    ``note`` why a row has no numbers."""
    import pandas as pd

    rows = []
    for name in names:
        entry = _entry(name)
        v = n_chunks if entry.multi and entry.max_chunks is None else entry.min_chunks
        row: dict[str, Any] = {
            "torch_schedule": name,
            "K": n_stages,
            "v": v,
            "microbatches": n_microbatches,
            "validates": False,
            "nccl_ok": False,
            "latency": None,
            "bubble": None,
            "tplib_schedule": entry.tplib,
            "tplib_latency": None,
            "tplib_bubble": None,
            "same_order": False,
            "note": "",
        }
        try:
            ours = torch_schedule(name, n_stages, n_microbatches, v)
            row["validates"] = True
            row["nccl_ok"] = _passes(check_nccl, ours)
            row["latency"], row["bubble"] = _priced(ours, costs)
            if entry.tplib is not None:
                plan = Plan.gpipe(n_microbatches, 1)
                chunked = registered(entry.tplib).chunked
                theirs = make_schedule(entry.tplib, n_stages, plan, n_chunks=v if chunked else None)
                row["tplib_latency"], row["tplib_bubble"] = _priced(theirs, costs)
                row["same_order"] = theirs.actions == ours.actions
        except ValueError as exc:  # ScheduleError is one
            row["note"] = str(exc).splitlines()[0]
        rows.append(row)
    return pd.DataFrame(rows)


def _passes(check: Callable[[Schedule], None], schedule: Schedule) -> bool:
    try:
        check(schedule)
    except ScheduleError:
        return False
    return True
