"""TeraPipe's whole layout, searched: #Data, #Pipe, #Op, recomputation and the plan.

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

Pruning keeps the search exact and fast. Before planning a candidate two floors are
computed from the cost model alone:

* memory: the weights and optimizer state of a stage plus the least its activations can
  be (without recomputation the whole minibatch is kept, and token slicing at best
  halves the attention scores: L^2 / 2 per sequence; with it, each sequence's input);
  a candidate whose floor exceeds the capacity cannot fit, whatever its plan;
* latency: stage 0's compute at the GPU's peak matrix rate (every product at
  ``gemm_efficiency`` x peak with no quantization loss, attention over the causal half),
  plus, in the fill-drain order, the last unit's forward and backward through the other
  K - 1 stages at the host floor with the link latency, plus the all-reduce and the
  optimizer step. The simulator charges at least this for any plan (its action times
  are never below these terms), so a candidate whose floor reaches the best latency
  found is dropped unplanned. Candidates are planned in order of their floors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from tplib.cluster import CALIBRATIONS, Calibration, ClusterCostModel, check_layout
from tplib.cluster.hardware import CLUSTERS, FP16, Hardware
from tplib.cluster.implementation import PAPER, RECOMPUTES, Implementation
from tplib.cluster.memory import STATE_BYTES, activation_rates
from tplib.nn.configs import GPTConfig, get_config, n_params_per_layer
from tplib.partition.chain import DoesNotFit
from tplib.partition.topology import Topology
from tplib.planner import plan_slices
from tplib.sim.simulate import simulate_schedule

__all__ = [
    "SEARCHED_RECOMPUTE",
    "Candidate",
    "Layout",
    "Search",
    "autoplan",
    "latency_floor",
    "layouts",
]

EPS = 1e-4  # the paper's eps = 0.1 ms (§3.3)
# The recomputation modes searched unless asked: the paper's two. Selective
# recomputation is priced too (tplib.cluster.implementation.RECOMPUTES) when asked for.
SEARCHED_RECOMPUTE = ("none", "full")
GRANULARITY = 8


@dataclass(frozen=True)
class Layout:
    """One way to run the model: #Data x #Pipe x #Op and recomputation."""

    n_data: int
    n_stages: int
    n_op: int
    recompute: str = "none"

    def __str__(self) -> str:
        rc = ", recompute" if self.recompute == "full" else ""
        return f"#Data={self.n_data} x #Pipe={self.n_stages} x #Op={self.n_op}{rc}"


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
    cfg: GPTConfig, n_gpus: int, batch: int, hardware: Hardware
) -> Iterator[tuple[int, int, int]]:
    """Every (#Data, #Pipe, #Op) of ``n_gpus`` GPUs the cluster model can price for
    ``cfg`` and a global batch ``batch`` (see the module docstring)."""
    g = hardware.gpus_per_node
    for n_op in range(1, min(g, n_gpus) + 1):
        for n_stages in range(1, cfg.n_layer + 1):
            if n_gpus % (n_op * n_stages):
                continue
            n_data = n_gpus // (n_op * n_stages)
            replica = n_stages * n_op
            if batch % n_data or (replica % g and g % replica):
                continue
            try:
                check_layout(cfg, n_stages=n_stages, n_op=n_op, n_data=n_data, hardware=hardware)
            except ValueError:
                continue
            yield n_data, n_stages, n_op


def _memory_floor(
    cfg: GPTConfig,
    layout: Layout,
    seq_len: int,
    pipeline_batch: int,
    cal: Calibration,
    impl: Implementation = PAPER,
) -> float:
    """The least memory per GPU any plan of ``layout`` needs (see the module docstring)."""
    layers = cfg.n_layer // layout.n_stages
    states = STATE_BYTES * layers * n_params_per_layer(cfg) / layout.n_op
    per_token, score_bytes = activation_rates(cfg, layout.n_op, impl, layout.recompute)
    tokens = pipeline_batch * seq_len
    if layout.recompute == "full":
        acts: float = tokens * cfg.hidden * FP16
    else:
        acts = layers * (tokens * per_token + tokens * seq_len / 2 * score_bytes)
    return states + acts + cal.memory_reserve


def latency_floor(cost: ClusterCostModel, pipeline_batch: int) -> float:
    """The least simulated latency any plan of ``cost``'s layout has (module docstring)."""
    cfg, op, cal, hw = cost.cfg, cost.n_op, cost.cal, cost.hw
    h, L, b = cfg.hidden, cost.seq_len, pipeline_batch
    # Products: forward 24 H^2 / #Op per token, backward twice; attention forward at
    # least 2 b H L^2 / #Op (QK^T and AV over the causal half), backward twice.
    fwd = 24 * h * h / op * b * L + 2 * b * h * L * L / op
    flops = fwd * (3 + (1 if cost.recompute == "full" else 0))
    compute = cost.layers_per_stage * flops / (cal.gemm_efficiency * hw.peak_fp16)
    floor = cost.layers_per_stage * cost.host_floor * (1 + cal.backward_floor)
    if cost.recompute == "full":
        floor += cost.layers_per_stage * cost.host_floor
    fill = (cost.n_stages - 1) * (floor + 2 * cal.intra_node_latency)
    return compute + fill + cost.allreduce(0) + cost.optimizer(0)


def _evaluate(
    cfg: GPTConfig, layout: Layout, cost: ClusterCostModel, pipeline_batch: int, eps: float
) -> tuple[float, float, str, float]:
    t0 = time.perf_counter()
    p = plan_slices(
        cost,
        seq_len=cost.seq_len,
        batch=pipeline_batch,
        n_stages=layout.n_stages,
        granularity=GRANULARITY,
        eps=eps,
    )
    seconds = time.perf_counter() - t0
    memory = cost.memory(p).total
    latency = simulate_schedule("terapipe", layout.n_stages, p, cost, validate=False).latency
    return latency, memory, p.to_paper(), seconds


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
) -> Search:
    """The fastest layout of ``model`` on ``n_gpus`` GPUs of ``cluster`` for a global
    batch of ``batch`` sequences that fits in memory (``memory_gib`` per GPU overrides
    the cluster's). ``calibration``: the cluster's by default; ``implementation``: the
    paper's, with FlashAttention-2 where the cluster runs it. Raises ``ValueError`` for
    input no layout can take, and :class:`~tplib.partition.chain.DoesNotFit` when none
    fits, naming the closest."""
    cfg = get_config(model) if isinstance(model, str) else model
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster={cluster!r}: known clusters are {sorted(CLUSTERS)}")
    hw = CLUSTERS[cluster]
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
    if L % GRANULARITY:
        raise ValueError(f"seq_len={L}: must be a multiple of the planner's {GRANULARITY} tokens")
    cfg = cfg if cfg.seq_len >= L else cfg.with_(seq_len=L)
    bad = [m for m in recompute if m not in RECOMPUTES]
    if not recompute or bad:
        raise ValueError(f"recompute={recompute!r}: choose among {RECOMPUTES}")
    start = time.perf_counter()
    found = [
        Layout(d, k, op, rc) for d, k, op in layouts(cfg, n_gpus, batch, hw) for rc in recompute
    ]
    if not found:
        raise ValueError(
            f"no layout of {cfg.name} on n_gpus={n_gpus} with batch={batch}: #Data x #Pipe x "
            f"#Op must equal the GPUs, #Pipe divide the {cfg.n_layer} layers, #Op divide "
            f"the {hw.gpus_per_node} GPUs of a node and the {cfg.n_head} heads, and #Data "
            "divide the batch"
        )
    costs, floors = {}, {}
    for lay in found:
        costs[lay] = ClusterCostModel(
            cfg, n_stages=lay.n_stages, n_op=lay.n_op, n_data=lay.n_data, seq_len=L,
            calibration=calibration, hardware=hw, recompute=lay.recompute,
            implementation=implementation,
        )  # fmt: skip
        floors[lay] = latency_floor(costs[lay], batch // lay.n_data)
    out: list[Candidate] = []
    best: float = math.inf
    for lay in sorted(found, key=floors.__getitem__):
        b = batch // lay.n_data
        mem_floor = _memory_floor(cfg, lay, L, b, calibration, implementation)
        if mem_floor > hw.gpu_memory:
            out.append(Candidate(lay, "out of memory", floors[lay], mem_floor))
        elif floors[lay] >= best:
            out.append(Candidate(lay, "pruned", floors[lay], mem_floor))
        else:
            latency, memory, text, secs = _evaluate(cfg, lay, costs[lay], b, eps)
            fits = memory <= hw.gpu_memory
            if fits:
                best = min(best, latency)
            status = "fits" if fits else "out of memory"
            out.append(Candidate(lay, status, floors[lay], memory, latency, text, secs))
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
