"""Shared cases for the tests of tplib.explorer (tests/test_explorer*.py): a small paper
setting, a valid scenario's fields and a synthetic profile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tplib.nn.configs import get_config
from tplib.perfmodel import build_profile

SMALL = 7  # GPT3-44B on 24 stages, 4 sequences per pipeline: plans in well under a second
BASE: dict[str, Any] = {"model": "GPT3-1B", "seq_len": 2048, "pipeline_batch": 4, "n_stages": 24}


def write_profile(directory: Path) -> Path:
    """A synthetic profile of one "tiny" layer (L = 64, g = 8, batch slices of 1 or 2
    sequences), saved in ``directory``: an analytic t(b, l, c) whose attention term grows
    with the context, so slicing has something to trade off."""

    def measure(b: int, length: int, context: int) -> float:
        return 1e-3 * (0.3 + b * length * (1 + (context + length) / 32) / 64)

    prof = build_profile(
        measure,
        config=get_config("tiny"),
        layers_per_stage=1,
        seq_len=64,
        granularity=8,
        batch_slice_sizes=(1, 2),
    )
    path = directory / "tiny.json"
    prof.save(path)
    return path
