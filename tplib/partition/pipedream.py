"""PipeDream's optimizer (Narayanan et al., SOSP 2019, §3.1): stages, their replication
and the minibatches in flight, over a hierarchical topology.

PipeDream cuts a chain of layers into stages, replicates each stage over some workers
(data parallelism on the stage) and minimises the time of the slowest stage. It reads a
:class:`~tplib.partition.chain.LayerChain` (T_l: forward + backward seconds of layer l;
a_l: bytes of its output; w_l = ``grad_bytes * params``: bytes its weights synchronise)
and a :class:`~tplib.partition.topology.Topology` (level k: m_k components of level k-1
joined at B_k bytes/s; m_0 = 1, level 0 is one GPU). With half-open layer ranges [i, j)::

    A^0(i, j, 1) = sum_{l in [i, j)} T_l
    T^k(i, j, m) = max(A^{k-1}(i, j, m_{k-1}), 2 (m - 1) sum_{l in [i, j)} w_l / B_k) / m
    A^k(i, j, m) = min(T^k(i, j, m),
                       min_{i < s < j} min_{1 <= m' < m}
                           max(A^k(i, s, m - m'), 2 a_{s-1} / B_k, T^k(s, j, m')))

T^k is one stage over [i, j) replicated on m components of level k, each running inside
it the best level-(k-1) pipeline of those layers; A^k(i, j, 1) = T^k(i, j, 1) =
A^{k-1}(i, j, m_{k-1}) is the paper's initialisation. Levels are solved from the
innermost out and the answer is A^L(0, N, m_L), in O(N^3 m_k^2) per level, vectorised
over i, s and m'. A split must be strictly faster than the single stage: ties go to
replication (fewer stages, fewer minibatches in flight). PipeDream admits
NOAM = ceil(W / GPUs of the input stage) minibatches at once, W the topology's GPUs.

Memory. A GPU stage is formed at level 1: a layer range on r <= m_1 GPUs. It is
infeasible (T^1 = inf) when one of its GPUs needs more than ``chain.capacity`` holding
f = ceil(W / r) minibatches in flight and f weight versions. The bound is conservative:
1F1B-RR admits NOAM <= W minibatches, a stage holds at most those, spread round-robin
over its replicas, and weight stashing keeps one version per minibatch in flight; but r
is the replication known at level 1, while the outer levels may replicate the stage
further (the DP reuses the level-1 answer for every outer m, so it cannot know). If
nothing fits, :class:`~tplib.partition.chain.DoesNotFit` names the partition that
minimises the largest per-GPU memory under the same bound: the same DP, with that
memory in place of time and free transfers.

The plan is flattened: a level-k stage on m components contributes, first to last, the
stages of its level-(k-1) sub-pipeline with their replicas multiplied by m. A GPU
stage's ``time`` is what the recurrence charges for it per minibatch: its compute, then
at each level that encloses it max(that, the level's weight synchronisation) / m;
``transfers`` are the cuts' 2 a / B divided by the replication of the levels above the
cut, so ``slowest`` = A^L(0, N, m_L) is the largest of both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from tplib.partition.chain import DoesNotFit, LayerChain
from tplib.partition.topology import Level, Topology

__all__ = ["PipeDreamPlan", "PipeDreamStage", "pipedream_partition"]

# Elements the DP's inner max/min touches (about N^3 m_k^2 / 6 per level), about a
# nanosecond each: beyond this a plan takes minutes; coarsen the chain (fewer layers).
WORK_LIMIT = 2e10

Tables = list[tuple[np.ndarray, np.ndarray]]  # per level k = 1..L: A^k and back-pointers


@dataclass(frozen=True)
class PipeDreamStage:
    """Layers ``[lo, hi)`` on ``replicas`` GPUs (data parallel), taking ``time``
    effective seconds per minibatch (see the module)."""

    lo: int
    hi: int
    replicas: int
    time: float


@dataclass(frozen=True)
class PipeDreamPlan:
    """The optimizer's answer: stages first to last, ``slowest`` = A^L(0, N, m_L), and
    ``transfers[s]``: effective seconds per minibatch between stages s and s + 1."""

    stages: tuple[PipeDreamStage, ...]
    slowest: float
    n_gpus: int
    transfers: tuple[float, ...]

    @property
    def stage_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple((s.lo, s.hi) for s in self.stages)

    @property
    def in_flight(self) -> int:
        """NOAM: minibatches admitted at once, ceil(GPUs / GPUs of the input stage)."""
        return -(-self.n_gpus // self.stages[0].replicas)

    @property
    def throughput(self) -> float:
        """Minibatches per second in the steady state."""
        return 1.0 / self.slowest

    def __str__(self) -> str:
        return "\n".join(
            f"stage {k}: layers [{s.lo}, {s.hi}) on {_gpus(s.replicas)}, "
            f"{s.time * 1e3:.3f} ms per minibatch"
            for k, s in enumerate(self.stages)
        )


def pipedream_partition(
    chain: LayerChain, topology: Topology, *, memory: bool = True
) -> PipeDreamPlan:
    """PipeDream's best plan of ``chain`` on ``topology``: stages, replicas and NOAM.
    ``memory``: drop stages one GPU cannot hold (see the module); raises
    :class:`~tplib.partition.chain.DoesNotFit` if every plan has one."""
    _check(chain, topology, memory)
    n, W = len(chain), topology.n_gpus
    C = _table(n, chain.compute, np.inf)  # inf outside lo < hi: no stage there
    w = _table(n, lambda lo, hi: chain.grad_bytes * chain.total("params", lo, hi), 0.0)
    a = np.array([0.0] + [layer.output for layer in chain.layers])  # a[s]: across cut s
    m1 = topology.levels[0].count
    mem = np.full((n + 1, n + 1, m1 + 1), np.inf)
    if memory:
        for m in range(1, m1 + 1):
            f = -(-W // m)
            for lo, hi in combinations(range(n + 1), 2):
                mem[lo, hi, m] = chain.stage_memory(lo, hi, in_flight=f, versions=f)

    def by_time(level: Level, below: np.ndarray | None) -> np.ndarray:
        m = np.arange(1, level.count + 1)
        sync = 2 * (m - 1) * w[:, :, None] / level.bandwidth
        T = np.full((n + 1, n + 1, level.count + 1), np.inf)
        T[:, :, 1:] = np.maximum((C if below is None else below)[:, :, None], sync) / m
        if memory and below is None:
            T[mem > chain.capacity] = np.inf
        return T

    def by_memory(level: Level, below: np.ndarray | None) -> np.ndarray:
        T = np.full((n + 1, n + 1, level.count + 1), np.inf)
        T[:, :, 1:] = mem[:, :, 1:] if below is None else below[:, :, None]
        return T

    tables = _levels(topology, by_time, lambda level: 2 * a / level.bandwidth)
    top = topology.levels[-1].count
    slowest = float(tables[-1][0][0, n, top])
    if math.isinf(slowest):
        closest = _levels(topology, by_memory, lambda level: np.zeros_like(a))
        plan = _flatten(closest, topology, C, w, a, len(topology.levels), 0, n, top)
        described = ", ".join(f"[{s.lo}, {s.hi}) on {_gpus(s.replicas)}" for s in plan[0])
        raise DoesNotFit(
            f"PipeDream's optimizer for {chain.source} on {topology.name or f'{W} GPUs'}",
            f"layers {described} (each GPU holding ceil({W} / r) minibatches and weight "
            "versions, r its stage's GPUs at the innermost level)",
            float(closest[-1][0][0, n, top]),
            chain.capacity,
        )
    stages, transfers = _flatten(tables, topology, C, w, a, len(topology.levels), 0, n, top)
    return PipeDreamPlan(tuple(stages), slowest, W, tuple(transfers))


def _gpus(r: int) -> str:
    return f"{r} GPU{'s' if r > 1 else ''}"


# ---- the dynamic program ----------------------------------------------------------------


def _table(n: int, f: Callable[[int, int], float], fill: float) -> np.ndarray:
    """``f(lo, hi)`` for every range ``0 <= lo < hi <= n``, ``fill`` elsewhere."""
    out = np.full((n + 1, n + 1), fill)
    for lo, hi in combinations(range(n + 1), 2):
        out[lo, hi] = f(lo, hi)
    return out


def _levels(
    topology: Topology,
    single: Callable[[Level, np.ndarray | None], np.ndarray],
    cut: Callable[[Level], np.ndarray],
) -> Tables:
    """A^k for k = 1..L, innermost first: ``single(level, A^{k-1}(., ., m_{k-1}))`` gives
    T^k (None below level 1), ``cut(level)[s]`` the cost of crossing cut s."""
    tables: Tables = []
    below: np.ndarray | None = None
    for level in topology.levels:
        A, back = _solve(single(level, below), cut(level))
        tables.append((A, back))
        below = A[:, :, level.count]
    return tables


def _solve(T: np.ndarray, cut: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A[i, j, m] of one level from its single stages T[i, j, m] (inf where i >= j, and at
    m = 0). ``back[i, j, m]`` = (s, m') of the best split, (0, 0) where T itself is best."""
    n1, _, M1 = T.shape
    A = T.copy()
    back = np.zeros((n1, n1, M1, 2), dtype=np.int64)
    for j in range(2, n1):
        for m in range(2, M1):
            # v[i, s - 1, m' - 1] = max(A[i, s, m - m'], cut[s], T[s, j, m']); A[i, s] is
            # inf for s <= i, so only cuts inside [i, j) can win.
            last = np.maximum(cut[1:j, None], T[1:j, j, 1:m])
            v = np.maximum(A[:j, 1:j, m - 1 : 0 : -1], last).reshape(j, -1)
            k = v.argmin(axis=1)
            best = v[np.arange(j), k]
            better = best < A[:j, j, m]
            A[:j, j, m] = np.where(better, best, A[:j, j, m])
            back[:j, j, m, 0] = np.where(better, k // (m - 1) + 1, 0)
            back[:j, j, m, 1] = np.where(better, k % (m - 1) + 1, 0)
    return A, back


def _flatten(
    tables: Tables,
    topology: Topology,
    C: np.ndarray,
    w: np.ndarray,
    a: np.ndarray,
    k: int,
    lo: int,
    hi: int,
    m: int,
    whole: bool = False,
) -> tuple[list[PipeDreamStage], list[float]]:
    """The GPU stages and transfers of A^k(lo, hi, m), or of T^k(lo, hi, m) if ``whole``."""
    level = topology.levels[k - 1]
    s, right = (0, 0) if whole else tables[k - 1][1][lo, hi, m].tolist()
    if s:
        first, into = _flatten(tables, topology, C, w, a, k, lo, s, m - right)
        last, out = _flatten(tables, topology, C, w, a, k, s, hi, right, whole=True)
        return first + last, [*into, float(2 * a[s] / level.bandwidth), *out]
    stages: list[PipeDreamStage] = [PipeDreamStage(lo, hi, 1, float(C[lo, hi]))]
    transfers: list[float] = []
    if k > 1:
        below = topology.levels[k - 2].count
        stages, transfers = _flatten(tables, topology, C, w, a, k - 1, lo, hi, below)
    sync = float(2 * (m - 1) * w[lo, hi] / level.bandwidth)
    return (
        [PipeDreamStage(x.lo, x.hi, x.replicas * m, max(x.time, sync) / m) for x in stages],
        [t / m for t in transfers],
    )


def _check(chain: LayerChain, topology: Topology, memory: bool) -> None:
    """Reject what the DP cannot plan, before it starts."""
    for i, layer in enumerate(chain.layers):
        for field in ("forward", "backward", "params", "stash", "output", "states"):
            v = getattr(layer, field)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(
                    f"layer {i} ({layer.name}) has {field}={v!r}: PipeDream's profile needs "
                    "finite, non-negative times and sizes"
                )
    for field in ("grad_bytes", "version_bytes", "reserve"):
        v = getattr(chain, field)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"chain.{field}={v!r}: must be finite and >= 0")
    if chain.compute(0, len(chain)) <= 0:
        raise ValueError(
            "the chain computes for 0 s per minibatch: PipeDream balances compute time, "
            "so its layers need their profiled times"
        )
    if memory and not chain.capacity > 0:
        raise ValueError(
            f"chain.capacity={chain.capacity!r}: a GPU's memory must be > 0 bytes "
            "(inf for no limit, or memory=False)"
        )
    n = len(chain)
    work = sum(n**3 * level.count**2 / 6 for level in topology.levels)
    if work > WORK_LIMIT:
        counts = [level.count for level in topology.levels]
        raise ValueError(
            f"{n} layers on levels of {counts} components: about {work:.1e} DP steps, over "
            f"the limit of {WORK_LIMIT:.0e} (N^3 m_k^2 / 6 per level): merge layers into "
            "fewer, or split a large level into two"
        )
