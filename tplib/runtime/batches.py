"""What each iteration of a run trains on: its rows, their documents and its loss scale.

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
K/V contexts and only the token slicing changes. Each distinct plan's schedule is built
and validated once, when the config is made
(:attr:`RunConfig.batch_schedules <tplib.runtime.RunConfig.batch_schedules>`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tplib.documents import IGNORE, Documents
from tplib.nn.configs import GPTConfig
from tplib.nn.data import batch_rows, document_batch
from tplib.runtime.parts import Data
from tplib.runtime.runconfig import RunConfig

__all__ = [
    "Batch",
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


def real_tokens(cfg: GPTConfig, data: Data, iterations: range) -> list[int]:
    """The tokens of real text (documents, not padding) each of ``iterations`` trains on
    from ``data``: what the throughput of packed rows is counted in."""
    if not data.packed:
        return [data.batch * data.seq_len for _ in iterations]
    return [
        document_batch(
            cfg, data.source, data.batch, data.seq_len, data.seed + i, data.packing
        ).packing.real_tokens
        for i in iterations
    ]


def on_device(rows: Tensor, device: torch.device) -> Tensor:
    """A pass's rows on the device in one copy (a GPU's from pinned memory, not one
    pageable copy and sync per unit)."""
    if device.type != "cuda":
        return rows
    return rows.pin_memory().to(device, non_blocking=True)
