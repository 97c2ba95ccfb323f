"""Figure 5 / Table 2, the main results: every setting without and with TeraPipe.

``simulate``: every setting of Table 1 on the V100-cluster model, GPipe (microbatches of
one sequence) against TeraPipe (the joint batch x token DP plan), beside the paper's
measurements; and, beyond the paper, a modern baseline, Megatron's interleaved 1F1B on the
same microbatches, with TeraPipe's slices interleaved or breadth-first over virtual
stages too, each at its best v (:func:`~tplib.search.setting.simulate_virtual`). ``measure``: the same comparison at CPU scale on real local processes (K = 2
stages, B = 1, 2, 4), the DP planning on stage profiles measured here and each
configuration timed beside the simulator's prediction from the same profiles.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import pandas as pd
from tqdm.auto import tqdm

from tplib.cluster import CALIBRATION, Calibration
from tplib.measure import TABLE_MODEL, Profiling, grid
from tplib.paper import GPIPE, TERAPIPE, main_row, setting
from tplib.plan import Plan
from tplib.search.setting import (
    EPS,
    Method,
    beside_paper,
    simulate_setting,
    simulate_virtual,
)
from tplib.tables import findings, plots
from tplib.tables.base import Comparison, Rows, Table, TableMode
from tplib.tables.nodes import from_nodes, on_nodes, run_settings

if TYPE_CHECKING:
    from tplib.runtime import LocalPool

__all__ = ["TABLE", "measure", "simulate"]


def simulate(
    settings: Iterable[int] = range(1, 11),
    method: Method = "exact",
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
) -> Rows:
    """Every setting ``(n)`` in ``settings`` without and with TeraPipe, simulated, beside
    the paper; the paper's own plans on our cluster model as an extra table. The columns
    after the paper's are beyond it: interleaved 1F1B and TeraPipe with virtual stages
    (:func:`~tplib.search.setting.simulate_virtual`), and TeraPipe's speedup over
    interleaved 1F1B (``speedup_over_interleaved``) beside its speedup over GPipe."""
    settings = list(settings)
    rows = []
    for n in settings:
        r = simulate_setting(n, method=method, eps=eps, calibration=calibration)
        row = beside_paper(r, main_row(n, GPIPE), main_row(n, TERAPIPE))
        plan = Plan.from_paper(str(r["plan"]))
        virtual = simulate_virtual(
            setting(n), plan, method=method, eps=eps, calibration=calibration
        )
        t = {k: cast(float, x) for k, x in (r | virtual).items() if k.startswith("latency_")}
        rows.append(
            row
            | virtual
            | {
                "speedup_over_interleaved": t["latency_interleaved_1f1b"] / t["latency_terapipe"],
                "speedup_terapipe_interleaved": t["latency_gpipe"]
                / t["latency_terapipe_interleaved"],
                "speedup_terapipe_bfs": t["latency_gpipe"] / t["latency_terapipe_bfs"],
            }
        )
    df = pd.DataFrame(rows)
    return Rows(df, findings.fidelity_extras(df, "setting"))


def measure(
    batches: Sequence[int] = (1, 2, 4),
    *,
    seq_len: int = 2048,
    model: str = TABLE_MODEL[0],
    model_overrides: Mapping[str, object] | Sequence[tuple[str, object]] = TABLE_MODEL[1],
    n_stages: int = 2,
    iters: int = 5,
    warmup: int = 1,
    eps: float = 0.0,
    profiling: Profiling | Mapping[str, Any] = Profiling(granularity=128, batch_slice_sizes=(1, 2)),
    link: Sequence[float] | None = None,
    pool: LocalPool | None = None,
    progress: bool = True,
    settings: Sequence[int] = (),
    launch: Mapping[str, Any] | None = None,
    plan: str = "cluster",
    precision: str = "fp16",
) -> Rows:
    """Table 2 at CPU scale: at every pipeline batch B in ``batches``, GPipe with
    microbatches of one sequence against TeraPipe's DP plan, both measured and simulated.
    One profile (batch slices of up to ``max(profiling.batch_slice_sizes)`` sequences,
    the DP's choice) serves every B.

    On GPU nodes: with ``settings`` and a ``launch`` description, those Table 1 rows
    instead, at full scale (see :mod:`tplib.tables.nodes`; ``plan`` is the TeraPipe
    plan's source, ``precision`` the runs' numeric format)."""
    if on_nodes(settings, launch, "Table 2"):
        return Rows(run_settings(settings, launch, plan=plan, precision=precision, steps=iters))
    from tplib.measure.harness import measured_bench  # starts processes: torch

    prof = Profiling.of(profiling)
    with measured_bench(
        model, model_overrides, n_stages, iters, warmup, link, prof, progress, pool
    ) as bench:
        bench.profile(seq_len, grid(seq_len, prof.granularity, 16))
        rows = [
            bench.without_with(seq_len, b, eps)
            for b in tqdm(batches, desc="main results", disable=not progress)
        ]
    return Rows(pd.DataFrame(rows))


TABLE = Table(
    "main_results",
    "Figure 5 / Table 2",
    "Main results: every setting without and with TeraPipe",
    {
        "simulate": TableMode(
            simulate,
            figure=lambda rows: plots.main_results_figure(rows.df, findings.SPEEDUP_TOLERANCE),
            findings=lambda df: "\n".join(
                (findings.speedup_targets(df, "setting"), findings.virtual_baselines(df))
            ),
            columns="setting model latency_gpipe paper_latency_gpipe latency_interleaved_1f1b "
            "v_interleaved_1f1b latency_terapipe paper_latency_terapipe speedup paper_speedup "
            "err_speedup speedup_over_interleaved",
            compare=Comparison(("setting",), "speedup", "paper_speedup", ("model",)),
        ),
        "measure": TableMode(
            measure,
            figure=lambda rows: (
                plots.main_results_figure(rows.df, findings.SPEEDUP_TOLERANCE)
                if from_nodes(rows.df)
                else plots.measured_figure(rows.df, "pipeline_batch")
            ),
            findings=lambda df: (
                findings.speedup_targets(df, "setting") if from_nodes(df) else findings.measured(df)
            ),
            columns="setting model pipeline_batch latency_gpipe latency_gpipe_std "
            "simulated_latency_gpipe paper_latency_gpipe latency_terapipe latency_terapipe_std "
            "simulated_latency_terapipe paper_latency_terapipe speedup simulated_speedup "
            "paper_speedup err_speedup tflops_per_gpu peak_memory_gib_terapipe plan",
            compare=Comparison(("pipeline_batch",), "speedup"),
        ),
    },
)
