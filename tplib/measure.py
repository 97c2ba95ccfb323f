"""Measure mode: the paper's experiments on real local processes, beside the simulator.

One mechanism, used by every function here:

1. measure the link between two local processes (:func:`tplib.launch.measure_link`);
2. profile every stage of the pipeline on this machine (:func:`tplib.perfmodel.profile_pipeline`),
   with the torch threads each pipeline process gets, the embeddings on the first stage
   and the LM head and loss on the last;
3. turn both into the simulator's :class:`~tplib.simulate.ActionCosts`
   (:func:`local_costs`) and the planner's cost model (:class:`BottleneckCost`);
4. plan with the DP, run every configuration on ONE :class:`~tplib.launch.LocalPool`
   for ``iters`` timed iterations after ``warmup``, and put the measured latency
   (mean ± std, median) beside the simulator's prediction.

The simulator gives each stage a processor of its own; local processes share this
machine's cores with each other and with whatever else runs on it. Where the stages and
the other jobs (:func:`busy_cores`, measured around each run) want more cores than there
are, stages computing at the same time slow each other down, and
:func:`simulate_shared` stretches their actions accordingly (processor sharing). Every
row carries both predictions: ``simulated_*`` (shared cores) and
``simulated_*_dedicated`` (a core per stage, what a quiet machine gives), and the
``busy_cores`` they were made for.

:func:`validate_simulator` checks the simulator against measurements (issue 5: within
10% for ``gpipe`` and ``terapipe`` on 2 stages). :func:`main_results`,
:func:`dp_ablation` and :func:`seqlen_sweep` are the CPU-scale versions of the paper's
Tables 2-4 for the notebooks' ``mode="measure"``; they default to :data:`TABLE_MODEL`, a
model small enough that all three finish in minutes on 2 cores yet long-sequence enough
that attention, hence the DP's uneven slicing, matters. Every knob is a parameter.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from tplib.config import GPTConfig
from tplib.launch import LocalPool, RunResult, measure_link
from tplib.model import build_model
from tplib.perfmodel import Profile, profile_pipeline
from tplib.plan import Plan
from tplib.planner import plan as plan_slices
from tplib.runtime import RunConfig
from tplib.schedule import SENDS, Action, Schedule, make_schedule
from tplib.simulate import SimResult, simulate

__all__ = [
    "TABLE_MODEL",
    "BottleneckCost",
    "LocalCosts",
    "Measured",
    "Profiling",
    "SharedCores",
    "busy_cores",
    "dp_ablation",
    "local_costs",
    "main_results",
    "measure_run",
    "seqlen_sweep",
    "simulate_shared",
    "validate_simulator",
]

Link = tuple[float, float]  # (bandwidth bytes/s, latency s), as measure_link returns
Overrides = Mapping[str, object] | Sequence[tuple[str, object]]

# The CPU table model: "small" cut to 4 layers of hidden 128 (2 per stage at K=2) with a
# 512-token vocabulary, keeping its 4096-token context. Attention's FLOPs relative to the
# matrix products' are about L / 12 h: 0.3 at L = 512, 2.7 at L = 4096, so the context
# effect that Eq. 9 models and the DP's uneven slices exploit shows, while one iteration
# of any table configuration stays under ~2 s on one core per stage.
TABLE_MODEL: tuple[str, tuple[tuple[str, object], ...]] = (
    "small",
    (("hidden", 128), ("n_head", 2), ("n_layer", 4), ("vocab_size", 512)),
)
BYTES_PER_ACTIVATION = 4  # the runtime sends float32 activations and gradients


# ---- costs from local measurements -----------------------------------------------------


@dataclass
class LocalCosts:
    """:class:`~tplib.simulate.ActionCosts` of a pipeline on this machine.

    ``compute``: stage k's profile, t(b, l, c) without communication, split into forward
    and backward by the stage's measured forward share. ``transfer``: a send occupies the
    link for latency + bytes / bandwidth (the ping-pong's one-way time); a posted receive
    costs its stage nothing beyond waiting, since the copy out of the socket is part of
    that one-way time. ``allreduce`` / ``optimizer``: per stage, see :func:`local_costs`.
    """

    profiles: Sequence[Profile]
    bandwidth: float
    latency: float
    t_allreduce: tuple[float, ...]
    t_optimizer: tuple[float, ...]
    blocking_sends: bool = False
    _cache: dict[tuple[int, int, int, int], float] = field(default_factory=dict, repr=False)

    def _slice(self, stage: int, plan: Plan, b: int, t: int) -> float:
        size, length = plan.batch_slices[b], plan.token_slices[b][t]
        key = (stage, size, length, plan.token_offset(b, t))
        if key not in self._cache:
            prof = self.profiles[stage]
            value = prof.compute_time(size, np.array([length]), np.array([key[3]]))
            self._cache[key] = float(np.asarray(value).reshape(-1)[0])
        return self._cache[key]

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        share = self.profiles[stage].fwd_fraction
        share = share if action.kind == "F" else 1.0 - share
        return share * self._slice(stage, plan, action.b, action.t)

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        if action.kind not in SENDS:
            return 0.0
        hidden = self.profiles[stage].config.hidden
        size, length = plan.batch_slices[action.b], plan.token_slices[action.b][action.t]
        return self.latency + size * length * hidden * BYTES_PER_ACTIVATION / self.bandwidth

    def allreduce(self, stage: int) -> float:
        return self.t_allreduce[stage]

    def optimizer(self, stage: int) -> float:
        return self.t_optimizer[stage]


def _ring_allreduce(n_bytes: float, ranks: int, link: Link) -> float:
    """A ring all-reduce: 2 (r - 1) steps, each moving 1 / r of the buffer."""
    if ranks < 2:
        return 0.0
    bandwidth, latency = link
    return 2 * (ranks - 1) * (n_bytes / ranks / bandwidth + latency)


def _stage_params(cfg: GPTConfig, lo: int, hi: int) -> tuple[int, int]:
    """(all parameters, the tied embedding's) of layers [lo, hi), counted on the meta device."""
    stage = build_model(cfg, lo, hi, device="meta")
    total = sum(p.numel() for p in stage.parameters())
    tied = (
        cfg.vocab_size * cfg.hidden if cfg.tie_embeddings and (lo == 0 or hi == cfg.n_layer) else 0
    )
    return total, tied


def local_costs(profiles: Sequence[Profile], link: Link, n_replicas: int = 1) -> LocalCosts:
    """The simulator's costs for the pipeline whose stages ``profiles`` describe (one per
    stage, from :func:`~tplib.perfmodel.profile_pipeline`), over a link of ``link`` =
    (bandwidth bytes/s, latency s) from :func:`~tplib.launch.measure_link`.

    The all-reduce of stage k is what the runtime does after the last backward: the tied
    embedding's gradient between the first and the last stage (when they differ), plus,
    with ``n_replicas`` > 1, the stage's whole gradient across replicas, both as ring
    all-reduces over the measured link. The optimizer step is the profile's measured
    AdamW step."""
    if not profiles:
        raise ValueError("local_costs needs one profile per stage, got none")
    bandwidth, latency = link
    if not (bandwidth > 0 and latency >= 0 and np.isfinite([bandwidth, latency]).all()):
        raise ValueError(f"link={link}: need a positive bandwidth and a non-negative latency")
    if n_replicas < 1:
        raise ValueError(f"n_replicas={n_replicas} must be at least 1")
    n_stages, allreduce = len(profiles), []
    for k, prof in enumerate(profiles):
        if prof.stage is None:
            raise ValueError(
                f"profile {k} is of a middle stage, not of pipeline stage {k}: profile the "
                "pipeline's own stages with tplib.perfmodel.profile_pipeline"
            )
        total, tied = _stage_params(prof.config, *prof.stage)
        t = _ring_allreduce(total * BYTES_PER_ACTIVATION, n_replicas, link)
        if n_stages > 1 and tied:
            t += _ring_allreduce(tied * BYTES_PER_ACTIVATION, 2, link)
        allreduce.append(t)
    return LocalCosts(
        profiles, bandwidth, latency, tuple(allreduce), tuple(p.optimizer_time for p in profiles)
    )


class BottleneckCost:
    """The planner's cost model of a pipeline of unequal stages: a slice costs what it
    costs on its slowest stage, plus its communication. (The planner's Eq. 5 assumes
    equal stages; the slowest one sets the pace of the steady state.)"""

    def __init__(self, profiles: Sequence[Profile]) -> None:
        self.profiles = list(profiles)
        self.max_batch = min(p.max_batch for p in self.profiles)

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        slowest = np.maximum.reduce([p.compute_time(batch, length, context) for p in self.profiles])
        return slowest + self.profiles[0].comm_time(batch, length)


# ---- stages sharing cores with other jobs -----------------------------------------------

CORE_KINDS = ("F", "B", "OPT")  # actions that keep a core busy; sends and waits do not


@dataclass
class SharedCores:
    """``costs`` with each compute action and optimizer step stretched by its own factor,
    ``scale[(stage, kind, b, t)]`` (1 when absent): :func:`simulate_shared`'s state."""

    costs: LocalCosts
    scale: dict[tuple[int, str, int, int], float] = field(default_factory=dict)
    blocking_sends: bool = False

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        key = (stage, action.kind, action.b, action.t)
        return self.costs.compute(stage, action, plan) * self.scale.get(key, 1.0)

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return self.costs.transfer(stage, action, plan)

    def allreduce(self, stage: int) -> float:
        return self.costs.allreduce(stage)

    def optimizer(self, stage: int) -> float:
        return self.costs.optimizer(stage) * self.scale.get((stage, "OPT", -1, -1), 1.0)


def _stretch(
    timeline: pd.DataFrame, cores: float, busy: float, threads: int
) -> dict[tuple[int, str, int, int], float]:
    """Per compute action: max(1, demand / cores), where demand counts the cores its own
    stage, the other stages computing meanwhile (time-averaged) and the other jobs want."""
    rows = timeline[timeline.kind.isin(CORE_KINDS)]
    spans = {k: part[["start", "end"]].to_numpy() for k, part in rows.groupby("stage")}
    out = {}
    for k, mine in spans.items():
        overlap = np.zeros(len(mine))
        for j, theirs in spans.items():
            if j != k:
                lo = np.maximum(mine[:, :1], theirs[:, 0])
                hi = np.minimum(mine[:, 1:], theirs[:, 1])
                overlap += np.clip(hi - lo, 0.0, None).sum(axis=1)
        others = overlap / np.maximum(mine[:, 1] - mine[:, 0], 1e-12)
        factor = np.maximum(1.0, (threads * (1.0 + others) + busy) / cores)
        part = rows[rows.stage == k]
        keys = zip(part.kind, part.b, part.t, strict=True)
        out |= {
            (k, str(kind), int(b), int(t)): float(f)
            for (kind, b, t), f in zip(keys, factor, strict=True)
        }
    return out


def simulate_shared(
    schedule: Schedule, costs: LocalCosts, *, cores: float, busy: float = 0.0,
    threads: int = 1, rounds: int = 50, tol: float = 1e-3,
) -> SimResult:  # fmt: skip
    """Simulate ``schedule`` on a machine of ``cores`` cores of which other jobs keep
    ``busy`` busy, each stage's process running ``threads`` threads.

    The simulator gives every stage a processor of its own. Local processes do not have
    one: stages that compute at the same time share the cores the other jobs leave, and
    with n threads wanting C cores each runs at C / n of a core (processor sharing,
    never faster than one core). So each compute action is stretched by
    max(1, demand / C), its demand being its own threads, those of the other stages while
    they compute during it (time-averaged) and ``busy``. Overlaps change as actions
    stretch, so this iterates, damped, to a fixed point from the one-core-per-stage
    simulation, which it returns unchanged when the stages and ``busy`` fit in ``cores``."""
    shared = SharedCores(costs)
    sim = simulate(schedule, shared)
    if not np.isfinite(busy) or threads * schedule.n_stages + busy <= cores:
        return sim  # NaN: the other jobs' load is unknown here
    for _ in range(rounds):
        target = _stretch(sim.timeline, cores, busy, threads)
        change = max((abs(v - shared.scale.get(key, 1.0)) for key, v in target.items()), default=0)
        shared.scale = {key: 0.5 * (shared.scale.get(key, 1.0) + v) for key, v in target.items()}
        sim = simulate(schedule, shared)
        if change < tol:
            break
    return sim


def busy_cores(window_s: float = 0.25) -> float:
    """Cores this machine spent busy (or stolen by its hypervisor) over the next
    ``window_s`` seconds, from Linux's ``/proc/stat``; NaN where there is none. Called
    while the pool's processes wait for work, it measures the other jobs' demand."""

    def snapshot() -> tuple[float, float]:
        with open("/proc/stat") as f:
            ticks = [float(x) for x in f.readline().split()[1:9]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    try:
        total0, idle0 = snapshot()
        time.sleep(window_s)
        total1, idle1 = snapshot()
    except (OSError, ValueError, IndexError):
        return float("nan")
    if total1 <= total0:
        return float("nan")
    busy = 1.0 - (idle1 - idle0) / (total1 - total0)
    return busy * (os.cpu_count() or 1)


# ---- running and timing ----------------------------------------------------------------


@dataclass(frozen=True)
class Profiling:
    """How the stages are profiled (:func:`tplib.perfmodel.profile_stage` options).

    The defaults suit a machine shared with other jobs: each point is timed once per
    round (``warmup=0``: the first visit's colder run is one round among ``rounds``),
    rounds are combined by their median, the typical time a pipeline run will see, and
    the table t(b, l, 0) is smoothed so that the DP plans on the trend, not on lucky
    timings. ``granularity`` None: the calling function's default grid."""

    granularity: int | None = None
    batch_sizes: tuple[int, ...] = (1,)
    repeats: int = 1
    warmup: int = 0
    rounds: int = 3
    reduce: str = "median"
    smooth: bool = True
    threads: int | None = None  # None: what each pipeline process gets

    def kwargs(self) -> dict[str, Any]:
        return {
            "batch_sizes": tuple(self.batch_sizes), "repeats": self.repeats,
            "warmup": self.warmup, "rounds": self.rounds, "reduce": self.reduce,
            "smooth": self.smooth, "threads": self.threads,
        }  # fmt: skip


@dataclass(frozen=True)
class Measured:
    """One configuration run on the pool: its timed iterations and what the simulator
    said, with the stages sharing this machine's cores with the other jobs (``sim``, from
    :func:`simulate_shared`) and with a core each (``sim_dedicated``)."""

    result: RunResult
    sim: SimResult
    sim_dedicated: SimResult
    busy_cores: float  # cores the other jobs kept busy around the run (mean of before, after)

    @property
    def latencies(self) -> list[float]:
        return self.result.iteration_s

    def row(self, suffix: str = "") -> dict[str, float]:
        """``latency`` (mean), ``latency_std``, ``latency_median``, ``latency_min``,
        ``simulated_latency``, ``err_latency`` (simulated / measured median - 1), the same
        two for ``_dedicated`` cores, the simulated ``bubble`` fraction and ``busy_cores``,
        each name with ``suffix``."""
        lat = self.latencies
        median = statistics.median(lat)
        return {
            f"latency{suffix}": statistics.fmean(lat),
            f"latency{suffix}_std": statistics.stdev(lat) if len(lat) > 1 else 0.0,
            f"latency{suffix}_median": median,
            f"latency{suffix}_min": min(lat),
            f"simulated_latency{suffix}": self.sim.latency,
            f"err_latency{suffix}": self.sim.latency / median - 1.0,
            f"simulated_latency{suffix}_dedicated": self.sim_dedicated.latency,
            f"err_latency{suffix}_dedicated": self.sim_dedicated.latency / median - 1.0,
            f"bubble{suffix}": self.sim.bubble_fraction,
            f"busy_cores{suffix}": self.busy_cores,
        }


def measure_run(pool: LocalPool, run: RunConfig, costs: LocalCosts) -> Measured:
    """Run ``run`` on ``pool`` and simulate its schedule under ``costs``.

    Other jobs on this machine are the main source of error, so the cores they keep busy
    are measured while the pool waits, just before and just after the run, and the
    simulation accounts for them (:func:`simulate_shared`); the plain simulation, a core
    per stage, comes alongside. A warning says when the stages cannot all have a core."""
    schedule = make_schedule(run.schedule, run.n_stages, run.resolved_plan())
    cores = os.cpu_count() or 1
    before = busy_cores()
    if before + run.world_size > cores + 0.5:
        warnings.warn(
            f"{before:.1f} of this machine's {cores} cores were busy with other work before "
            f"this run: its {run.world_size} processes share the rest, and only the "
            "shared-cores simulation can follow. Rerun on a quiet machine.",
            stacklevel=2,
        )
    result = pool.run(run)
    busy = 0.5 * (before + busy_cores())
    threads = run.threads or max(1, cores // run.world_size)  # as LocalPool sets them
    shared = simulate_shared(schedule, costs, cores=cores, busy=busy, threads=threads)
    return Measured(result, shared, simulate(schedule, costs), busy)


def _overrides(model_overrides: Overrides) -> tuple[tuple[str, object], ...]:
    items = model_overrides.items() if isinstance(model_overrides, Mapping) else model_overrides
    return tuple(sorted((str(k), v) for k, v in items))


@dataclass
class _Bench:
    """What one table function measures with: the model, the link, profiles per sequence
    length (reused by every configuration of that length) and one pool."""

    model: str
    overrides: tuple[tuple[str, object], ...]
    n_stages: int
    iters: int
    warmup: int
    link: Link
    profiling: Profiling
    progress: bool
    pool: LocalPool | None = None
    own_pool: bool = True  # started here, so closed here
    profiles: dict[int, list[Profile]] = field(default_factory=dict)

    @property
    def cfg(self) -> GPTConfig:
        return RunConfig(model=self.model, model_overrides=self.overrides).cfg

    def profile(self, seq_len: int, granularity: int) -> list[Profile]:
        if seq_len not in self.profiles:
            self.profiles[seq_len] = profile_pipeline(
                self.cfg, self.n_stages, seq_len=seq_len, granularity=granularity,
                bandwidth=self.link[0], latency=self.link[1], progress=self.progress,
                **self.profiling.kwargs(),
            )  # fmt: skip
        return self.profiles[seq_len]

    def run(self, schedule: str, p: Plan) -> Measured:
        if self.pool is None:
            # Started after profiling: its processes' start-up would disturb the timings.
            self.pool = LocalPool(self.n_stages)
        run = RunConfig(
            model=self.model, model_overrides=self.overrides, schedule=schedule,
            n_stages=self.n_stages, batch=p.batch, seq_len=p.seq_len, plan=p,
            steps=self.iters, warmup=self.warmup,
        )  # fmt: skip
        return measure_run(self.pool, run, local_costs(self.profiles[p.seq_len], self.link))

    def plan(self, seq_len: int, batch: int, eps: float) -> Plan:
        profiles = self.profiles[seq_len]
        return plan_slices(
            BottleneckCost(profiles), seq_len=seq_len, batch=batch, n_stages=self.n_stages,
            granularity=profiles[0].granularity, eps=eps,
        )  # fmt: skip


@contextmanager
def _bench(
    model: str, model_overrides: Overrides, n_stages: int, iters: int, warmup: int,
    link: Link | None, profiling: Profiling, progress: bool, pool: LocalPool | None,
) -> Iterator[_Bench]:  # fmt: skip
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters}, warmup={warmup}: need iters >= 1 and warmup >= 0")
    if pool is not None and pool.world_size != n_stages:
        raise ValueError(f"pool has {pool.world_size} processes, not n_stages={n_stages}")
    bench = _Bench(
        model, _overrides(model_overrides), n_stages, iters, warmup,
        link or measure_link(), profiling, progress, pool, own_pool=pool is None,
    )  # fmt: skip
    try:
        yield bench
    finally:
        if bench.pool is not None and bench.own_pool:
            bench.pool.close()


def _grid(seq_len: int, granularity: int | None, n_grid: int) -> int:
    """The profile's grid: ``granularity`` tokens, or L / ``n_grid``."""
    g = granularity or max(1, seq_len // n_grid)
    if seq_len % g:
        raise ValueError(
            f"granularity {g} does not divide seq_len {seq_len}: profiled lengths are "
            "g, 2g, ..., L, so pick a g that divides L"
        )
    return g


# ---- the simulator against measurements -------------------------------------------------


def validate_simulator(
    model: str = "small", n_stages: int = 2, batch: int = 1, seq_len: int = 1024,
    n_slices: int = 8, schedules: Sequence[str] = ("gpipe", "terapipe"), iters: int = 5,
    warmup: int = 1, *, model_overrides: Overrides = (), profiling: Profiling = Profiling(),
    link: Link | None = None, pool: LocalPool | None = None, progress: bool = True,
    runs: dict[str, Measured] | None = None,
) -> pd.DataFrame:  # fmt: skip
    """Profile the stages of ``model`` for ``n_stages`` local processes, simulate each of
    ``schedules`` with those costs, run it for ``iters`` timed iterations after ``warmup``
    and compare: one row per schedule with the measured ``latency`` (mean),
    ``latency_std``, ``latency_median``, the ``simulated_latency`` and ``err_latency``
    (simulated / measured median - 1).

    ``gpipe`` runs microbatches of one sequence, every other schedule the uniform plan of
    ``n_slices`` token slices per sequence. The profile's grid defaults to
    ``seq_len / n_slices`` tokens, so the plan's slices lie on it. Pass a dict as
    ``runs`` to get each schedule's :class:`Measured` (trace and simulated timeline)."""
    g = _grid(seq_len, profiling.granularity, n_slices)
    rows = []
    with _bench(
        model, model_overrides, n_stages, iters, warmup, link, profiling, progress, pool
    ) as bench:
        t0 = time.perf_counter()
        profiles = bench.profile(seq_len, g)
        t_profile = time.perf_counter() - t0
        for name in tqdm(schedules, desc="validating", disable=not progress):
            if name == "gpipe":
                p = Plan.gpipe(batch, seq_len)
            else:
                p = Plan.uniform(batch, seq_len, n_token_slices=n_slices)
            m = bench.run(name, p)
            if runs is not None:
                runs[name] = m
            rows.append({
                "schedule": name, "model": model, "n_stages": n_stages, "batch": batch,
                "seq_len": seq_len, "n_slices": max(len(t) for t in p.token_slices),
                "plan": p.to_paper(), "iterations": iters, **m.row(),
                "holdout_error": max(max(pr.holdout_error) for pr in profiles),
                "fwd_fraction": statistics.fmean(pr.fwd_fraction for pr in profiles),
                "bandwidth": bench.link[0], "link_latency": bench.link[1],
                "threads": profiles[0].threads, "profile_seconds": t_profile,
            })  # fmt: skip
    return pd.DataFrame(rows)


# ---- the paper's tables at CPU scale ---------------------------------------------------


def _without_with(bench: _Bench, seq_len: int, batch: int, eps: float) -> dict[str, object]:
    """GPipe (microbatches of one sequence) and TeraPipe (the DP plan) at (L, B)."""
    t0 = time.perf_counter()
    p = bench.plan(seq_len, batch, eps)
    t_plan = time.perf_counter() - t0
    gpipe = bench.run("gpipe", Plan.gpipe(batch, seq_len))
    tera = bench.run("terapipe", p)
    return {
        "model": bench.model, "seq_len": seq_len, "batch": batch, "n_stages": bench.n_stages,
        **gpipe.row("_gpipe"), **tera.row("_terapipe"),
        "speedup": statistics.median(gpipe.latencies) / statistics.median(tera.latencies),
        "simulated_speedup": gpipe.sim.latency / tera.sim.latency,
        "simulated_speedup_dedicated": gpipe.sim_dedicated.latency / tera.sim_dedicated.latency,
        "plan": p.to_paper(), "planner_latency": p.latency, "plan_seconds": t_plan,
        "iterations": bench.iters,
    }  # fmt: skip


def main_results(
    batches: Sequence[int] = (1, 2, 4), *, seq_len: int = 2048, model: str = TABLE_MODEL[0],
    model_overrides: Overrides = TABLE_MODEL[1], n_stages: int = 2, iters: int = 5,
    warmup: int = 1, eps: float = 0.0,
    profiling: Profiling = Profiling(granularity=128, batch_sizes=(1, 2)),
    link: Link | None = None, pool: LocalPool | None = None, progress: bool = True,
) -> pd.DataFrame:  # fmt: skip
    """Table 2 at CPU scale: at every batch size B in ``batches``, GPipe with microbatches
    of one sequence against TeraPipe's DP plan, both measured (``latency_gpipe``,
    ``latency_terapipe``, their ``_std``, ``_median`` and ``_min``) and simulated
    (``simulated_latency_*``), with the measured and the simulated ``speedup`` (of the
    medians). One profile (batch slices of up to ``max(profiling.batch_sizes)``
    sequences, the DP's choice) serves every B."""
    with _bench(
        model, model_overrides, n_stages, iters, warmup, link, profiling, progress, pool
    ) as bench:
        bench.profile(seq_len, _grid(seq_len, profiling.granularity, 16))
        rows = [
            _without_with(bench, seq_len, b, eps)
            for b in tqdm(batches, desc="main results", disable=not progress)
        ]
    return pd.DataFrame(rows)


def dp_ablation(
    slices: Sequence[int] = (1, 2, 4, 8, 16, 32), *, seq_len: int = 2048, batch: int = 1,
    model: str = TABLE_MODEL[0], model_overrides: Overrides = TABLE_MODEL[1],
    n_stages: int = 2, iters: int = 5, warmup: int = 1, eps: float = 0.0,
    profiling: Profiling = Profiling(granularity=64), link: Link | None = None,
    pool: LocalPool | None = None, progress: bool = True,
) -> pd.DataFrame:  # fmt: skip
    """Table 3 at CPU scale: uniform token slicing (``#Slices=n``, batch slices of one
    sequence) against the DP's plan (``DP``), all run as ``terapipe``, measured and
    simulated. ``rank`` orders the rows by measured median latency (1: fastest),
    ``simulated_rank`` by the simulator's. Slice counts must cut L on the profile's grid."""
    g = _grid(seq_len, profiling.granularity, max(slices))
    for n in slices:
        if seq_len % n or (seq_len // n) % g:
            raise ValueError(
                f"#slices={n} cuts L={seq_len} into {seq_len / n:g}-token slices, off the "
                f"profile's grid of {g} tokens: use a granularity that divides L / #slices"
            )
    rows = []
    with _bench(
        model, model_overrides, n_stages, iters, warmup, link, profiling, progress, pool
    ) as bench:
        bench.profile(seq_len, g)
        dp = bench.plan(seq_len, batch, eps)
        plans = [(f"#Slices={n}", Plan.uniform(batch, seq_len, n_token_slices=n)) for n in slices]
        for name, p in tqdm([*plans, ("DP", dp)], desc="DP ablation", disable=not progress):
            m = bench.run("terapipe", p)
            rows.append({
                "model": model, "seq_len": seq_len, "batch": batch, "n_stages": n_stages,
                "algorithm": name, "n_slices": max(len(t) for t in p.token_slices),
                "plan": p.to_paper(), **m.row(), "iterations": iters,
            })  # fmt: skip
    df = pd.DataFrame(rows)
    df["rank"] = df["latency_median"].rank(method="min").astype(int)
    df["simulated_rank"] = df["simulated_latency"].rank(method="min").astype(int)
    return df


def seqlen_sweep(
    seq_lens: Sequence[int] = (512, 1024, 2048, 4096), batches: Sequence[int] = (8, 4, 2, 1),
    *, model: str = TABLE_MODEL[0], model_overrides: Overrides = TABLE_MODEL[1],
    n_stages: int = 2, iters: int = 3, warmup: int = 1, n_grid: int = 16, eps: float = 0.0,
    profiling: Profiling = Profiling(), link: Link | None = None,
    pool: LocalPool | None = None, progress: bool = True,
) -> pd.DataFrame:  # fmt: skip
    """Table 4 at CPU scale: sequence length L growing while the batch shrinks (pairs of
    ``seq_lens`` and ``batches``), GPipe against TeraPipe's DP plan, measured and
    simulated. Each L is profiled once, on a grid of ``n_grid`` slice lengths (or of
    ``profiling.granularity`` tokens), and shared by both schedules."""
    if len(seq_lens) != len(batches):
        raise ValueError(
            f"seq_lens {list(seq_lens)} and batches {list(batches)} differ in length: "
            "give one batch size per sequence length"
        )
    grids = {L: _grid(L, profiling.granularity, n_grid) for L in seq_lens}
    rows = []
    with _bench(
        model, model_overrides, n_stages, iters, warmup, link, profiling, progress, pool
    ) as bench:
        pairs = list(zip(seq_lens, batches, strict=True))
        for L, b in tqdm(pairs, desc="sequence lengths", disable=not progress):
            # Profiled just before its runs: this machine's speed drifts over minutes.
            bench.profile(L, grids[L])
            rows.append(_without_with(bench, L, b, eps))
    return pd.DataFrame(rows)
