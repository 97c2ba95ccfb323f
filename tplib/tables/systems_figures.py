"""The figures and findings of the pipeline-systems table (:mod:`tplib.tables.pipeline_systems`).

Simulate mode: per setting, each system's TFLOPS per GPU and its busiest GPU's memory
against the V100's 16 GB. Measure mode: each system's measured and simulated
throughput on this machine, its measured peak memory, and the loss per step of the
statistical-efficiency runs (PipeDream-2BW's Figure 5, on the stdlib corpus).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from tplib.tables.base import Rows

__all__ = ["measured_figure", "measured_findings", "simulated_findings", "systems_figure"]


def _palette(order: list[str]) -> dict[str, tuple[float, float, float]]:
    return dict(zip(order, sns.color_palette("tab10", len(order)), strict=True))


def systems_figure(df: pd.DataFrame) -> plt.Figure:
    """Per setting (columns): TFLOPS per GPU (top) and the busiest GPU's memory (bottom)
    of each system, hatched where it does not fit in 16 GB; "cannot run" where the
    system cannot run the setting's batch (2BW with too few microbatches)."""
    settings = list(dict.fromkeys(df["setting"]))
    order = list(dict.fromkeys(df["system"]))
    palette = _palette(order)
    fig, axes = plt.subplots(
        2, len(settings), figsize=(3.4 * len(settings), 6.5), squeeze=False, sharex=True
    )
    for j, n in enumerate(settings):
        sub = df[df["setting"] == n]
        for i, (col, label) in enumerate(
            (("tflops_per_gpu", "TFLOPS per GPU"), ("memory_gib", "memory per GPU (GiB)"))
        ):
            ax = axes[i, j]
            sns.barplot(
                data=sub, x="system", y=col, hue="system", order=order, hue_order=order,
                palette=palette, legend=False, ax=ax,
            )  # fmt: skip
            fits = dict(zip(sub["system"], sub["fits_16gb"], strict=True))
            for patch in ax.patches:  # each bar sits at its system's position in order
                x = patch.get_x() + patch.get_width() / 2
                if fits.get(order[round(x)]) is False:
                    patch.set_hatch("//")
                    patch.set_alpha(0.5)
            for x, name in enumerate(order):
                if not sub.loc[sub["system"] == name, "feasible"].all():
                    ax.text(x, 0.02, "cannot run", transform=ax.get_xaxis_transform(),
                            rotation=90, ha="center", va="bottom", fontsize=8, color="0.4")  # fmt: skip
            if col == "memory_gib":
                ax.axhline(16, color="0.3", ls="--", lw=1)
                ax.set_yscale("log")
            ax.set_ylabel(label if j == 0 else "")
            ax.set_xlabel("")
            ax.tick_params(axis="x", labelrotation=90)
        axes[0, j].set_title(f"({n}) {sub['model'].iloc[0]}")
    fig.suptitle("Pipeline systems on the simulated V100 cluster (hatched: over 16 GB)")
    fig.tight_layout()
    return fig


def simulated_findings(df: pd.DataFrame) -> str:
    """Per setting: the fastest system that fits in 16 GB, and the ones that cannot run."""
    lines = []
    for n, sub in df.groupby("setting", sort=False):
        fits = sub["fits_16gb"].eq(True)
        ok = sub[sub["feasible"] & fits]
        best = ok.sort_values("throughput").iloc[-1] if len(ok) else None
        text = f"- ({n}) {sub['model'].iloc[0]}: "
        if best is not None:
            text += (
                f"fastest within 16 GB: {best['system']}, {best['tflops_per_gpu']:.1f} TFLOPS "
                f"per GPU, {best['speedup_vs_gpipe']:.2f}x GPipe, bubble {best['bubble']:.0%}"
            )
        else:
            text += "no system fits in 16 GB"
        over = sub[sub["feasible"] & ~fits]
        if len(over):
            text += "; over 16 GB: " + ", ".join(
                f"{r.system} ({r.memory_gib:.0f} GiB)" for r in over.itertuples()
            )
        cannot = sub[~sub["feasible"]]
        if len(cannot):
            text += "; cannot run: " + "; ".join(
                f"{r.system} ({r.note})" for r in cannot.itertuples()
            )
        lines.append(text)
    return "\n".join(lines)


def measured_figure(rows: Rows) -> plt.Figure:
    """Measured against simulated throughput per system, measured peak memory, and (when
    the rows carry it) the smoothed loss per step of each statistical-efficiency run."""
    df = rows.df[rows.df["feasible"]]
    loss = rows.extras.get("loss")
    n = 3 if loss is not None else 2
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.4))
    long = df.melt(
        id_vars="system",
        value_vars=["throughput", "simulated_throughput"],
        var_name="source",
        value_name="sequences/s",
    )
    long["source"] = long["source"].map(
        {"throughput": "measured", "simulated_throughput": "simulated"}
    )
    sns.barplot(data=long, x="system", y="sequences/s", hue="source", ax=axes[0])
    axes[0].set_title("throughput (steady state)")
    order = list(df["system"])
    sns.barplot(
        data=df, x="system", y="peak_memory_mib", hue="system", order=order,
        palette=_palette(order), legend=False, ax=axes[1],
    )  # fmt: skip
    axes[1].set_title("measured peak memory per process (MiB)")
    for ax in axes[:2]:
        ax.set_xlabel("")
        ax.tick_params(axis="x", labelrotation=90)
    if loss is not None:
        sns.lineplot(data=loss, x="step", y="loss_smoothed", hue="system", ax=axes[2])
        axes[2].set_title("training loss on the stdlib corpus (bytes)")
        axes[2].set_ylabel("loss (smoothed)")
    fig.suptitle(f"Pipeline systems on this machine: {df['model'].iloc[0]} model, "
                 f"{df['n_stages'].iloc[0]} stages (loss: the efficiency runs' model)")  # fmt: skip
    fig.tight_layout()
    return fig


def measured_findings(df: pd.DataFrame) -> str:
    """Per system: measured throughput, the simulator's error, memory and versions;
    the final loss against PipeDream-Flush's (vanilla updates) when measured."""
    lines = []
    ref = None
    if "final_loss" in df and (df["system"] == "PipeDream-Flush").any():
        ref = float(df.loc[df["system"] == "PipeDream-Flush", "final_loss"].iloc[0])
    for r in df.to_dict("records"):
        if not r["feasible"]:
            lines.append(f"- {r['system']}: cannot run ({r['note']})")
            continue
        text = (
            f"- {r['system']}: {r['throughput']:.3g} sequences/s measured, simulated "
            f"{r['simulated_throughput']:.3g} (iteration time error "
            f"{r['err_simulated_iteration_time']:+.0%}); peak {r['peak_memory_mib']:.0f} MiB, "
            f"{r['weight_versions']} weight versions held (schedule: "
            f"{r['schedule_weight_versions']}), delay {r['delay']}"
        )
        loss = r.get("final_loss")
        if loss is not None and loss == loss:  # not NaN
            text += f"; final loss {loss:.3f}"
            if ref is not None and r["system"] != "PipeDream-Flush":
                text += f" ({loss / ref - 1:+.1%} vs PipeDream-Flush)"
        lines.append(text)
    return "\n".join(lines)
