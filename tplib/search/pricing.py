"""One layout under one schedule, priced: plan it, simulate it, take its memory.

The layout search (:func:`tplib.search.layout.autoplan`) and the long-context study
(:mod:`tplib.search.long_context`) compare schedules on the same
:class:`~tplib.cluster.ClusterCostModel`; each schedule is priced here once:

- ``terapipe`` and ``terapipe-zb``: the DP planner's joint batch x token plan (the
  zero-bubble objective for the second, :func:`~tplib.planner.zero_bubble.plan_zero_bubble`),
  fill-drain, so a stage keeps the whole minibatch (:meth:`ClusterCostModel.memory`).
  With gradient accumulation (``rounds`` A > 1) the pipeline batch runs as A fill-drain
  rounds of B / A sequences and one update: a round is planned and simulated, and A of
  them take A times its span up to its update, plus the update (stage 0 ends every
  fill-drain round: its last backward is the round's last; tests check this against
  the rounds simulated one after the other);
- ``1f1b`` and ``interleaved-1f1b`` over microbatches, and ``seq1f1b``: 1F1B over token
  slices, every sequence cut alike by a :data:`Slicing` (by default Seq1F1B's equal-FLOP
  slicing, :func:`seq1f1b_slicing`; a caller may pass another). Their memory is
  the schedule's own (:func:`~tplib.cluster.memory.schedule_memory_per_gpu` on the end
  stages, which hold the model's ends).

Long pipelines (:func:`periodic`). A 1F1B schedule over M > 2P identical batch slices is
periodic once the pipeline is full: each further one adds the same time (interleaved:
each group of P). P and 2P of them are simulated and the rest extrapolated;
:func:`tplib.search.megatron.predict` does the same, and tests check it against
simulating all M. Fill-drain plans are simulated whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from tplib.cluster import Calibration, ClusterCostModel
from tplib.cluster.hardware import Hardware
from tplib.cluster.implementation import Implementation
from tplib.cluster.memory import schedule_memory_per_gpu
from tplib.nn.configs import GPTConfig
from tplib.plan import Plan
from tplib.planner import plan_slices
from tplib.planner.seq1f1b import FlopModel, equal_flop_slices
from tplib.planner.zero_bubble import plan_zero_bubble
from tplib.schedule import Schedule, make_schedule
from tplib.sim.simulate import simulate

__all__ = [
    "GRANULARITY",
    "MICROBATCH_SCHEDULES",
    "SEARCHED_SCHEDULES",
    "TOKEN_SCHEDULES",
    "Layout",
    "Priced",
    "Slicing",
    "layout_cost_model",
    "op_implementation",
    "periodic",
    "price",
    "price_microbatches",
    "price_terapipe",
    "seq1f1b_slicing",
    "token_slices_of",
    "variants",
]

GRANULARITY = 8  # the planner's token grid: every slice in the paper is a multiple of 8
# The DP-planned schedules and the ones over equal batch slices, by name.
TOKEN_SCHEDULES = ("terapipe", "terapipe-zb")
MICROBATCH_SCHEDULES = ("1f1b", "interleaved-1f1b", "seq1f1b")
SEARCHED_SCHEDULES = TOKEN_SCHEDULES + MICROBATCH_SCHEDULES
MICROBATCHES = (1, 2, 4, 8)  # sequences per microbatch the 1F1B schedules try
MAX_CHUNKS = 8  # interleaved 1F1B tries every v from 2 to this dividing a stage's layers
SEQ_SLICES = (2, 4, 8)  # token slices per sequence Seq1F1B tries

Slicing = Callable[[GPTConfig, int, int, int], Sequence[int]]
"""``(cfg, seq_len, n_slices, granularity) -> token slice lengths``: how ``seq1f1b`` cuts
every sequence, ``n_slices`` slices, each a multiple of ``granularity`` tokens."""


def seq1f1b_slicing(
    cfg: GPTConfig, seq_len: int, n_slices: int, granularity: int
) -> tuple[int, ...]:
    """Seq1F1B's slicing: ``n_slices`` slices of equal FLOPs for ``cfg``
    (:func:`~tplib.planner.seq1f1b.equal_flop_slices`) on the grid of ``granularity``."""
    return equal_flop_slices(FlopModel.of(cfg), seq_len, n_slices, granularity)


@dataclass(frozen=True)
class Layout:
    """One way to run the model: #Data x #CP x #Pipe x #Op, recomputation and the
    schedule, with its v chunks per stage, sequences per microbatch and token slices per
    sequence where it has them (1 where it has not; the DP planner chooses TeraPipe's)."""

    n_data: int
    n_stages: int
    n_op: int
    recompute: str = "none"
    n_cp: int = 1
    schedule: str = "terapipe"
    n_chunks: int = 1
    microbatch: int = 1
    n_slices: int = 1
    rounds: int = 1

    def __str__(self) -> str:
        rc = {"full": ", recompute", "selective": ", selective recompute"}.get(self.recompute, "")
        cp = f" x #CP={self.n_cp}" if self.n_cp > 1 else ""
        text = f"#Data={self.n_data}{cp} x #Pipe={self.n_stages} x #Op={self.n_op}{rc}"
        if self.schedule == "terapipe" and self.rounds == 1:
            return text
        if self.schedule in MICROBATCH_SCHEDULES:
            v = f" v={self.n_chunks}" if self.n_chunks > 1 else ""
            cut = f" x {self.n_slices} slices" if self.n_slices > 1 else ""
            return f"{text}, {self.schedule}{v} m={self.microbatch}{cut}"
        rounds = f" in {self.rounds} rounds" if self.rounds > 1 else ""
        return f"{text}, {self.schedule}{rounds}"


@dataclass(frozen=True)
class Priced:
    """What a layout costs under one schedule: ``latency`` (simulated, seconds),
    ``memory`` (bytes on its busiest GPU), the ``plan`` in the paper's notation, the
    seconds spent planning it."""

    latency: float
    memory: float
    plan: str
    plan_seconds: float = 0.0


S = TypeVar("S")


def op_implementation(implementation: Implementation, n_op: int) -> Implementation:
    """``implementation`` on #Op = ``n_op`` GPUs per stage: sequence parallelism, which
    splits tokens over a stage's #Op ranks, dropped where there is one."""
    if n_op == 1 and implementation.sequence_parallel:
        return replace(implementation, sequence_parallel=False)
    return implementation


def layout_cost_model(
    cfg: GPTConfig,
    lay: Layout,
    seq_len: int,
    *,
    calibration: Calibration,
    hardware: Hardware,
    implementation: Implementation,
) -> ClusterCostModel:
    """The cluster cost model of ``lay``'s #Data, #CP, #Pipe, #Op and recomputation at
    ``seq_len`` (before any placement of chunks), running ``implementation`` as
    :func:`op_implementation` fits it to the layout's #Op."""
    return ClusterCostModel(
        cfg, n_stages=lay.n_stages, n_op=lay.n_op, n_data=lay.n_data, seq_len=seq_len,
        calibration=calibration, hardware=hardware, recompute=lay.recompute,
        implementation=op_implementation(implementation, lay.n_op), n_cp=lay.n_cp,
    )  # fmt: skip


def periodic(
    units: int, period: int, run: Callable[[int], tuple[float, float, S]]
) -> tuple[float, float, S, int]:
    """(latency, busy stage-seconds, the last simulated schedule, batch slices
    simulated) of ``units`` batch slices, ``run(n)`` simulating n of them: all at once
    up to ``2 period``, else ``period`` and ``2 period`` and the rest extrapolated."""
    if units > 2 * period:
        (l1, b1, _), (l2, b2, schedule) = run(period), run(2 * period)
        rest = units - 2 * period
        return l2 + rest * (l2 - l1) / period, b2 + rest * (b2 - b1) / period, schedule, 2 * period
    latency, busy, schedule = run(units)
    return latency, busy, schedule, units


def price_terapipe(
    cost: ClusterCostModel,
    schedule: str,
    pipeline_batch: int,
    *,
    granularity: int,
    eps: float,
    rounds: int = 1,
) -> Priced:
    """``terapipe`` (the DP planner's plan) or ``terapipe-zb`` (the zero-bubble planner's)
    of ``pipeline_batch`` sequences on ``cost``'s layout, in ``rounds`` fill-drain rounds
    (gradient accumulation; see the module docstring)."""
    if rounds > 1:
        one = price_terapipe(
            cost, schedule, pipeline_batch // rounds, granularity=granularity, eps=eps
        )
        update = cost.allreduce(0) + cost.optimizer(0)
        latency = rounds * (one.latency - update) + update
        return Priced(latency, one.memory, one.plan, one.plan_seconds)
    t0 = time.perf_counter()
    plan_with = plan_zero_bubble if schedule == "terapipe-zb" else plan_slices
    plan = plan_with(
        cost,
        seq_len=cost.seq_len,
        batch=pipeline_batch,
        n_stages=cost.n_stages,
        granularity=granularity,
        eps=eps,
    )
    seconds = time.perf_counter() - t0
    memory = cost.memory(plan).total
    result = simulate(make_schedule(schedule, cost.n_stages, plan, validate=False), cost)
    return Priced(result.latency, memory, plan.to_paper(), seconds)


def price_microbatches(
    cost: ClusterCostModel,
    schedule: str,
    pipeline_batch: int,
    microbatch: int,
    *,
    n_chunks: int = 1,
    token_slices: Sequence[int] | None = None,
) -> Priced:
    """``1f1b``, ``interleaved-1f1b`` (``n_chunks`` v; ``cost`` placed for it) or
    ``seq1f1b`` (1F1B over every microbatch cut into ``token_slices``) of
    ``pipeline_batch`` sequences in microbatches of ``microbatch`` on ``cost``'s layout."""
    L, k = cost.seq_len, cost.n_stages
    m = pipeline_batch // microbatch
    slices = tuple(token_slices) if token_slices is not None else (L,)
    name = "1f1b" if schedule == "seq1f1b" else schedule
    chunks = n_chunks if name == "interleaved-1f1b" else None

    def run(n: int) -> tuple[float, float, Schedule]:
        plan = Plan((microbatch,) * n, (slices,) * n)
        built = make_schedule(name, k, plan, n_chunks=chunks, validate=False)
        return simulate(built, cost).latency, 0.0, built

    latency, _, built, _ = periodic(m, k, run)
    memory, _ = schedule_memory_per_gpu(
        cost.cfg,
        built,
        n_op=cost.n_op,
        recompute=cost.recompute,
        calibration=cost.cal,
        hardware=cost.hw,
        implementation=cost.impl,
        n_data=cost.n_data,
        stages=sorted({0, k - 1}),
        n_cp=cost.n_cp,
    )
    plan_text = Plan((microbatch,) * m, (slices,) * m).to_paper()
    return Priced(latency, memory.total, plan_text)


def variants(
    base: Layout,
    schedules: tuple[str, ...],
    pipeline_batch: int,
    layers: int,
    accumulate: bool = False,
) -> Iterator[Layout]:
    """Every schedule of ``schedules`` on ``base`` with each of its choices; TeraPipe's in
    1, 2, 4, ... rounds with ``accumulate``. Seq1F1B and interleaving need two stages or
    more (with one, they are 1F1B)."""
    for name in schedules:
        if name in TOKEN_SCHEDULES:
            counts = [2**i for i in range(pipeline_batch.bit_length()) if accumulate or i == 0]
            yield from (
                replace(base, schedule=name, rounds=a) for a in counts if pipeline_batch % a == 0
            )
            continue
        if base.n_stages == 1 and name != "1f1b":
            continue
        mbs = [m for m in MICROBATCHES if pipeline_batch % m == 0]
        if name == "1f1b":
            yield from (replace(base, schedule=name, microbatch=m) for m in mbs)
        elif name == "seq1f1b":
            for m in mbs:
                yield from (replace(base, schedule=name, microbatch=m, n_slices=n)
                            for n in SEQ_SLICES)  # fmt: skip
        else:  # interleaved: Megatron's M a multiple of K
            for v in range(2, min(layers, MAX_CHUNKS) + 1):
                yield from (
                    replace(base, schedule=name, n_chunks=v, microbatch=m)
                    for m in mbs
                    if layers % v == 0 and (pipeline_batch // m) % base.n_stages == 0
                )


def token_slices_of(
    cfg: GPTConfig, lay: Layout, L: int, grid: int, slicing: Slicing | None
) -> tuple[int, ...] | None:
    """The token slices ``lay``'s schedule cuts every sequence into (None: whole)."""
    if lay.schedule != "seq1f1b":
        return None
    assert slicing is not None  # autoplan refuses seq1f1b without one
    got = tuple(int(x) for x in slicing(cfg, L, lay.n_slices, grid))
    if sum(got) != L or any(x <= 0 or x % grid for x in got):
        raise ValueError(
            f"the seq1f1b slicing gave {got} for L={L}: it must cover L in positive "
            f"multiples of {grid} tokens"
        )
    return got


def price(
    lay: Layout,
    cost: ClusterCostModel,
    pipeline_batch: int,
    *,
    eps: float,
    grid: int,
    slices: tuple[int, ...] | None = None,
) -> Priced:
    """``lay``'s schedule of ``pipeline_batch`` sequences on ``cost`` (its layout, placed
    for the schedule's chunks): planned on the token ``grid`` with ``eps``, or over
    microbatches, cut into ``slices`` under ``seq1f1b``."""
    if lay.schedule in TOKEN_SCHEDULES:
        return price_terapipe(
            cost, lay.schedule, pipeline_batch, granularity=grid, eps=eps, rounds=lay.rounds
        )
    return price_microbatches(
        cost, lay.schedule, pipeline_batch, lay.microbatch, n_chunks=lay.n_chunks,
        token_slices=slices,
    )  # fmt: skip
