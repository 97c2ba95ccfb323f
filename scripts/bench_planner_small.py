"""Benchmark the DP planner on the paper's small problems: Table 1 settings (6) and (9).

Both hold B = 2 sequences per pipeline on K = 96 stages at L = 2048. Each plan is made
as the main-results table makes it (:func:`tplib.search.setting.plan_terapipe`: the
V100-cluster cost model, granularity 8), with both joint methods and with eps = 0 and
the paper's eps = 0.1 ms. Not a test: it prints a table of milliseconds per plan over
repeated runs (median, min, max), in two conditions:

- ``cold``: a new cost model object each run, so the cost grid is asked of the model
  again (one ``slice_time`` call per batch-slice size), as when every plan prices
  something new;
- ``warm``: the same cost model object each run, whose grid the planner keeps
  (:func:`tplib.planner.cost_table.end_table`), as a training loop that plans every
  batch on one model.

    .venv/bin/python scripts/bench_planner_small.py              # 20 runs per row
    .venv/bin/python scripts/bench_planner_small.py --runs 50 --settings 9
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable

import pandas as pd

from tplib.paper import Setting, setting
from tplib.plan import Plan
from tplib.planner import SliceCostModel
from tplib.search.setting import EPS, GRANULARITY, Method, cost_model, plan_terapipe


def timed(plan: Callable[[SliceCostModel], Plan], costs: list[SliceCostModel]) -> list[float]:
    """Milliseconds of ``plan`` on each cost model in turn; every plan must be the same."""
    times, plans = [], set()
    for cost in costs:
        start = time.perf_counter()
        plans.add(repr(plan(cost)))
        times.append((time.perf_counter() - start) * 1e3)
    assert len(plans) == 1, f"planned differently across runs: {plans}"
    return times


def planner(s: Setting, method: Method, eps: float) -> Callable[[SliceCostModel], Plan]:
    """Setting ``s``'s plan on a cost model, as the main-results table makes it."""
    return lambda cost: plan_terapipe(s, method=method, eps=eps, cost=cost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed plans per row")
    parser.add_argument("--settings", type=int, nargs="+", default=[6, 9])
    args = parser.parse_args()
    rows = []
    for n in args.settings:
        s = setting(n)
        methods: tuple[Method, ...] = ("exact", "paper")
        for method, eps in itertools.product(methods, (0.0, EPS)):
            plan, kept = planner(s, method, eps), cost_model(s)
            plan(kept)  # the warm runs start with the grid kept
            # Cold: models built beforehand, so only the planning is timed.
            runs = {
                "cold": timed(plan, [cost_model(s) for _ in range(args.runs)]),
                "warm": timed(plan, [kept] * args.runs),
            }
            for grid, ms in runs.items():
                rows.append(
                    {
                        "setting": n,
                        "B": s.pipeline_batch,
                        "K": s.n_stages,
                        "method": method,
                        "eps_ms": eps * 1e3,
                        "grid": grid,
                        "median_ms": statistics.median(ms),
                        "min_ms": min(ms),
                        "max_ms": max(ms),
                    }
                )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"L = 2048, g = {GRANULARITY}, {args.runs} runs per row; load average {load}")
    with pd.option_context("display.float_format", "{:.2f}".format, "display.width", 120):
        print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
