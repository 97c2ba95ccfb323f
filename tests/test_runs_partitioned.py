"""The planners' choices run for real: each becomes a RunConfig that the runtime trains
exactly as its single-device reference (the synchronous rule, or the delayed update
rule of the asynchronous schedule the planner chose)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from tplib.partition import (
    PipeDreamPlan,
    PipeDreamStage,
    Topology,
    balance,
    cluster_chain,
    pipedream_partition,
    twobw_plan,
)
from tplib.runs.partitioned import pipedream_run, search_run, twobw_run
from tplib.runtime import (
    Data,
    Hooks,
    LocalPool,
    Optim,
    Parallelism,
    RunConfig,
    RunResult,
    Timing,
    train_reference,
)
from tplib.search.layout import autoplan

SEQ_LEN = 16
TIMING = Timing(steps=3, timeout_s=60.0)
EXACT = Optim(lr=1e-3, adam_eps=1e-6)
# The asynchronous schedules' runs: their planners' runs do not clip, nor may a recipe given.
EXACT_ASYNC: dict[str, Any] = {"timing": TIMING, "optim": replace(EXACT, grad_clip=0.0)}


def _matches_reference(run: RunConfig, result: RunResult) -> None:
    ref = train_reference(run)
    torch.testing.assert_close(
        torch.tensor(result.losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-5
    )
    for replica in range(run.parallelism.n_data):
        for (stage, name), p in result.params(replica).items():
            last = stage == run.parallelism.n_stages - 1 and name == "head.weight"
            key = "wte.weight" if last and run.cfg.tie_embeddings else name
            torch.testing.assert_close(p, ref.params[key], rtol=1e-5, atol=1e-5)


def test_gpipe_balance_runs_as_uneven_stages(pools: Callable[[int], LocalPool]) -> None:
    ranges = balance(cluster_chain("tiny", microbatch=1, seq_len=SEQ_LEN), 3)
    assert len({hi - lo for lo, hi in ranges}) > 1  # uneven: 4 layers on 3 stages
    run = RunConfig(
        schedule_name="terapipe",
        parallelism=Parallelism(n_stages=3, stage_ranges=ranges),
        data=Data(batch=2, seq_len=SEQ_LEN),
        slicing=2,
        timing=TIMING,
        optim=EXACT,
    )
    _matches_reference(run, pools(3).run(run, Hooks(collect_params=True)))


def test_twobw_choice_trains_by_its_update_rule(pools: Callable[[int], LocalPool]) -> None:
    plan = twobw_plan(
        lambda b: cluster_chain("tiny", microbatch=b, seq_len=SEQ_LEN),
        Topology.flat(4, 1e9),
        batch=4,
        microbatches=(1, 2),
        depths=[2],
    )
    run = twobw_run(plan.best, "tiny", SEQ_LEN, **EXACT_ASYNC)
    assert (run.parallelism.n_data, run.parallelism.n_stages) == (plan.best.width, plan.best.depth)
    assert run.ranges == plan.best.stage_ranges and run.schedule_name == "2bw"
    _matches_reference(run, pools(run.parallelism.world_size).run(run, Hooks(collect_params=True)))


def test_pipedream_choice_trains_by_its_update_rule(pools: Callable[[int], LocalPool]) -> None:
    # A slow link makes replication's weight sync cost more than a cut: a straight pipeline.
    chain = cluster_chain("tiny", microbatch=2, seq_len=SEQ_LEN)
    plan = pipedream_partition(chain, Topology.flat(2, 5e6))
    assert [s.replicas for s in plan.stages] == [1, 1]
    run = pipedream_run(plan, "tiny", SEQ_LEN, microbatch=2, **EXACT_ASYNC)
    assert run.ranges == plan.stage_ranges and run.schedule_name == "pipedream"
    _matches_reference(run, pools(2).run(run, Hooks(collect_params=True)))


def test_a_replicated_stage_cannot_run() -> None:
    plan = PipeDreamPlan(
        (PipeDreamStage(0, 2, 2, 1.0), PipeDreamStage(2, 4, 1, 1.0)), 1.0, 3, (0.0,)
    )
    with pytest.raises(ValueError, match=r"unequally \(\[0, 2\) on 2, \[2, 4\) on 1\)"):
        pipedream_run(plan, "tiny", SEQ_LEN, microbatch=1)


def test_stages_replicated_alike_are_replicas_of_the_pipeline() -> None:
    plan = PipeDreamPlan(
        (PipeDreamStage(0, 2, 3, 1.0), PipeDreamStage(2, 4, 3, 1.0)), 1.0, 3, (0.0,)
    )
    run = pipedream_run(plan, "tiny", SEQ_LEN, microbatch=2)
    assert (run.parallelism.n_data, run.parallelism.n_stages, run.data.batch) == (3, 2, 6)
    assert run.ranges == ((0, 2), (2, 4))


def test_the_searched_layout_is_a_run() -> None:
    search = autoplan("GPT3-175B", 384, 2)
    run = search_run(search, timing=Timing(steps=3))
    lay = search.best.layout
    assert (run.parallelism.n_data, run.parallelism.n_stages, run.parallelism.n_op) == (
        lay.n_data,
        lay.n_stages,
        lay.n_op,
    )
    assert (
        run.parallelism.world_size == 384
        and run.parallelism.ranks_per_node == 8
        and run.timing.steps == 3
    )
    assert run.plan.to_paper() == search.best.plan and run.precision == "fp16"
    unplanned = next(c for c in search.candidates if c.status != "fits" and not c.plan)
    with pytest.raises(ValueError, match="was not planned"):
        search_run(search, unplanned)
