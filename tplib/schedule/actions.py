"""The data a schedule is made of: typed actions, each stage's ordered list of them.

A :class:`Schedule` tells every pipeline stage k in ``0..K-1`` what to do in one
iteration, in order. Each step is an :class:`Action`: a :class:`Kind` applied on a stage,
to one unit (batch slice ``b``, token slice ``t``) of the plan or, for the update at the
end of the iteration, to the stage as a whole. It is plain data, printed compactly
(``F b0 t2``, ``AR``) and parsed back, saved to CSV and read back, so one representation
serves the runtime (which interprets it), the simulator (which replays it with costs),
the plots and the tests.

With virtual pipeline stages (:mod:`tplib.schedule.chunks`) each rank holds ``v``
chunks of the model's layers: an action also names its chunk ``c``, printed ``F b0 t2 c1``
(chunk 0 is left out), and the schedule's ``placement`` says which rank holds each part of
the model; stage k of the schedule is then rank k. Sends and receives go to the rank that
holds the neighbouring part; between two chunks of one rank the activation and the
gradient pass without a message.

A synchronous schedule is one iteration, ended by the update. An asynchronous one
(PipeDream, PipeDream-2BW) runs ``n_iterations`` iterations without a flush: its plan is
the iteration's plan repeated, batch slice ``b`` belonging to iteration
``b // batch_slices_per_iteration``; it interleaves the updates (``AR``, ``OPT``) with
the units, and every forward and backward names the weight version ``v`` it uses (the
stage's weights after ``v`` updates), printed ``F b0 t2 v1``.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import IO

from tplib.plan import Plan, Unit
from tplib.schedule.chunks import Placement, check_placement, identity, rank_chunk

__all__ = [
    "COMMUNICATION",
    "COMPUTE",
    "LOCAL_WORK",
    "NO_UNIT",
    "NO_VERSION",
    "RECEIVES",
    "SENDS",
    "UPDATE",
    "WHOLE_SEQUENCE",
    "WORK",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "covered_slices",
    "parse_kind",
]


class Kind(StrEnum):
    """What an action does. Roughly:"""

    F = "F"  # run the unit's forward on this stage
    B = "B"  # run the unit's backward on this stage
    SA = "SA"  # send the unit's output activation to stage k+1
    RA = "RA"  # receive the unit's input activation from stage k-1
    SG = "SG"  # send the gradient of the unit's input to stage k-1
    RG = "RG"  # receive the gradient of the unit's output from stage k+1
    W = "W"  # the weight gradients a split B deferred: of one unit, or of a whole sequence
    AR = "AR"  # all-reduce the stage's gradients: data-parallel replicas, tied embedding
    OPT = "OPT"  # optimizer step on the stage's parameters, then zero the gradients


COMPUTE = frozenset({Kind.F, Kind.B})  # a unit's forward or backward
SENDS = frozenset({Kind.SA, Kind.SG})
RECEIVES = frozenset({Kind.RA, Kind.RG})
COMMUNICATION = SENDS | RECEIVES
UPDATE = frozenset({Kind.AR, Kind.OPT})  # once per stage, at the end; they have no unit
# What occupies a stage's own processor: sends and receives wait on the link instead,
# and the all-reduce on the network. This is the work that local processes sharing a
# machine's cores compete for.
LOCAL_WORK = frozenset({Kind.F, Kind.B, Kind.W, Kind.OPT})
# A pipeline step's work on one unit or sequence: what the grid draws one step wide.
WORK = frozenset({Kind.F, Kind.B, Kind.W})

NO_UNIT = -1  # b and t of the update actions, which belong to no unit
NO_VERSION = -1  # v of every action of a synchronous schedule, and of non-compute actions
WHOLE_SEQUENCE = -1  # t of a W that covers every token slice of its batch slice


_ACTION_RE = re.compile(
    r"^\s*(?:(?P<kind>F|B|SA|RA|SG|RG)\s+b(?P<b>\d+)\s+t(?P<t>\d+)(?:\s+c(?P<c>\d+))?"
    r"(?:\s+v(?P<v>\d+))?"
    r"|W\s+b(?P<wb>\d+)(?:\s+t(?P<wt>\d+))?(?:\s+c(?P<wc>\d+))?"
    r"|(?P<update>AR|OPT))\s*$"
)


def parse_kind(value: str) -> Kind:
    """``Kind(value)``, with an error that lists the known kinds."""
    try:
        return Kind(value)
    except ValueError:
        known = [k.value for k in Kind]
        raise ValueError(f"unknown action kind {value!r}: known kinds are {known}") from None


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message shows the grid with the faulty action marked."""

    def __init__(self, message: str, actions: Sequence[Action] = ()) -> None:
        super().__init__(message)
        self.actions = tuple(actions)


@dataclass(frozen=True)
class Action:
    """One step of one stage: ``kind`` applied to unit (``b``, ``t``) on ``stage``; the
    update kinds (``AR``, ``OPT``) take no unit (``b = t = -1``). In an asynchronous
    schedule a forward or backward also names the weight version ``v`` it uses. A ``W``
    with ``t = WHOLE_SEQUENCE`` covers every token slice of batch slice ``b``. With
    virtual stages a unit's action also names the ``chunk`` of the stage (rank) it runs
    on; the updates act on all of a rank's chunks and keep chunk 0."""

    kind: Kind
    stage: int
    b: int = NO_UNIT
    t: int = NO_UNIT
    v: int = NO_VERSION
    chunk: int = 0

    def __post_init__(self) -> None:
        if type(self.kind) is not Kind:  # a string, from a file or a caller: checked
            object.__setattr__(self, "kind", parse_kind(self.kind))
        if self.stage < 0:
            raise ValueError(f"action {self} on stage {self.stage}: stages are numbered from 0")
        if self.kind in UPDATE:
            if (self.b, self.t) != (NO_UNIT, NO_UNIT):
                raise ValueError(
                    f"action {self.kind} b{self.b} t{self.t}: {self.kind} acts on the whole "
                    "stage and takes no unit (leave b and t at -1)"
                )
        elif self.b < 0 or (self.t < 0 and not self.whole_sequence):
            raise ValueError(
                f"action {self.kind} b{self.b} t{self.t} on stage {self.stage}: "
                "a unit's batch-slice and token-slice indices must be non-negative"
            )
        if self.chunk < 0 or (self.chunk and self.kind in UPDATE):
            raise ValueError(
                f"action {self.kind} b{self.b} t{self.t} c{self.chunk}: chunks are numbered "
                "from 0, and an update acts on all of its rank's chunks (leave chunk at 0)"
            )
        if self.v != NO_VERSION and (self.kind not in COMPUTE or self.v < 0):
            raise ValueError(
                f"action {self.kind} b{self.b} t{self.t} v{self.v}: only forwards and "
                "backwards use a weight version, numbered from 0"
            )

    @property
    def unit(self) -> Unit:
        return Unit(self.b, self.t)

    @property
    def whole_sequence(self) -> bool:
        """Whether this is a ``W`` over every token slice of its batch slice."""
        return self.kind is Kind.W and self.t == WHOLE_SEQUENCE

    def __str__(self) -> str:
        # The stage is the row the action sits in, so the compact form leaves it out.
        if self.kind in UPDATE:
            return str(self.kind)
        chunk = f" c{self.chunk}" if self.chunk else ""
        if self.whole_sequence:
            return f"W b{self.b}{chunk}"
        version = "" if self.v == NO_VERSION else f" v{self.v}"
        return f"{self.kind} b{self.b} t{self.t}{chunk}{version}"

    @classmethod
    def parse(cls, text: str, stage: int) -> Action:
        """Inverse of ``str``: ``Action.parse("F b0 t2", stage=1)``, ``Action.parse("B b1 t0
        c1", 0)``, ``Action.parse("AR", 0)``."""
        m = _ACTION_RE.match(text)
        if m is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected '<kind> b<batch slice> t<token slice>' "
                f"with kind one of F, B, W, SA, RA, SG, RG, then optionally c<chunk> and "
                "v<version> (e.g. 'F b0 t2', 'B b1 t0 c1'), 'W b<batch slice>' (every token "
                "slice), or AR or OPT"
            )
        if m["update"]:
            return cls(Kind(m["update"]), stage)
        if m["wb"] is not None:
            t = WHOLE_SEQUENCE if m["wt"] is None else int(m["wt"])
            return cls(Kind.W, stage, int(m["wb"]), t, chunk=int(m["wc"] or 0))
        v = NO_VERSION if m["v"] is None else int(m["v"])
        return cls(Kind(m["kind"]), stage, int(m["b"]), int(m["t"]), v, int(m["c"] or 0))


def covered_slices(plan: Plan, b: int, t: int) -> range:
    """The token slices of batch slice ``b`` whose weight gradients ``W b<b> t<t>``
    computes: slice ``t``, or every one for ``t = WHOLE_SEQUENCE``."""
    return range(plan.n_token_slices(b)) if t == WHOLE_SEQUENCE else range(t, t + 1)


@dataclass(frozen=True)
class Schedule:
    """A named schedule: ``actions[k]`` is stage k's ordered list of actions, over
    ``n_iterations`` iterations whose plans, one after another, make ``plan``.
    ``placement`` is the stage (rank) of each part of the model
    (:mod:`tplib.schedule.chunks`); left empty, one part per stage."""

    name: str
    n_stages: int
    plan: Plan
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    n_iterations: int = 1
    placement: Placement = ()
    # Derived from the placement, for the engine's every message: (stage, chunk) of each
    # part, and each (stage, chunk)'s part.
    _where: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _part: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(acts) for acts in self.actions))
        if self.n_stages < 1:
            raise ValueError(f"n_stages={self.n_stages}: a schedule needs at least one stage")
        placement = tuple(self.placement) or identity(self.n_stages)
        check_placement(placement, self.n_stages)
        object.__setattr__(self, "placement", placement)
        where = tuple(rank_chunk(placement, p) for p in range(len(placement)))
        object.__setattr__(self, "_where", where)
        object.__setattr__(self, "_part", {rc: p for p, rc in enumerate(where)})
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
                if a.chunk >= self.n_chunks:
                    raise ValueError(
                        f"action {a} on stage {k} names chunk {a.chunk}, but schedule "
                        f"{self.name!r} gives each stage {self.n_chunks} (chunks 0.."
                        f"{self.n_chunks - 1})"
                    )
        n_b = self.plan.n_batch_slices
        if self.n_iterations < 1 or n_b % self.n_iterations:
            raise ValueError(
                f"schedule {self.name!r}: n_iterations={self.n_iterations} must be a positive "
                f"divisor of the plan's {n_b} batch slices (each iteration has the same number)"
            )

    @property
    def n_chunks(self) -> int:
        """v: the chunks (virtual stages) each stage holds."""
        return len(self.placement) // self.n_stages

    @property
    def n_parts(self) -> int:
        """v * K: the parts the model is cut into."""
        return len(self.placement)

    def part(self, a: Action) -> int:
        """The model part action ``a`` runs on: chunk ``a.chunk`` of its stage."""
        return self._part[a.stage, a.chunk]

    def where(self, part: int) -> tuple[int, int]:
        """(stage, chunk) that holds model part ``part``."""
        if not 0 <= part < len(self.placement):
            raise ValueError(f"part {part}: schedule {self.name!r} has parts 0..{self.n_parts - 1}")
        return self._where[part]

    def neighbour(self, a: Action, step: int) -> tuple[int, int] | None:
        """(stage, chunk) of the part ``step`` (+1 or -1) from ``a``'s, None past the
        model's ends."""
        p = self._part[a.stage, a.chunk] + step
        return self._where[p] if 0 <= p < len(self.placement) else None

    @property
    def batch_slices_per_iteration(self) -> int:
        """m: the batch slices (microbatches) of one iteration."""
        return self.plan.n_batch_slices // self.n_iterations

    def iteration_of(self, b: int) -> int:
        """The iteration batch slice ``b`` belongs to."""
        return b // self.batch_slices_per_iteration

    @property
    def asynchronous(self) -> bool:
        """Whether its forwards and backwards name weight versions (no flush: the stages
        update while other units are in flight)."""
        return any(a.v != NO_VERSION for acts in self.actions for a in acts)

    @property
    def split_backward(self) -> bool:
        """Whether its backwards leave the weight gradients to ``W`` actions."""
        return any(a.kind is Kind.W for acts in self.actions for a in acts)

    def compute_actions(self, stage: int) -> tuple[Action, ...]:
        """Stage ``stage``'s forwards and backwards, in order, without communication."""
        return tuple(a for a in self.actions[stage] if a.kind in COMPUTE)

    def __str__(self) -> str:
        # Each stage's list as it is: the timed grid is tplib.schedule.drawing's.
        rows = (f"stage {k} | {', '.join(map(str, acts))}" for k, acts in enumerate(self.actions))
        chunks = "" if self.n_chunks == 1 else f" x {self.n_chunks} chunks {self.placement}"
        head = f"{self.name} on {self.n_stages} stages{chunks}, plan {self.plan}"
        return "\n".join((head, *rows))

    # ---- CSV -------------------------------------------------------------------------

    def to_csv(self, path_or_buffer: str | os.PathLike[str] | IO[str]) -> None:
        """Write one row per action (stage, index, kind, b, t, v, and with virtual stages
        chunk) after ``# key: value`` comment lines holding the name, stage count, plan and (with virtual
        stages) placement (``pandas.read_csv(..., comment="#")`` reads the rows)."""
        meta = {
            "name": self.name,
            "n_stages": str(self.n_stages),
            "n_iterations": str(self.n_iterations),
            "plan": self.plan.to_paper(),
        }
        if self.n_chunks > 1:
            meta["placement"] = " ".join(map(str, self.placement))
        for key in ("latency", "t_max", "eps"):
            value = getattr(self.plan, key)
            if value is not None:
                meta[f"plan_{key}"] = repr(float(value))
        with _open(path_or_buffer, "w") as f:
            for key, value in meta.items():
                f.write(f"# {key}: {value}\n")
            writer = csv.writer(f, lineterminator="\n")
            chunked = self.n_chunks > 1  # without chunks, the files of earlier versions
            writer.writerow(["stage", "index", "kind", "b", "t", "v"] + ["chunk"] * chunked)
            for k, acts in enumerate(self.actions):
                for i, a in enumerate(acts):
                    writer.writerow([k, i, a.kind.value, a.b, a.t, a.v] + [a.chunk] * chunked)

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
            (
                int(r["stage"]),
                int(r["index"]),
                r["kind"],
                int(r["b"]),
                int(r["t"]),
                int(r.get("v") or NO_VERSION),  # files written before versions lack it
                int(r.get("chunk") or 0),  # and before virtual stages, chunks
            )
            for r in csv.DictReader(body)
        )
        actions: list[list[Action]] = [[] for _ in range(n_stages)]
        for k, i, kind, b, t, v, c in rows:
            if not 0 <= k < n_stages or i != len(actions[k]):
                raise ValueError(
                    f"schedule CSV row stage={k} index={i} is out of place: "
                    "indices must run 0, 1, ... on each stage"
                )
            actions[k].append(Action(parse_kind(kind), k, b, t, v, c))
        n_iterations = int(meta.get("n_iterations", "1"))
        placement = tuple(int(x) for x in meta.get("placement", "").split())
        acts = tuple(tuple(a) for a in actions)
        return cls(meta["name"], n_stages, plan, acts, n_iterations, placement)


@contextmanager
def _open(path_or_buffer: str | os.PathLike[str] | IO[str], mode: str) -> Iterator[IO[str]]:
    if isinstance(path_or_buffer, (str, os.PathLike)):
        with open(path_or_buffer, mode, newline="", encoding="utf-8") as f:
            yield f
    else:
        yield path_or_buffer  # a caller's buffer: use it, leave it open
