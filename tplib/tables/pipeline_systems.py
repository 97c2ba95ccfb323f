"""Pipeline systems side by side: GPipe, PipeDream, PipeDream-Flush, PipeDream-2BW and
TeraPipe, TeraPipe's token slices under the 1F1B and 2BW schedules, and the virtual-stage
schedules (interleaved 1F1B, ZB-V) with and without TeraPipe's slices.

Every system trains one pipeline's batch, B / #Data sequences of L tokens, per
iteration, and updates the weights once per iteration; they differ in how the batch is
cut into units, the order the stages run them in, and which weights a unit sees:

=================  =========  ==========================================  =========
system             schedule   plan (one iteration)                        recompute
=================  =========  ==========================================  =========
GPipe              gpipe      microbatches of one sequence (the paper's   none
                              "w/o TeraPipe")
GPipe+recompute    gpipe      microbatches of one sequence                full
PipeDream          pipedream  the minibatch: ONE batch slice of all       none
                              B / #Data sequences
PipeDream-Flush    1f1b       microbatches of one sequence                none
PipeDream-2BW      2bw        m = B / #Data microbatches of one sequence  none
TeraPipe           terapipe   the DP's batch x token plan                 none
TeraPipe+1F1B      1f1b       the DP's batch x token plan                 none
TeraPipe+2BW       2bw        the DP's batch x token plan                 none
=================  =========  ==========================================  =========

With virtual stages, two chunks per stage (the model cut into 2K parts):

====================  ====================  =================================  ==========
system                schedule              plan (one iteration)               placement
====================  ====================  =================================  ==========
Interleaved 1F1B      interleaved-1f1b      microbatches of one sequence       interleaved
TeraPipe+interleaved  terapipe-interleaved  the DP's batch x token plan        interleaved
ZB-V                  zbv                   microbatches of one sequence       V
TeraPipe+ZB-V         terapipe-zbv          the DP's batch x token plan        V
====================  ====================  =================================  ==========

They need stages of an even number of layers (settings with one layer per stage cannot
run them), and interleaving needs as many units per iteration as stages. The token-sliced
rows run the DP's plan for TeraPipe, as TeraPipe+1F1B does, not one planned for the
chunks; the memory of ZB-V's rows counts the activations in flight between F and B but
not the inputs and output gradients a split backward keeps until its W.

PipeDream's minibatch. PipeDream updates after every minibatch, so the minibatch is
the batch an update sees. We make it the whole pipeline batch, one batch slice: each
update then sees the same B sequences as every other system's, with the same number of
updates per sequence trained, so the throughputs (sequences/s) and the losses per
update compare like for like; only the staleness differs (``delay``: K-1 updates on
stage 0). The price is PipeDream's own: no microbatches, so each stage k stashes K-k
whole minibatches' activations and K-k weight versions. (Minibatches of one sequence
would pipeline finer but update B / #Data times as often, with batches of one.)

2BW needs enough microbatches per iteration that iteration t finds version t-1 on every
stage (:func:`~tplib.schedule.asynchronous.min_microbatches`; about K for one token
slice each). Most of Table 1's settings have fewer sequences per pipeline than stages,
so PipeDream-2BW cannot run them at the paper's batch (the row says so, with no
numbers); cut into token slices, the same batch has K / M times more units, and
TeraPipe+2BW can.

Throughput is the steady state (:mod:`tplib.sim.throughput`): the flushed latency of the
synchronous schedules, the slope of the update times of the asynchronous ones; TFLOPS
per GPU use the paper's formula (:func:`~tplib.search.setting.tflops_per_gpu`). Memory
is the busiest GPU's (:func:`~tplib.cluster.memory.schedule_memory_per_gpu`): weight
versions and the units in flight at its peak, against the V100's 16 GB.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from tplib.cluster import CALIBRATION, Calibration, ClusterCostModel
from tplib.cluster.memory import schedule_memory_per_gpu
from tplib.measure.options import TABLE_MODEL, Profiling
from tplib.paper import GPIPE, TERAPIPE, Setting, main_row, setting
from tplib.plan import Plan
from tplib.schedule import held_versions, make_schedule
from tplib.search.setting import EPS, paper_flops, plan_terapipe, setting_fields
from tplib.sim.simulate import simulate as simulate_schedule
from tplib.sim.throughput import steady_of, steady_window
from tplib.tables.base import Comparison, Rows, Table, TableMode, TableResult, is_timing
from tplib.tables.systems import (
    MEASURED,
    SYSTEMS,
    System,
    check_systems,
    delay,
    infeasible,
    system_plan,
)
from tplib.tables.systems_figures import (
    measured_figure,
    measured_findings,
    simulated_findings,
    systems_figure,
)
from tplib.util.files import write_csv

__all__ = ["TABLE", "measure", "save_tables", "simulate", "simulated_systems"]

GIB = 2**30
Overrides = Mapping[str, object] | Sequence[tuple[str, object]]
_DEFAULT_SETTINGS = (3, 5, 8, 9)  # one per model: GPT3-1B, 13B, 44B, 175B


def _cost(s: Setting, recompute: str, calibration: Calibration) -> ClusterCostModel:
    return ClusterCostModel.for_setting(s, calibration, recompute=recompute)


def _paper_tflops(n: int, system: str) -> float:
    """The paper's TFLOPS per GPU for its two systems (Table 2), NaN for the others."""
    algorithm = {"GPipe": GPIPE, "TeraPipe": TERAPIPE}.get(system)
    return main_row(n, algorithm).tflops if algorithm else float("nan")


def simulate_system(
    s: Setting, system: System, terapipe: Plan, *, window: int, calibration: Calibration
) -> dict[str, Any]:
    """One row: ``system`` on setting ``s`` (see the module docstring)."""
    plan = system_plan(system, s.pipeline_batch, s.seq_len, terapipe)
    row: dict[str, Any] = setting_fields(s) | {
        "system": system.name,
        "schedule": system.schedule,
        "recompute": system.recompute,
        "n_chunks": system.n_chunks,
        "plan": plan.to_paper(),
    }
    why = infeasible(system, s.n_stages, plan, s.layers_per_stage)
    if why:
        return row | {"feasible": False, "note": why}
    cost = _cost(s, system.recompute, calibration)
    n_iterations = 1
    if system.asynchronous:
        n_iterations, a, b = steady_window(s.n_stages, plan, window)
    schedule = make_schedule(
        system.schedule,
        s.n_stages,
        plan,
        n_iterations=n_iterations,
        n_chunks=system.n_chunks,
        validate=False,
    )
    window_ab = None if n_iterations == 1 else (a, b)
    steady = steady_of(schedule, simulate_schedule(schedule, cost), window_ab, cost.blocking_sends)
    held = held_versions(schedule)
    memory, worst = schedule_memory_per_gpu(
        s.config,
        schedule,
        n_op=s.n_op,
        recompute=system.recompute,
        versions=held,
        calibration=calibration,
    )
    t = steady.iteration_time
    return row | {
        "feasible": True,
        "note": "",
        "iteration_time": t,
        "throughput": s.batch / t,
        "tflops_per_gpu": paper_flops(s) / t / s.n_gpus / 1e12,
        "paper_tflops_per_gpu": _paper_tflops(s.index, system.name),
        "bubble": steady.bubble_fraction,
        "memory_gib": memory.total / GIB,
        "states_gib": memory.states / GIB,
        "activations_gib": memory.activations / GIB,
        "memory_stage": worst,
        "fits_16gb": memory.fits,
        "weight_versions": max(held),
        "delay": delay(schedule),
        "n_iterations": n_iterations,
        "spread": steady.spread,
    }


def simulated_systems(
    settings: Iterable[int] = _DEFAULT_SETTINGS,
    systems: Sequence[str] = tuple(SYSTEMS),
    *,
    window: int = 4,
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
    progress: bool = False,
) -> pd.DataFrame:
    """Every system of ``systems`` on every Table 1 setting of ``settings``, on the
    V100-cluster model (see the module docstring): steady-state time per iteration,
    sequences/s (all replicas), TFLOPS per GPU, the steady bubble, the busiest GPU's
    memory and weight versions, and ``speedup_vs_gpipe``."""
    check_systems(systems)
    rows = []
    jobs = [(n, name) for n in settings for name in systems]
    plans: dict[int, Plan] = {}
    for n, name in tqdm(jobs, desc="pipeline systems", disable=not progress):
        s = setting(n)
        if n not in plans:
            plans[n] = plan_terapipe(s, eps=eps, calibration=calibration)
        rows.append(
            simulate_system(s, SYSTEMS[name], plans[n], window=window, calibration=calibration)
        )
    df = pd.DataFrame(rows)
    if "iteration_time" not in df:
        df["iteration_time"] = np.nan
    gpipe = df[df["system"] == "GPipe"].set_index("setting")["iteration_time"]
    df["speedup_vs_gpipe"] = df["setting"].map(gpipe) / df["iteration_time"]
    return df


def simulate(
    settings: Sequence[int] = _DEFAULT_SETTINGS,
    systems: Sequence[str] = tuple(SYSTEMS),
    window: int = 4,
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
) -> Rows:
    """The simulate mode's table: :func:`simulated_systems`."""
    return Rows(
        simulated_systems(settings, systems, window=window, eps=eps, calibration=calibration)
    )


def measure(
    systems: Sequence[str] = MEASURED,
    *,
    model: str = TABLE_MODEL[0],
    model_overrides: Overrides = TABLE_MODEL[1],
    n_stages: int = 2,
    batch: int = 4,
    seq_len: int = 512,
    n_slices: int = 4,
    iters: int = 5,
    warmup: int = 1,
    profiling: Profiling | Mapping[str, Any] = Profiling(granularity=64),
    link: Sequence[float] | None = None,
    efficiency_steps: int = 300,
    efficiency: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> Rows:
    """The measure mode: :func:`~tplib.tables.systems_measure.measured_systems` on this
    machine with those parameters (by default the CPU table model, 2 stages, 4 sequences
    of 512 tokens, TeraPipe's plan 4 token slices each: about a minute), then, unless
    ``efficiency_steps`` is 0, :func:`~tplib.tables.systems_measure.statistical_efficiency`
    over that many steps with ``efficiency``'s further keyword arguments: its loss per
    step in ``Rows.extras["loss"]``, its final loss per system in the table (about a
    minute: the tiny model, 2 stages, 8 byte sequences of 64 per step)."""
    from tplib.tables import systems_measure  # starts processes: torch

    more = {"steps": efficiency_steps, **(efficiency or {})} if efficiency_steps else None

    return systems_measure.measure_rows(
        systems,
        model=model,
        model_overrides=model_overrides,
        n_stages=n_stages,
        batch=batch,
        seq_len=seq_len,
        n_slices=n_slices,
        iters=iters,
        warmup=warmup,
        profiling=Profiling.of(profiling),
        link=link,
        efficiency=more,
        progress=progress,
    )


def save_tables(
    result: TableResult, out_dir: str | os.PathLike[str], tag: str | None = None
) -> list[Path]:
    """Save ``result``'s CSV and figure (:meth:`TableResult.save`) and each extra table
    as ``<name>-<tag>-<key>.csv`` beside them, a simulated one without its wall times
    (as the CSV); return every path written."""
    csv, png = result.save(out_dir, tag)
    paths = [csv, png]
    for key, extra in result.extras.items():
        if result.mode == "simulate":
            extra = extra.drop(columns=[c for c in extra.columns if is_timing(c)])
        paths.append(write_csv(extra, csv.with_name(f"{csv.stem}-{key}.csv")))
    return paths


TABLE = Table(
    "pipeline_systems",
    "PipeDream-2BW §5 on TeraPipe's settings",
    "Pipeline systems: throughput, memory and weight versions; TeraPipe's slices under "
    "1F1B and 2BW",
    {
        "simulate": TableMode(
            simulate,
            figure=lambda rows: systems_figure(rows.df),
            findings=simulated_findings,
            columns="setting model system plan throughput tflops_per_gpu speedup_vs_gpipe "
            "bubble memory_gib weight_versions delay fits_16gb",
            compare=Comparison(
                ("setting", "system"), "tflops_per_gpu", "paper_tflops_per_gpu", ("model",)
            ),
        ),
        "measure": TableMode(
            measure,
            figure=measured_figure,
            findings=measured_findings,
            columns="system plan iteration_time simulated_iteration_time "
            "err_simulated_iteration_time throughput bubble peak_memory_mib weight_versions "
            "delay final_loss",
            compare=Comparison(("system",), "throughput"),
        ),
    },
)
