"""Re-deriving the fitted fields of the cluster model's calibration from Table 2.

:func:`fit_calibration` simulates the paper's GPipe ("w/o TeraPipe") schedule of each
Table-1 setting on :class:`~tplib.cluster.cost.ClusterCostModel` and fits the fields
named in :data:`~tplib.cluster.calibration.FIT_STAGES` to the paper's GPipe latencies,
stage by stage. No TeraPipe number enters the fit, so every TeraPipe latency the model
gives is a prediction. A test refits from :data:`~tplib.cluster.calibration.CALIBRATION`
and checks that the stored values are the fit's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from tplib.cluster.calibration import CALIBRATION, FIT_STAGES, HELD_OUT, Calibration
from tplib.cluster.cost import ClusterCostModel
from tplib.paper import GPIPE, TABLE2, PaperResult, setting
from tplib.plan import Plan

if TYPE_CHECKING:
    from tplib.schedule import Schedule

__all__ = ["FitResult", "fit_calibration"]

# Bounds of fitted fields: efficiencies are fractions of a peak.
_BOUNDS = {
    "gemm_efficiency": (0.01, 1.0),
    "network_efficiency": (0.01, 1.0),
    "allreduce_efficiency": (0.01, 1.0),
    "collective_latency": (1e-6, 1e-2),
    "allreduce_latency": (1e-4, 10.0),
}


@functools.cache
def _gpipe_schedule(n_stages: int, pipeline_batch: int, seq_len: int) -> Schedule:
    """GPipe over microbatches of one sequence. Schedules do not depend on the
    calibration, so the fit builds each once, not once per step."""
    # Loaded when fitting only: pricing a layout needs neither schedules nor the simulator.
    from tplib.schedule import make_schedule

    return make_schedule("gpipe", n_stages, Plan.gpipe(pipeline_batch, seq_len))


def _gpipe_latencies(cal: Calibration, rows: list[PaperResult]) -> np.ndarray:
    """Simulated GPipe latency of each row's setting under ``cal``."""
    from tplib.sim.simulate import simulate

    out = []
    for r in rows:
        s = setting(r.setting, r.seq_len)
        schedule = _gpipe_schedule(s.n_stages, s.pipeline_batch, s.seq_len)
        out.append(simulate(schedule, ClusterCostModel.for_setting(s, cal)).latency)
    return np.array(out)


def _gauss_newton(
    start: Calibration,
    fields: tuple[str, ...],
    rows: list[PaperResult],
    tol: float,
    max_iter: int,
) -> tuple[Calibration, int]:
    """Least squares on log latency over ``rows`` in log-parameter space."""
    target = np.log([r.latency for r in rows])
    lo, hi = np.log([_BOUNDS[f] for f in fields]).T

    def calib(theta: np.ndarray) -> Calibration:
        values: dict[str, Any] = dict(zip(fields, map(float, np.exp(theta)), strict=True))
        return replace(start, **values)

    def residual(theta: np.ndarray) -> np.ndarray:
        return np.log(_gpipe_latencies(calib(theta), rows)) - target

    theta = np.log([getattr(start, f) for f in fields])
    r = residual(theta)
    for it in range(1, max_iter + 1):
        # Forward differences, stepping inward at an upper bound.
        steps = np.where(theta + 1e-4 > hi, -1e-4, 1e-4)
        units = np.eye(len(fields))
        jac = np.stack(
            [(residual(theta + h * e) - r) / h for h, e in zip(steps, units, strict=True)],
            axis=1,
        )
        step = np.linalg.lstsq(jac, -r, rcond=None)[0]
        for _ in range(20):  # halve the step until the cost does not grow
            new = np.clip(theta + step, lo, hi)
            r_new = residual(new)
            if r_new @ r_new <= r @ r:
                break
            step = step / 2
        else:
            return calib(theta), it
        moved = np.max(np.abs(new - theta))
        theta, r = new, r_new
        if moved < tol:
            return calib(theta), it
    return calib(theta), max_iter


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit_calibration` found: the calibration and, for the GPipe rows it
    used and those it held out (setting, simulated, paper), the RMS error of log latency
    over the rows it used."""

    calibration: Calibration
    settings: tuple[int, ...]
    simulated: tuple[float, ...]
    paper: tuple[float, ...]
    held_out: tuple[int, ...]
    iterations: int

    @property
    def errors(self) -> dict[int, float]:
        """Simulated / paper - 1 per setting, held-out rows included."""
        return {
            s: sim / paper - 1
            for s, sim, paper in zip(self.settings, self.simulated, self.paper, strict=True)
        }

    @property
    def rms_log_error(self) -> float:
        used = [s not in self.held_out for s in self.settings]
        err = np.log(np.array(self.simulated)[used]) - np.log(np.array(self.paper)[used])
        return float(math.sqrt(np.mean(err**2)))


def fit_calibration(
    start: Calibration = CALIBRATION,
    stages: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = FIT_STAGES,
    held_out: tuple[int, ...] = HELD_OUT,
    *,
    tol: float = 1e-5,
    max_iter: int = 30,
) -> FitResult:
    """Re-derive the fitted fields of :class:`Calibration` from Table 2's GPipe rows.

    For each (fields, settings) of ``stages`` in turn: minimise sum_i (log sim_i - log
    paper_i)^2 over the "w/o TeraPipe" rows of those settings, where sim_i is
    :func:`tplib.sim.simulate.simulate` of the GPipe schedule (microbatches of one sequence)
    on :class:`ClusterCostModel`, by Gauss-Newton in log-parameter space (forward
    differences, step halving, efficiencies bounded to (0.01, 1]), starting at ``start``.
    Deterministic. No TeraPipe number enters the fit. The result also simulates the GPipe
    rows of ``held_out``, which no stage saw, to check the fit on data it did not use.
    """
    fitted = {n for _, settings in stages for n in settings}
    if overlap := set(held_out) & fitted:
        raise ValueError(f"held_out={held_out}: settings {sorted(overlap)} are also fitted")
    cal, iterations = start, 0
    for fields, settings in stages:
        rows = [r for r in TABLE2 if r.algorithm == GPIPE and r.setting in settings]
        cal, it = _gauss_newton(cal, fields, rows, tol, max_iter)
        iterations += it
    rows = [r for r in TABLE2 if r.algorithm == GPIPE and r.setting in fitted | set(held_out)]
    sim = _gpipe_latencies(cal, rows)
    return FitResult(
        cal,
        tuple(r.setting for r in rows),
        tuple(map(float, sim)),
        tuple(r.latency for r in rows),
        tuple(held_out),
        iterations,
    )
