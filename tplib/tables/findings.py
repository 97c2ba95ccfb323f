"""The findings a table states, as markdown, computed from its rows.

Simulate mode checks the paper's claims on our numbers and the simulator's fidelity
targets (every speedup within ±15% of the paper's, GPipe latencies within ±10% with the
rows held out of the fit named, the paper's own plans within ±15% of its measured
latencies; the DP's longer-slices-first plans; the ablation's ordering); measure mode
states the measured effect and how far the simulator's prediction is from each
measurement. Every sentence is derived from the DataFrame, never written in advance.
"""

from __future__ import annotations

import pandas as pd

from tplib.plan import Plan

__all__ = [
    "SPEEDUP_TOLERANCE",
    "ablation_targets",
    "fidelity_extras",
    "measured",
    "speedup_targets",
    "virtual_baselines",
]

SPEEDUP_TOLERANCE = 0.15  # predicted speedup within +-15% of the paper's
_GPIPE_TOLERANCE = 0.10  # simulated GPipe latency within +-10% of the paper's
_PLAN_TOLERANCE = 0.15  # the paper's own plan, simulated, within +-15% of its latency
_BEYOND_COLUMNS = (
    "tflops_per_gpu",
    "paper_tflops_per_gpu",
    "latency_terapipe_zb",
    "latency_1f1b_zb",
    "speedup_zb",
    "gain_zb_over_terapipe",
)
_PAPER_PLAN_COLUMNS = (
    "paper_plan",
    "latency_paper_plan",
    "paper_latency_terapipe",
    "err_latency_paper_plan",
    "gpipe_row",
    "err_latency_gpipe",
)


def _longer_first(scheme: str) -> bool:
    """Whether every batch slice's token slices do not grow from first to last half."""
    p = Plan.from_paper(scheme)
    for ts in p.token_slices:
        half = len(ts) // 2
        if half and sum(ts[:half]) / half < sum(ts[-half:]) / half:
            return False
    return True


def _within(errors: pd.Series, tolerance: float) -> str:
    inside = int((errors.abs() <= tolerance).sum())
    return f"{inside} of {len(errors)} within ±{tolerance:.0%}"


def speedup_targets(df: pd.DataFrame, key: str) -> str:
    """Which rows (identified by ``key``) meet the fidelity targets: the speedup within
    ±15% (and how many within ±10%), the GPipe latency within ±10% (held-out rows named),
    the paper's own plan within ±15%; and the plans' shape."""
    lines = [
        f"- speedup: {_within(df.err_speedup, SPEEDUP_TOLERANCE)} of the paper's, "
        f"{_within(df.err_speedup, 0.10)}; largest error {df.err_speedup.abs().max():.1%}."
    ]
    for _, r in df[df.err_speedup.abs() > SPEEDUP_TOLERANCE].iterrows():
        lines.append(
            f"  - **miss** {key} {r[key]}: ours {r.speedup:.2f}x, paper {r.paper_speedup:.2f}x "
            f"({r.err_speedup:+.1%}); our plan `{r.plan}`, the paper's `{r.paper_plan}`"
        )
    err_g = df.err_latency_gpipe
    lines.append(f"- GPipe latency: {_within(err_g, _GPIPE_TOLERANCE)} of the paper's.")
    if "gpipe_row" in df.columns:
        held = df[df.gpipe_row == "held out"]
        lines.append(
            "  - rows the calibration's fit did not see: "
            + ", ".join(f"{r[key]} {r.err_latency_gpipe:+.1%}" for _, r in held.iterrows())
        )
    for _, r in df[err_g.abs() > _GPIPE_TOLERANCE].iterrows():
        lines.append(f"  - **miss** {key} {r[key]}: {r.err_latency_gpipe:+.1%}")
    if "err_latency_paper_plan" in df.columns:
        err_p = df.err_latency_paper_plan
        lines.append(
            f"- the paper's own plans, simulated: {_within(err_p, _PLAN_TOLERANCE)} of its "
            f"measured TeraPipe latency; largest error {err_p.abs().max():.1%}."
        )
        for _, r in df[err_p.abs() > _PLAN_TOLERANCE].iterrows():
            lines.append(f"  - **miss** {key} {r[key]}: {r.err_latency_paper_plan:+.1%}")
    shaped = [_longer_first(x) for x in df.plan]
    lines.append(
        f"- DP plans with longer slices first (mean of the first half >= the last half): "
        f"{sum(shaped)} of {len(df)}."
    )
    return "\n".join(lines)


def fidelity_extras(df: pd.DataFrame, key: str) -> dict[str, pd.DataFrame]:
    """The tables a simulated results notebook shows beside its main one (kept narrow
    enough for a notebook panel): the plans, the paper's own plans on our cluster model,
    throughput with the zero-bubble schedules beyond the paper, and (where the rows have
    them) the virtual-stage schedules beyond it."""
    beyond = [c for c in _BEYOND_COLUMNS if c in df.columns]
    extras = {
        "our plans beside the paper's": df[[key, "plan", "paper_plan"]],
        "the paper's own plans on our cluster model": df[[key, *_PAPER_PLAN_COLUMNS]],
        "throughput, and zero-bubble schedules beyond the paper": df[[key, *beyond]],
    }
    if "speedup_over_interleaved" in df.columns:
        extras[_VIRTUAL_TITLE] = df[[key, *_VIRTUAL_COLUMNS]]
    return extras


_VIRTUAL_TITLE = "interleaved 1F1B and TeraPipe over virtual stages, beyond the paper"
_VIRTUAL_COLUMNS = (
    "latency_gpipe",
    "latency_interleaved_1f1b",
    "v_interleaved_1f1b",
    "latency_terapipe",
    "speedup",
    "speedup_over_interleaved",
    "latency_terapipe_interleaved",
    "v_terapipe_interleaved",
    "speedup_terapipe_interleaved",
    "latency_terapipe_bfs",
    "v_terapipe_bfs",
    "speedup_terapipe_bfs",
    "note_interleaved_1f1b",
    "note_terapipe_interleaved",
)


def virtual_baselines(df: pd.DataFrame) -> str:
    """Beyond the paper: TeraPipe's speedup over interleaved 1F1B at its best v beside its
    speedup over GPipe, where interleaving pays, and TeraPipe's own slices over virtual
    stages against TeraPipe."""
    if "speedup_over_interleaved" not in df.columns:
        return ""
    over, gp = df.speedup_over_interleaved, df.speedup
    lines = [
        f"- TeraPipe over interleaved 1F1B (best v): {over.min():.2f}x to {over.max():.2f}x "
        f"(over GPipe: {gp.min():.2f}x to {gp.max():.2f}x)."
    ]
    chunked = df[df.v_interleaved_1f1b > 1]
    where = ", ".join(f"{r.setting} (v={r.v_interleaved_1f1b})" for r in chunked.itertuples())
    lines.append(
        f"  - interleaving (v > 1) was interleaved 1F1B's best in settings {where}; elsewhere "
        "v = 1, plain 1F1B."
        if len(chunked)
        else "  - v = 1, plain 1F1B, was interleaved 1F1B's best in every setting."
    )
    refused = df[df.note_interleaved_1f1b.fillna("") != ""]
    if len(refused):
        lines.append(
            "  - v > 1 could not run for want of microbatches (Megatron's rule: as many as "
            f"stages) in settings {', '.join(str(n) for n in refused.setting)}."
        )
    for name, label in (("terapipe_bfs", "breadth-first"), ("terapipe_interleaved", "interleaved")):
        gain = df.latency_terapipe / df[f"latency_{name}"]
        better = df[(gain > 1) & (df[f"v_{name}"] > 1)]
        lines.append(
            f"- TeraPipe's slices {label} over v > 1 chunks beat TeraPipe in "
            f"{len(better)} of {len(df)} settings"
            + (
                ": "
                + ", ".join(
                    f"{r.setting} (v={getattr(r, f'v_{name}')}, {g:.2f}x)"
                    for r, g in zip(better.itertuples(), gain[better.index], strict=True)
                )
                if len(better)
                else ""
            )
            + "."
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
        paper_best = uni.iloc[int(uni.paper_latency.to_numpy().argmin())]
        paper_dp = float(part.paper_latency[part.algorithm == "DP"].iloc[0])
        ours_best = uni.iloc[int(uni.latency.to_numpy().argmin())]
        lines.append(
            f"- setting ({n}): DP {dp:.3f} s vs best uniform ({ours_best.algorithm}) "
            f"{best_uniform:.3f} s: the DP {best_uniform / dp:.2f}x faster; the paper's "
            f"{paper_best.paper_latency / paper_dp:.2f}x (DP {paper_dp:.3f} s vs "
            f"{paper_best.algorithm} {paper_best.paper_latency:.3f} s); full ranking "
            f"identical to the paper's: {'yes' if same_order else 'no'}"
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
