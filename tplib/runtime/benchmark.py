"""Iteration-latency and memory benchmark of the real runtime on local processes.

:func:`bench` trains a few iterations after warm-up and reports the median iteration
latency and the runtime's overhead: measured latency minus the busiest stage's own work
(its forwards, backwards and optimizer step, from the trace). The overhead is what
pipelining costs beyond the unavoidable work of the slowest stage: bubbles,
communication and bookkeeping. Beside the latency it reports each stage's measured peak
memory and what the analytic model (:func:`tplib.cluster.runtime_memory.rank_memory`) predicts
for the same configuration.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import pandas as pd

from tplib.cluster.memory import MemoryEstimate
from tplib.cluster.runtime_memory import rank_memory
from tplib.runtime.pool import launch, local_backend
from tplib.runtime.result import RunResult
from tplib.runtime.runconfig import RunConfig
from tplib.schedule import LOCAL_WORK
from tplib.schedule.chunks import part_of

__all__ = ["BenchResult", "bench", "busiest_stage_work", "modelled_memory"]


@dataclass(frozen=True)
class BenchResult:
    schedule: str
    model: str
    n_stages: int
    n_data: int
    n_op: int
    recompute: str
    precision: str
    device: str
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
    memory_source: str  # "counted" (CPU) or "allocator" (CUDA)
    stage_peak_bytes: tuple[int, ...]  # measured, the largest rank of each stage
    modelled_peak_bytes: tuple[float, ...]  # the analytic model's, each stage
    memory_error: float  # the largest |modelled / measured - 1| over the stages
    backend: str  # "gloo" or "nccl" (tplib.runtime.backend)
    # #CP; the modelled memory does not know it (each rank priced with whole slices)
    n_cp: int = 1

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def busiest_stage_work(trace: pd.DataFrame) -> pd.Series:
    """Per iteration: the largest total time any rank spent on its own work (forwards,
    backwards and the optimizer step; not waiting or communicating)."""
    work = trace[trace.kind.isin([k.value for k in LOCAL_WORK])]
    per_rank = (work.end - work.start).groupby([work.iteration, work["rank"]]).sum()
    return per_rank.groupby(level=0).max()


def modelled_memory(run: RunConfig) -> list[MemoryEstimate]:
    """The analytic model's peak memory of one rank of each stage of ``run`` (with
    virtual stages, of all the stage's chunks together)."""
    schedule, par = run.schedule, run.parallelism
    return [
        rank_memory(
            run.cfg,
            [run.ranges[part_of(schedule.placement, k, c)] for c in range(schedule.n_chunks)],
            # An asynchronous schedule's units span every iteration: its own plan names them.
            plan=schedule.plan,
            actions=schedule.actions[k],
            n_op=par.n_op,
            recompute=run.recompute,
            precision=run.precision,
            sequence_parallel=run.parallelism.sequence_parallel,
            optimizer_shards=par.n_data if par.distributed_optimizer else 1,
        )
        for k in range(schedule.n_stages)
    ]


def bench(
    run: RunConfig, result: RunResult | None = None, backend: str | None = None
) -> BenchResult:
    """Run ``run`` on local processes (unless a ``result`` is given) and summarise it.
    ``backend``: "nccl" or "gloo" instead of :func:`~tplib.runtime.pool.local_backend`'s
    choice."""
    backend = local_backend(run, backend).backend
    result = result or launch(run, backend=backend)
    latencies = result.iteration_s
    busiest = busiest_stage_work(result.trace)
    overhead = [lat - busiest[i] for i, lat in enumerate(latencies)]
    measured = result.stage_peak_bytes()
    modelled = [m.total for m in modelled_memory(run)]
    sources = {r.memory.source for r in result.ranks if r.memory is not None}
    return BenchResult(
        schedule=run.schedule_name,
        model=run.model,
        n_stages=run.parallelism.n_stages,
        n_data=run.parallelism.n_data,
        n_op=run.parallelism.n_op,
        recompute=run.recompute,
        precision=run.precision,
        device=run.device,
        batch=run.data.batch,
        seq_len=run.data.seq_len,
        n_slices=max(len(ts) for ts in run.plan.token_slices),
        plan=run.plan.to_paper(),
        iterations=len(latencies),
        median_latency_s=statistics.median(latencies),
        latency_mean_s=statistics.fmean(latencies),
        latency_std_s=statistics.stdev(latencies) if len(latencies) > 1 else 0.0,
        busiest_work_s=statistics.median(busiest.tolist()),
        overhead_s=statistics.median(overhead),
        memory_source="/".join(sorted(sources)),
        stage_peak_bytes=tuple(measured),
        modelled_peak_bytes=tuple(modelled),
        memory_error=max(
            (abs(m / x - 1) for m, x in zip(modelled, measured, strict=True) if x),
            default=float("nan"),  # memory was not counted
        ),
        backend=backend,
        n_cp=run.parallelism.n_cp,
    )
