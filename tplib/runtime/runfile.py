"""A :class:`~tplib.runtime.runconfig.RunConfig` as JSON: what a torchrun job or a batch
script reads (``python -m tplib run`` writes it). Every field a run is constructed from,
with plans in the paper's notation; reading it back builds, and so checks, the run.

The file says its format. Format 2, written since the run's configuration came in
parts, holds the top-level fields and one object per part::

    {"format": 2, "model": "tiny", "schedule_name": "terapipe", "slicing": 4, ...,
     "parallelism": {"n_stages": 2, ...}, "data": {"batch": 2, ...},
     "optim": {"lr": 0.001, ...}, "timing": {"steps": 1, ...}}

Format 1, the files written before, has no ``"format"`` key and every field flat; it is
still read (:data:`FORMAT_1_FIELDS` says where each of its fields went), since saved
runs outlive the code that wrote them. A field that is missing takes its default; one
that is unknown, or an unknown format, is an error that names it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tplib.plan import Plan
from tplib.runtime.parts import PARTS
from tplib.runtime.runconfig import RunConfig
from tplib.util.files import write_json

__all__ = [
    "FORMAT",
    "FORMAT_1_FIELDS",
    "load_run_config",
    "run_config_from_dict",
    "run_config_to_dict",
    "save_run_config",
]

FORMAT = 2  # what run_config_to_dict writes

# Format 1's flat fields: the part each moved to (None: RunConfig itself) and its name
# there.
FORMAT_1_FIELDS: dict[str, tuple[str | None, str]] = {
    "model": (None, "model"),
    "model_overrides": (None, "model_overrides"),
    "schedule": (None, "schedule_name"),
    "vertical_sync": (None, "vertical_sync"),
    "slicing": (None, "slicing"),
    "seed": (None, "seed"),
    "device": (None, "device"),
    "precision": (None, "precision"),
    "recompute": (None, "recompute"),
    "n_stages": ("parallelism", "n_stages"),
    "n_data": ("parallelism", "n_data"),
    "n_op": ("parallelism", "n_op"),
    "ranks_per_node": ("parallelism", "ranks_per_node"),
    "stage_ranges": ("parallelism", "stage_ranges"),
    "batch": ("data", "batch"),
    "seq_len": ("data", "seq_len"),
    "data": ("data", "source"),
    "data_seed": ("data", "seed"),
    "lr": ("optim", "lr"),
    "betas": ("optim", "betas"),
    "weight_decay": ("optim", "weight_decay"),
    "adam_eps": ("optim", "adam_eps"),
    "weight_decay_params": ("optim", "weight_decay_params"),
    "grad_clip": ("optim", "grad_clip"),
    "lr_schedule": ("optim", "lr_schedule_name"),
    "lr_warmup_steps": ("optim", "lr_warmup_steps"),
    "lr_decay_steps": ("optim", "lr_decay_steps"),
    "min_lr_ratio": ("optim", "min_lr_ratio"),
    "steps": ("timing", "steps"),
    "warmup": ("timing", "warmup"),
    "timeout_s": ("timing", "timeout_s"),
    "threads": ("timing", "threads"),
}


def _init_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def run_config_to_dict(run: RunConfig) -> dict[str, Any]:
    """``run`` as format 2: JSON's types, plans in the paper's notation."""
    out: dict[str, Any] = {"format": FORMAT}
    for name in _init_fields(RunConfig):
        value = getattr(run, name)
        out[name] = (
            {f: getattr(value, f) for f in _init_fields(PARTS[name])} if name in PARTS else value
        )
    out["slicing"] = run.slicing.to_paper() if isinstance(run.slicing, Plan) else run.slicing
    out["batch_plans"] = [p.to_paper() for p in run.batch_plans]
    ranges = run.parallelism.stage_ranges
    out["parallelism"]["stage_ranges"] = None if ranges is None else [list(r) for r in ranges]
    out["optim"]["betas"] = list(run.optim.betas)
    out["model_overrides"] = dict(run.model_overrides)
    return out


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    """The run of a format-2 or format-1 dict (see the module's docstring)."""
    if not isinstance(data, dict):
        raise ValueError(f"a run config is a JSON object of RunConfig fields, not {data!r}")
    data = dict(data)
    version = data.pop("format", 1)
    if version == 1 and not isinstance(version, bool):
        top, parts = _from_format_1(data)
    elif version == 2 and not isinstance(version, bool):
        top, parts = _from_format_2(data)
    else:
        raise ValueError(
            f"run file format {version!r} is not one tplib reads: format 2 (written since "
            'the run\'s parts) or 1 (flat fields, no "format" key)'
        )
    if isinstance(top.get("slicing"), str):
        top["slicing"] = Plan.from_paper(top["slicing"])
    if isinstance(plans := top.get("batch_plans"), list):
        top["batch_plans"] = tuple(Plan.from_paper(p) if isinstance(p, str) else p for p in plans)
    # JSON's arrays become the tuples a RunConfig holds (lists would not compare equal).
    layout = parts.get("parallelism", {})
    if isinstance(ranges := layout.get("stage_ranges"), list):
        layout["stage_ranges"] = tuple(tuple(r) if isinstance(r, list) else r for r in ranges)
    optim = parts.get("optim", {})
    if isinstance(optim.get("betas"), list):
        optim["betas"] = tuple(optim["betas"])
    overrides = top.get("model_overrides") or {}
    try:
        top["model_overrides"] = tuple(sorted(dict(overrides).items()))
    except (TypeError, ValueError):
        raise ValueError(
            f"model_overrides={overrides!r} must map GPTConfig fields to values, "
            'e.g. {"n_layer": 4}'
        ) from None
    made: dict[str, Any] = {name: PARTS[name](**fields) for name, fields in parts.items()}
    return RunConfig(**top, **made)


def _from_format_1(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    unknown = sorted(set(map(str, data)) - set(FORMAT_1_FIELDS))
    if unknown:
        raise ValueError(
            f'unknown RunConfig fields {unknown} in a run file without a "format" key, read '
            f"as format 1 (flat fields): its fields are {sorted(FORMAT_1_FIELDS)}; a file "
            'of nested parts says "format": 2'
        )
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for old, value in data.items():
        part, name = FORMAT_1_FIELDS[old]
        (top if part is None else parts.setdefault(part, {}))[name] = value
    return top, parts


def _from_format_2(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    known = _init_fields(RunConfig)
    unknown = sorted(set(map(str, data)) - set(known))
    if unknown:
        raise ValueError(f"unknown RunConfig fields {unknown}: known fields are {sorted(known)}")
    top = {name: value for name, value in data.items() if name not in PARTS}
    parts: dict[str, dict[str, Any]] = {}
    for name in PARTS.keys() & data.keys():
        part, given = PARTS[name], data[name]
        if not isinstance(given, dict):
            raise ValueError(
                f"RunConfig.{name}={given!r} must be a JSON object of {part.__name__} fields"
            )
        fields = _init_fields(part)
        unknown = sorted(set(map(str, given)) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown {part.__name__} fields {unknown} in {name!r}: known fields are "
                f"{sorted(fields)}"
            )
        parts[name] = dict(given)
    return top, parts


def save_run_config(run: RunConfig, path: str | Path) -> None:
    write_json(path, run_config_to_dict(run), indent=2)


def load_run_config(path: str | Path) -> RunConfig:
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"run config {path} is not JSON: {exc}") from None
    return run_config_from_dict(data)
