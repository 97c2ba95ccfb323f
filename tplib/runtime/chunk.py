"""A rank's chunks: the module and the executor of each model part the rank holds.

Without virtual stages a rank holds one part of the model, its stage; with them
(:mod:`tplib.schedule.chunks`) it holds v, each a :class:`Chunk` with its own layers and
its own :class:`~tplib.nn.slicing.SliceExecutor`, whose K/V contexts are that chunk's
layers'. The worker runs each action on the chunk it names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tplib.nn.context import StageContext
from tplib.nn.model import GPTStage, build_model
from tplib.nn.oppart import OpGroup
from tplib.nn.precision import param_dtype
from tplib.nn.ring import CPGroup
from tplib.nn.slicing import SliceExecutor
from tplib.runtime.runconfig import RunConfig
from tplib.schedule.chunks import part_of

__all__ = ["Chunk", "build_chunks", "held_contexts"]


@dataclass
class Chunk:
    """One chunk of the rank's layers (its only one without virtual stages): the model
    part it holds, its module and the executor that keeps its K/V contexts."""

    part: int
    module: GPTStage
    executor: SliceExecutor


def build_chunks(
    run: RunConfig,
    stage: int,
    device: torch.device,
    *,
    op: OpGroup | None,
    hold: Callable[[Tensor], object] | None,
    cp: CPGroup | None = None,
) -> list[Chunk]:
    """Build every chunk of ``stage``, in chunk order: the layers of the part each holds
    (``run.ranges``), on ``device``, this rank's #Op shard (``op``), running this CP
    rank's tokens (``cp``); ``hold`` is the memory meter's hook for what the executors
    keep (None: not counted). The loss is scaled by the whole batch's tokens on every
    rank: summed over replicas and CP ranks, it is the mean loss."""
    schedule = run.schedule
    dtype = param_dtype(run.precision)
    chunks = []
    for c in range(schedule.n_chunks):
        part = part_of(schedule.placement, stage, c)
        lo, hi = run.ranges[part]
        module = build_model(
            run.cfg, lo, hi, seed=run.seed, device=device, dtype=dtype, op=op, cp=cp
        )
        executor = SliceExecutor(
            module,
            schedule.plan,
            loss_scale=1.0 / (run.data.batch * run.data.seq_len),
            dtype=torch.bfloat16 if run.precision == "bf16" else dtype,
            recompute=run.recompute,
            hold=hold,
            keep_contexts=not schedule.asynchronous,
            split_backward=schedule.split_backward,
        )
        chunks.append(Chunk(part, module, executor))
    return chunks


def held_contexts(chunks: list[Chunk], asynchronous: bool) -> list[StageContext]:
    """The K/V contexts a rank's chunks hold: every sequence's (a synchronous schedule
    keeps them for the iteration), or the most an asynchronous one held at once."""
    out: list[StageContext] = []
    for chunk in chunks:
        ex = chunk.executor
        n_b = ex.plan.n_batch_slices
        out += ex.peak_contexts if asynchronous else [ex.context(b) for b in range(n_b)]
    return out
