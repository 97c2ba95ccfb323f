"""The long-context study on this machine: a long sequence of the small model, sliced in
time by three rules or split in space by context parallelism, measured beside the
simulator (``long_context`` in measure mode).

Four configurations of the ``long`` model (L = 8192) on two local processes:

=================  ==========================================================================
``method``         what runs
=================  ==========================================================================
``terapipe``       2 stages, ``terapipe``, the DP's plan on the stages' measured profiles
``seq1f1b``        2 stages, ``1f1b`` over Seq1F1B's equal-FLOP slices (its best k on the
                   same profiles, :func:`~tplib.planner.seq1f1b.best_seq1f1b`)
``uniform``        2 stages, ``terapipe``, equal slices (the best count of 1, 2, 4, ...,
                   :func:`~tplib.planner.evaluate.best_uniform`)
``cp``             1 stage on 2 CP ranks (ring attention), the whole sequences unsliced
=================  ==========================================================================

Every configuration runs ``iters`` timed iterations per round, the four in turn, for
``rounds`` rounds (A B C D A B C D ...), so a slow spell of the machine falls on all of
them. ``latency`` is the median of every timed iteration of a configuration,
``latency_round_min`` / ``_max`` the spread of its rounds' medians. Beside it the
simulator's prediction from the same profiles, link and measured contention, with the
processes sharing this machine's cores (:mod:`tplib.measure.harness`; the CP run priced
by :mod:`tplib.measure.context_parallel`), and its error.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
from tqdm.auto import tqdm

from tplib.measure.options import Profiling
from tplib.plan import Plan
from tplib.tables.base import Rows

if TYPE_CHECKING:
    from tplib.measure.harness import Bench, Measured
    from tplib.runtime import LocalPool

__all__ = ["CPU_METHODS", "measure"]

CPU_METHODS = ("terapipe", "seq1f1b", "uniform", "cp")


def _configurations(
    bench: Bench, seq_len: int, batch: int, n_cp: int, eps: float
) -> dict[str, tuple[str, Plan, dict[str, Any]]]:
    """Each method's schedule, plan and run options, planned on the profiles."""
    from tplib.measure.pricing import BottleneckCost
    from tplib.planner.evaluate import best_uniform
    from tplib.planner.seq1f1b import FlopModel, best_seq1f1b
    from tplib.runtime import Parallelism

    profiles = bench.profiles[seq_len]
    cost, g = BottleneckCost(profiles), profiles[0].granularity
    seq = best_seq1f1b(
        cost, FlopModel.of(bench.cfg), seq_len=seq_len, batch=batch,
        n_stages=bench.n_stages, granularity=g,
    )  # fmt: skip
    uniform = best_uniform(cost, seq_len, batch, bench.n_stages, granularity=g)
    return {
        "terapipe": ("terapipe", bench.plan(seq_len, batch, eps), {}),
        "seq1f1b": ("1f1b", seq, {}),
        "uniform": ("terapipe", uniform, {}),
        "cp": ("gpipe", Plan.gpipe(batch, seq_len), {"parallelism": Parallelism(n_cp=n_cp)}),
    }


def _row(method: str, schedule: str, plan: Plan, runs: list[Measured]) -> dict[str, Any]:
    every = [t for m in runs for t in m.latencies]
    latency = statistics.median(every)
    by_round = [m.latency for m in runs]
    sim = statistics.median(m.sim.latency for m in runs)
    dedicated = statistics.median(m.sim_dedicated.latency for m in runs)
    return {
        "method": method,
        "schedule": schedule,
        "plan": plan.to_paper(),
        "n_slices": len(plan.token_slices[0]),
        "latency": latency,
        "latency_round_min": min(by_round),
        "latency_round_max": max(by_round),
        "simulated_latency": sim,
        "err_simulated_latency": sim / latency - 1.0,
        "simulated_latency_dedicated": dedicated,
        "err_simulated_latency_dedicated": dedicated / latency - 1.0,
        "busy_cores": statistics.fmean(m.busy_cores for m in runs),
        "iterations": len(every),
    }


def measure(
    seq_len: int = 8192,
    batch: int = 1,
    model: str = "long",
    model_overrides: Mapping[str, object] | Sequence[tuple[str, object]] = (),
    n_stages: int = 2,
    n_cp: int = 2,
    methods: Sequence[str] = CPU_METHODS,
    rounds: int = 3,
    iters: int = 2,
    warmup: int = 1,
    eps: float = 0.0,
    profiling: Profiling | Mapping[str, Any] = Profiling(granularity=512),
    link: Sequence[float] | None = None,
    pool: LocalPool | None = None,
    progress: bool = True,
) -> Rows:
    """The four configurations of the module docstring at ``seq_len`` with ``batch``
    sequences, each measured in ``rounds`` alternating rounds of ``iters`` iterations
    (after ``warmup`` untimed ones per round), beside the simulator."""
    if bad := [m for m in methods if m not in CPU_METHODS]:
        raise ValueError(f"methods={bad!r}: choose among {list(CPU_METHODS)}")
    if rounds < 1 or n_cp < 2 or n_cp != n_stages:
        raise ValueError(
            f"rounds={rounds}, n_cp={n_cp}, n_stages={n_stages}: need rounds >= 1 and #CP = "
            "#Pipe >= 2, so that every configuration runs on the same processes"
        )
    from tplib.measure.harness import measured_bench  # starts processes: torch

    prof = Profiling.of(profiling)
    with measured_bench(
        model, model_overrides, n_stages, iters, warmup, link, prof, progress, pool
    ) as bench:
        bench.profile(seq_len, prof.granularity or 512)
        configs = _configurations(bench, seq_len, batch, n_cp, eps)
        runs: dict[str, list[Measured]] = {m: [] for m in methods}
        for _ in tqdm(range(rounds), desc="rounds", disable=not progress):
            for m in methods:
                schedule, plan, options = configs[m]
                runs[m].append(bench.run(schedule, plan, **options))
        rows = [
            {"model": model, "seq_len": seq_len, "batch": batch}
            | _row(m, configs[m][0], configs[m][1], runs[m])
            for m in methods
        ]
    df = pd.DataFrame(rows)
    df["speedup_over_uniform"] = (
        df.latency[df.method == "uniform"].iloc[0] / df.latency
        if "uniform" in set(df.method)
        else float("nan")
    )
    return Rows(df)
