"""Does TeraPipe still pay on modern clusters? The paper's settings on DGX A100 and DGX
H100 against today's pipeline schedules.

``simulate`` mode only. Three parts:

- **calibration** (an extra table): the DGX A100 model against the ten published
  Megatron-LM runs it was fitted to (:func:`~tplib.search.megatron_fit.calibration_table`);
  the published TFLOPS are the reference column, never a result.
- **the settings** (the table): each of Table 1's settings, its layout and GPU count
  unchanged, on each cluster's 80 GB GPUs, running FlashAttention-2 and pricing the N
  layers alone (as the paper's FLOP formula counts them), without recomputation; setting
  (5) also at Table 4's longer sequences with their batches. Per row, the latency and
  TFLOPS per GPU (:func:`~tplib.search.setting.tflops_per_gpu`) of

  ==========================  =========================================================
  column suffix               schedule and plan
  ==========================  =========================================================
  ``gpipe``                   GPipe, microbatches of one sequence (the paper's baseline)
  ``1f1b``                    1F1B (PipeDream-Flush) on the same microbatches
  ``interleaved_1f1b``        Megatron's interleaved 1F1B at its best v (``v_...``)
  ``zb_h1``                   ``1f1b-zb`` on the same microbatches: 1F1B with the weight
                              gradients deferred into its bubbles (ZB-H1's idea)
  ``terapipe``                TeraPipe: the joint batch x token DP plan, fill-drain
  ``terapipe_zb``             ``terapipe-zb``, planned by the zero-bubble objective
  ``terapipe_interleaved``    TeraPipe's slices interleaved over v chunks, at its best v
  ==========================  =========================================================

  ``latency_terapipe_best`` is the fastest of the three TeraPipe rows (``best_terapipe``
  names it); ``speedup_over_interleaved``, ``speedup_over_gpipe`` and
  ``speedup_over_zb_h1`` divide the baseline's latency by it. ZB-H1 stands beside
  interleaved 1F1B because TeraPipe's best is often ``terapipe-zb``, whose split
  backward helps microbatches too.
- **autoplan** (columns of the L = 2048 rows, and an extra table of one row per query):
  :func:`~tplib.search.layout.autoplan`'s best layout for the setting's model, GPU count
  and batch on that cluster, its TeraPipe latency and its speedup over the setting's own
  layout; a search where nothing fits is recorded in ``autoplan_note``.

Rows come setting by setting, each computed alone, so the table splits over ``settings``
(:mod:`tplib.reproduce.split`); setting (5) carries its Table 4 rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from tplib.cluster.calibration import CALIBRATIONS
from tplib.cluster.hardware import CLUSTERS
from tplib.cluster.implementation import Implementation, Platform
from tplib.paper import SEQLEN_BATCH, SETTINGS, Setting, setting
from tplib.partition.chain import DoesNotFit
from tplib.plan import Plan
from tplib.search.layout import autoplan
from tplib.search.megatron_fit import calibration_table
from tplib.search.setting import (
    EPS,
    setting_fields,
    simulate_on_cluster,
    simulate_setting,
    simulate_virtual,
    tflops_per_gpu,
)
from tplib.tables.base import Comparison, Rows, Table, TableMode

__all__ = ["CLUSTER_NAMES", "FLASH", "PAYS", "TABLE", "autoplan_layouts",
           "calibration_summary", "figure", "findings", "search_row", "setting_row",
           "simulate"]  # fmt: skip

CLUSTER_NAMES = ("dgx-a100", "dgx-h100")
FLASH = Implementation(attention="flash")
PAYS = 1.05  # TeraPipe "pays" where its best is at least 5% faster than the baseline
TERAPIPES = ("terapipe", "terapipe_zb", "terapipe_interleaved")
_NOT_SEARCHED = "not searched"
T = TypeVar("T")


def setting_row(s: Setting, cluster: str, eps: float = EPS) -> dict[str, Any]:
    """Setting ``s`` (a Table 1 row or a Table 4 variant) on ``cluster``: every schedule
    of the module docstring, its latency, TFLOPS per GPU and the speedups."""
    on: dict[str, Any] = {
        "calibration": CALIBRATIONS[cluster],
        "on": Platform(CLUSTERS[cluster], FLASH),
    }
    r: dict[str, Any] = simulate_setting(s.index, seq_len=s.seq_len, eps=eps, **on)
    virtual: dict[str, Any] = simulate_virtual(s, Plan.from_paper(r["plan"]), eps=eps, **on)

    def microbatches(schedule: str) -> float:
        """``schedule`` on GPipe's microbatches of one sequence."""
        return simulate_on_cluster(s, s.gpipe_plan(), schedule, **on).latency

    latency = {
        "gpipe": r["latency_gpipe"],
        "1f1b": microbatches("1f1b"),
        "interleaved_1f1b": virtual["latency_interleaved_1f1b"],
        "zb_h1": microbatches("1f1b-zb"),
        "terapipe": r["latency_terapipe"],
        "terapipe_zb": r["latency_terapipe_zb"],
        "terapipe_interleaved": virtual["latency_terapipe_interleaved"],
    }
    best = min(TERAPIPES, key=latency.__getitem__)
    t = latency[best]
    return (
        {"cluster": cluster}
        | setting_fields(s)
        | {"n_gpus": s.n_gpus, "batch": s.batch}
        | {f"latency_{k}": v for k, v in latency.items()}
        | {
            "v_interleaved_1f1b": virtual["v_interleaved_1f1b"],
            "v_terapipe_interleaved": virtual["v_terapipe_interleaved"],
            "best_terapipe": best,
            "latency_terapipe_best": t,
        }
        | {f"tflops_{k}": tflops_per_gpu(s, v) for k, v in latency.items()}
        | {
            "tflops_terapipe_best": tflops_per_gpu(s, t),
            "speedup_over_interleaved": latency["interleaved_1f1b"] / t,
            "speedup_over_gpipe": latency["gpipe"] / t,
            "speedup_over_zb_h1": latency["zb_h1"] / t,
            "plan": r["plan"],
            "plan_zb": r["plan_zb"],
            "plan_terapipe_interleaved": virtual["plan_terapipe_interleaved"],
            "memory_gib": r["memory_gib"],
            "fits_memory": r["fits_memory"],
            "note_interleaved_1f1b": virtual["note_interleaved_1f1b"],
        }
    )


def search_row(
    model: str, n_gpus: int, batch: int, cluster: str, eps: float = EPS
) -> dict[str, Any]:
    """:func:`~tplib.search.layout.autoplan`'s best layout of ``model`` on ``n_gpus`` GPUs
    of ``cluster`` for a global batch of ``batch`` (L = 2048, FlashAttention-2); a search
    where no layout fits gives NaNs and the reason in ``autoplan_note``."""
    try:
        search = autoplan(model, n_gpus, batch, cluster=cluster, eps=eps, implementation=FLASH)
    except DoesNotFit as e:
        return _no_search(str(e))
    best = search.best
    return {
        "autoplan_layout": str(best.layout),
        "autoplan_n_stages": best.layout.n_stages,
        "autoplan_recompute": best.layout.recompute,
        "latency_autoplan": best.latency,
        "memory_gib_autoplan": best.memory / 2**30,
        "plan_autoplan": best.plan,
        "autoplan_note": "",
        "plan_seconds": search.seconds,
    }


def _check(clusters: Sequence[str], settings: list[int], seq_lens: Sequence[int]) -> None:
    bad = [c for c in clusters if c not in CLUSTER_NAMES]
    if bad or not clusters:
        raise ValueError(f"clusters={list(clusters)}: choose among {list(CLUSTER_NAMES)}")
    unknown = [n for n in settings if n not in SETTINGS]
    if unknown:
        raise ValueError(f"settings {unknown} are not in Table 1: settings are 1..10")
    longer = sorted(L for L in SEQLEN_BATCH if SETTINGS[5].seq_len != L)
    wrong = [L for L in seq_lens if L not in longer]
    if wrong:
        raise ValueError(f"seq_lens {wrong}: Table 4's longer L for setting (5) are {longer}")


class _Clock:
    """Wall and CPU seconds spent in each part of the table (the machine may be shared:
    the CPU time is what the part costs, the wall time what it took)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def timed(self, part: str, work: Callable[..., T], *args: Any) -> T:
        wall, cpu = time.perf_counter(), time.process_time()
        out = work(*args)
        self.wall[part] = self.wall.get(part, 0.0) + time.perf_counter() - wall
        self.cpu[part] = self.cpu.get(part, 0.0) + time.process_time() - cpu
        return out

    def table(self) -> pd.DataFrame:
        return pd.DataFrame({"wall_s": self.wall, "cpu_s": self.cpu}).rename_axis("part")


def simulate(
    clusters: Sequence[str] = CLUSTER_NAMES,
    settings: Iterable[int] = range(1, 11),
    seq_lens: Sequence[int] = (4096, 6144, 8192),
    search: bool = True,
    eps: float = EPS,
) -> Rows:
    """Every setting of ``settings`` (setting (5) also at each L of ``seq_lens``, Table
    4's batch) on every cluster of ``clusters``; ``search``: autoplan's best layout for
    each L = 2048 row. Extras: ``calibration`` and ``autoplan`` (one row per query);
    traces: ``seconds``, the wall and CPU time of each part."""
    settings = list(settings)
    _check(clusters, settings, seq_lens)
    clock = _Clock()
    calibration = clock.timed("calibration", calibration_table)
    searched: dict[tuple[str, str, int, int], dict[str, Any]] = {}
    rows = []
    for n in settings:
        variants = [setting(n)] + [setting(n, L) for L in seq_lens if n == 5]
        for s in variants:
            table1 = s.seq_len == SETTINGS[n].seq_len
            for cluster in clusters:
                part = "settings" if table1 else "seq_lens"
                row = clock.timed(part, setting_row, s, cluster, eps)
                key = (cluster, s.model, s.n_gpus, s.batch)
                if search and table1 and key not in searched:
                    query = (s.model, s.n_gpus, s.batch, cluster, eps)
                    searched[key] = clock.timed("autoplan", search_row, *query)
                found = searched.get(key) if table1 else None
                rows.append(row | _autoplan_columns(found, row["latency_terapipe"]))
    df = pd.DataFrame(rows)
    extras = {"calibration": calibration, "autoplan": autoplan_layouts(df)}
    return Rows(df, extras, {"seconds": clock.table()})


def _no_search(note: str) -> dict[str, Any]:
    """The autoplan columns of a row without a layout: NaNs, and ``note`` says why."""
    nan = float("nan")
    return {"autoplan_layout": "", "autoplan_n_stages": nan, "autoplan_recompute": "",
            "latency_autoplan": nan, "memory_gib_autoplan": nan, "plan_autoplan": "",
            "autoplan_note": note, "plan_seconds": nan}  # fmt: skip


def _autoplan_columns(found: dict[str, Any] | None, latency_terapipe: float) -> dict[str, Any]:
    """A row's autoplan columns: the search's, or NaNs where none ran."""
    found = found or _no_search(_NOT_SEARCHED)
    speedup = latency_terapipe / found["latency_autoplan"]
    return found | {"speedup_over_paper_layout": speedup}


def autoplan_layouts(df: pd.DataFrame) -> pd.DataFrame:
    """One row per search the table ran (cluster, model, #GPUs, batch): the paper's
    layout beside autoplan's, with the speedup of the latter's TeraPipe."""
    searched = df[df.autoplan_note.fillna("") != _NOT_SEARCHED].copy()
    searched["paper_layout"] = [
        f"#Data={r.n_data} x #Pipe={r.n_stages} x #Op={r.n_op}" for r in searched.itertuples()
    ]
    cols = ["cluster", "model", "n_gpus", "batch", "setting", "paper_layout",
            "latency_terapipe", "autoplan_layout", "autoplan_n_stages", "latency_autoplan",
            "memory_gib_autoplan", "speedup_over_paper_layout", "plan_autoplan",
            "autoplan_note"]  # fmt: skip
    keys = ["cluster", "model", "n_gpus", "batch"]
    # The setting with the fastest TeraPipe on its own layout stands for its query.
    best = searched.sort_values("latency_terapipe").drop_duplicates(keys)
    return best.sort_values(["cluster", "setting"])[cols].reset_index(drop=True)


def _label(r: Any) -> str:
    return f"({r.setting})" + (f" L={r.seq_len}" if r.seq_len != 2048 else "")


def figure(rows: Rows) -> Figure:
    """TeraPipe's best over interleaved 1F1B and over ZB-H1, per setting and cluster."""
    df = rows.df.assign(label=[_label(r) for r in rows.df.itertuples()])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
    for ax, (col, name) in zip(
        axes,
        (("speedup_over_interleaved", "interleaved 1F1B"), ("speedup_over_zb_h1", "ZB-H1")),
        strict=True,
    ):
        sns.barplot(df, x="label", y=col, hue="cluster", ax=ax)
        ax.axhline(1.0, color="0.4", lw=0.8)
        ax.axhline(PAYS, color="0.4", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("setting")
        ax.set_ylabel(f"TeraPipe's best over {name}")
        ax.set_title(f"Speedup over {name} (dashed: +{PAYS - 1:.0%})")
        ax.tick_params(axis="x", labelrotation=60)
    fig.tight_layout()
    return fig


def _gains(part: pd.DataFrame, col: str) -> str:
    """Where TeraPipe's best beats a baseline by PAYS or more, and the median gain."""
    won = part[part[col] >= PAYS].sort_values(col, ascending=False)
    where = ", ".join(f"{_label(r)} {getattr(r, col):.2f}x" for r in won.itertuples())
    return (
        f"{len(won)} of {len(part)} settings by >= {PAYS - 1:.0%}"
        + (f" ({where})" if where else "")
        + f"; median {part[col].median():.2f}x"
    )


def _plain_speedup(df: pd.DataFrame) -> pd.Series:
    """TeraPipe's best over interleaved 1F1B without the split backward of terapipe-zb."""
    plain = df[["latency_terapipe", "latency_terapipe_interleaved"]].min(axis=1)
    return df.latency_interleaved_1f1b / plain


def findings(df: pd.DataFrame) -> str:
    """Where TeraPipe still pays on each cluster, by how much, by model and with L."""
    lines = []
    for cluster, part in df.groupby("cluster", sort=False):
        table1 = part[part.seq_len == 2048]
        lines.append(f"- **{cluster}**, Table 1's settings:")
        over = _gains(table1, "speedup_over_interleaved")
        lines.append(f"  - over interleaved 1F1B, TeraPipe's best wins {over}.")
        lines.append(f"  - over ZB-H1: {_gains(table1, 'speedup_over_zb_h1')}.")
        lines.append(f"  - over GPipe: median {table1.speedup_over_gpipe.median():.2f}x.")
        by_model = table1.groupby("model", sort=False).speedup_over_interleaved.median()
        lines.append(
            "  - median over interleaved 1F1B by model: "
            + ", ".join(f"{m} {g:.2f}x" for m, g in by_model.items())
            + "."
        )
        counts = table1.best_terapipe.value_counts()
        lines.append(
            "  - TeraPipe's fastest schedule: "
            + ", ".join(f"`{str(k).replace('_', '-')}` in {v}" for k, v in counts.items())
            + "; without split backwards (`terapipe` or `terapipe-interleaved`) it wins "
            + _gains(table1.assign(plain=_plain_speedup(table1)), "plain")
            + "."
        )
        short = int((table1.note_interleaved_1f1b.fillna("") != "").sum())
        lines.append(
            f"  - interleaved 1F1B ran v > 1 in {int((table1.v_interleaved_1f1b > 1).sum())} "
            f"settings; in {short} it could not, with fewer microbatches than stages."
        )
        sweep = part[part.setting == 5].sort_values("seq_len")
        if len(sweep) > 1:
            gains = sweep.speedup_over_interleaved
            trend = "grows" if gains.is_monotonic_increasing else "does not grow steadily"
            at = ", ".join(
                f"L={r.seq_len} {r.speedup_over_interleaved:.2f}x" for r in sweep.itertuples()
            )
            zb = ", ".join(f"{g:.2f}x" for g in sweep.speedup_over_zb_h1)
            lines.append(
                f"  - setting (5) with L (Table 4's batches): the gain over interleaved 1F1B "
                f"{trend}, {at}; over ZB-H1 {zb}."
            )
        searched = autoplan_layouts(part)
        if len(searched):
            failed = searched[searched.autoplan_note.fillna("") != ""]
            moved = searched[searched.autoplan_layout != searched.paper_layout]
            gain = searched.speedup_over_paper_layout
            flat = searched[searched.autoplan_n_stages == 1]
            flat_at = ", ".join(f"{r.model} B={r.batch}" for r in flat.itertuples())
            lines.append(
                f"  - autoplan: a layout other than Table 1's in {len(moved)} of "
                f"{len(searched)} searches, its TeraPipe up to {gain.max():.2f}x faster "
                f"than the paper's layout's (median {gain.median():.2f}x); no pipeline at "
                f"all (#Pipe = 1) in {len(flat)}"
                + (f" ({flat_at})" if flat_at else "")
                + (f"; nothing fits in {len(failed)}" if len(failed) else "")
                + "."
            )
    return "\n".join(lines)


def calibration_summary(calibration: pd.DataFrame) -> str:
    """One line on the DGX A100 model against the published runs it was fitted to."""
    worst = calibration.iloc[int(calibration.error.abs().to_numpy().argmax())]
    return (
        f"The DGX A100 model predicts the {len(calibration)} published Megatron runs' TFLOPS "
        f"per GPU within {abs(worst.error):.1%} (worst: {worst.model}, "
        f"{worst.predicted_tflops:.1f} against {worst.published_tflops:g}); median |error| "
        f"{calibration.error.abs().median():.1%}."
    )


TABLE = Table(
    "modern_clusters",
    "beyond the paper: Table 1 on DGX A100 / H100",
    "Modern clusters: TeraPipe against interleaved 1F1B and ZB-H1 on DGX A100 and DGX H100",
    {
        "simulate": TableMode(
            simulate,
            figure=figure,
            findings=findings,
            columns="cluster setting model seq_len pipeline_batch n_stages n_op n_data "
            "latency_gpipe latency_interleaved_1f1b v_interleaved_1f1b latency_zb_h1 "
            "latency_terapipe latency_terapipe_zb latency_terapipe_interleaved best_terapipe "
            "tflops_terapipe_best speedup_over_interleaved speedup_over_zb_h1 "
            "speedup_over_gpipe autoplan_layout speedup_over_paper_layout",
            compare=Comparison(
                ("cluster", "setting", "seq_len"), "speedup_over_interleaved", None, ("model",)
            ),
        ),
    },
)
