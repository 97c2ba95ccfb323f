"""Figure 6 / Table 3, the DP ablation: uniform token slicing against the DP's plan.

``simulate``: settings (8) and (9), batch slices of one sequence cut into #slices equal
token slices (as in Table 3) against the DP's joint plan, on the V100-cluster model,
beside the paper. The paper's finding to keep: one slice is worst, very fine slicing is
bad again, the DP is best. ``measure``: uniform 1..32 slices against the DP on real local
processes (K = 2), the simulator's prediction beside each measurement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
from tqdm.auto import tqdm

from tplib.cluster import CALIBRATION, Calibration
from tplib.measure import TABLE_MODEL, Profiling, grid
from tplib.paper import ablation_rows, setting
from tplib.plan import Plan
from tplib.search.setting import EPS, Method, plan_terapipe, rel, simulate_on_cluster
from tplib.tables import findings, plots
from tplib.tables.base import Comparison, Rows, Table, TableMode
from tplib.tables.nodes import ablation_rows_on_nodes, from_nodes, on_nodes

if TYPE_CHECKING:
    from tplib.runtime import LocalPool

__all__ = ["TABLE", "measure", "simulate"]


def simulate(
    settings: Iterable[int] = (8, 9),
    method: Method = "exact",
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
) -> Rows:
    """Each row of Table 3 for ``settings``, simulated, beside the paper's latency.
    ``rank`` orders each setting's rows from fastest (1), ours and the paper's."""
    rows = []
    for n in settings:
        s = setting(n)
        for ref in ablation_rows(n):
            if ref.n_slices is not None:
                p = Plan.uniform(s.pipeline_batch, s.seq_len, n_token_slices=ref.n_slices)
            else:
                p = plan_terapipe(s, method=method, eps=eps, calibration=calibration)
            lat = simulate_on_cluster(s, p, "terapipe", calibration=calibration).latency
            rows.append(
                {
                    "setting": n,
                    "model": s.model,
                    "algorithm": ref.algorithm,
                    "plan": p.to_paper(),
                    "latency": lat,
                    "paper_latency": ref.latency,
                    "err_latency": rel(lat, ref.latency),
                }
            )
    df = pd.DataFrame(rows)
    df["rank"] = df.groupby("setting")["latency"].rank(method="min").astype(int)
    df["paper_rank"] = df.groupby("setting")["paper_latency"].rank(method="min").astype(int)
    return Rows(df)


def measure(
    slices: Sequence[int] = (1, 2, 4, 8, 16, 32),
    *,
    seq_len: int = 2048,
    pipeline_batch: int = 1,
    model: str = TABLE_MODEL[0],
    model_overrides: Mapping[str, object] | Sequence[tuple[str, object]] = TABLE_MODEL[1],
    n_stages: int = 2,
    iters: int = 5,
    warmup: int = 1,
    eps: float = 0.0,
    profiling: Profiling | Mapping[str, Any] = Profiling(granularity=64),
    link: Sequence[float] | None = None,
    pool: LocalPool | None = None,
    progress: bool = True,
    settings: Sequence[int] = (),
    launch: Mapping[str, Any] | None = None,
    plan: str = "cluster",
    precision: str = "fp16",
) -> Rows:
    """Table 3 at CPU scale: uniform token slicing (``#Slices=n``, batch slices of one
    sequence) against the DP's plan (``DP``), all run as ``terapipe``, measured and
    simulated. ``rank`` orders the rows by measured median latency (1: fastest),
    ``simulated_rank`` by the simulator's. Slice counts must cut L on the profile's grid.

    On GPU nodes: with ``settings`` (the paper's are 8 and 9) and a ``launch``
    description, the paper's rows of those settings at full scale instead (see
    :mod:`tplib.tables.nodes`)."""
    if on_nodes(settings, launch, "Table 3"):
        df = ablation_rows_on_nodes(settings, launch, plan=plan, precision=precision, steps=iters)
        return Rows(df)
    from tplib.measure.harness import measured_bench  # starts processes: torch

    prof = Profiling.of(profiling)
    g = grid(seq_len, prof.granularity, max(slices))
    for n in slices:
        if seq_len % n or (seq_len // n) % g:
            raise ValueError(
                f"#slices={n} cuts L={seq_len} into {seq_len / n:g}-token slices, off the "
                f"profile's grid of {g} tokens: use a granularity that divides L / #slices"
            )
    rows = []
    with measured_bench(
        model, model_overrides, n_stages, iters, warmup, link, prof, progress, pool
    ) as bench:
        bench.profile(seq_len, g)
        dp = bench.plan(seq_len, pipeline_batch, eps)
        plans = [
            (f"#Slices={n}", Plan.uniform(pipeline_batch, seq_len, n_token_slices=n))
            for n in slices
        ]
        for name, p in tqdm([*plans, ("DP", dp)], desc="DP ablation", disable=not progress):
            m = bench.run("terapipe", p)
            rows.append(
                {
                    "model": model,
                    "seq_len": seq_len,
                    "pipeline_batch": pipeline_batch,
                    "n_stages": n_stages,
                    "algorithm": name,
                    "n_slices": max(len(t) for t in p.token_slices),
                    "plan": p.to_paper(),
                    **m.row(),
                    "iterations": iters,
                }
            )
    df = pd.DataFrame(rows)
    df["rank"] = df["latency"].rank(method="min").astype(int)
    df["simulated_rank"] = df["simulated_latency"].rank(method="min").astype(int)
    return Rows(df)


TABLE = Table(
    "dp_ablation",
    "Figure 6 / Table 3",
    "DP ablation: uniform token slicing against the DP's plan",
    {
        "simulate": TableMode(
            simulate,
            figure=lambda rows: plots.dp_ablation_figure(rows.df),
            findings=findings.ablation_targets,
            columns="setting algorithm latency paper_latency err_latency rank paper_rank plan",
            compare=Comparison(("setting", "algorithm"), "latency", "paper_latency"),
        ),
        "measure": TableMode(
            measure,
            figure=lambda rows: (
                plots.dp_ablation_figure(rows.df)
                if from_nodes(rows.df)
                else plots.measured_ablation_figure(rows.df)
            ),
            findings=lambda df: (
                findings.ablation_targets(df) if from_nodes(df) else findings.measured(df)
            ),
            columns="setting algorithm latency latency_std simulated_latency paper_latency "
            "err_latency err_simulated_latency rank simulated_rank paper_rank plan",
            compare=Comparison(("algorithm",), "latency"),
        ),
    },
)
