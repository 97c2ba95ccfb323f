"""What each iteration of a run trains on: its rows, their documents, its loss scale, and
under per-batch plans the schedule it runs.

Unpacked data (:class:`~tplib.runtime.parts.Data` ``source`` "synthetic" or "stdlib") is
rows of L tokens, every target counted: the loss is scaled by ``1 / (B * L)``. Packed
data (a document source, :data:`tplib.packing.DOCUMENT_SOURCES`) is rows of whole
documents with their boundaries (:class:`~tplib.documents.Documents`): a document's last
token and padding predict nothing, so the loss is scaled by the targets the global
batch counts, and each replica's executors get its rows' boundaries (none, when
``document_masking`` is off: scheme (b) of the packed comparison, which attends across
documents). Every rank draws the same batch from the iteration's seed.

Per-batch plans (:attr:`RunConfig.batch_plans <tplib.runtime.RunConfig.batch_plans>`):
iteration i runs plan i, each with the run's batch split, so the executors keep their
K/V contexts and only the token slicing changes. Each plan's schedule is built and
validated once, when the config is made, and again in each process
(:func:`batch_schedules`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tplib.documents import IGNORE, Documents
from tplib.nn.data import batch_rows, document_batch
from tplib.plan import Plan
from tplib.runtime.runconfig import RunConfig
from tplib.schedule import Schedule, make_schedule

__all__ = [
    "Batch",
    "batch_schedules",
    "iteration_batch",
    "on_device",
    "real_tokens",
]


@dataclass(frozen=True)
class Batch:
    """One replica's rows of the iterations a pass runs, as the executors take them."""

    tokens: Tensor
    targets: Tensor
    documents: Documents | None  # the rows' boundaries; None: attention ignores them
    loss_scale: float  # 1 / the targets the global batch counts


def iteration_batch(run: RunConfig, index: int, n: int, replica: int) -> Batch:
    """Replica ``replica``'s rows of iterations ``[index, index + n)``."""
    data, rows = run.data, run.pipeline_batch
    mine = slice(replica * rows, (replica + 1) * rows)
    if not data.packed:
        iterations = range(index, index + n)
        tokens, targets = batch_rows(
            run.cfg, data.source, data.batch, data.seq_len, iterations, data.seed, mine
        )
        return Batch(tokens, targets, None, 1.0 / (data.batch * data.seq_len))
    packed = document_batch(
        run.cfg, data.source, data.batch, data.seq_len, data.seed + index, data.packing
    )
    counted = int((packed.targets != IGNORE).sum())
    documents = packed.documents.rows(mine.start, rows) if data.document_masking else None
    return Batch(packed.tokens[mine], packed.targets[mine], documents, 1.0 / max(1, counted))


def real_tokens(run: RunConfig, iterations: range) -> list[int]:
    """The tokens of real text (documents, not padding) each of ``iterations`` trains on:
    what the throughput of packed rows is counted in."""
    data = run.data
    if not data.packed:
        return [data.batch * data.seq_len for _ in iterations]
    return [
        document_batch(
            run.cfg, data.source, data.batch, data.seq_len, data.seed + i, data.packing
        ).packing.real_tokens
        for i in iterations
    ]


def _schedule(run: RunConfig, plan: Plan) -> Schedule:
    p = run.parallelism
    return make_schedule(
        run.schedule_name, p.n_stages, plan, n_iterations=run.timing.iterations,
        n_chunks=p.n_chunks,
    )  # fmt: skip


def batch_schedules(run: RunConfig) -> tuple[Schedule, ...]:
    """Each iteration's schedule under per-batch plans (one per distinct plan); ()
    without them."""
    built: dict[Plan, Schedule] = {}
    return tuple(built.setdefault(p, _schedule(run, p)) for p in run.batch_plans)


def on_device(rows: Tensor, device: torch.device) -> Tensor:
    """A pass's rows on the device in one copy (a GPU's from pinned memory, not one
    pageable copy and sync per unit)."""
    if device.type != "cuda":
        return rows
    return rows.pin_memory().to(device, non_blocking=True)
