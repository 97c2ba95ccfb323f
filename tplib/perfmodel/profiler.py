"""Profiling stages: a measured :class:`~tplib.perfmodel.profile.Profile` of one stage
(:func:`profile_stage`) or of every stage of a pipeline (:func:`profile_pipeline`),
each timed by a :class:`~tplib.perfmodel.timer.StageTimer` on the run's precision,
dropout and attention, and recording beside Eq. 9 the forward's share of
forward+backward, the weight gradients' share and the optimizer step.

A profile times either a middle stage of ``layers_per_stage`` blocks (what the paper's
uniform stages are) or an actual stage ``[lo, hi)`` of a K-stage pipeline: the first
stage with the embeddings, the last with the LM head and loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from tplib.nn.configs import GPTConfig, get_config
from tplib.nn.layer_ranges import balanced_stages, check_stage_ranges
from tplib.perfmodel.build import build_profile
from tplib.perfmodel.profile import (
    DEFAULT_LINK_BANDWIDTH,
    DEFAULT_LINK_LATENCY,
    Profile,
    ProfileError,
    grid_steps,
)
from tplib.perfmodel.timer import StageTimer
from tplib.util.machine import threads_per_process

__all__ = ["profile_pipeline", "profile_stage"]


def profile_stage(
    model: str | GPTConfig,
    *,
    layers_per_stage: int = 1,
    seq_len: int | None = None,
    max_batch_slice_size: int = 1,
    batch_slice_sizes: Sequence[int] | None = None,
    granularity: int = 8,
    repeats: int = 5,
    warmup: int = 1,
    device: str | None = None,
    precision: str = "fp32",
    dropout: float | None = None,
    attention: str | None = None,
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH,
    link_latency: float = DEFAULT_LINK_LATENCY,
    rounds: int = 1,
    threads: int | None = None,
    progress: bool = True,
    seed: int = 0,
    stage: tuple[int, int] | None = None,
    smooth: bool = False,
    reduce: str = "min",
) -> Profile:
    """Profile a middle stage of ``layers_per_stage`` blocks of ``model`` (or, with
    ``stage=(lo, hi)``, exactly that stage of a pipeline, embeddings or head included) on
    ``device`` (CUDA when present, else CPU) for batch slices of ``batch_slice_sizes``
    sequences (default 1..max_batch_slice_size). The profile also records the forward's
    median share of the time and the stage's optimizer step.

    It times what a run in ``precision`` does (``"fp32"``, ``"bf16"`` autocast, ``"fp16"``
    on CUDA), training with ``dropout`` (None: the model's rate, as a run of it trains),
    through attention ``attention`` (None: the runtime's default for the device), and
    records all three (see :class:`StageTimer`).

    On a machine shared with other jobs, use ``rounds`` > 1 (each point timed at several
    moments, keeping the least) and ``threads`` (torch's CPU threads while measuring,
    restored after) below the core count: spin-waiting threads that lose their core
    make timings many times slower and noisier. Where the machine stays busy, the
    typical time (``reduce="median"``) predicts a pipeline run better than the least,
    and ``smooth`` fits the table t(b, l, 0) by
    :func:`~tplib.perfmodel.build.smooth_lengths` against what is left of the noise."""
    cfg = get_config(model) if isinstance(model, str) else model
    seq_len = cfg.seq_len if seq_len is None else seq_len
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if batch_slice_sizes is None:
        sizes = list(range(1, max_batch_slice_size + 1))
    else:
        sizes = list(batch_slice_sizes)
    if not sizes or min(sizes) < 1:
        raise ProfileError(f"batch slice sizes {sizes}: need at least one, all >= 1")
    grid_steps(seq_len, granularity)  # fail before building anything
    timer = StageTimer(
        cfg,
        layers_per_stage,
        seq_len=seq_len,
        device=device,
        precision=precision,
        dropout=dropout,
        attention=attention,
        repeats=repeats,
        warmup=warmup,
        seed=seed,
        stage=stage,
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        desc = "profiling" if stage is None else f"profiling layers [{stage[0]}, {stage[1]})"
        prof = build_profile(
            timer,
            config=cfg,
            layers_per_stage=len(timer.stage.blocks),
            seq_len=seq_len,
            granularity=granularity,
            batch_slice_sizes=sizes,
            rounds=rounds,
            progress=progress,
            seed=seed,
            desc=desc,
            device=str(timer.device),
            precision=precision,
            attention=timer.attention_timed,
            dropout=timer.dropout,
            link_bandwidth=link_bandwidth,
            link_latency=link_latency,
            repeats=repeats,
            threads=torch.get_num_threads(),
            stage=stage,
            smooth=smooth,
            reduce=reduce,
            torch_version=torch.__version__,
        )
        # Measured after the sweep, in the same thread setting. The forward share is the
        # median over every timed point: it varies little with (b, l, c).
        return replace(
            prof,
            fwd_fraction=float(np.median(timer.forward_fractions)),
            optimizer_time=timer.optimizer_time(repeats),
            wgrad_fraction=timer.wgrad_fraction(sizes[0], seq_len),
        )
    finally:
        torch.set_num_threads(before)


def profile_pipeline(
    model: str | GPTConfig,
    n_stages: int,
    *,
    stage_ranges: Sequence[tuple[int, int]] | None = None,
    n_data: int = 1,
    threads: int | None = None,
    progress: bool = True,
    **kwargs: Any,
) -> list[Profile]:
    """Profile every stage of a ``n_stages``-stage pipeline of ``model``, one
    :class:`~tplib.perfmodel.profile.Profile` per stage: layers ``stage_ranges``
    (default: :func:`~tplib.nn.layer_ranges.balanced_stages`), the first with the embeddings, the
    last with the LM head and loss. ``kwargs`` go to :func:`profile_stage` (seq_len,
    batch_slice_sizes, granularity, repeats, rounds, precision, dropout, ...).

    ``threads`` defaults to what each process of a local pipeline of
    ``n_stages x n_data`` processes gets: a stage timed with all cores runs several
    times faster than it does in the pipeline."""
    cfg = get_config(model) if isinstance(model, str) else model
    ranges = list(stage_ranges or balanced_stages(cfg.n_layer, n_stages))
    check_stage_ranges(cfg, ranges, n_stages)
    threads = threads or threads_per_process(n_stages * n_data)
    return [
        profile_stage(cfg, stage=(lo, hi), threads=threads, progress=progress, **kwargs)
        for lo, hi in ranges
    ]
