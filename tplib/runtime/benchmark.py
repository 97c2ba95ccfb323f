"""Iteration-latency benchmark of the real runtime on local processes.

:func:`bench` trains a few iterations after warm-up and reports the median iteration
latency and the runtime's overhead: measured latency minus the busiest stage's own work
(its forwards, backwards and optimizer step, from the trace). The overhead is what
pipelining costs beyond the unavoidable work of the slowest stage: bubbles,
communication and bookkeeping.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import pandas as pd

from tplib.runtime.config import RunConfig
from tplib.runtime.pool import RunResult, launch
from tplib.schedule import LOCAL_WORK

__all__ = ["BenchResult", "bench", "busiest_stage_work"]


@dataclass(frozen=True)
class BenchResult:
    schedule: str
    model: str
    n_stages: int
    n_data: int
    batch: int
    seq_len: int
    n_slices: int
    plan: str
    iterations: int
    median_latency_s: float
    latency_mean_s: float
    latency_std_s: float
    busiest_work_s: float
    overhead_s: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def busiest_stage_work(trace: pd.DataFrame) -> pd.Series:
    """Per iteration: the largest total time any rank spent on its own work (forwards,
    backwards and the optimizer step; not waiting or communicating)."""
    work = trace[trace.kind.isin([k.value for k in LOCAL_WORK])]
    per_rank = (work.end - work.start).groupby([work.iteration, work["rank"]]).sum()
    return per_rank.groupby(level=0).max()


def bench(run: RunConfig, result: RunResult | None = None) -> BenchResult:
    """Run ``run`` on local processes (unless a ``result`` is given) and summarise it."""
    result = result or launch(run)
    latencies = result.iteration_s
    busiest = busiest_stage_work(result.trace)
    overhead = [lat - busiest[i] for i, lat in enumerate(latencies)]
    return BenchResult(
        schedule=run.schedule,
        model=run.model,
        n_stages=run.n_stages,
        n_data=run.n_data,
        batch=run.batch,
        seq_len=run.seq_len,
        n_slices=max(len(ts) for ts in run.plan.token_slices),
        plan=run.plan.to_paper(),
        iterations=len(latencies),
        median_latency_s=statistics.median(latencies),
        latency_mean_s=statistics.fmean(latencies),
        latency_std_s=statistics.stdev(latencies) if len(latencies) > 1 else 0.0,
        busiest_work_s=statistics.median(busiest.tolist()),
        overhead_s=statistics.median(overhead),
    )
