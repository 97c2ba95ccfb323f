"""The layout search's floors: the least memory and latency a candidate can have.

:func:`~tplib.search.layout.autoplan` prunes with them before planning anything, so they
must never exceed what the planned and simulated candidate costs (tests check it on
every candidate of several searches).

Both come from the cost model alone:

* memory: the weights and optimizer state of a stage plus the least its activations can
  be (without recomputation the whole minibatch is kept, and token slicing at best
  halves the attention scores: L^2 / 2 per sequence; with it, each sequence's input;
  a 1F1B schedule keeps min(K, M) microbatches on its first stage, Seq1F1B at least a
  whole sequence; with #CP, 1 / #CP of it all); a candidate whose floor exceeds the
  capacity cannot fit, whatever its plan;
* latency: stage 0's compute at the GPU's peak matrix rate (every product at
  ``gemm_efficiency`` x peak with no quantization loss, attention over the causal half;
  FlashAttention at its ``flash_efficiency``, its backward 2.5 forwards; with #CP, 1 /
  #CP of it), plus the first unit's forward and the last one's backward through the
  other K - 1 stages (chunks of them, with virtual stages) at the host floor, or at the
  peak rate where the unit is known (a microbatch, a sequence's first token slice), with
  the link latency, plus the all-reduce and the optimizer step. The simulator charges at
  least this for any plan (its action times are never below these terms), so a
  candidate whose floor reaches the best latency found is dropped unplanned. Candidates
  are planned in order of their floors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tplib.cluster import Calibration, ClusterCostModel
from tplib.cluster.hardware import FP16
from tplib.cluster.implementation import PAPER, Implementation
from tplib.cluster.memory import (
    STATE_BYTES,
    activation_rates,
    end_params,
    logit_bytes,
    state_bytes,
)
from tplib.nn.configs import GPTConfig, n_params_per_layer
from tplib.schedule.chunks import identity
from tplib.search.pricing import TOKEN_SCHEDULES, Layout

__all__ = ["latency_floor", "layer_work", "memory_floor", "stage_seconds"]


def _held(layout: Layout, pipeline_batch: int) -> int:
    """The fewest sequences whose activations the first stage keeps at once: all under
    fill-drain, min(K, M) microbatches under 1F1B, a whole sequence's under Seq1F1B."""
    if layout.schedule in TOKEN_SCHEDULES:
        return pipeline_batch // layout.rounds
    if layout.schedule == "seq1f1b":
        return layout.microbatch
    return min(layout.n_stages, pipeline_batch // layout.microbatch) * layout.microbatch


def _activations(
    cfg: GPTConfig, layout: Layout, impl: Implementation, tokens: float, seq_len: int
) -> float:
    """The least bytes a stage's layers keep for ``tokens`` tokens of whole sequences."""
    layers = cfg.n_layer // layout.n_stages
    per_token, score_bytes = activation_rates(cfg, layout.n_op, impl, layout.recompute)
    if layout.recompute == "full":
        acts: float = tokens * cfg.hidden * FP16
        acts /= layout.n_op if impl.sequence_parallel else 1
        return acts * (layers if impl.layer_checkpoints else 1)
    return layers * (tokens * per_token + tokens * seq_len / 2 * score_bytes)


def memory_floor(
    cfg: GPTConfig,
    layout: Layout,
    seq_len: int,
    pipeline_batch: int,
    cal: Calibration,
    impl: Implementation = PAPER,
) -> float:
    """The least memory per GPU any plan of ``layout`` needs (see the module docstring):
    with the model's ends, the larger of the first stage's and the last's, the first
    with the embedding, the last with its copy and the logits of what it keeps."""
    layers, op, k = cfg.n_layer // layout.n_stages, layout.n_op, layout.n_stages
    params = layers * n_params_per_layer(cfg) / op
    shards = layout.n_data * layout.n_cp
    if impl.distributed_optimizer:
        states = state_bytes(params, impl, shards)
    else:
        states = STATE_BYTES * layers * n_params_per_layer(cfg) / op
    tokens = _held(layout, pipeline_batch) * seq_len / layout.n_cp
    floor = states + _activations(cfg, layout, impl, tokens, seq_len) + cal.memory_reserve
    if not impl.ends:
        return floor
    placement = identity(k)

    def ends(stage: int) -> float:  # the end parameters' states on ``stage``
        more = params + end_params(cfg, op, stage, placement)
        return state_bytes(more, impl, shards) - state_bytes(params, impl, shards)

    if k == 1:
        return floor + ends(0) + tokens * logit_bytes(cfg, op)
    # The last stage holds its units briefly: one microbatch under 1F1B, all under
    # fill-drain.
    fill_drain = layout.schedule in TOKEN_SCHEDULES
    held = pipeline_batch // layout.rounds if fill_drain else layout.microbatch
    last = held * seq_len / layout.n_cp
    last_floor = states + _activations(cfg, layout, impl, last, seq_len) + cal.memory_reserve
    return max(floor + ends(0), last_floor + ends(k - 1) + last * logit_bytes(cfg, op))


def layer_work(cost: ClusterCostModel, batch: int, length: int) -> float:
    """One layer's forward and backward (and recomputed forward) over ``batch``
    sequences of ``length`` tokens without context, on one GPU of the #Op group without
    #CP, in FLOPs at the matrix products' rate: FlashAttention's count scaled to it."""
    h, op, cal = cost.cfg.hidden, cost.n_op, cost.cal
    b, L = batch, length
    full = 1 if cost.recompute == "full" else 0
    # Products: forward 24 H^2 / #Op per token, backward twice; attention forward at
    # least 2 b H L^2 / #Op (QK^T and AV over the causal half), backward twice.
    if cost.impl.attention != "flash" or cal.flash_efficiency is None:
        fwd = 24 * h * h / op * b * L + 2 * b * h * L * L / op
        return fwd * (3 + full)
    # FlashAttention-2: its backward does 2.5 forwards, at its own efficiency.
    attention = 2 * b * h * L * L / op * (3.5 + full)
    return 24 * h * h / op * b * L * (3 + full) + attention * (
        cal.gemm_efficiency / cal.flash_efficiency
    )


def stage_seconds(cost: ClusterCostModel, size: int, slices: Sequence[int], layers: int) -> float:
    """The cost model's forward and backward seconds (recomputation in) of ``layers``
    layers of one stage for a batch slice of ``size`` sequences cut into ``slices``."""
    lengths = np.asarray(slices, dtype=float)
    fwd, bwd = cost.stage_times(size, lengths, np.cumsum(lengths) - lengths, layers)
    return float((fwd + bwd).sum())


def latency_floor(
    cost: ClusterCostModel,
    pipeline_batch: int,
    unit: tuple[int, Sequence[int]] | None = None,
    rounds: int = 1,
) -> float:
    """The least simulated latency any plan of ``cost``'s layout has (module docstring);
    ``unit``: (sequences, token slices) of every batch slice, where the plan is made of
    such alike (microbatches, each perhaps cut into token slices); ``rounds``: fill-drain
    rounds, each filling and draining the pipeline once."""
    cal, hw = cost.cal, cost.hw
    peak = cal.gemm_efficiency * hw.peak_fp16
    work = layer_work(cost, pipeline_batch, cost.seq_len)
    compute = cost.layers_per_stage * work / peak / cost.n_cp
    floor = cost.layers_per_chunk * cost.host_floor * (1 + cal.backward_floor)
    if cost.recompute == "full":
        floor += cost.layers_per_chunk * cost.host_floor
    stage = cost.layers_per_stage
    if unit is not None:
        size, slices = unit
        total = pipeline_batch // size * stage_seconds(cost, size, slices, stage)
        compute = max(compute, total)
        floor = max(floor, stage_seconds(cost, size, slices[:1], cost.layers_per_chunk))
    elif cost.impl.attention == "flash":
        compute = max(compute, stage_seconds(cost, pipeline_batch, [cost.seq_len], stage))
    fill = (cost.n_stages - 1) * (floor + 2 * cal.intra_node_latency) * rounds
    return compute + fill + cost.allreduce(0) + cost.optimizer(0)
