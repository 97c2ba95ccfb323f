"""Benchmark planning for packed batches: DP, snap rule and plan cache, per batch.

Not a test. For paper settings (5), (6) and (9) at L = 2048 on the V100 cluster model
(:class:`~tplib.cluster.ClusterCostModel` of the setting, as the tables build it), the
model is fitted once to a :class:`~tplib.planner.PackedCost` (its worst relative residual
is printed, and the DGX H100 model's beside it). Then, over a stream of packed batches of
the setting's B / #Data rows, each batch is planned by

- ``dp``: :func:`~tplib.planner.plan_packed` (eps = 0.1 ms, batch slices of at most
  ``--bmax`` rows);
- ``snap``: :func:`~tplib.planner.snap_uniform`, with the slice count and batch-slice
  size of the plan for unpacked rows (planned once per setting);
- ``whole``: that unpacked plan itself, unchanged for every batch;
- ``cache``: :class:`~tplib.planner.PlanCache` in front of the DP, at several buckets.

Documents: the packed-sequences table's stream (:func:`~tplib.tables.packed_sequences.batches`
over :func:`~tplib.nn.doc_lengths.document_stream`): log-normal lengths of median 256
tokens (sigma 1), or the standard library's files as byte-token documents; packed
first-fit decreasing into rows of L tokens, documents longer than L cut into L-token
pieces, the rest of each row padding, what a batch leaves out carried to the next.

The iteration time is the fill-drain latency ``sum t + (K - 1) max t`` of the plan on the
packed rows (:func:`~tplib.planner.packed_latency` on the fitted cost: the planner's
objective, without the gradient all-reduce and the optimizer step). The fit table's
``plan_loss_pct`` says what the fit costs a plan: unpacked rows planned on the fit and
priced on the cluster model, against :func:`~tplib.planner.exact_joint` on the model. Planning times are
wall-clock on this machine, one core. Prints pandas tables::

    .venv/bin/python scripts/bench_planner_packed.py             # 200 batches, (5) (6) (9)
    .venv/bin/python scripts/bench_planner_packed.py --quick     # 20 batches, setting (9)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from tplib.documents import Documents
from tplib.nn.doc_lengths import document_stream
from tplib.paper import setting
from tplib.plan import Plan
from tplib.planner import (
    PackedCost,
    PlanCache,
    exact_joint,
    packed_latency,
    pipeline_latency,
    plan_packed,
    snap_uniform,
)
from tplib.planner.cost_table import slice_time_table
from tplib.search.setting import EPS, cost_model
from tplib.tables.packed_sequences import PLATFORMS
from tplib.tables.packed_sequences import batches as packed_batches

T = TypeVar("T")
L = 2048
BUCKETS = (8, 64, 256, L)


def timed(f: Callable[[], T]) -> tuple[T, float]:
    """``f()`` and the milliseconds it took."""
    start = time.perf_counter()
    out = f()
    return out, 1e3 * (time.perf_counter() - start)


def fit_table(settings: list[int], bmax: int) -> pd.DataFrame:
    out = []
    for i in settings:
        s = setting(i)
        K, B, b = s.n_stages, s.pipeline_batch, min(bmax, s.pipeline_batch)
        for name, (calibration, platform) in zip(
            ("V100 (paper)", "DGX H100 (flash)"), PLATFORMS.values(), strict=True
        ):
            model = cost_model(s, calibration, on=platform)
            fit, ms = timed(partial(PackedCost.fit, model, seq_len=L, max_batch_slice_size=b))
            grid = slice_time_table(model, seq_len=L, max_batch_slice_size=b)[1:]
            k, j = np.nonzero(np.isfinite(grid[0]))
            rel = np.concatenate(
                [np.abs(fit.slice_time(x + 1, 8 * k, 8 * j) / grid[x, k, j] - 1) for x in range(b)]
            )
            # What the fit costs a plan: unpacked rows planned on it, priced on the model,
            # against exact_joint's plan on the model itself.
            whole = Documents.whole(B, L)
            ours = plan_packed(fit, whole, n_stages=K, eps=EPS, max_batch_slice_size=b)
            best = exact_joint(
                model, seq_len=L, batch=B, n_stages=K, eps=EPS, max_batch_slice_size=b
            )
            loss = pipeline_latency(ours, model, K) / pipeline_latency(best, model, K) - 1
            out.append(
                dict(setting=f"({i})", cluster=name, b_max=b, worst=fit.residual,
                     p95=np.quantile(rel, 0.95), median=np.median(rel), fit_ms=ms,
                     plan_loss_pct=100 * loss)
            )  # fmt: skip
    return pd.DataFrame(out)


@dataclass(frozen=True)
class Batch:
    """One packed batch, its DP plan and what each way of planning it gives."""

    docs: Documents
    dp: Plan
    dp_ms: float
    snap_ms: float
    t_dp: float  # seconds of the iteration under each plan
    t_snap: float
    t_whole: float


def run_batches(
    i: int, source: str, n_batches: int, bmax: int, seed: int
) -> tuple[dict[str, Any], list[Batch], Callable[[Plan, Documents], float]]:
    """Plan ``n_batches`` packed batches of setting ``i``: the summary row, the batches
    and the iteration time of any plan on any of them."""
    s = setting(i)
    B, K, b = s.pipeline_batch, s.n_stages, min(bmax, s.pipeline_batch)
    cost = PackedCost.fit(cost_model(s), seq_len=L, max_batch_slice_size=b)
    whole = plan_packed(cost, Documents.whole(B, L), n_stages=K, eps=EPS, max_batch_slice_size=b)
    n_slices, size = max(map(len, whole.token_slices)), max(whole.batch_slices)

    def latency(p: Plan, docs: Documents) -> float:
        return packed_latency(p, cost, docs, K)

    stream = document_stream(source, seq_len=L, seed=seed)
    batches, n_docs = [], []
    for packing in packed_batches(stream, rows=B, n_batches=n_batches, packed=True):
        docs = packing.documents()
        dp, dp_ms = timed(
            partial(plan_packed, cost, docs, n_stages=K, eps=EPS, max_batch_slice_size=b)
        )
        snap, snap_ms = timed(partial(snap_uniform, docs, n_slices, batch_slices=size))
        t = [latency(p, docs) for p in (dp, snap, whole)]
        batches.append(Batch(docs, dp, dp_ms, snap_ms, *t))
        n_docs.append(np.mean([len(x) - 1 for x in docs.bounds]))
    t_dp = float(np.mean([x.t_dp for x in batches]))
    dp_ms = float(np.mean([x.dp_ms for x in batches]))
    summary = dict(
        setting=f"({i})", docs=source, B=B, K=K, b_max=b, docs_per_row=np.mean(n_docs),
        whole_plan=f"{len(whole.batch_slices)}x{size} rows, {n_slices} slices",
        dp_ms=dp_ms, dp_ms_max=max(x.dp_ms for x in batches),
        snap_ms=np.mean([x.snap_ms for x in batches]), iteration_s=t_dp,
        dp_pct=100 * dp_ms / (1e3 * t_dp),
        snap_vs_dp_pct=100 * (np.mean([x.t_snap for x in batches]) / t_dp - 1),
        whole_vs_dp_pct=100 * (np.mean([x.t_whole for x in batches]) / t_dp - 1),
    )  # fmt: skip
    return summary, batches, latency


def planned(plan: Plan, docs: Documents) -> Plan:
    """The batch's DP plan, made already (its time is the batch's ``dp_ms``)."""
    return plan


def cache_rows(
    label: dict[str, str], batches: list[Batch], latency: Callable[[Plan, Documents], float]
) -> list[dict[str, Any]]:
    """A PlanCache per bucket in front of the DP (a miss pays that batch's DP)."""
    out = []
    t_dp = np.mean([x.t_dp for x in batches])
    for bucket in BUCKETS:
        cache = PlanCache(bucket=bucket)
        hit_ms, plan_ms, used = [], [], []
        for x in batches:
            hits = cache.hits
            p, ms = timed(partial(cache.get_or_plan, x.docs, partial(planned, x.dp)))
            if cache.hits > hits:
                hit_ms.append(ms)
            plan_ms.append(ms if cache.hits > hits else x.dp_ms + ms)
            used.append(latency(p, x.docs))
        out.append(
            dict(**label, bucket=bucket, hit_rate=cache.hit_rate,
                 hit_ms=np.mean(hit_ms) if hit_ms else np.nan, plan_ms=np.mean(plan_ms),
                 plan_pct=100 * np.mean(plan_ms) / (1e3 * np.mean(used)),
                 vs_dp_pct=100 * (np.mean(used) / t_dp - 1))
        )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="packed batches per setting")
    parser.add_argument("--settings", type=int, nargs="+", default=[5, 6, 9])
    parser.add_argument("--bmax", type=int, default=4, help="most rows in a batch slice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 batches of setting (9)")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.settings = 20, [9]
    pd.set_option("display.width", 200, "display.max_columns", 30, "display.precision", 3)
    print("== PackedCost fits: relative residuals over the unpacked grid (g = 8, L = 2048)")
    print(fit_table(args.settings, args.bmax).to_string(index=False))
    summaries, caches = [], []
    for i in args.settings:
        for source in ("lognormal", "corpus"):
            summary, batches, latency = run_batches(i, source, args.batches, args.bmax, args.seed)
            summaries.append(summary)
            caches += cache_rows({"setting": f"({i})", "docs": source}, batches, latency)
    print(f"\n== Per batch, mean over {args.batches} batches (ms: planning wall-clock)")
    print(pd.DataFrame(summaries).to_string(index=False))
    print("\n== PlanCache in front of the DP: planning per batch (misses pay the DP)")
    print(pd.DataFrame(caches).to_string(index=False))


if __name__ == "__main__":
    main()
