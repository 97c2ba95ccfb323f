"""Figure 7 / Table 4, longer sequences: GPT3-13B at growing L, without and with TeraPipe.

``simulate``: setting (5) at L = 2048, 4096, 6144 and 8192 with B = 32, 8, 4 and 2 (the
paper shrank the batch to fit memory), on the V100-cluster model, beside the paper.
``measure``: L = 512..4096 with the batch shrinking, on real local processes (K = 2), the
simulator's prediction beside each measurement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
from tqdm.auto import tqdm

from tplib.cluster import CALIBRATION, Calibration
from tplib.measure import TABLE_MODEL, Profiling, grid
from tplib.paper import GPIPE, SEQLEN_BATCH, TERAPIPE, seqlen_row
from tplib.search.setting import EPS, Method, beside_paper, simulate_setting
from tplib.tables import findings, plots
from tplib.tables.base import Comparison, Rows, Table, TableMode
from tplib.tables.nodes import from_nodes, run_settings

if TYPE_CHECKING:
    from tplib.runtime import LocalPool

__all__ = ["TABLE", "measure", "simulate"]


def simulate(
    seq_lens: Iterable[int] = tuple(SEQLEN_BATCH),
    method: Method = "exact",
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
) -> Rows:
    """Setting (5) at each L of ``seq_lens`` (with Table 4's batch), simulated, beside the
    paper."""
    rows = []
    for seq_len in seq_lens:
        r = simulate_setting(5, seq_len=seq_len, method=method, eps=eps, calibration=calibration)
        rows.append(beside_paper(r, seqlen_row(seq_len, GPIPE), seqlen_row(seq_len, TERAPIPE)))
    df = pd.DataFrame(rows)
    return Rows(df, findings.fidelity_extras(df, "seq_len"))


def measure(
    seq_lens: Sequence[int] = (512, 1024, 2048, 4096),
    batches: Sequence[int] = (8, 4, 2, 1),
    *,
    model: str = TABLE_MODEL[0],
    model_overrides: Mapping[str, object] | Sequence[tuple[str, object]] = TABLE_MODEL[1],
    n_stages: int = 2,
    iters: int = 3,
    warmup: int = 1,
    n_grid: int = 16,
    eps: float = 0.0,
    profiling: Profiling | Mapping[str, Any] = Profiling(),
    link: Sequence[float] | None = None,
    pool: LocalPool | None = None,
    progress: bool = True,
    launch: Mapping[str, Any] | None = None,
    plan: str = "cluster",
    precision: str = "fp16",
) -> Rows:
    """Table 4 at CPU scale: L growing while the pipeline batch shrinks (pairs of
    ``seq_lens`` and ``batches``), GPipe against TeraPipe's DP plan, measured and
    simulated. Each L is profiled once, on a grid of ``n_grid`` slice lengths (or of
    ``profiling.granularity`` tokens), and shared by both schedules.

    On GPU nodes: with a ``launch`` description, setting (5) at each of ``seq_lens``
    (the paper's 2048..8192; ``batches`` are then the paper's) at full scale (see
    :mod:`tplib.tables.nodes`)."""
    if launch is not None:
        return Rows(
            run_settings([(5, L) for L in seq_lens], launch, plan=plan, precision=precision)
        )
    if len(seq_lens) != len(batches):
        raise ValueError(
            f"seq_lens {list(seq_lens)} and batches {list(batches)} differ in length: "
            "give one batch size per sequence length"
        )
    from tplib.measure.harness import measured_bench  # starts processes: torch

    prof = Profiling.of(profiling)
    grids = {L: grid(L, prof.granularity, n_grid) for L in seq_lens}
    rows = []
    with measured_bench(
        model, model_overrides, n_stages, iters, warmup, link, prof, progress, pool
    ) as bench:
        pairs = list(zip(seq_lens, batches, strict=True))
        for L, b in tqdm(pairs, desc="sequence lengths", disable=not progress):
            # Profiled just before its runs: this machine's speed drifts over minutes.
            bench.profile(L, grids[L])
            rows.append(bench.without_with(L, b, eps))
    return Rows(pd.DataFrame(rows))


TABLE = Table(
    "seqlen_sweep",
    "Figure 7 / Table 4",
    "Longer sequences: GPT3-13B at growing L, without and with TeraPipe",
    {
        "simulate": TableMode(
            simulate,
            figure=lambda rows: plots.seqlen_figure(rows.df, findings.SPEEDUP_TOLERANCE),
            findings=lambda df: findings.speedup_targets(df, "seq_len"),
            columns="seq_len pipeline_batch latency_gpipe paper_latency_gpipe "
            "latency_terapipe paper_latency_terapipe speedup paper_speedup err_speedup",
            compare=Comparison(("seq_len",), "speedup", "paper_speedup", ("pipeline_batch",)),
        ),
        "measure": TableMode(
            measure,
            figure=lambda rows: (
                plots.seqlen_figure(rows.df, findings.SPEEDUP_TOLERANCE)
                if from_nodes(rows.df)
                else plots.measured_figure(rows.df, "seq_len")
            ),
            findings=lambda df: (
                findings.speedup_targets(df, "seq_len") if from_nodes(df) else findings.measured(df)
            ),
            columns="seq_len pipeline_batch latency_gpipe latency_gpipe_std "
            "simulated_latency_gpipe latency_terapipe latency_terapipe_std "
            "simulated_latency_terapipe speedup simulated_speedup paper_speedup err_speedup "
            "tflops_per_gpu peak_memory_gib_terapipe plan",
            compare=Comparison(("seq_len",), "speedup", None, ("pipeline_batch",)),
        ),
    },
)
