"""The findings a table states, as markdown, computed from its rows.

Simulate mode checks the paper's claims on our numbers (the speedup within ±20% of the
paper's, the DP's longer-slices-first plans, the ablation's ordering); measure mode
states the measured effect and how far the simulator's prediction is from each
measurement. Every sentence is derived from the DataFrame, never written in advance.
"""

from __future__ import annotations

import pandas as pd

from tplib.plan import Plan

__all__ = ["SPEEDUP_TOLERANCE", "ablation_targets", "longer_first", "measured", "speedup_targets"]

SPEEDUP_TOLERANCE = 0.20  # predicted speedup within +-20% of the paper's


def longer_first(scheme: str) -> bool:
    """Whether every batch slice's token slices do not grow from first to last half."""
    p = Plan.from_paper(scheme)
    for ts in p.token_slices:
        half = len(ts) // 2
        if half and sum(ts[:half]) / half < sum(ts[-half:]) / half:
            return False
    return True


def speedup_targets(df: pd.DataFrame, key: str) -> str:
    """Which rows (identified by ``key``) meet the ±20% speedup target, and the plan shape."""
    lines = []
    misses = df[df.err_speedup.abs() > SPEEDUP_TOLERANCE]
    lines.append(
        f"- speedup within ±{SPEEDUP_TOLERANCE:.0%} of the paper: "
        f"{len(df) - len(misses)} of {len(df)} rows; "
        f"largest error {df.err_speedup.abs().max():.1%}."
    )
    for _, r in misses.iterrows():
        lines.append(
            f"  - **miss** {key} {r[key]}: ours {r.speedup:.2f}x, paper {r.paper_speedup:.2f}x "
            f"({r.err_speedup:+.1%}); our plan `{r.plan}`, the paper's `{r.paper_plan}`"
        )
    shaped = [longer_first(x) for x in df.plan]
    lines.append(
        f"- DP plans with longer slices first (mean of the first half >= the last half): "
        f"{sum(shaped)} of {len(df)}."
    )
    return "\n".join(lines)


def ablation_targets(df: pd.DataFrame) -> str:
    """Does each setting keep the paper's ordering (one slice worst, very fine slicing bad
    again, the DP best)?"""
    lines = []
    for n, part in df.groupby("setting", sort=False):
        uni = part[part.algorithm != "DP"]
        n_slices = uni.algorithm.str.extract(r"=(\d+)")[0].astype(int)
        one = float(uni.latency[n_slices == 1].iloc[0])
        finest = float(uni.latency[n_slices == n_slices.max()].iloc[0])
        best_uniform = float(uni.latency.min())
        dp = float(part.latency[part.algorithm == "DP"].iloc[0])
        checks = {
            "one slice is worst": one >= part.latency.max(),
            f"the finest slicing (#slices={n_slices.max()}) is worse than the best uniform": (
                finest > best_uniform
            ),
            "the DP is best": dp <= best_uniform,
        }
        same_order = list(part.sort_values("latency").algorithm) == list(
            part.sort_values("paper_latency").algorithm
        )
        lines.append(
            f"- setting ({n}): DP {dp:.3f} s vs best uniform {best_uniform:.3f} s "
            f"({best_uniform / dp:.2f}x); full ranking identical to the paper's: "
            f"{'yes' if same_order else 'no'}"
        )
        lines += [f"  - {'met' if ok else '**not met**'}: {name}" for name, ok in checks.items()]
    return "\n".join(lines)


def measured(df: pd.DataFrame) -> str:
    """Measure mode: the measured effect, and how well the simulator predicted each
    measurement (``err_simulated_latency*`` = simulated / measured median - 1)."""
    cols = [c for c in df.columns if c.startswith("err_simulated_latency") and "dedicated" not in c]
    errs = df[cols].abs()
    lines = [
        f"- simulator (shared cores) vs measured median latency: largest error "
        f"{errs.max().max():.1%}, mean {errs.mean().mean():.1%} over {errs.size} measurements."
    ]
    if "speedup" in df.columns:
        key = "pipeline_batch" if df.pipeline_batch.nunique() > 1 else "seq_len"
        for _, r in df.iterrows():
            lines.append(
                f"- {key}={r[key]}: TeraPipe {r.speedup:.2f}x faster than GPipe "
                f"(simulated {r.simulated_speedup:.2f}x); plan `{r.plan}`"
            )
    elif "algorithm" in df.columns:
        best = df.iloc[int(df.latency.to_numpy().argmin())]
        lines.append(
            f"- fastest measured: {best.algorithm} ({best.latency:.3f} s); the simulator "
            f"ranks the rows {list(df.simulated_rank)}, the measurements {list(df['rank'])}."
        )
    return "\n".join(lines)
