"""Schedules in torch.distributed.pipelining's action CSV: written for torch, read from it.

torch's runtime (``_PipelineScheduleRuntime._load_csv``, 2.13) reads one row per rank,
each cell an action ``<stage><type><microbatch>``: ``0F0`` (forward), ``1B0`` (full
backward), ``1I0`` and ``1W0`` (its input- and weight-gradient halves), ``2SEND_F1``,
``3RECV_B0``; ``0UNSHARD``, ``0RESHARD``, ``0REDUCE_GRAD`` name no microbatch; DualPipeV's
overlapped forward and backward is one cell, ``(0F3;3B1)OVERLAP_F_B``. A torch *stage*
is a tplib *part* (:mod:`tplib.schedule.chunks`), a torch rank a tplib stage. Formats:
``compute_only`` (forwards and backwards; torch adds the rest) and ``compute_comms``
(the whole program torch runs: also sends and receives, ``REDUCE_GRAD`` after a stage's
last backward, torch's gradient scaling, and FSDP's ``UNSHARD``/``RESHARD``).

Export (:func:`to_torch`): a synchronous schedule of whole microbatches. ``B`` is torch's
``B``, or ``I`` where the schedule has ``W`` actions, whose ``W`` (of a unit or its whole
sequence: the same with one token slice) is torch's ``W``. ``compute_comms`` keeps tplib's
sends after their compute and brackets each rank with ``UNSHARD`` and ``RESHARD`` of its
stages. torch's messages carry no tag, so between two ranks activations and gradients share
one FIFO: each receive is posted in its sender's order on the pair of ranks, as late as
that order and its consumer allow (without virtual stages a pair carries one kind, and
that is just before the compute, tplib's own place). The update (``AR``, ``OPT``) has no
torch action: torch steps the optimizer outside ``step()``.

Import (:func:`read_torch`, :func:`from_torch`): a CSV in either format, or a torch
schedule's ``pipeline_order`` (actions taken by their ``str()``: torch need not be
imported). K is the rank count; the placement is where each stage index runs (torch's
interleaved loop, stage i on rank i % K, or the V of ZBV and DualPipeV), a part's chunk
its place among its rank's stages in model order; the plan is ``Plan.gpipe`` of the
microbatches. A combined action runs as its parts, in order. In an order with ``I`` or
``W``, a full ``B`` becomes ``B`` then at once its ``W`` (tplib's ``B`` is then the input
gradient), and each ``W`` covers its microbatch. torch's sends and receives are checked
(sent after the producer, received before the consumer, once each, in one order on both
ranks of a pair), then replaced by tplib's own (:func:`~tplib.schedule.add_communication`);
``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD`` are dropped, and the update added.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal

from tplib.plan import Plan
from tplib.schedule.actions import SENDS, WHOLE_SEQUENCE, WORK, Action, Kind, Schedule
from tplib.schedule.chunks import Placement, check_placement, rank_chunk
from tplib.schedule.passes import add_communication, add_update
from tplib.schedule.validate import validate as validate_schedule

__all__ = ["FORMATS", "TorchAction", "TorchFormat", "TorchOrder", "check_exportable"]
__all__ += ["from_torch", "parse_torch_action", "read_torch", "read_torch_csv", "to_torch"]
__all__ += ["write_torch_csv"]

TorchFormat = Literal["compute_only", "compute_comms"]
FORMATS: tuple[TorchFormat, ...] = ("compute_only", "compute_comms")
COMPUTE_KINDS = ("F", "I", "B", "W")
MESSAGE_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
BOOKKEEPING = ("UNSHARD", "RESHARD", "REDUCE_GRAD")  # the kinds that name no microbatch
OVERLAP = "OVERLAP_F_B"

_KINDS = "|".join(COMPUTE_KINDS + MESSAGE_KINDS + BOOKKEEPING)
_SINGLE = re.compile(rf"(\d+)({_KINDS})(\d*)")
_COMBINED = re.compile(r"\(([^()]*)\)(\w+)")


@dataclass(frozen=True)
class TorchAction:
    """One cell of torch's schedule: ``kind`` on torch stage ``stage`` for ``microbatch``;
    a combined action (``OVERLAP_F_B``) holds its compute ``parts`` in order instead."""

    stage: int
    kind: str
    microbatch: int = -1  # none: UNSHARD, RESHARD, REDUCE_GRAD, a combined action
    parts: tuple[TorchAction, ...] = ()

    def __str__(self) -> str:
        if self.parts:
            return f"({';'.join(map(str, self.parts))}){self.kind}"
        return f"{self.stage}{self.kind}{'' if self.microbatch < 0 else self.microbatch}"

    @property
    def leaves(self) -> tuple[TorchAction, ...]:
        """What runs, in order: a combined action's parts, or the action itself."""
        return self.parts or (self,)


def _single(text: str) -> TorchAction:
    m = _SINGLE.fullmatch(text)
    if m is None:
        raise ValueError(
            f"cannot parse torch action {text!r}: expected <stage><type><microbatch> with "
            f"type one of {', '.join(COMPUTE_KINDS + MESSAGE_KINDS)} (e.g. '0F0', '2SEND_F1'), "
            f"<stage><type> with type one of {', '.join(BOOKKEEPING)}, or "
            f"'(<action>;<action>){OVERLAP}'"
        )
    stage, kind, mb = int(m[1]), m[2], m[3]
    if (kind in BOOKKEEPING) != (mb == ""):
        rule = "takes no microbatch" if kind in BOOKKEEPING else "needs a microbatch index"
        raise ValueError(f"torch action {text!r}: {kind} {rule}")
    return TorchAction(stage, kind, int(mb) if mb else -1)


def parse_torch_action(text: str) -> TorchAction | None:
    """torch's ``_Action.from_str``, whole-cell: ``None`` for an empty cell (a bubble)."""
    text = text.strip()
    if not text:
        return None
    m = _COMBINED.fullmatch(text)
    if m is None:
        return _single(text)
    parts = tuple(_single(s.strip()) for s in m[1].split(";") if s.strip())
    if m[2] != OVERLAP or not parts or any(p.kind not in COMPUTE_KINDS for p in parts):
        raise ValueError(
            f"torch action {text!r}: a combined action is '(<compute>;<compute>){OVERLAP}', "
            f"its parts forwards and backwards ({', '.join(COMPUTE_KINDS)})"
        )
    return TorchAction(-1, OVERLAP, -1, parts)


TorchRows = list[list[TorchAction | None]]
Source = str | os.PathLike[str] | IO[str]
Orders = Source | Mapping[int, Sequence[object]] | Sequence[Sequence[object]]


def read_torch_csv(source: Source) -> TorchRows:
    """The rows of a torch schedule CSV (a path or an open text file), rank by rank."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, newline="", encoding="utf-8") as f:
            return read_torch_csv(f)
    return [[parse_torch_action(cell) for cell in row] for row in csv.reader(source)]


def write_torch_csv(rows: Sequence[Sequence[TorchAction | None]], dest: Source) -> None:
    """Write ``rows`` as torch's ``_dump_csv`` does (csv's default dialect, a bubble as an
    empty cell), to a path or an open text file."""
    if isinstance(dest, (str, os.PathLike)):
        with open(dest, "w", newline="", encoding="utf-8") as f:
            write_torch_csv(rows, f)
        return
    writer = csv.writer(dest)
    for row in rows:
        writer.writerow(["" if a is None else str(a) for a in row])


# ---- export ---------------------------------------------------------------------------


def check_exportable(schedule: Schedule) -> None:
    """Refuse, with the reason, a schedule torch's runtime cannot run as written."""
    if schedule.asynchronous or schedule.n_iterations != 1:
        raise ValueError(
            f"schedule {schedule.name!r} is asynchronous ({schedule.n_iterations} iterations "
            "without a flush, forwards and backwards on named weight versions): torch's "
            "runtime runs one flushed iteration per step() on a single version of the weights"
        )
    plan = schedule.plan
    for b in range(plan.n_batch_slices):
        if plan.n_token_slices(b) != 1:
            raise ValueError(
                f"schedule {schedule.name!r} cuts batch slice {b} into "
                f"{plan.n_token_slices(b)} token slices: torch's stages carry no key/value "
                "context from one microbatch to the next, so a token slice could not attend "
                "to the slices before it; export a plan of whole microbatches (one token "
                "slice per batch slice)"
            )


def _compute(schedule: Schedule, a: Action) -> TorchAction:
    kind = {Kind.F: "F", Kind.B: "I" if schedule.split_backward else "B", Kind.W: "W"}[a.kind]
    return TorchAction(schedule.part(a), kind, a.b)


def to_torch(schedule: Schedule, fmt: TorchFormat = "compute_only") -> TorchRows:
    """Each rank's actions in torch's form (see the module docstring)."""
    check_exportable(schedule)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: torch's CSV formats are {list(FORMATS)}")
    if fmt == "compute_only":
        return [
            [_compute(schedule, a) for a in acts if a.kind in WORK] for acts in schedule.actions
        ]
    n_micro = schedule.plan.n_batch_slices
    rows: list[list[TorchAction]] = []
    for k, acts in enumerate(schedule.actions):
        mine = [p for p, r in enumerate(schedule.placement) if r == k]
        row = [TorchAction(p, "UNSHARD") for p in mine]
        finished: Counter[int] = Counter()  # torch counts B and W towards REDUCE_GRAD
        reduce: list[TorchAction] = []  # after the sends that follow the last backward
        for a in acts:
            if a.kind in WORK:
                t = _compute(schedule, a)
                row += [*reduce, t]
                finished[t.stage] += t.kind in ("B", "W")
                last = t.kind in ("B", "W") and finished[t.stage] == n_micro
                reduce = [TorchAction(t.stage, "REDUCE_GRAD")] if last else []
            elif a.kind in SENDS:
                kind = "SEND_F" if a.kind is Kind.SA else "SEND_B"
                row.append(TorchAction(schedule.part(a), kind, a.b))
        rows.append(row + reduce + [TorchAction(p, "RESHARD") for p in mine])
    return _place_receives(schedule, rows)


def _place_receives(schedule: Schedule, rows: list[list[TorchAction]]) -> TorchRows:
    """Insert every receive: in its sender's order on the pair of ranks, each as late as
    that order and its consumer allow."""
    placement, consumer = schedule.placement, "I" if schedule.split_backward else "B"
    incoming: dict[tuple[int, int], list[TorchAction]] = defaultdict(list)  # (src, dst) ranks
    for s, row in enumerate(rows):
        for a in row:
            if a.kind.startswith("SEND"):
                p = a.stage + (1 if a.kind == "SEND_F" else -1)
                incoming[s, placement[p]].append(TorchAction(p, "RECV" + a.kind[4:], a.microbatch))
    out: TorchRows = []
    for r, row in enumerate(rows):
        at = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(row)}
        before = []  # (the index it goes before, its sender, its place in the sender's order)
        for (src, dst), recvs in incoming.items():
            deadline = len(row)
            for n in reversed(range(len(recvs))) if dst == r else ():
                need = "F" if recvs[n].kind == "RECV_F" else consumer
                deadline = min(deadline, at[recvs[n].stage, need, recvs[n].microbatch])
                before.append((deadline, src, n))
        placed: dict[int, list[TorchAction]] = defaultdict(list)
        for deadline, src, n in sorted(before):
            placed[deadline].append(incoming[src, r][n])
        out.append([x for i, a in enumerate(row) for x in (*placed[i], a)])
    return out


# ---- import ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchOrder:
    """A torch schedule read and checked: its ``rows`` (bubbles dropped), where each torch
    stage runs (``placement``), its microbatch count and which format it was in."""

    rows: tuple[tuple[TorchAction, ...], ...]
    placement: Placement
    n_microbatches: int
    fmt: TorchFormat

    @property
    def n_ranks(self) -> int:
        return len(self.rows)

    @property
    def n_chunks(self) -> int:
        """v: the stages each rank holds."""
        return len(self.placement) // self.n_ranks

    @property
    def split_backward(self) -> bool:
        """Whether it splits backwards (``I``, ``W``): a full ``B`` then becomes two actions."""
        return any(x.kind in ("I", "W") for row in self.rows for a in row for x in a.leaves)

    @property
    def n_combined(self) -> int:
        """How many combined actions (``OVERLAP_F_B``) it runs as their parts."""
        return sum(1 for row in self.rows for a in row if a.parts)

    def to_schedule(
        self, seq_len: int, *, microbatch: int = 1, name: str = "torch", validate: bool = True
    ) -> Schedule:
        """The tplib schedule of this order for microbatches of ``microbatch`` sequences of
        ``seq_len`` tokens, with tplib's messages and update; validated unless told not."""
        split = self.split_backward
        acts: list[list[Action]] = [[] for _ in self.rows]
        for k, row in enumerate(self.rows):
            for x in (x for a in row for x in a.leaves if x.kind in COMPUTE_KINDS):
                c = rank_chunk(self.placement, x.stage)[1]
                full = [Kind.B, Kind.W] if split else [Kind.B]
                kinds = {"F": [Kind.F], "I": [Kind.B], "B": full, "W": [Kind.W]}[x.kind]
                acts[k] += [
                    Action(kind, k, x.microbatch, WHOLE_SEQUENCE if kind is Kind.W else 0, chunk=c)
                    for kind in kinds
                ]
        plan = Plan.gpipe(self.n_microbatches * microbatch, seq_len, microbatch)
        bare = Schedule(name, self.n_ranks, plan, tuple(map(tuple, acts)), 1, self.placement)
        schedule = add_update(add_communication(bare))
        if validate:
            validate_schedule(schedule)
        return schedule


def read_torch(source: Orders) -> TorchOrder:
    """Read a torch schedule (a CSV path or file, a ``pipeline_order`` dict or a list of
    rows) and check it: each stage on one rank, every rank the same number of stages, each
    stage's forwards numbered 0..M-1, and (``compute_comms``) its messages."""
    if isinstance(source, Mapping):
        if sorted(source) != list(range(len(source))):
            raise ValueError(f"pipeline_order has ranks {sorted(source)}: expected 0..K-1")
        source = [source[r] for r in range(len(source))]
    cells = (
        read_torch_csv(source)
        if isinstance(source, (str, os.PathLike, io.IOBase))
        else [[None if a is None else parse_torch_action(str(a)) for a in row] for row in source]
    )
    rows = [[a for a in row if a is not None] for row in cells]
    compute = [(r, x) for r, row in enumerate(rows) for a in row for x in a.leaves]
    compute = [(r, x) for r, x in compute if x.kind in COMPUTE_KINDS]
    if not compute:
        raise ValueError("the torch schedule has no forward or backward: nothing to import")
    owner: dict[int, int] = {}
    forwards: dict[int, list[int]] = defaultdict(list)
    for r, x in compute:
        if owner.setdefault(x.stage, r) != r:
            raise ValueError(
                f"torch stage {x.stage} runs on rank {owner[x.stage]} and on rank {r}: a "
                "stage (a model part) lives on one rank"
            )
        if x.kind == "F":
            forwards[x.stage].append(x.microbatch)
    idle = sorted(set(range(max(owner) + 1)) - set(owner))
    if idle:
        raise ValueError(f"torch stages {idle} run nothing: stages are numbered 0..{max(owner)}")
    placement = tuple(owner[p] for p in range(len(owner)))
    check_placement(placement, len(rows))
    for p in range(len(placement)):
        if sorted(forwards[p]) != list(range(len(forwards[p]))):
            raise ValueError(
                f"torch stage {p} runs the forwards of microbatches {sorted(forwards[p])}: "
                "each of 0..M-1 once, numbered from 0"
            )
    n_micro = len(forwards[0])
    for r, x in compute:
        if len(forwards[x.stage]) != n_micro or x.microbatch >= n_micro:
            raise ValueError(f"rank {r} runs {x}: every stage runs microbatches 0..{n_micro - 1}")
    messages = any(a.kind in MESSAGE_KINDS for row in rows for a in row)
    if messages:
        _check_messages(rows, placement)
    order = tuple(tuple(row) for row in rows)
    return TorchOrder(order, placement, n_micro, "compute_comms" if messages else "compute_only")


def _check_messages(rows: list[list[TorchAction]], placement: Placement) -> None:
    """A compute_comms order's sends and receives: each after its producer or before its
    consumer, once, and in one order on both ranks of a pair (torch's messages carry no
    tag: a pair of ranks is one FIFO)."""
    n_parts = len(placement)

    def remote(p: int, q: int) -> bool:
        return 0 <= q < n_parts and placement[q] != placement[p]

    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    got: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    expected: set[tuple[str, int, int]] = set()  # (F or B, receiving stage, microbatch)
    for r, row in enumerate(rows):
        done: set[tuple[str, int, int]] = set()
        for i, a in enumerate(row):
            for x in a.leaves:
                if x.kind in COMPUTE_KINDS:
                    direction = "F" if x.kind == "F" else "B"
                    done.add((direction, x.stage, x.microbatch))
                    p, q = x.stage, x.stage + (1 if x.kind == "F" else -1)
                    if x.kind != "W" and remote(p, q):
                        expected.add((direction, q, x.microbatch))
            if a.kind not in MESSAGE_KINDS:
                continue
            direction, p, b = a.kind[-1], a.stage, a.microbatch
            step = 1 if direction == "F" else -1
            sending = a.kind.startswith("SEND")
            peer = p + step if sending else p - step
            where = f"rank {r}'s action #{i} {a}"
            if not 0 <= p < n_parts or placement[p] != r or not remote(p, peer):
                raise ValueError(
                    f"{where}: stage {p} is not on rank {r}, or has no neighbour stage "
                    f"{peer} on another rank to exchange with"
                )
            if sending != ((direction, p, b) in done):
                rule = "after the compute it sends" if sending else "before the compute it feeds"
                raise ValueError(f"{where}: a {a.kind} comes {rule}")
            key = (direction, peer if sending else p, b)
            (sent if sending else got)[
                (r, placement[peer]) if sending else (placement[peer], r)
            ].append(key)
    for what, msgs in (("sent", sent), ("received", got)):
        every = Counter(m for pair in msgs for m in msgs[pair])
        if set(every) != expected or max(every.values(), default=1) > 1:
            wrong = sorted(expected ^ set(every) | {m for m, n in every.items() if n > 1})
            raise ValueError(
                f"the messages {what} are not those the computes need, each once: "
                f"{wrong} (kind, receiving stage, microbatch) missing, extra or repeated"
            )
    for pair in sorted(sent):
        if sent[pair] != got[pair]:
            raise ValueError(
                f"rank {pair[0]} sends to rank {pair[1]} (kind, stage, microbatch) "
                f"{sent[pair]}, but rank {pair[1]} receives {got[pair]}: torch's messages "
                "carry no tag, so between two ranks they are received in the order sent"
            )


def from_torch(source: Orders, seq_len: int, **options: Any) -> Schedule:
    """``read_torch(source).to_schedule(seq_len, **options)``: torch's schedule as tplib's."""
    return read_torch(source).to_schedule(seq_len, **options)
