"""PipeDream-2BW's planner (Narayanan et al., 2021, §4): how wide, how deep, what per-GPU
microbatch and whether to recompute, for the most samples per second that fit in memory.

2BW runs w parallel pipelines of d stages on w·d GPUs (§3.3). A stage is an equal count
of blocks (``balanced_stages``; the first and last blocks carry the embeddings and the
head, so the end stages are heavier), and a stage's w replicas all-reduce their
gradients once per update, after g = B / (w·b) microbatches of b per GPU, B being the
global ("maximum safe") batch. Algorithm 1 sweeps every (w, d) with w·d <= N GPUs;
SEARCH(w, d, B) tries every b with B % (w·b) == 0 and recomputation r in {no, yes} and
keeps the fastest that fits. With d > 1 the update also needs g >= ``min_microbatches``
(d - 1 under tplib's 2BW 1F1B schedule, the paper's m >= d made exact). d = 1 is "model
and data parallelism without pipelining": a plain data-parallel step, one weight version.

THROUGHPUT (§4.2.1), for one microbatch; stage i holds layers [lo_i, hi_i):

    T_i^comp      = forward + backward of the stage, with r its forward again
                    (``chain.compute(lo, hi, r)``, in place of the paper's c_extra = 4/3)
    T_{j->i}^comm = 2 |A_{j,i}| / bw for each neighbour j: the boundary activation
                    forward and its gradient back (0 when d = 1)
    T_i^comm      = 2 (w-1)/w * grad_bytes * |W_i| / bw: a ring all-reduce of the
                    stage's gradients over its w replicas
    d > 1:  t = max_i max(T_i^comp, sum_j T_{j->i}^comm, T_i^comm / g)
    d = 1:  t = sum_i max(T_i^comp + sum_j T_{j->i}^comm, T_i^comm / g)
    throughput = w b / t samples/s

The paper's formulas charge T_i^comm to every microbatch. A stage all-reduces once per
update, though, i.e. once every g microbatches, and overlaps it with the compute of
those g, so its share per microbatch is T_i^comm / g (the same when g = 1); charging it
whole would penalise gradient accumulation, which exists to amortise it.

Placement: rank = stage * w + replica, so a stage's replicas are adjacent and its
all-reduce stays inside a node whenever they fit in one (§3.3's advice). GPUs talk at
the bandwidth of the innermost topology level one of whose components holds them all
(``Topology.cluster``: a node's NVLink, else the network); a stage boundary at the
outermost level any of its w replica pairs crosses.

MEMORY (§4.2.2): the most ``chain.stage_memory`` over the stages, with 2 weight versions
when d > 1 (1 when d = 1) and d - i microbatches in flight on stage i (0-based). The
paper counts d on every stage, a worst case: under 1F1B stage i runs d - i - 1 forwards
ahead of its first backward and one more forward before each backward, so it peaks at
d - i (the tests count it on ``two_bw``'s own actions). Only the first stage holds d;
charging d to the others, the head's stage included, would reject configurations that fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tplib.nn.layer_ranges import StageRange, balanced_stages
from tplib.partition.chain import DoesNotFit, LayerChain
from tplib.partition.topology import Topology
from tplib.schedule.asynchronous import min_microbatches
from tplib.sim.costs import ring_allreduce

__all__ = [
    "TwoBWConfig",
    "TwoBWPlan",
    "placement",
    "twobw_memory",
    "twobw_plan",
    "twobw_throughput",
]


@dataclass(frozen=True)
class TwoBWConfig:
    """One (w, d, b, r) the planner evaluated: ``accumulation`` g microbatches per update
    per pipeline, the stages' layer ranges, seconds per microbatch t, samples/s over the
    w pipelines, bytes per GPU (the most over the stages) and whether that fits."""

    width: int
    depth: int
    microbatch: int
    recompute: bool
    accumulation: int
    stage_ranges: tuple[StageRange, ...]
    seconds_per_microbatch: float
    throughput: float
    memory: float
    fits: bool

    def __str__(self) -> str:
        r = "recompute" if self.recompute else "no recompute"
        return f"(w={self.width}, d={self.depth}), b={self.microbatch}, {r}, g={self.accumulation}"


@dataclass(frozen=True)
class TwoBWPlan:
    """The planner's choice and every configuration it evaluated, best first (those that
    fit by throughput, then those that do not), so a report can say why the others lost."""

    best: TwoBWConfig
    candidates: tuple[TwoBWConfig, ...]


def _check_depth(chain: LayerChain, depth: int) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= len(chain):
        raise ValueError(
            f"depth={depth!r} must be between 1 and the chain's {len(chain)} layers: "
            "every stage needs at least one layer"
        )


def _check_width(width: int, depth: int, n_gpus: int) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width={width!r}: need at least one pipeline")
    if width * depth > n_gpus:
        raise ValueError(
            f"width·depth = {width}·{depth} = {width * depth} exceeds the topology's "
            f"{n_gpus} GPUs: w parallel pipelines of d stages take w·d GPUs"
        )


def _level(topology: Topology, ranks: Iterable[int]) -> int:
    """The innermost level one of whose components holds every rank in ``ranks``."""
    ranks = list(ranks)
    top = len(topology.levels) - 1
    for k in range(top):
        size = topology.gpus_below(k + 1)
        if len({r // size for r in ranks}) == 1:
            return k
    return top


def placement(topology: Topology, width: int, depth: int) -> tuple[list[float], list[float]]:
    """Bandwidths of w pipelines of d stages placed rank = stage * w + replica: each
    boundary's (the slowest of its w replica pairs) and each stage's all-reduce ring."""
    bandwidth = [level.bandwidth for level in topology.levels]
    w = width
    links = [
        bandwidth[max(_level(topology, (k * w + r, (k + 1) * w + r)) for r in range(w))]
        for k in range(depth - 1)
    ]
    rings = [bandwidth[_level(topology, range(i * w, (i + 1) * w))] for i in range(depth)]
    return links, rings


def twobw_throughput(
    chain: LayerChain,
    topology: Topology,
    *,
    width: int,
    depth: int,
    recompute: bool,
    accumulation: int,
) -> tuple[float, float]:
    """(seconds per microbatch t, samples/s) of w = ``width`` pipelines of d = ``depth``
    equal stages with microbatches of ``chain.microbatch`` per GPU and g =
    ``accumulation`` microbatches per update (see the module docstring)."""
    _check_depth(chain, depth)
    _check_width(width, depth, topology.n_gpus)
    if chain.n_op != 1:
        raise ValueError(
            f"chain of #Op={chain.n_op}: the 2BW planner places one GPU per stage replica "
            "(build the chain with n_op=1)"
        )
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation={accumulation!r}: an update takes >= 1 microbatch")
    w, d, g = width, depth, accumulation
    stages = balanced_stages(len(chain), d)
    links, rings = placement(topology, w, d)
    p2p = [2 * chain.boundary(*stages[k]) / links[k] for k in range(d - 1)]
    terms = []  # (T_i^comp, sum_j T_{j->i}^comm, T_i^comm / g) per stage
    for i, (lo, hi) in enumerate(stages):
        comm = (p2p[i - 1] if i > 0 else 0.0) + (p2p[i] if i < d - 1 else 0.0)
        params = chain.total("params", lo, hi)
        reduce = float(ring_allreduce(chain.grad_bytes * params, w, rings[i]))
        terms.append((chain.compute(lo, hi, recompute), comm, reduce / g))
    if d > 1:  # pipelined: communication overlaps compute, the slowest stage sets the pace
        t = max(max(x) for x in terms)
    else:
        t = sum(max(comp + comm, reduce) for comp, comm, reduce in terms)
    return t, (w * chain.microbatch / t if t > 0 else float("inf"))


def twobw_memory(chain: LayerChain, *, depth: int, recompute: bool) -> float:
    """Bytes per GPU of the most loaded of d = ``depth`` equal stages: 2 weight versions
    when d > 1, d - i microbatches in flight on stage i (see the module docstring)."""
    _check_depth(chain, depth)
    versions = 2 if depth > 1 else 1
    return max(
        chain.stage_memory(lo, hi, in_flight=depth - i, versions=versions, recompute=recompute)
        for i, (lo, hi) in enumerate(balanced_stages(len(chain), depth))
    )


def _rank(c: TwoBWConfig) -> tuple[bool, float, float, int, int, int, bool]:
    """Sort key, best first: fits, then throughput; ties to less memory, then smaller."""
    return (not c.fits, -c.throughput, c.memory, c.width, c.depth, c.microbatch, c.recompute)


def _check_counts(name: str, values: Sequence[int] | None, n_gpus: int) -> None:
    if values is None:
        return
    bad = [
        x for x in values if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= n_gpus
    ]
    if not values or bad:
        raise ValueError(
            f"{name}={list(values)}: give at least one, each an integer between 1 and the "
            f"topology's {n_gpus} GPUs"
        )


def twobw_plan(
    chain_for: Callable[[int], LayerChain],
    topology: Topology,
    *,
    batch: int,
    microbatches: Sequence[int] = (1, 2, 4, 8),
    widths: Sequence[int] | None = None,
    depths: Sequence[int] | None = None,
) -> TwoBWPlan:
    """Algorithm 1: the fastest (w, d, b, r) that fits, for a global batch B = ``batch``.

    ``chain_for(b)`` is the model's chain for microbatches of b per GPU (e.g. ``lambda b:
    cluster_chain(model, microbatch=b)``), called once for each b in ``microbatches``
    that divides B. Given ``widths`` and ``depths`` are paired with each other (every
    w·d must fit in the GPUs); one left out ranges over what fits beside the other (d
    up to the layer count). Raises ``ValueError`` for bad input and :class:`DoesNotFit`,
    naming the configuration that needs the least memory, when nothing fits."""
    n = topology.n_gpus
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: the global batch B holds at least one sample")
    if not microbatches or any(
        isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in microbatches
    ):
        raise ValueError(
            f"microbatches={list(microbatches)}: give at least one, each a positive integer"
        )
    _check_counts("widths", widths, n)
    _check_counts("depths", depths, n)
    if widths is not None and depths is not None:
        for w in widths:
            for d in depths:
                _check_width(w, d, n)
    sizes = sorted({b for b in microbatches if batch % b == 0})
    if not sizes:
        raise ValueError(
            f"no microbatch size in {list(microbatches)} divides batch={batch}: "
            "B % (w·b) == 0 is needed so that the w pipelines share B evenly"
        )
    chains = {b: chain_for(b) for b in sizes}
    n_layers = len(chains[sizes[0]])
    for b, chain in chains.items():
        if chain.microbatch != b or len(chain) != n_layers:
            raise ValueError(
                f"chain_for({b}) gave a chain of microbatch {chain.microbatch} and "
                f"{len(chain)} layers: it must give microbatch {b}, the same layers for every b"
            )
    if depths is not None and max(depths) > n_layers:
        raise ValueError(
            f"depth {max(depths)} is more than the chain's {n_layers} layers: every stage "
            "needs at least one layer"
        )
    pairs = [
        (w, d)
        for w in (widths if widths is not None else range(1, n + 1))
        for d in (depths if depths is not None else range(1, min(n_layers, n // w) + 1))
        if w * d <= n
    ]
    seq_len = chains[sizes[0]].seq_len
    need = {d: min_microbatches(d, (seq_len,)) if d > 1 else 1 for d in {d for _, d in pairs}}
    valid = [
        (w, d, b, batch // (w * b))
        for w, d in pairs
        for b in sizes
        if batch % (w * b) == 0 and batch // (w * b) >= need[d]
    ]
    if not valid:
        by_depth = {d: m for d, m in sorted(need.items()) if d > 1}
        raise ValueError(
            f"no (w, d, b) for batch={batch} with microbatches {list(microbatches)}: b needs "
            "B % (w·b) == 0, and with d > 1 g = B/(w·b) >= the microbatches 2BW's schedule "
            f"needs per update (by depth: {by_depth})"
        )
    memory: dict[tuple[int, int, bool], float] = {}  # independent of w
    configs = []
    for w, d, b, g in valid:
        chain = chains[b]
        for r in (False, True):
            t, speed = twobw_throughput(
                chain, topology, width=w, depth=d, recompute=r, accumulation=g
            )
            if (b, d, r) not in memory:
                memory[b, d, r] = twobw_memory(chain, depth=d, recompute=r)
            mem = memory[b, d, r]
            stages = balanced_stages(n_layers, d)
            configs.append(TwoBWConfig(w, d, b, r, g, stages, t, speed, mem, mem <= chain.capacity))
    configs.sort(key=_rank)
    if not configs[0].fits:
        closest = min(configs, key=lambda c: (c.memory, _rank(c)))
        raise DoesNotFit(
            f"PipeDream-2BW's planner for batch={batch} on {topology.name or f'{n} GPUs'}",
            str(closest),
            closest.memory,
            chains[closest.microbatch].capacity,
        )
    return TwoBWPlan(configs[0], tuple(configs))
