"""The simulator against the runtime on this machine (the method behind measure mode).

Each stage of a K-stage pipeline is profiled here, the link between two local processes
is measured, how much the stages slow each other when they work at once is measured by
its own benchmark (:mod:`tplib.perfmodel.contention`), and the simulator prices every
schedule with those costs; then the real runtime trains the same configurations on
local processes. The target: the simulator within 10% of the measured median latency
for ``gpipe``, ``1f1b`` (both on microbatches of one sequence), ``terapipe`` and
``terapipe-zb`` (split backwards, weight gradients fused per sequence; both on token
slices) on 2 stages.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
from tqdm.auto import tqdm

from tplib.measure import Profiling, grid
from tplib.plan import Plan
from tplib.tables import plots
from tplib.tables.base import Comparison, Rows, Table, TableMode

if TYPE_CHECKING:
    from tplib.runtime import LocalPool

__all__ = ["TABLE", "measure"]

_TARGET = 0.10  # the simulator within 10% of the measured median latency
MICROBATCHED = ("gpipe", "1f1b")  # run on microbatches of one sequence, not token slices


def measure(
    model: str = "small",
    n_stages: int = 2,
    pipeline_batch: int = 2,
    seq_len: int = 1024,
    n_slices: int = 8,
    schedules: Sequence[str] = ("gpipe", "1f1b", "terapipe", "terapipe-zb"),
    iters: int = 5,
    warmup: int = 1,
    *,
    model_overrides: Mapping[str, object] | Sequence[tuple[str, object]] = (),
    profiling: Profiling | Mapping[str, Any] = Profiling(),
    link: Sequence[float] | None = None,
    pool: LocalPool | None = None,
    progress: bool = True,
) -> Rows:
    """Profile the stages of ``model`` for ``n_stages`` local processes, simulate each of
    ``schedules`` with those costs, run it for ``iters`` timed iterations after ``warmup``
    and compare. ``gpipe`` runs microbatches of one sequence, every other schedule the
    uniform plan of ``n_slices`` token slices per sequence; the profile's grid defaults
    to ``seq_len / n_slices`` tokens, so the plan's slices lie on it. The figure draws
    each schedule's measured and simulated timelines (``Rows.traces``)."""
    from tplib.measure.harness import measured_bench  # starts processes: torch

    prof = Profiling.of(profiling)
    g = grid(seq_len, prof.granularity, n_slices)
    rows, runs = [], {}
    with measured_bench(
        model, model_overrides, n_stages, iters, warmup, link, prof, progress, pool
    ) as bench:
        t0 = time.perf_counter()
        profiles = bench.profile(seq_len, g)
        t_profile = time.perf_counter() - t0
        contention = bench.contention.get(seq_len)
        measured_contention = contention.columns() if contention else {}
        for name in tqdm(schedules, desc="validating", disable=not progress):
            if name in MICROBATCHED:
                p = Plan.gpipe(pipeline_batch, seq_len)
            else:
                p = Plan.uniform(pipeline_batch, seq_len, n_token_slices=n_slices)
            m = bench.run(name, p)
            runs[name] = m
            rows.append(
                {
                    "schedule": name,
                    "model": model,
                    "n_stages": n_stages,
                    "pipeline_batch": pipeline_batch,
                    "seq_len": seq_len,
                    "n_slices": max(len(t) for t in p.token_slices),
                    "plan": p.to_paper(),
                    "iterations": iters,
                    **m.row(),
                    "holdout_error": max(max(pr.holdout_error) for pr in profiles),
                    "fwd_fraction": statistics.fmean(pr.fwd_fraction for pr in profiles),
                    "wgrad_fraction": statistics.fmean(pr.wgrad_fraction for pr in profiles),
                    "link_bandwidth": bench.link.bandwidth,
                    "link_latency": bench.link.latency,
                    "threads": profiles[0].threads,
                    **measured_contention,
                    "profile_seconds": t_profile,  # the contention benchmark's included
                }
            )
    return Rows(pd.DataFrame(rows), traces=runs)


def _findings(df: pd.DataFrame) -> str:
    def verdict(err: float) -> str:
        return "within" if abs(err) <= _TARGET else "OUTSIDE"

    lines = []
    first = df.iloc[0]
    if "contention_factors" in df:
        lines.append(
            f"- Stages working at once, measured by their own benchmark "
            f"({first['contention_rounds']} alone/together pairs per stage): each stage's "
            f"work stretches x{first['contention_factors']} (pairs "
            f"{first['contention_pairs_min']:.3f}..{first['contention_pairs_max']:.3f}); the "
            "shared-cores simulation applies it where stages overlap, the one-core-per-stage "
            "one does not."
        )
    for r in df.to_dict("records"):
        err, err_dedicated = r["err_simulated_latency"], r["err_simulated_latency_dedicated"]
        lines.append(
            f"- `{r['schedule']}`: measured {r['latency']:.4g} s median ({r['latency_mean']:.4g}"
            f" ± {r['latency_std']:.2g} s, {r['busy_cores']:.1f} cores busy with other jobs); "
            f"simulated {r['simulated_latency']:.4g} s, error {err:+.1%} ({verdict(err)} "
            f"{_TARGET:.0%}); a core per stage {r['simulated_latency_dedicated']:.4g} s, error "
            f"{err_dedicated:+.1%} ({verdict(err_dedicated)} {_TARGET:.0%})"
        )
    return "\n".join(lines)


TABLE = Table(
    "simulator_validation",
    "the method behind measure mode",
    "The simulator against measured iteration latency on this machine",
    {
        "measure": TableMode(
            measure,
            figure=lambda rows: plots.validation_figure(rows.df, rows.traces),
            findings=_findings,
            columns="schedule plan latency latency_std simulated_latency err_simulated_latency "
            "simulated_latency_dedicated err_simulated_latency_dedicated busy_cores "
            "contention holdout_error",
            compare=Comparison(("schedule",), "err_simulated_latency"),
        ),
    },
)
