"""Pipeline stages as layer ranges: a stage (the paper's cell c_k) is a contiguous range
``[lo, hi)`` of the model's layers.

The rules for ranges are written once, here: every module that takes a stage or a list
of stages (the model, the runtime, the profiler, profiles) checks it with these.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tplib.nn.configs import GPTConfig

__all__ = ["balanced_stages", "check_stage_range", "check_stage_ranges"]

StageRange = tuple[int, int]


def balanced_stages(n_layer: int, n_stages: int) -> tuple[StageRange, ...]:
    """Contiguous layer ranges, as equal as possible (earlier stages take the extra layers)."""
    if not 1 <= n_stages <= n_layer:
        raise ValueError(
            f"n_stages={n_stages} must be between 1 and the model's {n_layer} layers: "
            "every stage needs at least one layer"
        )
    q, r = divmod(n_layer, n_stages)
    bounds = [0]
    for k in range(n_stages):
        bounds.append(bounds[-1] + q + (1 if k < r else 0))
    return tuple(itertools.pairwise(bounds))


def check_stage_range(cfg: GPTConfig, lo: int, hi: int) -> None:
    """Raise ``ValueError`` unless ``[lo, hi)`` is a non-empty range of the model's layers."""
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi <= cfg.n_layer):
        raise ValueError(
            f"stage layer range [{lo}, {hi}) is outside model {cfg.name}'s layers "
            f"[0, {cfg.n_layer}): a stage needs 0 <= lo < hi <= n_layer"
        )


def check_stage_ranges(cfg: GPTConfig, ranges: Sequence[StageRange], n_stages: int) -> None:
    """Raise ``ValueError`` unless ``ranges`` gives ``n_stages`` stages that cover the
    model's layers contiguously, first to last."""
    if len(ranges) != n_stages:
        raise ValueError(
            f"stage ranges {list(ranges)} give {len(ranges)} stages for n_stages={n_stages}: "
            "give one layer range per stage"
        )
    expected_lo = 0
    for k, (lo, hi) in enumerate(ranges):
        if lo != expected_lo or hi <= lo:
            raise ValueError(
                f"stage {k} covers layers [{lo}, {hi}) but must start at layer {expected_lo} "
                f"and be non-empty: stage ranges {list(ranges)} must cover "
                f"[0, {cfg.n_layer}) contiguously"
            )
        expected_lo = hi
    if expected_lo != cfg.n_layer:
        raise ValueError(
            f"stage ranges {list(ranges)} end at layer {expected_lo}, not at the model's "
            f"{cfg.n_layer}: they must cover every layer"
        )
