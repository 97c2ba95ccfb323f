"""Measure mode at the paper's scale: each Table-1 setting trained for real on GPU nodes.

Where the CPU measure mode times a scaled-down model on this machine, this runs a
setting exactly as Table 1 lays it out (:func:`tplib.runs.setting_run`): GPipe with microbatches of one sequence, and
TeraPipe with the DP planner's plan (from the cluster model, the paper's printed plan,
or a profile measured on the GPUs at hand). Each run is started with a
:class:`~tplib.runs.settings.Launch` (``srun`` inside a SLURM allocation by default),
and the row holds the measured median latencies, the speedup, the paper's TFLOPS per
GPU formula, the largest stage's peak memory, and the paper's own values beside them,
in the columns the simulated table uses, so the same figure and findings apply.

The table notebooks take it as measure-mode parameters, e.g. for papermill on the
allocation's first node::

    -p mode measure -y 'params: {settings: [9], launch: {launcher: srun}}'
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from tplib.paper import GPIPE, TERAPIPE, ablation_rows, main_row, seqlen_row, setting
from tplib.plan import Plan
from tplib.runs.settings import setting_run
from tplib.search.setting import beside_paper, rel, setting_fields, tflops_per_gpu

__all__ = ["ablation_rows_on_nodes", "from_nodes", "on_nodes", "run_settings"]


def on_nodes(settings: Sequence[object], launch: object, table: str) -> bool:
    """Whether a measure-mode call asks for GPU nodes (it gives settings and a launch
    description); ``ValueError`` when it gives only one of them."""
    if not settings and launch is None:
        return False
    if not settings or launch is None:
        raise ValueError(
            f"settings={list(settings)} and launch={launch!r}: measuring {table} rows on "
            "GPU nodes needs both the settings and how to launch them"
        )
    return True


def from_nodes(df: pd.DataFrame) -> bool:
    """Whether measured rows came from GPU nodes (each names the ``launcher`` that
    started its runs) rather than from this machine; such rows stand beside the paper's
    values in the simulated table's columns, so its figure and findings apply."""
    return "launcher" in df.columns


def _measured_row(
    n: int, seq_len: int | None, gpipe: Any, terapipe: Any, launcher: str
) -> dict[str, object]:
    """The row of setting ``n`` (at ``seq_len``) from its two runs' results
    (:class:`~tplib.runtime.RunResult`), started by ``launcher``, beside the paper's."""
    s = setting(n, seq_len)
    lat_g, lat_t = gpipe.median_latency_s, terapipe.median_latency_s
    row: dict[str, object] = setting_fields(s) | {
        "launcher": launcher,
        "latency_gpipe": lat_g,
        "latency_gpipe_std": statistics.pstdev(gpipe.iteration_s),
        "latency_terapipe": lat_t,
        "latency_terapipe_std": statistics.pstdev(terapipe.iteration_s),
        "speedup": lat_g / lat_t,
        "tflops_gpipe": tflops_per_gpu(s, lat_g),
        "tflops_per_gpu": tflops_per_gpu(s, lat_t),
        "plan": terapipe.config.plan.to_paper(),
        "precision": terapipe.config.precision,
        "peak_memory_gib_gpipe": max(gpipe.stage_peak_bytes()) / 2**30,
        "peak_memory_gib_terapipe": max(terapipe.stage_peak_bytes()) / 2**30,
    }
    if seq_len is None or seq_len == setting(n).seq_len:
        paper = (main_row(n, GPIPE), main_row(n, TERAPIPE))
    else:
        paper = (seqlen_row(s.seq_len, GPIPE), seqlen_row(s.seq_len, TERAPIPE))
    return beside_paper(row, *paper)


def run_settings(
    settings: Iterable[int | tuple[int, int]],
    launch: Mapping[str, Any] | Any,
    *,
    plan: str = "cluster",
    precision: str = "fp16",
    recompute: str = "none",
    steps: int = 10,
    warmup: int = 2,
) -> pd.DataFrame:
    """Run every setting (``n``, or ``(n, seq_len)`` for Table 4) with and without
    TeraPipe on GPU nodes, one row each. Every config is made (and checked) before the
    first run starts."""
    from tplib.runs.settings import Launch, run_on_nodes

    how = Launch.of(launch)
    jobs = []
    for item in settings:
        n, seq_len = item if isinstance(item, tuple) else (item, None)
        options: dict[str, Any] = dict(
            precision=precision, recompute=recompute, steps=steps, warmup=warmup
        )
        gpipe = setting_run(n, plan="gpipe", seq_len=seq_len, **options)
        tera = setting_run(n, plan=plan, seq_len=seq_len, **options)
        jobs.append((n, seq_len, gpipe, tera))
    rows = []
    for n, seq_len, gpipe, tera in jobs:
        tag = f"setting{n}" + (f"-L{seq_len}" if seq_len else "")
        rows.append(
            _measured_row(
                n,
                seq_len,
                run_on_nodes(gpipe, how, f"{tag}-gpipe"),
                run_on_nodes(tera, how, f"{tag}-terapipe"),
                how.name,
            )
        )
    return pd.DataFrame(rows)


def ablation_rows_on_nodes(
    settings: Iterable[int],
    launch: Mapping[str, Any] | Any,
    *,
    plan: str = "cluster",
    precision: str = "fp16",
    steps: int = 10,
    warmup: int = 2,
) -> pd.DataFrame:
    """Table 3 on GPU nodes: for each setting, every row the paper measured (uniform
    ``#Slices=n``, batch slices of one sequence, and the DP's plan from ``plan``), each
    run as ``terapipe`` at full scale, beside the paper's latency, in the simulated
    table's columns. Every config is made (and checked) before the first run starts."""
    from tplib.runs.settings import Launch, run_on_nodes

    how = Launch.of(launch)
    jobs = []
    for n in settings:
        s = setting(n)
        for ref in ablation_rows(n):
            source: str | Plan = plan
            if ref.n_slices is not None:
                source = Plan.uniform(s.pipeline_batch, s.seq_len, n_token_slices=ref.n_slices)
            run = setting_run(n, plan=source, precision=precision, steps=steps, warmup=warmup)
            jobs.append((n, ref, run))
    rows = []
    for n, ref, run in jobs:
        name = f"setting{n}-" + ref.algorithm.replace("#Slices=", "slices")
        result = run_on_nodes(run, how, name)
        rows.append(
            {
                "setting": n,
                "model": run.model,
                "launcher": how.name,
                "algorithm": ref.algorithm,
                "plan": run.plan.to_paper(),
                "latency": result.median_latency_s,
                "latency_std": statistics.pstdev(result.iteration_s),
                "paper_latency": ref.latency,
                "err_latency": rel(result.median_latency_s, ref.latency),
                "peak_memory_gib": max(result.stage_peak_bytes()) / 2**30,
            }
        )
    df = pd.DataFrame(rows)
    df["rank"] = df.groupby("setting")["latency"].rank(method="min").astype(int)
    df["paper_rank"] = df.groupby("setting")["paper_latency"].rank(method="min").astype(int)
    return df
