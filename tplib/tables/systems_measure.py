"""The pipeline systems on this machine: each system's schedule run for real beside the
simulator, and how fast each lowers the loss on real text.

:func:`measured_systems` profiles the stages of a small model as ``n_stages`` local
processes (:mod:`tplib.measure.harness`), runs every system of
:data:`~tplib.tables.systems.SYSTEMS` on the runtime and reads its
steady-state time per iteration the way :mod:`tplib.sim.throughput` reads the simulator's:
the median flushed iteration of a synchronous schedule, the slope of the update times
in the trace of an asynchronous one (over the same window as the simulation, clear of
the fill and the drain). Beside it, the simulator's prediction from the same profiles
and link, with the stages sharing this machine's cores and with a core each. At CPU
scale TeraPipe's plan is ``n_slices`` equal token slices per sequence, batch slices of
one sequence (the plan :mod:`tplib.tables.validation` uses; on a model this small the
DP would often choose not to slice). Every run has ``grad_clip=0``, which the
asynchronous schedules need, so all systems do the same optimizer work.

:func:`statistical_efficiency` trains the same small model on the Python standard
library's sources (:mod:`tplib.nn.corpus`, bytes) with a few systems, from the same
initialisation on the same batches, and returns the loss of every step: vanilla
updates (PipeDream-Flush), 2BW's W(t+1) = W(t) - lr grad f(W(t-1)) and PipeDream's
per-stage delays, as in PipeDream-2BW's Figure 5.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from tplib.measure.options import Profiling, grid
from tplib.plan import Plan
from tplib.schedule import Action, Kind, held_versions
from tplib.schedule.chunks import Placement
from tplib.sim.costs import ActionCosts, place
from tplib.sim.throughput import slope, steady_of, steady_window, update_ends
from tplib.tables.base import Rows
from tplib.tables.systems import (
    MEASURED,
    SYSTEMS,
    check_systems,
    delay,
    infeasible,
    system_plan,
)

if TYPE_CHECKING:
    from tplib.runtime import LocalPool

__all__ = ["RecomputeCosts", "measure_rows", "measured_systems", "statistical_efficiency"]

Overrides = Mapping[str, object] | Sequence[tuple[str, object]]
_EFFICIENCY_SYSTEMS = ("PipeDream-Flush", "PipeDream-2BW", "PipeDream")
BYTE_VOCAB = (("vocab_size", 256),)  # the stdlib corpus is bytes


@dataclass(frozen=True)
class RecomputeCosts:
    """``costs`` of a run with full recomputation: each backward runs its unit's forward
    again first, on the same chunk (the profiles are timed without recomputation)."""

    costs: ActionCosts

    @property
    def blocking_sends(self) -> bool:
        return self.costs.blocking_sends

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        t = self.costs.compute(stage, action, plan)
        if action.kind is Kind.B:
            again = Action(Kind.F, stage, action.b, action.t, chunk=action.chunk)
            t += self.costs.compute(stage, again, plan)
        return t

    def placed(self, placement: Placement) -> RecomputeCosts:
        return RecomputeCosts(place(self.costs, placement))

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return self.costs.transfer(stage, action, plan)

    def allreduce(self, stage: int) -> float:
        return self.costs.allreduce(stage)

    def optimizer(self, stage: int) -> float:
        return self.costs.optimizer(stage)


def measured_systems(
    systems: Sequence[str] = MEASURED,
    *,
    model: str = "tiny",
    model_overrides: Overrides = (),
    n_stages: int = 2,
    batch: int = 4,
    seq_len: int = 64,
    n_slices: int = 4,
    iters: int = 5,
    warmup: int = 1,
    profiling: Profiling = Profiling(granularity=8),
    link: Sequence[float] | None = None,
    pool: LocalPool | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Every system of ``systems`` run on ``n_stages`` local processes, ``batch``
    sequences of ``seq_len`` tokens per iteration, beside the simulator (see the module
    docstring). A synchronous system runs ``iters`` timed iterations after ``warmup``;
    an asynchronous one as many as its steady-state window needs (at least ``iters``
    wide)."""
    from tplib.measure.harness import measured_bench  # starts processes: torch
    from tplib.runtime import Optim, Parallelism, Timing

    check_systems(systems)
    tera = Plan.uniform(batch, seq_len, n_token_slices=n_slices)
    plans = {name: system_plan(SYSTEMS[name], batch, seq_len, tera) for name in systems}
    # Profile every batch-slice size a plan runs (PipeDream's minibatch is the batch).
    sizes = {b for p in plans.values() for b in p.batch_slices}
    profiling = replace(
        profiling, batch_slice_sizes=tuple(sorted(sizes | set(profiling.batch_slice_sizes)))
    )
    rows = []
    with measured_bench(
        model, model_overrides, n_stages, iters, warmup, link, profiling, progress, pool
    ) as bench:
        bench.profile(seq_len, grid(seq_len, profiling.granularity, 16))
        for name in tqdm(systems, desc="pipeline systems", disable=not progress):
            system, p = SYSTEMS[name], plans[name]
            row: dict[str, Any] = {
                "system": name,
                "schedule": system.schedule,
                "recompute": system.recompute,
                "model": model,
                "n_stages": n_stages,
                "pipeline_batch": batch,
                "seq_len": seq_len,
                "plan": p.to_paper(),
            }
            why = infeasible(system, n_stages, p)
            if why:
                rows.append(row | {"feasible": False, "note": why})
                continue
            costs: ActionCosts = bench.costs[seq_len]
            if system.recompute == "full":
                costs = RecomputeCosts(costs)
            options: dict[str, Any] = {"optim": Optim(grad_clip=0.0), "recompute": system.recompute}
            if system.n_chunks > 1:
                options["parallelism"] = Parallelism(n_stages=n_stages, n_chunks=system.n_chunks)
            window = None
            if system.asynchronous:
                n, a, b = steady_window(n_stages, p, window=iters)
                options |= {"timing": Timing(warmup=0, steps=n)}
                window = (a, b)
            m = bench.run(system.schedule, p, costs=costs, **options)
            schedule = m.result.config.schedule
            if window is None:
                measured, spread = m.latency, 0.0
                std = statistics.stdev(m.latencies) if len(m.latencies) > 1 else 0.0
            else:
                ends = update_ends(m.result.trace)
                measured, spread = slope(ends, window)
                std = float(np.std(np.diff(ends[window[0] : window[1] + 1])))
            shared = steady_of(schedule, m.sim, window, costs.blocking_sends)
            dedicated = steady_of(schedule, m.sim_dedicated, window, costs.blocking_sends)
            rows.append(
                row
                | {
                    "feasible": True,
                    "note": "",
                    "iteration_time": measured,
                    "iteration_time_std": std,
                    "spread": spread,
                    "simulated_iteration_time": shared.iteration_time,
                    "err_simulated_iteration_time": shared.iteration_time / measured - 1,
                    "simulated_iteration_time_dedicated": dedicated.iteration_time,
                    "err_simulated_iteration_time_dedicated": (
                        dedicated.iteration_time / measured - 1
                    ),
                    "throughput": batch / measured,
                    "simulated_throughput": batch / shared.iteration_time,
                    "bubble": shared.bubble_fraction,
                    "peak_memory_mib": max(m.result.stage_peak_bytes()) / 2**20,
                    "weight_versions": max(
                        getattr(r, "weight_versions", 1) for r in m.result.ranks
                    ),
                    "schedule_weight_versions": max(held_versions(schedule)),
                    "delay": delay(schedule),
                    "iterations": schedule.n_iterations if window else iters,
                    "busy_cores": m.busy_cores,
                }
            )
    return pd.DataFrame(rows)


def statistical_efficiency(
    steps: int = 300,
    *,
    systems: Sequence[str] = _EFFICIENCY_SYSTEMS,
    model: str = "tiny",
    model_overrides: Overrides = BYTE_VOCAB,
    n_stages: int = 2,
    batch: int = 8,
    seq_len: int = 64,
    n_slices: int = 4,
    lr: float = 1e-3,
    seed: int = 0,
    smooth: int = 10,
    pool: LocalPool | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Train ``model`` for ``steps`` updates with each of ``systems`` on the stdlib
    corpus (``Data(source="stdlib")``), from seed ``seed`` on the same batches, and return
    every step's loss: columns system, schedule, delay, step, loss and ``loss_smoothed``
    (the mean over the last ``smooth`` steps). The learning rate warms up over the
    first tenth of the steps, then decays by a cosine; no clipping (asynchronous
    schedules cannot clip the global norm)."""
    from tplib.runtime import (  # starts processes: torch
        Data,
        LocalPool,
        Optim,
        Parallelism,
        RunConfig,
        Timing,
    )

    check_systems(systems)
    if steps < 1 or smooth < 1:
        raise ValueError(f"steps={steps}, smooth={smooth}: both must be positive")
    overrides = dict(
        model_overrides.items() if isinstance(model_overrides, Mapping) else model_overrides
    )
    overrides.setdefault("vocab_size", 256)
    tera = Plan.uniform(batch, seq_len, n_token_slices=n_slices)
    own = pool is None
    pool = pool or LocalPool(n_stages)
    frames = []
    try:
        for name in tqdm(systems, desc="statistical efficiency", disable=not progress):
            system = SYSTEMS[name]
            run = RunConfig(
                model=model,
                model_overrides=tuple(sorted(overrides.items())),
                schedule_name=system.schedule,
                parallelism=Parallelism(n_stages=n_stages),
                data=Data(batch=batch, seq_len=seq_len, source="stdlib"),
                slicing=system_plan(system, batch, seq_len, tera),
                timing=Timing(steps=steps),
                optim=Optim(grad_clip=0.0, lr=lr, lr_warmup_steps=max(1, steps // 10)),
                recompute=system.recompute,
                seed=seed,
            )
            losses = pool.run(run).losses
            frame = pd.DataFrame(
                {
                    "system": name,
                    "schedule": system.schedule,
                    "delay": delay(run.schedule),
                    "step": np.arange(len(losses)),
                    "loss": losses,
                }
            )
            frame["loss_smoothed"] = frame["loss"].rolling(smooth, min_periods=1).mean()
            frames.append(frame)
    finally:
        if own:
            pool.close()
    return pd.concat(frames, ignore_index=True)


def measure_rows(
    systems: Sequence[str],
    *,
    efficiency: Mapping[str, Any] | None,
    progress: bool,
    **measured: Any,
) -> Rows:
    """The measure mode's rows: :func:`measured_systems` with ``measured``, and (unless
    ``efficiency`` is None) :func:`statistical_efficiency` with ``efficiency``, whose
    steps go to ``Rows.extras["loss"]`` and whose final loss (mean of the last tenth of
    the steps) joins each system's row as ``final_loss``."""
    df = measured_systems(systems, progress=progress, **measured)
    extras = {}
    if efficiency is not None:
        loss = statistical_efficiency(**{"progress": progress, **efficiency})
        last = loss[loss["step"] >= loss["step"].max() * 0.9]
        df["final_loss"] = df["system"].map(last.groupby("system")["loss"].mean())
        extras["loss"] = loss
    return Rows(df, extras)
