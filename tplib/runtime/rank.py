"""What one rank of a run returns, :class:`RankResult` with its trace rows, and where it
is while it runs, :class:`Progress`.

A trace row is one action a rank ran: where (rank, stage, replica, op rank; the CP rank
is the rank's :attr:`RankResult.cp_rank`), which
iteration it belongs to (counted from the first timed one), what (kind, unit ``b``,
``t`` and the weight version ``v``, -1 where none), and when (seconds from the start of
the pass over the schedule).
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

from tplib.runtime.memory import StageMemory
from tplib.schedule import Kind

if TYPE_CHECKING:
    from tplib.runtime.runconfig import RunConfig

__all__ = ["TRACE_COLUMNS", "Progress", "RankResult", "TraceRow", "rank_label", "spans"]

TRACE_COLUMNS = (
    "rank",
    "stage",
    "replica",
    "op_rank",
    "iteration",
    "kind",
    "b",
    "t",
    "v",
    "chunk",
    "start",
    "end",
)
TraceRow = tuple[int, int, int, int, int, str, int, int, int, int, float, float]


@dataclass
class RankResult:
    """What one process returns: its trace, losses, timings, memory and (optionally)
    tensors (its shards, with #Op > 1)."""

    rank: int
    stage: int
    replica: int
    layers: tuple[int, int]
    op_rank: int = 0
    trace: list[TraceRow] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # per timed iteration, last stage only
    iteration_s: list[float] = field(default_factory=list)
    memory: StageMemory | None = None
    steps_skipped: int = 0  # fp16 steps skipped on overflow
    # Per timed iteration, the global gradient norm before clipping (the same on every
    # rank; NaN for a skipped fp16 step); empty when the run does not clip.
    grad_norms: list[float] = field(default_factory=list)
    grads: dict[str, Tensor] = field(default_factory=dict)
    params: dict[str, Tensor] = field(default_factory=dict)
    weight_versions: int = 1  # the most weight versions the stage held at once
    cp_rank: int = 0  # its place in the stage's #CP ring (context parallelism)


def spans(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``: a node's ranks are consecutive, and a job may
    name hundreds of them."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def rank_label(run: RunConfig, rank: int) -> str:
    """``rank`` of ``run`` with its place in the layout, as errors name it."""
    replica, stage, op_rank, cp_rank = run.parallelism.position(rank)
    op = f", op rank {op_rank}" if run.parallelism.n_op > 1 else ""
    cp = f", CP rank {cp_rank}" if run.parallelism.n_cp > 1 else ""
    return f"rank {rank} (stage {stage}, replica {replica}{cp}{op})"


class Progress:
    """Where each rank is: its iteration and the index of the action it runs in its
    stage's list, or (negative) a phase outside the list.

    Kept in memory shared with the process that started the ranks (:meth:`shared`), it
    is what that process reports when a rank dies without a word (SIGKILL, the
    out-of-memory killer) or stops answering. Each rank writes only its own two cells,
    and a store of one machine word needs no lock.
    """

    IDLE, SETUP, BARRIER, DRAIN, RESULTS = -1, -2, -3, -4, -5
    _PHASES: ClassVar[dict[int, str]] = {
        IDLE: "waiting for a run",
        SETUP: "building its stage and process groups",
        BARRIER: "at the barrier before iteration {i} of {n}",
        DRAIN: "completing its sends of iteration {i} of {n}, or at the barrier after it",
        RESULTS: "measuring its memory and returning its results",
    }

    def __init__(self, cells: MutableSequence[int]) -> None:
        self._cells = cells  # rank r: [2r] its iteration, [2r + 1] its position
        for r in range(len(cells) // 2):
            self.set(r, 0, self.IDLE)

    @classmethod
    def shared(cls, ctx: BaseContext, world_size: int) -> Progress:
        """Progress in shared memory, handed to processes ``ctx`` starts."""
        return cls(ctx.RawArray("q", 2 * world_size))

    @classmethod
    def local(cls, world_size: int) -> Progress:
        """Progress nobody else reads (a rank started by torchrun)."""
        return cls([0] * (2 * world_size))

    def set(self, rank: int, iteration: int, position: int) -> None:
        self._cells[2 * rank], self._cells[2 * rank + 1] = iteration, position

    def where(self, rank: int) -> tuple[int, int]:
        """(iteration, position) of ``rank``."""
        return self._cells[2 * rank], self._cells[2 * rank + 1]

    def describe(self, run: RunConfig, rank: int) -> str:
        """What ``rank`` of ``run`` is doing, in words."""
        iteration, position = self.where(rank)
        n = run.timing.iterations  # counted from 1 below, warm-up included
        if position < 0:
            return self._PHASES[position].format(i=iteration + 1, n=n)
        stage = run.parallelism.position(rank)[1]
        schedule = run.schedule
        actions = schedule.actions[stage]
        action = actions[position]
        unit = f"b{action.b} t{action.t} ({action})"
        if action.kind in (Kind.RA, Kind.RG):
            forward = action.kind is Kind.RA
            peer = schedule.neighbour(action, -1 if forward else 1)
            what = "activation" if forward else "gradient"
            doing = f"waiting for the {what} of {unit} from stage {peer[0] if peer else '?'}"
        else:
            doing = f"running {action}"
        where = f"action {position + 1} of {len(actions)} on stage {stage}"
        if schedule.asynchronous:  # one pass runs every iteration: the unit's says which
            iteration = schedule.iteration_of(action.b) if action.b >= 0 else -1
        if iteration >= 0:
            where += f", iteration {iteration + 1} of {n}"
        return f"{doing}, {where}"
