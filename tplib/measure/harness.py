"""Measuring pipelines on real local processes, beside the simulator's prediction.

One mechanism, used by every measured table (:mod:`tplib.tables`):

1. measure the link between two local processes (:func:`tplib.runtime.measure_link`);
2. profile every stage of the pipeline on this machine
   (:func:`tplib.perfmodel.profile_pipeline`), with the torch threads each pipeline
   process gets, the embeddings on the first stage and the LM head and loss on the last,
   and measure how much the stages slow each other when they work at once
   (:func:`~tplib.perfmodel.contention.measure_contention`);
3. turn both into the simulator's costs (:func:`~tplib.measure.local_costs`) and the
   planner's cost model (:class:`~tplib.measure.BottleneckCost`);
4. plan with the DP, run every configuration on ONE :class:`~tplib.runtime.LocalPool`
   for ``iters`` timed iterations after ``warmup``, and put the measured latency beside
   the simulator's, with the stages sharing this machine's cores
   (:func:`~tplib.measure.simulate_shared`) and with a core each.

:class:`Bench` holds what one table measures with; :meth:`Bench.row` is the row of one
configuration, with the same column names in every measured table.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tplib.measure.context_parallel import ContextParallelCosts, context_parallel_costs
from tplib.measure.options import Profiling
from tplib.measure.pricing import BottleneckCost, LocalCosts, local_costs
from tplib.measure.shared import simulate_shared
from tplib.nn.configs import GPTConfig, get_config
from tplib.perfmodel import Profile, profile_pipeline
from tplib.perfmodel.contention import Contention, measure_contention
from tplib.plan import Plan
from tplib.planner import plan_slices
from tplib.runtime import Data, LocalPool, Parallelism, RunConfig, RunResult, Timing, measure_link
from tplib.sim.costs import ActionCosts, Link
from tplib.sim.simulate import SimResult, simulate
from tplib.util.machine import busy_cores, cpu_count, threads_per_process

__all__ = ["Bench", "Measured", "measured_bench"]

Overrides = Mapping[str, object] | Sequence[tuple[str, object]]
# Message sizes of the ring's exchange link, those of long sequences' K/V blocks (MBs):
# the fit of a line over kilobytes too underprices them by a third.
_RING_SIZES = (2**18, 2**20, 2**22, 2**23, 2**24)


@dataclass(frozen=True)
class Measured:
    """One configuration run on the pool: its timed iterations and what the simulator
    said, with the stages sharing this machine's cores with the other jobs (``sim``) and
    with a core each (``sim_dedicated``)."""

    result: RunResult
    sim: SimResult
    sim_dedicated: SimResult
    busy_cores: float  # cores the other jobs kept busy around the run (mean of before, after)
    contention: tuple[float, ...] = ()  # each stage's measured factor; none: not measured

    @property
    def latencies(self) -> list[float]:
        return self.result.iteration_s

    @property
    def latency(self) -> float:
        """The median iteration latency: what the tables compare."""
        return statistics.median(self.latencies)

    def row(self, suffix: str = "") -> dict[str, float]:
        """The columns of one measured configuration, each name with ``suffix``:
        ``latency`` (median of the timed iterations), ``latency_mean``, ``latency_std``,
        ``latency_min``; ``simulated_latency`` (shared cores) and its error against the
        measurement ``err_simulated_latency`` (simulated / measured - 1), the same two
        for a core per stage (``..._dedicated``); the simulated ``bubble`` fraction and
        the ``busy_cores`` of other jobs; ``contention``, the stages' largest measured
        factor (NaN: not measured)."""
        lat = self.latencies
        s = suffix
        return {
            f"latency{s}": self.latency,
            f"latency{s}_mean": statistics.fmean(lat),
            f"latency{s}_std": statistics.stdev(lat) if len(lat) > 1 else 0.0,
            f"latency{s}_min": min(lat),
            f"simulated_latency{s}": self.sim.latency,
            f"err_simulated_latency{s}": self.sim.latency / self.latency - 1.0,
            f"simulated_latency{s}_dedicated": self.sim_dedicated.latency,
            f"err_simulated_latency{s}_dedicated": self.sim_dedicated.latency / self.latency - 1.0,
            f"bubble{s}": self.sim.bubble_fraction,
            f"busy_cores{s}": self.busy_cores,
            f"contention{s}": max(self.contention, default=float("nan")),
        }


def _overrides(model_overrides: Overrides) -> tuple[tuple[str, object], ...]:
    items = model_overrides.items() if isinstance(model_overrides, Mapping) else model_overrides
    return tuple(sorted((str(k), v) for k, v in items))


@dataclass
class Bench:
    """What one measured table measures with: the model, the link, profiles per sequence
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
    costs: dict[int, LocalCosts] = field(default_factory=dict)  # per L, from its profiles
    contention: dict[int, Contention] = field(default_factory=dict)  # per L, if measured
    # The #CP ring's exchanges (both ranks sending at once); measured at the first CP run.
    ring_link: Link | None = None

    @property
    def cfg(self) -> GPTConfig:
        return get_config(self.model, self.overrides)

    def profile(self, seq_len: int, granularity: int) -> list[Profile]:
        """Every stage's profile at ``seq_len`` (measured once per length)."""
        if seq_len not in self.profiles:
            self.profiles[seq_len] = profile_pipeline(
                self.cfg,
                self.n_stages,
                seq_len=seq_len,
                granularity=granularity,
                link_bandwidth=self.link.bandwidth,
                link_latency=self.link.latency,
                progress=self.progress,
                **self.profiling.kwargs(),
            )
            self.costs[seq_len] = local_costs(self.profiles[seq_len], self.link)
            if self.profiling.contention_rounds:
                self.contention[seq_len] = measure_contention(
                    self.cfg,
                    self.n_stages,
                    seq_len=seq_len,
                    granularity=granularity,
                    threads=self.profiles[seq_len][0].threads,
                    rounds=self.profiling.contention_rounds,
                )
        return self.profiles[seq_len]

    def plan(self, seq_len: int, pipeline_batch: int, eps: float) -> Plan:
        """The DP's plan on the profiles of ``seq_len``."""
        profiles = self.profiles[seq_len]
        return plan_slices(
            BottleneckCost(profiles),
            seq_len=seq_len,
            batch=pipeline_batch,
            n_stages=self.n_stages,
            granularity=profiles[0].granularity,
            eps=eps,
        )

    def run(
        self, schedule: str, p: Plan, *, costs: ActionCosts | None = None, **options: Any
    ) -> Measured:
        """Run ``p`` as ``schedule`` on the pool, beside its simulation with ``costs``
        (default: the profiles' at ``p``'s length). ``options`` are further
        :class:`~tplib.runtime.RunConfig` fields (``optim``, ``recompute``, ...) or
        replace its defaults (``timing``: the harness's steps and warm-up).

        A context-parallel run, ``parallelism=Parallelism(n_cp=...)`` of one stage on a
        pool of #CP processes, is priced by default by
        :func:`~tplib.measure.context_parallel.context_parallel_costs` on the profiles of
        ``p``'s length (every stage's, summed) and ``ring_link`` (measured now if
        unknown), and simulated with #CP processes sharing the cores, each stretched by
        the stages' mean contention factor."""
        fields: dict[str, Any] = {
            "model": self.model,
            "model_overrides": self.overrides,
            "schedule_name": schedule,
            "parallelism": Parallelism(n_stages=self.n_stages),
            "data": Data(batch=p.batch, seq_len=p.seq_len),
            "slicing": p,
            "timing": Timing(steps=self.iters, warmup=self.warmup),
        }
        run = RunConfig(**(fields | options))
        layout = run.parallelism
        if self.pool is None:
            # Started after profiling: its processes' start-up would disturb the timings.
            self.pool = LocalPool(layout.world_size)
        # Started and idle before the other jobs' load is sampled, or it would count ours.
        self.pool.wait_ready()
        measured = self.contention.get(p.seq_len)
        factors = measured.factors if measured else ()
        if layout.n_cp > 1:
            costs = costs or self._cp_costs(p.seq_len, layout)
            factors = (statistics.fmean(factors),) if factors else ()
        costs = costs or self.costs[p.seq_len]
        cores = cpu_count()
        before = busy_cores()
        world = run.parallelism.world_size
        if before + world > cores + 0.5:
            warnings.warn(
                f"{before:.1f} of this machine's {cores} cores were busy with other work "
                f"before this run: its {world} processes share the rest, and only "
                "the shared-cores simulation can follow. Rerun on a quiet machine.",
                stacklevel=2,
            )
        result = self.pool.run(run)
        busy = 0.5 * (before + busy_cores())
        threads = run.timing.threads or threads_per_process(
            run.parallelism.world_size
        )  # as LocalPool sets them
        shared = simulate_shared(
            run.schedule,
            costs,
            cores=cores,
            busy=busy,
            threads=threads,
            contention=factors,
            processes_per_stage=layout.n_cp,
        )
        return Measured(result, shared, simulate(run.schedule, costs), busy, factors)

    def _cp_costs(self, seq_len: int, layout: Parallelism) -> ContextParallelCosts:
        if layout.n_stages != 1 or layout.world_size != layout.n_cp:
            raise ValueError(
                f"{layout}: the harness prices context parallelism on one stage alone "
                "(Parallelism(n_cp=...)); pass costs for other layouts"
            )
        if self.ring_link is None:
            self.ring_link = measure_link(_RING_SIZES, exchange=True)
        return context_parallel_costs(self.profiles[seq_len], self.ring_link, layout.n_cp)

    def without_with(self, seq_len: int, pipeline_batch: int, eps: float) -> dict[str, object]:
        """The row of GPipe (microbatches of one sequence) against TeraPipe (the DP's plan)
        at (L, B): both measured and simulated, and both speedups."""
        t0 = time.perf_counter()
        p = self.plan(seq_len, pipeline_batch, eps)
        t_plan = time.perf_counter() - t0
        gpipe = self.run("gpipe", Plan.gpipe(pipeline_batch, seq_len))
        tera = self.run("terapipe", p)
        return {
            "model": self.model,
            "seq_len": seq_len,
            "pipeline_batch": pipeline_batch,
            "n_stages": self.n_stages,
            **gpipe.row("_gpipe"),
            **tera.row("_terapipe"),
            "speedup": gpipe.latency / tera.latency,
            "simulated_speedup": gpipe.sim.latency / tera.sim.latency,
            "simulated_speedup_dedicated": gpipe.sim_dedicated.latency / tera.sim_dedicated.latency,
            "plan": p.to_paper(),
            "planner_latency": p.latency,
            "plan_seconds": t_plan,
            "iterations": self.iters,
        }


@contextmanager
def measured_bench(
    model: str,
    model_overrides: Overrides,
    n_stages: int,
    iters: int,
    warmup: int,
    link: Link | Sequence[float] | None,
    profiling: Profiling,
    progress: bool,
    pool: LocalPool | None,
) -> Iterator[Bench]:
    """A :class:`Bench`, checked before anything is measured; its pool (if it started
    one) is closed on exit."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters}, warmup={warmup}: need iters >= 1 and warmup >= 0")
    if pool is not None and pool.world_size != n_stages:
        raise ValueError(f"pool has {pool.world_size} processes, not n_stages={n_stages}")
    get_config(model)  # an unknown model fails before the link is measured
    bench = Bench(
        model,
        _overrides(model_overrides),
        n_stages,
        iters,
        warmup,
        measure_link() if link is None else Link(*link),
        profiling,
        progress,
        pool,
        own_pool=pool is None,
    )
    try:
        yield bench
    finally:
        if bench.pool is not None and bench.own_pool:
            bench.pool.close()
