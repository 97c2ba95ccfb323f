"""TeraPipe's whole layout, searched: #Data, #CP, #Pipe, #Op, recomputation, the schedule
and the plan.

The paper chose Table 1's layouts by hand ("the maximal batch size that fits"). Given a
model, a GPU count, a global batch B and a cluster, :func:`autoplan` searches every
layout the cluster model can price (:func:`layouts`): #Data x #Pipe x #Op = #GPUs with
#Op inside a node (dividing its GPUs and the model's heads), #Pipe stages of equal
layer counts, B split evenly over #Data, and a replica (#Pipe x #Op GPUs) filling whole
nodes or a whole share of one (the simulator runs one replica and prices the others
alike, which holds only when every replica sits on its nodes the same way); each with
and without full recomputation. For a
candidate it plans the batch and token slicing with the DP planner (the joint plan,
eps = 0.1 ms, on :class:`~tplib.cluster.ClusterCostModel`), checks the plan's memory per
GPU (:func:`~tplib.cluster.memory.memory_per_gpu`) and simulates the iteration
(:func:`tplib.sim.simulate.simulate_schedule`, the ``terapipe`` schedule with the all-reduce and
the optimizer step). The answer is the fitting candidate of least simulated latency.

Beyond the paper, on request: context parallelism (``context_parallel``: each #CP that
divides the GPUs, with L a multiple of 2 #CP, FlashAttention only; a replica is then
#CP x #Pipe x #Op GPUs) and other schedules (``schedules``, priced by
:mod:`tplib.search.pricing`): ``terapipe-zb`` (the zero-bubble planner's plan), and 1F1B
over microbatches of 1, 2, 4 or 8 sequences, interleaved over v chunks per stage, or over
token slices cut by a slicing (``seq1f1b``, Seq1F1B's), and (``accumulate``) TeraPipe's
plans in rounds of gradient accumulation. Each schedule is a candidate of its own, its
choices in its :class:`Layout`. The defaults search what the paper did.

Pruning keeps the search exact and fast: before planning a candidate, a memory floor
and a latency floor are computed from the cost model alone
(:mod:`tplib.search.floors`); a candidate whose memory floor exceeds the capacity cannot
fit, and one whose latency floor reaches the best latency found is dropped unplanned.
Candidates are planned in order of their latency floors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from tplib.cluster import CALIBRATIONS, Calibration, ClusterCostModel, check_layout
from tplib.cluster.hardware import CLUSTERS, Hardware
from tplib.cluster.implementation import PAPER, RECOMPUTES, Implementation
from tplib.nn.configs import GPTConfig, get_config
from tplib.partition.chain import DoesNotFit
from tplib.partition.topology import Topology
from tplib.schedule.chunks import interleaved
from tplib.search.floors import latency_floor, memory_floor
from tplib.search.pricing import (
    GRANULARITY,
    MICROBATCH_SCHEDULES,
    SEARCHED_SCHEDULES,
    TOKEN_SCHEDULES,
    Layout,
    Slicing,
    layout_cost_model,
    op_implementation,
    price,
    seq1f1b_slicing,
    token_slices_of,
    variants,
)

__all__ = [
    "SEARCHED_RECOMPUTE",
    "SEARCHED_SCHEDULES",
    "Candidate",
    "Layout",
    "NoLayout",
    "Search",
    "autoplan",
    "latency_floor",
    "layouts",
]

EPS = 1e-4  # the paper's eps = 0.1 ms (§3.3)
# The recomputation modes searched unless asked: the paper's two. Selective
# recomputation is priced too (tplib.cluster.implementation.RECOMPUTES) when asked for.
SEARCHED_RECOMPUTE = ("none", "full")


class NoLayout(ValueError):
    """No layout the search may price takes the model, GPUs, batch and schedules asked."""


@dataclass(frozen=True)
class Candidate:
    """A layout and what the search learnt of it. ``status``: "fits" (planned, simulated,
    fits), "out of memory" (planned and over capacity, or its floor already is), or
    "pruned" (its latency floor reached the best found). ``memory``: the plan's bytes
    per GPU, or the floor when unplanned; ``latency`` (simulated) is NaN unless planned."""

    layout: Layout
    status: str
    latency_floor: float
    memory: float
    latency: float = math.nan
    plan: str = ""
    plan_seconds: float = 0.0
    reason: str = ""

    def row(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "layout"}
        return asdict(self.layout) | d | {"memory_gib": self.memory / 2**30}


@dataclass(frozen=True)
class Search:
    """The search's answer: every candidate, the fitting ones first by latency."""

    model: str
    n_gpus: int
    batch: int
    seq_len: int
    cluster: str
    capacity: float
    candidates: tuple[Candidate, ...]
    seconds: float

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def top(self, n: int = 5) -> tuple[Candidate, ...]:
        return self.candidates[:n]

    def to_dict(self) -> dict[str, Any]:
        head = {k: v for k, v in asdict(self).items() if k != "candidates"}
        return head | {"candidates": [c.row() for c in self.candidates]}

    def report(self, top: int = 5) -> str:
        gib = 2**30
        lines = [
            f"{self.model}, {self.n_gpus} GPUs ({self.cluster}, {self.capacity / gib:.0f} GiB "
            f"each), B={self.batch}, L={self.seq_len}: {len(self.candidates)} layouts "
            f"searched in {self.seconds:.1f} s",
        ]
        for i, c in enumerate(self.candidates[:top], start=1):
            lat = f"{c.latency:.4f} s" if c.status == "fits" else "-"
            lines.append(
                f"{i:>2}. {c.layout!s:<44} latency {lat:>10}  memory {c.memory / gib:5.1f} GiB"
                f"  {c.reason}"
            )
            if c.plan:
                lines.append(f"    plan {c.plan}")
        lost: dict[str, int] = {}
        for c in self.candidates[top:]:
            lost[c.status] = lost.get(c.status, 0) + 1
        if lost:
            rest = ", ".join(f"{n} {s}" for s, n in sorted(lost.items()))
            lines.append(f"    the other {len(self.candidates) - top}: {rest}")
        return "\n".join(lines)


def layouts(
    cfg: GPTConfig, n_gpus: int, batch: int, hardware: Hardware, n_cp: int = 1
) -> Iterator[tuple[int, int, int]]:
    """Every (#Data, #Pipe, #Op) of ``n_gpus`` GPUs the cluster model can price for
    ``cfg`` and a global batch ``batch``, with ``n_cp`` context-parallel ranks per stage
    (see the module docstring)."""
    g = hardware.gpus_per_node
    for n_op in range(1, min(g, n_gpus) + 1):
        for n_stages in range(1, cfg.n_layer + 1):
            if n_gpus % (n_op * n_stages * n_cp):
                continue
            n_data = n_gpus // (n_op * n_stages * n_cp)
            replica = n_stages * n_op * n_cp
            if batch % n_data or (replica % g and g % replica):
                continue
            try:
                check_layout(
                    cfg, n_stages=n_stages, n_op=n_op, n_data=n_data, hardware=hardware,
                    n_cp=n_cp,
                )  # fmt: skip
            except ValueError:
                continue
            yield n_data, n_stages, n_op


def _cp_choices(
    context_parallel: tuple[int, ...] | None, n_gpus: int, L: int, flash: bool
) -> tuple[int, ...]:
    """The #CP values searched: those asked (each checked), or every one that can run."""
    if context_parallel is None:
        if not flash:
            return (1,)
        return tuple(c for c in range(1, n_gpus + 1) if n_gpus % c == 0 and L % (2 * c) == 0)
    for c in context_parallel:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"context_parallel={context_parallel!r}: #CP values are ints >= 1")
        if c > 1 and (not flash or L % (2 * c)):
            raise ValueError(
                f"#CP={c}: context parallelism needs FlashAttention and L={L} a multiple "
                f"of 2 #CP = {2 * c}"
            )
    if not context_parallel:
        raise ValueError("context_parallel=(): search at least one #CP (1: none)")
    return tuple(context_parallel)


def autoplan(
    model: str | GPTConfig,
    n_gpus: int,
    batch: int,
    *,
    seq_len: int | None = None,
    cluster: str = "p3.16xlarge",
    memory_gib: float | None = None,
    recompute: tuple[str, ...] = SEARCHED_RECOMPUTE,
    eps: float = EPS,
    calibration: Calibration | None = None,
    implementation: Implementation | None = None,
    schedules: tuple[str, ...] = ("terapipe",),
    context_parallel: tuple[int, ...] | None = (1,),
    granularity: int = GRANULARITY,
    slicing: Slicing | None = None,
    hardware: Hardware | None = None,
    accumulate: bool = False,
) -> Search:
    """The fastest layout of ``model`` on ``n_gpus`` GPUs of ``cluster`` for a global
    batch of ``batch`` sequences that fits in memory (``memory_gib`` per GPU overrides
    the cluster's; ``hardware`` the cluster's nodes). ``calibration``: the cluster's by
    default; ``implementation``: the paper's, with FlashAttention-2 where the cluster
    runs it (sequence parallelism is dropped where #Op = 1). ``schedules``: those of
    :data:`SEARCHED_SCHEDULES` to try; ``context_parallel``: the #CP values (None: every
    one that can run); ``granularity``: the planner's token grid (a multiple of 2 #CP
    too where #CP > 1); ``slicing``: how ``seq1f1b`` cuts a sequence (default:
    Seq1F1B's equal-FLOP slicing, :func:`~tplib.search.pricing.seq1f1b_slicing`);
    ``accumulate``: TeraPipe's plans also in 2, 4, ... fill-drain rounds of gradient accumulation. Under
    FlashAttention selective recomputation costs and keeps what none does, so it is
    searched only where none is not. Raises ``ValueError`` for input no layout can take
    (:class:`NoLayout` where the model, GPUs, batch and schedules admit none), and
    :class:`~tplib.partition.chain.DoesNotFit` when none fits, naming the closest."""
    cfg = get_config(model) if isinstance(model, str) else model
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster={cluster!r}: known clusters are {sorted(CLUSTERS)}")
    hw = hardware or CLUSTERS[cluster]
    calibration = calibration or CALIBRATIONS[cluster]
    if implementation is None:
        flash = calibration.flash_efficiency is not None
        implementation = Implementation(attention="flash") if flash else PAPER
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ValueError(f"memory_gib={memory_gib}: a GPU's memory must be > 0 GiB")
        hw = replace(hw, gpu_memory=memory_gib * 2**30)
    Topology.cluster(n_gpus, hw, calibration)  # refuses a GPU count the nodes cannot hold
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: the global batch needs at least one sequence")
    L = seq_len or cfg.seq_len
    if granularity < 1 or L % granularity:
        raise ValueError(f"seq_len={L}: must be a multiple of the planner's {granularity} tokens")
    cfg = cfg if cfg.seq_len >= L else cfg.with_(seq_len=L)
    bad = [m for m in recompute if m not in RECOMPUTES]
    if not recompute or bad:
        raise ValueError(f"recompute={recompute!r}: choose among {RECOMPUTES}")
    unknown = [s for s in schedules if s not in SEARCHED_SCHEDULES]
    if not schedules or unknown:
        raise ValueError(f"schedules={schedules!r}: choose among {SEARCHED_SCHEDULES}")
    slicing = slicing or seq1f1b_slicing
    flash = implementation.attention == "flash"
    cps = _cp_choices(context_parallel, n_gpus, L, flash)
    if flash and "none" in recompute:  # the same prices: see the docstring
        recompute = tuple(m for m in recompute if m != "selective")
    start = time.perf_counter()
    found: list[Layout] = []
    for cp in cps:
        grid = math.lcm(granularity, 2 * cp) if cp > 1 else granularity
        names = tuple(s for s in schedules if L % grid == 0 or s not in TOKEN_SCHEDULES)
        for d, k, op in layouts(cfg, n_gpus, batch, hw, n_cp=cp):
            for rc in recompute:
                base = Layout(d, k, op, rc, n_cp=cp)
                found += variants(base, names, batch // d, cfg.n_layer // k, accumulate)
    if not found:
        raise NoLayout(
            f"no layout of {cfg.name} on n_gpus={n_gpus} with batch={batch}: #Data x #Pipe x "
            f"#Op must equal the GPUs, #Pipe divide the {cfg.n_layer} layers, #Op divide "
            f"the {hw.gpus_per_node} GPUs of a node and the {cfg.n_head} heads, and #Data "
            f"divide the batch; schedules {schedules} ask more (interleaving v > 1 "
            "dividing a stage's layers, Megatron's microbatches a multiple of #Pipe)"
        )
    bases: dict[tuple[int, int, int, str, int], ClusterCostModel] = {}
    costs, floors, slices = {}, {}, {}
    for lay in found:
        key = (lay.n_data, lay.n_stages, lay.n_op, lay.recompute, lay.n_cp)
        if key not in bases:
            bases[key] = layout_cost_model(
                cfg, lay, L, calibration=calibration, hardware=hw, implementation=implementation
            )
        costs[lay] = bases[key].placed(interleaved(lay.n_stages, lay.n_chunks))
        grid = math.lcm(granularity, 2 * lay.n_cp) if lay.n_cp > 1 else granularity
        slices[lay] = token_slices_of(cfg, lay, L, grid, slicing)
        unit = None
        if lay.schedule in MICROBATCH_SCHEDULES:
            unit = (lay.microbatch, slices[lay] or (L,))
        floors[lay] = latency_floor(costs[lay], batch // lay.n_data, unit, lay.rounds)
    out: list[Candidate] = []
    best: float = math.inf
    for lay in sorted(found, key=floors.__getitem__):
        b = batch // lay.n_data
        mem_floor = memory_floor(
            cfg, lay, L, b, calibration, op_implementation(implementation, lay.n_op)
        )
        if mem_floor > hw.gpu_memory:
            out.append(Candidate(lay, "out of memory", floors[lay], mem_floor))
        elif floors[lay] >= best:
            out.append(Candidate(lay, "pruned", floors[lay], mem_floor))
        else:
            grid = math.lcm(granularity, 2 * lay.n_cp) if lay.n_cp > 1 else granularity
            priced = price(lay, costs[lay], b, eps=eps, grid=grid, slices=slices[lay])
            fits = priced.memory <= hw.gpu_memory
            if fits:
                best = min(best, priced.latency)
            status = "fits" if fits else "out of memory"
            out.append(
                Candidate(lay, status, floors[lay], priced.memory, priced.latency,
                          priced.plan, priced.plan_seconds)
            )  # fmt: skip
    seconds = time.perf_counter() - start
    fitting = sorted((c for c in out if c.status == "fits"), key=lambda c: c.latency)
    if not fitting:
        closest = min(out, key=lambda c: c.memory)
        raise DoesNotFit(
            f"{cfg.name} on {n_gpus} GPUs with batch {batch}",
            str(closest.layout),
            closest.memory,
            hw.gpu_memory,
        )
    others = [c for c in out if c.status != "fits"]
    others.sort(key=lambda c: (c.status, c.latency_floor))
    ranked = [_with_reason(c, fitting[0], hw.gpu_memory) for c in fitting + others]
    return Search(cfg.name, n_gpus, batch, L, cluster, hw.gpu_memory, tuple(ranked), seconds)


def _with_reason(c: Candidate, best: Candidate, capacity: float) -> Candidate:
    gib = 2**30
    if c is best:
        why = "best"
    elif c.status == "fits":
        why = f"slower: +{c.latency / best.latency - 1:.1%} ({c.latency:.4f} s)"
    elif c.status == "pruned":
        why = f"pruned: latency floor {c.latency_floor:.4f} s >= best {best.latency:.4f} s"
    elif c.latency == c.latency:  # planned: the plan itself is over capacity
        why = f"out of memory: its plan needs {c.memory / gib:.1f} > {capacity / gib:.0f} GiB"
    else:
        why = f"out of memory: needs at least {c.memory / gib:.1f} > {capacity / gib:.0f} GiB"
    return replace(c, reason=why)
