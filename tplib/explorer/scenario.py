"""What the explorer plans: a :class:`Scenario`, and the cost model it names.

A scenario is a model, L, the sequences ONE pipeline processes per iteration (B / #Data,
``pipeline_batch``), the layout (K stages, #Op, #Data), the cost source and the
planner's ``eps``, ``method`` and granularity ``g``. It is frozen and validated when
made, so an impossible layout fails in the form, not in the planner.

The cost source is the V100-cluster model of :mod:`tplib.cluster` (:data:`CLUSTER`) or
the path of a profile measured by ``python -m tplib profile`` (:mod:`tplib.perfmodel`).
A profile prices one stage on one device: it models neither #Op nor #Data.

:func:`scenario_for_setting`, :func:`scenario_for_profile` and :func:`make_scenario`
(the notebook's parameters) build common ones; :func:`cost_model` prices one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, get_args

import numpy as np

from tplib.cluster import ClusterCostModel, check_layout
from tplib.nn.configs import MODELS, get_config
from tplib.paper import SEQLEN_BATCH, setting
from tplib.perfmodel import Profile
from tplib.search.setting import EPS, GRANULARITY, Method
from tplib.sim.costs import SliceCostModel

__all__ = [
    "CLUSTER",
    "MAX_GRID_STEPS",
    "METHODS",
    "Scenario",
    "cost_model",
    "load_profile",
    "make_scenario",
    "scenario_for_profile",
    "scenario_for_setting",
]

CLUSTER = "cluster"  # Scenario.cost for the V100-cluster model; anything else is a path
METHODS: tuple[Method, ...] = get_args(Method)
# The DP's time grows about 10x per doubling of L / g (0.9 s at 512 points, 3.5 s at 1024,
# 47 s at 2048, measured at L = 8192 on 2 cores): past this an interactive change stalls.
MAX_GRID_STEPS = 1024


@dataclass(frozen=True)
class Scenario:
    """What to plan. ``pipeline_batch`` is B / #Data, the sequences ONE pipeline
    processes per iteration."""

    model: str  # a name in tplib.nn.configs.MODELS (with a profile: the profiled model)
    seq_len: int  # L
    pipeline_batch: int  # B / #Data
    n_stages: int  # K (#Pipe)
    n_op: int = 1  # #Op: GPUs each stage is operation-partitioned over (cluster only)
    n_data: int = 1  # #Data: data-parallel replicas (cluster only: prices the all-reduce)
    cost: str = CLUSTER  # "cluster" (the V100 model) or the path of a profile JSON
    eps: float = EPS  # the planner's t_max tolerance, seconds (0: exact)
    method: Method = "exact"  # "exact" (true fill-drain) or "paper" (§3.4's sum of T_b)
    granularity: int = GRANULARITY  # g: slice lengths are multiples of g tokens

    def __post_init__(self) -> None:
        if isinstance(self.cost, os.PathLike):
            object.__setattr__(self, "cost", os.fspath(self.cost))
        for name in ("seq_len", "pipeline_batch", "n_stages", "n_op", "n_data", "granularity"):
            value = getattr(self, name)
            # bool is an int subclass; True as a batch size is a bug, not 1.
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"Scenario.{name}={value!r}: must be a positive integer")
            object.__setattr__(self, name, int(value))
        if self.seq_len % self.granularity:
            raise ValueError(
                f"Scenario.seq_len={self.seq_len} is not a multiple of granularity="
                f"{self.granularity}: slice lengths lie on a grid of g tokens, pick a g "
                "that divides L"
            )
        if self.seq_len // self.granularity > MAX_GRID_STEPS:
            raise ValueError(
                f"Scenario.seq_len={self.seq_len} with granularity={self.granularity} gives "
                f"{self.seq_len // self.granularity} grid points: the explorer plans at most "
                f"{MAX_GRID_STEPS}, so pick g >= {-(-self.seq_len // MAX_GRID_STEPS)} "
                "(python -m tplib plan has no such limit)"
            )
        if not isinstance(self.eps, int | float) or not 0 <= self.eps < float("inf"):
            raise ValueError(f"Scenario.eps={self.eps!r}: must be finite seconds >= 0")
        if self.method not in METHODS:
            raise ValueError(f"Scenario.method={self.method!r}: choose one of {METHODS}")
        if not isinstance(self.cost, str) or not self.cost.strip():
            raise ValueError(
                f"Scenario.cost={self.cost!r}: use {CLUSTER!r} for the V100-cluster model "
                "or the path of a profile JSON (python -m tplib profile ...)"
            )
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"Scenario.model={self.model!r}: must be a model name")
        if self.uses_cluster:
            self._check_cluster_layout()
        elif self.n_op != 1 or self.n_data != 1:
            raise ValueError(
                f"Scenario.n_op={self.n_op}, n_data={self.n_data} with a profile: a profile "
                "prices one stage on one device, so #Op and #Data are not modelled; set "
                "both to 1 (or use the cluster model)"
            )

    def _check_cluster_layout(self) -> None:
        # The cluster model's rules, raised when the scenario is made, not when it is planned.
        try:
            cfg = get_config(self.model)
        except ValueError:
            raise ValueError(
                f"Scenario.model={self.model!r} is unknown: known models are {sorted(MODELS)}"
            ) from None
        check_layout(cfg, n_stages=self.n_stages, n_op=self.n_op, n_data=self.n_data)

    @property
    def uses_cluster(self) -> bool:
        return self.cost == CLUSTER

    def with_(self, **changes: Any) -> Scenario:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @property
    def label(self) -> str:
        source = "V100 cluster model" if self.uses_cluster else f"profile {self.cost}"
        return (
            f"{self.model}, L={self.seq_len}, {self.pipeline_batch} sequence(s) per pipeline, "
            f"K={self.n_stages}, #Op={self.n_op}, #Data={self.n_data}; cost: {source}; "
            f"method={self.method}, eps={self.eps * 1e3:g} ms, g={self.granularity}"
        )


def scenario_for_setting(n: int, seq_len: int | None = None, **changes: Any) -> Scenario:
    """Table-1 setting ``(n)`` (with ``seq_len``: its Table-4 variant) as a scenario on
    the cluster model; ``changes`` override fields (e.g. ``eps=0``, ``method="paper"``)."""
    s = setting(n, seq_len)
    base = Scenario(s.model, s.seq_len, s.pipeline_batch, s.n_stages, s.n_op, s.n_data)
    return base.with_(**changes) if changes else base


def scenario_for_profile(
    path: str | os.PathLike[str],
    *,
    n_stages: int | None = None,
    pipeline_batch: int = 1,
    **changes: Any,
) -> Scenario:
    """A scenario priced by the profile at ``path``: its model, L and g; ``n_stages``
    defaults to the profiled model's layers over the profiled stage's layers."""
    prof = load_profile(os.fspath(path))
    if n_stages is None:
        n_stages = max(1, prof.config.n_layer // prof.layers_per_stage)
    return Scenario(
        prof.config.name,
        prof.seq_len,
        pipeline_batch,
        n_stages,
        cost=os.fspath(path),
        granularity=prof.granularity,
    ).with_(**changes)


def make_scenario(
    n: int | None = None,
    *,
    seq_len: int | None = None,
    profile: str | os.PathLike[str] | None = None,
    **fields: Any,
) -> Scenario:
    """The notebook's parameters as a scenario: priced by ``profile`` when given, else
    Table-1 setting ``(n)`` on the cluster model, else ``fields`` alone. ``fields``
    override what the first two fill in; so does ``seq_len``, except that setting (5)
    with a Table-4 length takes that variant, ``pipeline_batch`` included."""
    table4 = n == 5 and seq_len in SEQLEN_BATCH
    if seq_len is not None and not table4:
        fields["seq_len"] = seq_len
    if profile is not None:
        return scenario_for_profile(profile, **fields)
    if n is not None:
        base = scenario_for_setting(n, seq_len if table4 else None)
        return base.with_(**fields) if fields else base
    return Scenario(**fields)


def load_profile(path: str) -> Profile:
    """The profile at ``path``, or a ValueError that says how to make one."""
    if not Path(path).is_file():
        raise ValueError(
            f"profile {path!r} does not exist: give the JSON written by "
            "python -m tplib profile, or use the cluster model"
        )
    return Profile.load(path)


def cost_model(sc: Scenario) -> SliceCostModel:
    """The slice-cost model ``sc`` names: the cluster model of its layout, or its profile
    (checked against the scenario's model and grid)."""
    if sc.uses_cluster:
        cfg = get_config(sc.model)
        cfg = cfg if cfg.seq_len == sc.seq_len else cfg.with_(seq_len=sc.seq_len)
        return ClusterCostModel(
            cfg, n_stages=sc.n_stages, n_op=sc.n_op, n_data=sc.n_data, seq_len=sc.seq_len
        )
    prof = load_profile(sc.cost)
    if prof.config.name.lower() != sc.model.lower():
        raise ValueError(
            f"profile {sc.cost!r} was measured on model {prof.config.name!r}, but "
            f"Scenario.model={sc.model!r}: plan the profiled model "
            "(scenario_for_profile reads it from the file)"
        )
    if sc.seq_len > prof.seq_len or sc.granularity % prof.granularity:
        raise ValueError(
            f"Scenario seq_len={sc.seq_len}, granularity={sc.granularity} is off profile "
            f"{sc.cost!r}'s grid (L <= {prof.seq_len}, g a multiple of {prof.granularity})"
        )
    return prof
