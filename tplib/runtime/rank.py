"""What one rank of a run returns: :class:`RankResult`, with its trace rows.

A trace row is one action a rank ran: where (rank, stage, replica, op rank), which
iteration it belongs to (counted from the first timed one), what (kind, unit ``b``,
``t`` and the weight version ``v``, -1 where none), and when (seconds from the start of
the pass over the schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from tplib.runtime.memory import StageMemory

__all__ = ["TRACE_COLUMNS", "RankResult", "TraceRow"]

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
    "start",
    "end",
)
TraceRow = tuple[int, int, int, int, int, str, int, int, int, float, float]


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
