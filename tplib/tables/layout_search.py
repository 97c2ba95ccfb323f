"""The layout search against Table 1: what :func:`tplib.search.layout.autoplan` picks for each
setting's model, GPU count and batch, beside the layout the paper chose by hand.

``simulate``: for every setting, the search on the V100-cluster model, and the paper's
own layout (its #Data x #Pipe x #Op, no recomputation, the DP planner's TeraPipe plan)
simulated on the same model: both latencies, their ratio, each one's memory per GPU,
where the paper's layout ranked in the search and why it lost, and how long the search
took. The paper's measured TeraPipe latency stands beside as the reference it is.
"""

from __future__ import annotations

from collections.abc import Iterable

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from tplib.cluster import CALIBRATION, Calibration, ClusterCostModel
from tplib.paper import SETTINGS, TERAPIPE, main_row
from tplib.search.layout import Layout, autoplan
from tplib.search.setting import EPS, simulate_setting
from tplib.tables.base import Comparison, Rows, Table, TableMode

__all__ = ["TABLE", "figure", "findings", "simulate"]


def _row(n: int, eps: float, calibration: Calibration) -> dict[str, object]:
    s = SETTINGS[n]
    search = autoplan(
        s.model, s.n_gpus, s.batch, seq_len=s.seq_len, eps=eps, calibration=calibration
    )
    paper = simulate_setting(n, eps=eps, calibration=calibration)
    best = search.best
    own = Layout(s.n_data, s.n_stages, s.n_op)
    ranked = [c.layout for c in search.candidates]
    rank = ranked.index(own) + 1 if own in ranked else 0
    mine = search.candidates[rank - 1] if rank else None
    status = {c.status for c in search.candidates}
    count = {k: sum(c.status == k for c in search.candidates) for k in sorted(status)}
    latency_paper = float(paper["latency_terapipe"])  # type: ignore[arg-type]
    # The all-reduce is where layouts differ most: #Data replicas on other nodes share a
    # node's network link, and #Op and #Pipe shrink what each GPU all-reduces.
    lay = best.layout
    theirs = ClusterCostModel.for_setting(s, calibration)
    ours = ClusterCostModel(
        s.config, n_stages=lay.n_stages, n_op=lay.n_op, n_data=lay.n_data,
        seq_len=s.seq_len, calibration=calibration, recompute=lay.recompute,
    )  # fmt: skip
    return {
        "setting": n,
        "model": s.model,
        "n_gpus": s.n_gpus,
        "batch": s.batch,
        "paper_layout": str(own),
        "latency_paper_layout": latency_paper,
        "memory_gib_paper_layout": paper["memory_gib"],
        "paper_layout_fits": paper["fits_memory"],
        "allreduce_paper_layout": theirs.allreduce(0),
        "paper_layout_rank": rank,
        "paper_layout_reason": mine.reason if mine else "not a candidate",
        "best_layout": str(best.layout),
        "best_n_data": best.layout.n_data,
        "best_n_stages": best.layout.n_stages,
        "best_n_op": best.layout.n_op,
        "best_recompute": best.layout.recompute,
        "latency_best": best.latency,
        "memory_gib_best": best.memory / 2**30,
        "allreduce_best": ours.allreduce(0),
        "speedup_over_paper_layout": latency_paper / best.latency,
        "plan_best": best.plan,
        "candidates": len(search.candidates),
        "fitting": count.get("fits", 0),
        "planned": sum(c.latency == c.latency for c in search.candidates),
        "pruned": count.get("pruned", 0),
        "out_of_memory": count.get("out of memory", 0),
        "plan_seconds": search.seconds,
        "paper_latency_terapipe": main_row(n, TERAPIPE).latency,
    }


def simulate(
    settings: Iterable[int] = range(1, 11),
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
) -> Rows:
    """Every setting ``(n)`` in ``settings``: the searched layout beside the paper's."""
    settings = list(settings)
    unknown = [n for n in settings if n not in SETTINGS]
    if unknown:
        raise ValueError(f"settings {unknown} are not in Table 1: settings are 1..10")
    return Rows(pd.DataFrame([_row(n, eps, calibration) for n in settings]))


def figure(rows: Rows) -> Figure:
    """Simulated latency of the paper's layout and of the searched one, per setting."""
    df = rows.df
    long = pd.concat(
        [
            pd.DataFrame({"setting": df.setting, "layout": who, "latency (s)": df[col]})
            for who, col in (
                ("paper's (Table 1)", "latency_paper_layout"),
                ("searched", "latency_best"),
            )
        ]
    )
    fig, ax = plt.subplots(figsize=(8, 3.6))
    sns.barplot(long, x="setting", y="latency (s)", hue="layout", ax=ax)
    ax.set_title("Simulated iteration latency: Table 1's layout vs the layout search")
    fig.tight_layout()
    return fig


def findings(df: pd.DataFrame) -> str:
    """How often the search beats the paper's layout, by how much, and how fast."""
    faster = df[df.speedup_over_paper_layout > 1.0 + 1e-9]
    same = df[df.paper_layout_rank == 1]
    top = df.sort_values("speedup_over_paper_layout").iloc[-1]
    lines = [
        f"- the search finds the paper's own layout best in {len(same)} of {len(df)} "
        f"settings, and a faster one in {len(faster)}; the largest gain is "
        f"{top.speedup_over_paper_layout:.2f}x (setting ({int(top.setting)}): "
        f"{top.best_layout} instead of {top.paper_layout}).",
        f"- search time: at most {df.plan_seconds.max():.1f} s per setting "
        f"(median {df.plan_seconds.median():.1f} s).",
    ]
    rc = df[df.best_recompute == "full"]
    lines.append(
        f"- the best layout recomputes in {len(rc)} of {len(df)} settings"
        + (f": {', '.join(f'({int(n)})' for n in rc.setting)}." if len(rc) else ".")
    )
    over = df[~df.paper_layout_fits.astype(bool)]
    if len(over):
        which = ", ".join(f"({int(n)})" for n in over.setting)
        lines.append(f"- the paper's layout does not fit our memory model in settings {which}.")
    return "\n".join(lines)


TABLE = Table(
    "layout_search",
    "Table 1 (layouts)",
    "The layout search against the paper's hand-chosen layouts",
    {
        "simulate": TableMode(
            simulate,
            figure=figure,
            findings=findings,
            columns="setting model n_gpus batch paper_layout latency_paper_layout "
            "allreduce_paper_layout paper_layout_rank best_layout best_recompute latency_best "
            "allreduce_best memory_gib_best speedup_over_paper_layout plan_seconds",
            compare=Comparison(("setting",), "latency_best", None, ("model",)),
        ),
    },
)
