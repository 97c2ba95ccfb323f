"""Long context, 8K to 1M tokens: slice the sequence in time (TeraPipe, Seq1F1B), split it
in space (context parallelism), or both?

``simulate`` mode, on the cluster models (``measure`` mode: the same question at CPU scale on
this machine, :mod:`tplib.tables.long_context_measure`). A *study* is a model on a cluster with a GPU
count and a global batch (:data:`STUDIES`):

=========================  ===========  ===========================================
study                      GPUs         global batch
=========================  ===========  ===========================================
``GPT3-13B/dgx-h100``      64 (8 nodes)    4M tokens (2^22): 512 sequences at 8K, 4 at 1M
``GPT3-175B/dgx-h100``     512 (64 nodes)  4M tokens
``GPT3-13B/p3.16xlarge``   320 (setting (5))  Table 4's 16K tokens: B = 2 at 8K, then one
                                           sequence (the bridge to Table 4)
=========================  ===========  ===========================================

The DGX H100 studies run Megatron-LM's long-context configuration
(:data:`~tplib.search.long_context.LONG_CONTEXT`: FlashAttention-2, sequence parallelism,
the distributed optimizer); the p3.16xlarge study runs the paper's implementation
(unfused attention), where context parallelism cannot run (the cluster model prices its
ring with FlashAttention only), so its CP rows say so. For every study, length and
method (:data:`~tplib.search.long_context.METHODS`: ``1f1b``, ``interleaved-1f1b``,
``cp``, ``seq1f1b``, ``terapipe``, ``terapipe-zb``, ``terapipe-cp``) a row holds the
method's fastest layout that fits in the GPU's memory, by the memory model
(:func:`~tplib.search.long_context.best_layout`, recomputation searched), with its
iteration time, tokens per second per GPU, MFU and memory per GPU, or why nothing fits.

Extras:

- ``winners``: per study and L, the fastest method, the runner-up and the margin, the
  gain over 1F1B, and what separates the winner from the runner-up in their layouts
  (recomputation: memory; #CP: communication and attention split; pipeline depth and
  token slices: the bubble).
- ``dp_vs_seq1f1b``: TeraPipe's DP plan against Seq1F1B's equal-FLOP slicing on the
  same cost model (the Seq1F1B row's layout) and grid, each priced by the DP's objective
  ``sum t + (K - 1) max t`` (:func:`~tplib.planner.seq1f1b.compare_with_dp`): the DP is
  never slower, and ``margin`` says by how much Seq1F1B's slicing is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from tplib.cluster.calibration import CALIBRATIONS
from tplib.cluster.implementation import PAPER_PLATFORM, Platform
from tplib.planner.seq1f1b import FlopModel, compare_with_dp
from tplib.search.long_context import (
    LONG_CONTEXT,
    METHODS,
    LongContextResult,
    best_layout,
    layout_cost,
    search_grid,
)
from tplib.tables.base import Comparison, Rows, Table, TableMode
from tplib.tables.long_context_measure import measure

__all__ = ["LENGTHS", "STUDIES", "TABLE", "Study", "dp_summary", "findings", "simulate", "winners"]

LENGTHS = (8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)
_RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}
_TOKEN_SLICED = ("terapipe", "terapipe-zb", "seq1f1b")


@dataclass(frozen=True)
class Study:
    """A model on a cluster: GPUs, the global batch in tokens (at least one sequence) and
    the platform's hardware and training code."""

    model: str
    n_gpus: int
    batch_tokens: int
    platform: Platform

    def batch(self, seq_len: int) -> int:
        """Sequences per iteration at ``seq_len``."""
        return max(1, self.batch_tokens // seq_len)


STUDIES: dict[str, Study] = {
    "GPT3-13B/dgx-h100": Study("GPT3-13B", 64, 2**22, LONG_CONTEXT),
    "GPT3-175B/dgx-h100": Study("GPT3-175B", 512, 2**22, LONG_CONTEXT),
    "GPT3-13B/p3.16xlarge": Study("GPT3-13B", 320, 2 * 8192, PAPER_PLATFORM),
}


def _check(studies: Sequence[str], seq_lens: Sequence[int], methods: Sequence[str]) -> None:
    if bad := [s for s in studies if s not in STUDIES]:
        raise ValueError(f"studies={bad!r}: choose among {list(STUDIES)}")
    if bad_m := [m for m in methods if m not in METHODS]:
        raise ValueError(f"methods={bad_m!r}: choose among {list(METHODS)}")
    if bad_l := [L for L in seq_lens if not isinstance(L, int) or L < 1024 or L % 1024]:
        raise ValueError(f"seq_lens={bad_l!r}: each L must be a positive multiple of 1024")


def simulate(
    studies: Sequence[str] = tuple(STUDIES),
    seq_lens: Sequence[int] = LENGTHS,
    methods: Sequence[str] = tuple(METHODS),
    compare: bool = True,
) -> Rows:
    """Every method's best layout for every study of ``studies`` at every L of
    ``seq_lens``; ``compare``: the ``dp_vs_seq1f1b`` extra too. Traces: ``seconds``, the
    search time of each study."""
    _check(studies, seq_lens, methods)
    rows, comparisons, seconds = [], [], []
    for name in studies:
        study = STUDIES[name]
        t0 = time.perf_counter()
        for L in seq_lens:
            found = {
                m: best_layout(
                    study.model, study.n_gpus, L, m, batch=study.batch(L), platform=study.platform
                )
                for m in methods
            }
            rows += [{"study": name, "cluster": study.platform.hardware.name} | r.row()
                     for r in found.values()]  # fmt: skip
            seq = found.get("seq1f1b")
            if compare and seq is not None and seq.fits:
                comparisons.append({"study": name} | _dp_vs_seq1f1b(study, seq))
        seconds.append({"study": name, "seconds": time.perf_counter() - t0})
    df = pd.DataFrame(rows)
    extras = {"winners": winners(df)}
    if compare:
        extras["dp_vs_seq1f1b"] = pd.DataFrame(comparisons)
    return Rows(df, extras, {"seconds": pd.DataFrame(seconds)})


def _dp_vs_seq1f1b(study: Study, seq: LongContextResult) -> dict[str, Any]:
    """The DP's plan against Seq1F1B's slicing on the cost model of ``seq``'s layout: the
    pipeline's sequences, on the layout's grid, every k of Seq1F1B tried."""
    cost = layout_cost(seq, study.platform, CALIBRATIONS[study.platform.hardware.name])
    cp = seq.cp or 1
    granularity = search_grid(seq.seq_len, cp)
    size = seq.microbatch or 1
    pipeline_batch = seq.batch // (seq.dp or 1)
    c = compare_with_dp(
        cost,
        FlopModel.of(cost.cfg),
        seq_len=seq.seq_len,
        batch=pipeline_batch,
        n_stages=seq.pp or 1,
        granularity=granularity,
        batch_slice_size=size,
    )
    return {
        "model": seq.model,
        "seq_len": seq.seq_len,
        "layout": f"TP{seq.tp} CP{cp} PP{seq.pp} DP{seq.dp}",
        "pipeline_batch": pipeline_batch,
        "granularity": granularity,
        "dp_latency": c.dp_latency,
        "seq1f1b_latency": c.seq1f1b_latency,
        "margin": c.margin,
        "dp_slices": len(c.dp.token_slices[0]),
        "seq1f1b_slices": len(c.seq1f1b.token_slices[0]),
    }


def _why(win: pd.Series, other: pd.Series) -> str:
    """What separates the winner's layout from ``other``'s, in the terms that decide
    long-context runs: memory (recomputation), the bubble, communication."""
    reasons = []
    if _RECOMPUTE_RANK[other.recompute] > _RECOMPUTE_RANK[win.recompute]:
        reasons.append(f"memory: {other.method} recomputes ({other.recompute}) to fit")
    if win.cp > other.cp:
        reasons.append(f"CP{int(win.cp)} splits every sequence's attention over the ring")
    if win.pp < other.pp:
        reasons.append(f"bubble: a shallower pipeline (PP{int(win.pp)} vs PP{int(other.pp)})")
    elif win.schedule == "terapipe-zb" and other.schedule != "terapipe-zb":
        reasons.append("bubble: split backwards fill it")
    elif win.schedule in _TOKEN_SLICED and other.schedule not in _TOKEN_SLICED:
        reasons.append("bubble: token slices fill the pipeline")
    if win.tp < other.tp:
        reasons.append(f"communication: less tensor parallelism (TP{int(win.tp)} vs "
                       f"TP{int(other.tp)})")  # fmt: skip
    return "; ".join(reasons) or "the same layout's schedule"


def winners(df: pd.DataFrame) -> pd.DataFrame:
    """Per study and L: the fastest method that fits, the runner-up, its margin, the
    gain over 1F1B, and :func:`_why`."""
    out = []
    for (study, L), part in df.groupby(["study", "seq_len"], sort=False):
        fit = part[part.fits].sort_values("iteration_s")
        if fit.empty:
            out.append({"study": study, "seq_len": L, "winner": "nothing fits"})
            continue
        win = fit.iloc[0]
        rest = fit[fit.iteration_s > win.iteration_s * (1 + 1e-9)]
        ties = fit[fit.iteration_s <= win.iteration_s * (1 + 1e-9)].method
        row: dict[str, Any] = {
            "study": study, "seq_len": L, "winner": win.method,
            "tied_with": " ".join(m for m in ties if m != win.method),
            "layout": f"TP{int(win.tp)} CP{int(win.cp)} PP{int(win.pp)} DP{int(win.dp)}",
            "recompute": win.recompute, "iteration_s": win.iteration_s, "mfu": win.mfu,
            "memory_gib": win.memory_gib,
        }  # fmt: skip
        if not rest.empty:
            second = rest.iloc[0]
            row |= {"runner_up": second.method, "margin": second.iteration_s / win.iteration_s,
                    "why": _why(win, second)}  # fmt: skip
        base = part[(part.method == "1f1b") & part.fits]
        row["speedup_over_1f1b"] = (
            base.iteration_s.iloc[0] / win.iteration_s if not base.empty else math.nan
        )
        out.append(row)
    return pd.DataFrame(out)


def findings(df: pd.DataFrame) -> str:
    """Which method wins at each L of each study, by how much, and why."""
    w = winners(df)
    lines = []
    for study, part in w.groupby("study", sort=False):
        lines.append(f"- **{study}**:")
        for r in part.to_dict("records"):
            if r["winner"] == "nothing fits":
                lines.append(f"  - L={r['seq_len']}: no method fits.")
                continue
            tied = r.get("tied_with")
            tie = f" (tied with {tied})" if isinstance(tied, str) and tied else ""
            runner = r.get("runner_up")
            over = (f", {r['margin']:.2f}x ahead of {runner} ({r['why']})"
                    if isinstance(runner, str) else ", the only method that fits")  # fmt: skip
            gain = float(r["speedup_over_1f1b"])
            base = f"; {gain:.2f}x over 1F1B" if not math.isnan(gain) else "; 1F1B does not fit"
            lines.append(
                f"  - L={r['seq_len']}: `{r['winner']}`{tie} on {r['layout']} "
                f"({r['recompute']} recomputation), MFU {r['mfu']:.1%}, "
                f"{r['memory_gib']:.0f} GiB{over}{base}."
            )
    return "\n".join(lines)


def dp_summary(comparisons: pd.DataFrame) -> str:
    """TeraPipe's DP against Seq1F1B's slicing (the ``dp_vs_seq1f1b`` extra), in a line
    per study: is the DP ever slower, and by how much Seq1F1B's slicing is."""
    lines = []
    for study, part in comparisons.groupby("study", sort=False):
        worst = part.sort_values("margin").iloc[-1]
        never = "never slower" if (part.margin >= 0).all() else "SLOWER somewhere"
        lines.append(
            f"- **{study}**: the DP is {never} than Seq1F1B's equal-FLOP slicing at "
            f"{len(part)} lengths; Seq1F1B's slicing is {part.margin.min():.3%} to "
            f"{part.margin.max():.3%} slower (most at L={worst.seq_len}, "
            f"{int(worst.seq1f1b_slices)} slices against the DP's {int(worst.dp_slices)})."
        )
    return "\n".join(lines)


def figure(rows: Rows) -> Figure:
    """Tokens per second per GPU against L, one panel per study, one line per method."""
    df = rows.df[rows.df.fits]
    studies = list(dict.fromkeys(rows.df.study))
    methods = list(dict.fromkeys(rows.df.method))
    fig, axes = plt.subplots(1, len(studies), figsize=(5.5 * len(studies), 4), squeeze=False)
    for ax, study in zip(axes[0], studies, strict=True):
        part = df[df.study == study]
        if not part.empty:
            # One colour and marker per method in every panel.
            sns.lineplot(part, x="seq_len", y="tokens_per_s_per_gpu", hue="method",
                         hue_order=methods, style="method", style_order=methods,
                         markers=True, ax=ax)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(study)
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("tokens / s / GPU")
    fig.tight_layout()
    return fig


def measured_findings(df: pd.DataFrame) -> str:
    """The measured comparison on this machine: the fastest, and the simulator's errors."""
    best = df.sort_values("latency").iloc[0]
    errors = ", ".join(f"{r.method} {r.err_simulated_latency:+.1%}" for r in df.itertuples())
    worst = df.err_simulated_latency.abs().max()
    spread = ", ".join(
        f"{r.method} {r.latency:.2f} s ({r.latency_round_min:.2f}-{r.latency_round_max:.2f})"
        for r in df.itertuples()
    )
    return "\n".join(
        [
            f"- Fastest on this machine: `{best.method}` ({best.latency:.2f} s per iteration); "
            f"median and round spread: {spread}.",
            f"- The simulator's error, shared cores: {errors}; "
            f"{'all within' if worst <= 0.10 else 'NOT all within'} 10% (largest {worst:.1%}).",
        ]
    )


def measured_figure(rows: Rows) -> Figure:
    """Measured and simulated iteration time of each configuration."""
    df = rows.df
    long = pd.concat(
        [
            df.assign(source="measured", seconds=df.latency),
            df.assign(source="simulated", seconds=df.simulated_latency),
        ]
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    sns.barplot(long, x="method", y="seconds", hue="source", ax=ax)
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"{df.model.iloc[0]}, L={df.seq_len.iloc[0]}, two processes")
    fig.tight_layout()
    return fig


TABLE = Table(
    "long_context",
    "beyond the paper: Table 4 past 8K",
    "Long context: TeraPipe and Seq1F1B against context parallelism, 8K to 1M tokens",
    {
        "simulate": TableMode(
            simulate,
            figure=figure,
            findings=findings,
            columns="study seq_len method fits tp cp pp dp v microbatch recompute schedule "
            "iteration_s tokens_per_s_per_gpu mfu memory_gib budget_gib reason",
            compare=Comparison(("study", "seq_len", "method"), "iteration_s", None, ("model",)),
        ),
        "measure": TableMode(
            measure,
            figure=measured_figure,
            findings=measured_findings,
            columns="method schedule n_slices latency latency_round_min latency_round_max "
            "simulated_latency err_simulated_latency speedup_over_uniform",
            compare=Comparison(("method",), "latency", None, ("schedule",)),
        ),
    },
)
