"""The layout search: exact against exhaustive evaluation, sound pruning, clear errors."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tplib.cluster import DGX_H100, ClusterCostModel
from tplib.cluster.calibration import DGX_H100_CALIBRATION
from tplib.nn.configs import GPTConfig, get_config
from tplib.partition import DoesNotFit
from tplib.planner import plan_slices
from tplib.schedule.chunks import interleaved
from tplib.search.layout import Layout, autoplan
from tplib.search.long_context import LONG_CONTEXT
from tplib.search.megatron import MegatronRun, predict
from tplib.search.pricing import price
from tplib.sim.simulate import simulate_schedule

CASES = [("GPT3-1B", 32, 16, 1024), ("GPT3-1B", 16, 8, 1024), ("GPT3-13B", 64, 8, 1024)]


def exhaustive(model: str, n_gpus: int, batch: int, seq_len: int) -> dict[tuple, float]:
    """Every layout planned and simulated, no pruning: (D, K, Op, recompute) -> latency
    of those that fit. Written out from the rules in the search's docstring."""
    cfg = get_config(model).with_(seq_len=seq_len)
    out = {}
    for op in (1, 2, 4, 8):
        for k in range(1, cfg.n_layer + 1):
            if cfg.n_layer % k or cfg.n_head % op or n_gpus % (k * op):
                continue
            d = n_gpus // (k * op)
            replica = k * op
            if batch % d or (replica % 8 and 8 % replica):
                continue
            for rc in ("none", "full"):
                cost = ClusterCostModel(
                    cfg, n_stages=k, n_op=op, n_data=d, seq_len=seq_len, recompute=rc
                )
                p = plan_slices(cost, seq_len=seq_len, batch=batch // d, n_stages=k, eps=1e-4)
                if cost.memory(p).fits:
                    latency = simulate_schedule("terapipe", k, p, cost, validate=False).latency
                    out[(d, k, op, rc)] = latency
    return out


@pytest.mark.parametrize("case", CASES)
def test_search_equals_exhaustive_evaluation(case: tuple[str, int, int, int]) -> None:
    search = autoplan(*case[:3], seq_len=case[3])
    every = exhaustive(*case)
    best = min(every, key=every.__getitem__)
    lay = search.best.layout
    assert (lay.n_data, lay.n_stages, lay.n_op, lay.recompute) == best
    assert search.best.latency == pytest.approx(every[best])
    # Every candidate the search planned and kept has the exhaustive latency; every
    # fitting layout is a candidate of some status.
    found = {
        (c.layout.n_data, c.layout.n_stages, c.layout.n_op, c.layout.recompute): c
        for c in search.candidates
    }
    assert set(every) <= set(found)
    for key, c in found.items():
        if c.status == "fits":
            assert c.latency == pytest.approx(every[key])


@pytest.mark.parametrize("case", CASES)
def test_floors_never_exceed_what_a_plan_costs(case: tuple[str, int, int, int]) -> None:
    """Pruning is sound: the latency and memory floors stay below every planned value."""
    search = autoplan(*case[:3], seq_len=case[3], memory_gib=1e6)  # plan everything that can
    planned = [c for c in search.candidates if not math.isnan(c.latency)]
    assert planned
    for c in planned:
        assert c.latency_floor <= c.latency
    best = search.best.latency
    for c in search.candidates:
        assert (c.status == "pruned") == (math.isnan(c.latency) and c.latency_floor >= best)


def test_paper_scale_search_ranks_and_explains() -> None:
    search = autoplan("GPT3-175B", 384, 2)
    assert search.best.status == "fits" and search.best.reason == "best"
    assert search.best.memory <= 16 * 2**30
    statuses = [c.status for c in search.candidates]
    assert statuses == sorted(statuses, key=lambda s: s != "fits")  # fitting ones first
    fits = [c.latency for c in search.candidates if c.status == "fits"]
    assert fits == sorted(fits)
    for c in search.candidates[1:]:
        assert c.reason.startswith(("slower", "pruned", "out of memory"))
    assert "searched in" in search.report() and "best" in search.report()


def test_memory_nothing_fits_names_the_closest() -> None:
    with pytest.raises(DoesNotFit, match=r"nothing fits in 8\.0 GiB.*closest is #Data=1") as e:
        autoplan("GPT3-175B", 384, 2, memory_gib=8)
    assert e.value.memory > e.value.capacity == 8 * 2**30


LONG = GPTConfig("long", n_layer=4, hidden=1024, n_head=8, seq_len=131072, vocab_size=32000)


def _megatron(lay: Layout) -> MegatronRun:
    """``lay`` as a Megatron run of LONG on 8 H100s: priced apart, by predict."""
    return MegatronRun(
        "dgx-h100", 8, layers=4, hidden=1024, heads=8, batch=4, vocab=32000,
        seq_len=131072, tp=lay.n_op, pp=lay.n_stages, cp=lay.n_cp, microbatch=lay.microbatch,
        interleave=lay.n_chunks, schedule=lay.schedule, recompute=lay.recompute,
        sequence_parallel=lay.n_op > 1, distributed_optimizer=True, dropout=0.0,
    )  # fmt: skip


def test_context_parallel_layouts_win_at_long_length_and_the_search_stays_exact() -> None:
    """At L = 128K in 16 GiB per GPU, a #CP > 1 layout beats every layout without it; and
    every candidate, planned or pruned, priced apart as a Megatron run, is no faster than
    the best unless it does not fit (the planned ones cost what the search says)."""
    kw = dict(
        seq_len=131072, cluster="dgx-h100", memory_gib=16,
        recompute=("none", "selective", "full"), implementation=LONG_CONTEXT.implementation,
        schedules=("1f1b", "interleaved-1f1b"),
    )  # fmt: skip
    search = autoplan(LONG, 8, 4, context_parallel=None, **kw)  # type: ignore[arg-type]
    without = autoplan(LONG, 8, 4, **kw)  # type: ignore[arg-type]
    assert search.best.layout.n_cp > 1 and search.best.latency < without.best.latency
    assert {c.layout.n_cp for c in search.candidates} == {1, 2, 4, 8}
    for c in search.candidates:
        p = predict(_megatron(c.layout))
        if not math.isnan(c.latency):
            assert (c.latency, c.memory) == pytest.approx((p.iteration_s, p.memory_gib * 2**30))
        assert p.memory_gib > 16 or p.iteration_s >= search.best.latency * (1 - 1e-12)


def test_pruning_stays_exact_with_cp_rounds_and_token_slices() -> None:
    """TeraPipe in rounds, split backwards and 1F1B over token slices, every #CP: each
    candidate the floors left unplanned, priced now, does not fit or is no faster."""
    cfg = LONG.with_(n_layer=2, seq_len=16384)

    def halves(cfg: GPTConfig, seq_len: int, n: int, grid: int) -> list[int]:
        return [seq_len // n] * n

    search = autoplan(
        cfg, 8, 4, seq_len=16384, cluster="dgx-h100", memory_gib=6,
        implementation=LONG_CONTEXT.implementation, schedules=("terapipe", "seq1f1b"),
        context_parallel=None, granularity=1024, slicing=halves, accumulate=True,
    )  # fmt: skip
    assert {c.layout.rounds for c in search.candidates} >= {1, 2, 4}
    for c in search.candidates:
        if not math.isnan(c.latency):
            continue
        lay = c.layout
        impl = LONG_CONTEXT.implementation
        impl = impl if lay.n_op > 1 else dataclasses.replace(impl, sequence_parallel=False)
        cost = ClusterCostModel(
            cfg, n_stages=lay.n_stages, n_op=lay.n_op, n_data=lay.n_data, n_cp=lay.n_cp,
            calibration=DGX_H100_CALIBRATION, hardware=DGX_H100, recompute=lay.recompute,
            implementation=impl,
        ).placed(interleaved(lay.n_stages, lay.n_chunks))  # fmt: skip
        grid = math.lcm(1024, 2 * lay.n_cp)
        cut = tuple(halves(cfg, 16384, lay.n_slices, grid)) if lay.n_slices > 1 else None
        got = price(lay, cost, 4 // lay.n_data, eps=1e-4, grid=grid, slices=cut)
        assert got.memory > 6 * 2**30 or got.latency >= search.best.latency
        assert got.memory >= c.memory and got.latency >= c.latency_floor  # the floors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_gpus": 390}, "n_gpus=390 does not fill whole nodes"),
        ({"n_gpus": 40, "batch": 4}, "no layout of GPT3-1B on n_gpus=40 with batch=4"),
        ({"batch": 0}, "batch=0"),
        ({"cluster": "dgx-2"}, "cluster='dgx-2'"),
        ({"seq_len": 1001}, "seq_len=1001"),
        ({"memory_gib": -1.0}, "memory_gib=-1.0"),
        ({"recompute": ("some",)}, "recompute="),
        ({"recompute": ("none", "partial")}, "choose among .'none', 'selective', 'full'."),
        ({"schedules": ("gpipe",)}, "schedules=.'gpipe',.: choose among"),
        ({"context_parallel": (2,)}, "#CP=2: context parallelism needs FlashAttention"),
    ],
)
def test_bad_input_is_refused_before_any_work(kwargs: dict, match: str) -> None:
    args = {"model": "GPT3-1B", "n_gpus": 32, "batch": 16} | kwargs
    with pytest.raises(ValueError, match=match):
        autoplan(**args)
