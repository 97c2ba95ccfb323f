"""A :class:`~tplib.runtime.runconfig.RunConfig` as JSON: what a torchrun job or a batch
script reads (``python -m tplib run`` writes it). Every field a run is constructed from,
with plans in the paper's notation; reading it back builds, and so checks, the run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tplib.plan import Plan
from tplib.runtime.runconfig import RunConfig
from tplib.util.files import write_json

__all__ = ["load_run_config", "run_config_from_dict", "run_config_to_dict", "save_run_config"]


def run_config_to_dict(run: RunConfig) -> dict[str, Any]:
    out = {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.init}
    out["slicing"] = run.slicing.to_paper() if isinstance(run.slicing, Plan) else run.slicing
    out["stage_ranges"] = None if run.stage_ranges is None else [list(r) for r in run.stage_ranges]
    out["betas"] = list(run.betas)
    out["model_overrides"] = dict(run.model_overrides)
    return out


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    if not isinstance(data, dict):
        raise ValueError(f"a run config is a JSON object of RunConfig fields, not {data!r}")
    known = {f.name for f in dataclasses.fields(RunConfig) if f.init}
    unknown = sorted(set(map(str, data)) - known)
    if unknown:
        raise ValueError(f"unknown RunConfig fields {unknown}: known fields are {sorted(known)}")
    data = dict(data)
    if isinstance(data.get("slicing"), str):
        data["slicing"] = Plan.from_paper(data["slicing"])
    # JSON's arrays become the tuples a RunConfig holds (lists would not compare equal).
    if isinstance(ranges := data.get("stage_ranges"), list):
        data["stage_ranges"] = tuple(tuple(r) if isinstance(r, list) else r for r in ranges)
    if isinstance(data.get("betas"), list):
        data["betas"] = tuple(data["betas"])
    overrides = data.get("model_overrides") or {}
    try:
        data["model_overrides"] = tuple(sorted(dict(overrides).items()))
    except (TypeError, ValueError):
        raise ValueError(
            f"model_overrides={overrides!r} must map GPTConfig fields to values, "
            'e.g. {"n_layer": 4}'
        ) from None
    return RunConfig(**data)


def save_run_config(run: RunConfig, path: str | Path) -> None:
    write_json(path, run_config_to_dict(run), indent=2)


def load_run_config(path: str | Path) -> RunConfig:
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"run config {path} is not JSON: {exc}") from None
    return run_config_from_dict(data)
