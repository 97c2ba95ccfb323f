"""Fitting the DGX A100 model to Megatron's published A100 runs, and checking it there.

The DGX A100 model has one fitted field, ``gemm_efficiency``: the fraction of the A100's
312 TFLOPS its matrix products reach. :func:`fit_dgx_a100` finds the value that
minimises the RMS log error of the predicted TFLOPS per GPU over the ten runs of
Narayanan et al. 2021, Table 1 (:data:`tplib.published.NARAYANAN_2021`), each predicted
as it ran: full recomputation, Megatron's written-out attention with its fused softmax
(no FlashAttention in 2021), scatter-gather between stages, no sequence parallelism,
no distributed optimizer, dropout 0.1. Every other field of
:data:`~tplib.cluster.calibration.DGX_A100_CALIBRATION` is a published spec, measurement
or stated assumption, and no H100 measurement enters anything: the DGX H100 model takes
the fitted fraction of its own peak. A test refits and checks that the stored value is
the fit's.

:func:`calibration_table` gives each run's prediction beside the published value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import pandas as pd

from tplib.cluster.calibration import DGX_A100_CALIBRATION, Calibration
from tplib.published import NARAYANAN_2021, PublishedRun
from tplib.search.megatron import MegatronRun, predict

__all__ = ["FitResult", "calibration_run", "calibration_table", "fit_dgx_a100", "rms_log_error"]

_GOLDEN = (math.sqrt(5) - 1) / 2


def calibration_run(r: PublishedRun) -> MegatronRun:
    """The :class:`MegatronRun` of a published run, as it ran (module docstring)."""
    return MegatronRun(
        cluster=r.cluster,
        gpus=r.gpus,
        layers=r.layers,
        hidden=r.hidden,
        heads=r.heads,
        batch=r.batch,
        vocab=r.vocab,
        seq_len=r.seq_len,
        tp=r.tp,
        pp=r.pp,
        microbatch=r.microbatch,
        interleave=r.interleave,
        recompute=r.recompute,
        attention="fused-softmax",
        dropout=0.1,
    )


def calibration_table(calibration: Calibration = DGX_A100_CALIBRATION) -> pd.DataFrame:
    """One row per published run: its layout, the published and predicted TFLOPS per
    GPU, the error, and the prediction's iteration time, bubble and memory."""
    rows = []
    for r in NARAYANAN_2021:
        p = predict(calibration_run(r), calibration)
        rows.append(
            {
                "model": r.model,
                "layers": r.layers,
                "hidden": r.hidden,
                "heads": r.heads,
                "tp": r.tp,
                "pp": r.pp,
                "gpus": r.gpus,
                "batch": r.batch,
                "microbatch": r.microbatch,
                "interleave": r.interleave,
                "published_tflops": r.tflops_per_gpu,
                "predicted_tflops": p.tflops_per_gpu,
                "error": p.tflops_per_gpu / r.tflops_per_gpu - 1,
                "iteration_s": p.iteration_s,
                "bubble_fraction": p.bubble_fraction,
                "memory_gib": p.memory_gib,
                "fits": p.fits,
            }
        )
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class FitResult:
    """The fitted ``gemm_efficiency``, its calibration and the table under it."""

    gemm_efficiency: float
    calibration: Calibration
    table: pd.DataFrame

    @property
    def rms_log_error(self) -> float:
        return rms_log_error(1 + e for e in self.table["error"])

    @property
    def worst_error(self) -> float:
        return float(self.table["error"].abs().max())


def rms_log_error(ratios: Iterable[float]) -> float:
    """The root mean square of the logs of predicted / published ``ratios``."""
    logs = [math.log(x) for x in ratios]
    return math.sqrt(sum(x * x for x in logs) / len(logs))


def _rms_log_error(gemm_efficiency: float, base: Calibration) -> float:
    cal = replace(base, gemm_efficiency=gemm_efficiency)
    return rms_log_error(
        predict(calibration_run(r), cal).tflops_per_gpu / r.tflops_per_gpu for r in NARAYANAN_2021
    )


def fit_dgx_a100(
    base: Calibration = DGX_A100_CALIBRATION,
    bounds: tuple[float, float] = (0.3, 1.0),
    tol: float = 1e-6,
) -> FitResult:
    """The ``gemm_efficiency`` in ``bounds`` of least RMS log error over the published
    runs (golden-section search: the error is unimodal in it), every other field of
    ``base`` held."""
    a, b = bounds
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = _rms_log_error(c, base), _rms_log_error(d, base)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = _rms_log_error(c, base)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = _rms_log_error(d, base)
    best = (a + b) / 2
    cal = replace(base, gemm_efficiency=best)
    return FitResult(best, cal, calibration_table(cal))
