"""The steps that measure: Figure 3, slicing's cost, keyed dropout's cost, a training
step's MFU and memory against the model, each into its files with the target it is held
to (the timings themselves: :mod:`tplib.gpucheck.kernels`, :mod:`tplib.gpucheck.training`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tplib.gpucheck.result import StepResult
from tplib.gpucheck.sizes import MEMORY_CASES, MEMORY_TARGET, MFU_TARGET, SLICING_TARGET, Sizes
from tplib.nn.configs import get_config
from tplib.util.files import save_figure, write_csv, write_json

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "dropout_step",
    "efficiency_step",
    "figure3_step",
    "memory_step",
    "slicing_step",
]


def _figure3(df: pd.DataFrame, title: str) -> Figure:
    """Two panels, as the paper's Figure 3: forward time and throughput against tokens."""
    import seaborn as sns
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    sns.lineplot(df, x="tokens", y="median_ms", marker="o", label="median", ax=ax1)
    ax1.fill_between(df.tokens, df.min_ms, df.max_ms, alpha=0.25, label="min..max")
    ax1.legend()
    ax1.set(yscale="log", xlabel="input tokens", ylabel="forward time (ms)")
    sns.lineplot(df, x="tokens", y="tokens_per_s", marker="o", ax=ax2)
    ax2.set(xlabel="input tokens", ylabel="throughput (tokens/s)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
    fig.suptitle(title)
    return fig


def _device_name(sizes: Sizes) -> str:
    return torch.cuda.get_device_name() if sizes.device == "cuda" else "cpu"


def figure3_step(out: Path, sizes: Sizes) -> StepResult:
    """One layer's forward for 1..2048 tokens: ``fig3_layer_forward.csv`` and ``.png``,
    both or neither."""
    from tplib.gpucheck.kernels import time_layer_forward

    cfg = get_config(sizes.model)
    dtype = getattr(torch, sizes.fig3_dtype)
    df = time_layer_forward(
        cfg,
        sizes.fig3_tokens,
        device=sizes.device,
        dtype=dtype,
        repeats=2 * sizes.repeats,
        warmup=sizes.warmup,
    )
    title = (
        f"One {cfg.name} layer, forward, {sizes.fig3_dtype}, on {_device_name(sizes)} (Figure 3)"
    )
    fig = _figure3(df, title)
    write_csv(df, out / "fig3_layer_forward.csv")
    save_figure(fig, out / "fig3_layer_forward.png")
    at = df.set_index("tokens").median_ms
    counts = list(at.index)
    shown = [n for n in (1, 256, 2048) if n in counts]
    if len(shown) < 3:  # a rehearsal's few counts: the first, the middle and the last
        shown = sorted({counts[0], counts[len(counts) // 2], counts[-1]})
    return StepResult("figure 3", "ok", ", ".join(f"{n} tok {at[n]:.3f} ms" for n in shown))


def slicing_step(out: Path, sizes: Sizes) -> StepResult:
    """A stage's forward + backward, whole against token-sliced: ``slicing.csv``."""
    from tplib.gpucheck.kernels import time_slicing

    cfg = get_config(sizes.model)
    df = time_slicing(
        cfg,
        layers=sizes.stage_layers,
        seq_len=sizes.seq_len,
        slices=sizes.slices,
        precision=sizes.precision,
        device=sizes.device,
        repeats=sizes.repeats,
        warmup=sizes.warmup,
    )
    write_csv(df, out / "slicing.csv")
    ratio = df.set_index("variant").ratio
    parts = [
        f"{n} slices x{ratio[f'{n} slices']:.3f} (fused W x{ratio[f'{n} slices, fused W']:.3f})"
        for n in sizes.slices
    ]
    first = sizes.slices[0]
    at = float(ratio[f"{first} slices"])
    met = "met" if at <= SLICING_TARGET else "missed"
    return StepResult(
        "slicing",
        "ok",
        f"{cfg.name}, {sizes.stage_layers} layers, L={sizes.seq_len}, {sizes.precision}: "
        + ", ".join(parts),
        target=f"<= {SLICING_TARGET:.2f}x at {first} slices: {met} ({at:.3f}x)",
        values={"ratios": ratio.to_dict()},
    )


def dropout_step(out: Path, sizes: Sizes) -> StepResult:
    """The keyed dropout against attention without it: ``dropout.csv``."""
    from tplib.gpucheck.kernels import time_dropout

    cfg = get_config(sizes.model)
    df = time_dropout(
        cfg,
        seq_len=sizes.seq_len,
        precision=sizes.precision,
        device=sizes.device,
        repeats=sizes.repeats,
        warmup=sizes.warmup,
    )
    write_csv(df, out / "dropout.csv")
    r = df.set_index("variant").ratio
    return StepResult(
        "dropout",
        "ok",
        f"L={sizes.seq_len}: layer x{r['layer, keyed dropout']:.2f} with dropout; attention "
        f"written out x{r['attention, written out']:.2f}, with keyed dropout "
        f"x{r['attention, keyed dropout']:.2f} of fused",
        values={"ratios": r.to_dict()},
    )


def efficiency_step(out: Path, sizes: Sizes) -> StepResult:
    """A whole model's training step: tokens/s and MFU, into ``efficiency.json``."""
    from tplib.gpucheck.training import measure_efficiency

    cfg = get_config(sizes.model)
    record = measure_efficiency(
        cfg,
        batch=sizes.efficiency_batch,
        seq_len=sizes.efficiency_seq_len,
        device=sizes.device,
        repeats=sizes.repeats,
        warmup=sizes.warmup,
        device_name=_device_name(sizes),
    )
    write_json(out / "efficiency.json", asdict(record))
    head = (
        f"{cfg.name} bf16, {sizes.efficiency_batch} x {sizes.efficiency_seq_len} tokens: "
        f"{record.tokens_per_s:,.0f} tokens/s, {record.achieved_tflops:.3g} TFLOP/s"
    )
    if record.mfu is None:
        return StepResult("efficiency", "ok", head, target="MFU: no peak known for this device")
    met = "met" if record.mfu >= MFU_TARGET else "missed"
    return StepResult(
        "efficiency",
        "ok",
        f"{head}, MFU {record.mfu:.1%}",
        target=f">= {MFU_TARGET:.0%} MFU: {met}",
        values={"mfu": record.mfu},
    )


def memory_step(out: Path, sizes: Sizes) -> StepResult:
    """Each rank's peak beside the memory model's, gpipe / 1f1b / terapipe, with and
    without recomputation: ``memory.csv``."""
    from tplib.gpucheck.training import measure_memory

    df = measure_memory(
        sizes.memory_model,
        overrides=sizes.memory_overrides,
        n_stages=2,
        batch=sizes.memory_batch,
        seq_len=sizes.memory_seq_len,
        token_slices=4,
        precision=sizes.precision,
        device=sizes.device,
        cases=MEMORY_CASES,
        timeout_s=120,
    )
    write_csv(df, out / "memory.csv")
    worst = df.iloc[int(df.error.abs().to_numpy().argmax())]
    met = "met" if abs(worst.error) <= MEMORY_TARGET else "missed"
    where = f"{worst.schedule}, recompute {worst.recompute}, stage {worst.stage}"
    return StepResult(
        "memory",
        "ok",
        f"{len(MEMORY_CASES)} runs on 2 ranks ({df.source.iloc[0]}): modelled / measured - 1 "
        f"in [{df.error.min():+.1%}, {df.error.max():+.1%}]",
        target=f"within {MEMORY_TARGET:.0%}: {met} (worst {worst.error:+.1%}, {where})",
        values={"errors": df.error.tolist()},
    )
