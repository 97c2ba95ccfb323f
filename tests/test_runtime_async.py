"""Asynchronous schedules on gloo processes compute exactly their defining update rules.

For PipeDream (weight stashing, with and without vertical sync) and PipeDream-2BW, on 1,
2 and 4 stages, with and without token slices, with data-parallel replicas and with
operation partitioning: the losses of every iteration and the parameters after 6 AdamW
updates match :func:`tplib.runtime.train_reference`, which applies the recurrence
W(t+1) = W(t) - lr * grad f_t(W_0(t - d_0), ..., W_{K-1}(t - d_{K-1})) directly on one
process (fp32, 1e-5). The delays are the papers': 2BW 1, PipeDream K-1-k, vertical sync
K-1. On more than one stage the same runs do *not* match the synchronous rule (delay 0),
so the comparison can tell the rules apart. Each stage reports how many weight versions it
held at once: PipeDream K-k on stage k, with vertical sync K, 2BW 2, a flushed 1F1B 1.

Recomputation (2 and 4 stages, token slices) is checked the same way, and only it reads
the weights a backward installs: without it autograd has kept the forward's own
parameters, so a backward on the wrong version would go unseen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tplib.plan import Plan
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

SEQ_LEN = 16
STEPS = 6


def _plan(schedule: str, k: int, sliced: bool) -> Plan:
    """One replica's plan: PipeDream's minibatch is one batch slice of 2 sequences;
    2BW's iteration is m microbatches of one sequence, m large enough for K stages."""
    tokens = (5, 11) if sliced else (SEQ_LEN,)
    if schedule == "pipedream":
        return Plan((2,), (tokens,))
    m = 3 if k == 4 and not sliced else 2
    return Plan((1,) * m, (tokens,) * m)


def _config(
    schedule: str,
    k: int,
    *,
    sliced: bool = False,
    r: int = 1,
    n_op: int = 1,
    source: str = "synthetic",
    **fields: Any,
) -> RunConfig:
    plan = _plan(schedule.split("+")[0], k, sliced)
    return RunConfig(
        model="tiny",
        schedule_name=schedule.split("+")[0],
        vertical_sync=schedule.endswith("+vs"),
        parallelism=Parallelism(n_stages=k, n_data=r, n_op=n_op),
        data=Data(batch=plan.batch * r, seq_len=SEQ_LEN, source=source),
        slicing=plan,
        timing=Timing(steps=STEPS, timeout_s=60),
        optim=Optim(
            grad_clip=0.0,  # asynchronous schedules do not clip (see RunConfig)
            lr=1e-3,  # a wrong version moves parameters ~1e-3, 100x the tolerance
            adam_eps=1e-6,  # as in test_runtime: keeps the zero-gradient key bias at noise level
        ),
        **fields,
    )


def _model_name(run: RunConfig, stage: int, name: str) -> str:
    last = stage == run.parallelism.n_stages - 1
    return "wte.weight" if last and name == "head.weight" and run.cfg.tie_embeddings else name


def _max_param_error(
    run: RunConfig, result: RunResult, ref_params: dict[str, torch.Tensor]
) -> float:
    worst = 0.0
    for replica in range(run.parallelism.n_data):
        params = result.params(replica)
        assert params, "no parameters collected"
        for (stage, name), p in params.items():
            worst = max(worst, (p - ref_params[_model_name(run, stage, name)]).abs().max().item())
    return worst


def _versions(result: RunResult) -> list[int]:
    """Weight versions held, per stage (every rank of a stage must agree)."""
    per_stage: dict[int, set[int]] = {}
    for r in result.ranks:
        per_stage.setdefault(r.stage, set()).add(r.weight_versions)
    assert all(len(v) == 1 for v in per_stage.values()), per_stage
    return [per_stage[s].pop() for s in sorted(per_stage)]


def _expected_versions(schedule: str, k: int) -> list[int]:
    if schedule == "pipedream":
        return [k - s for s in range(k)]  # PipeDream: up to K - k on stage k
    if schedule == "pipedream+vs":
        return [k] * k  # vertical sync: versions t-K+1 .. t on every stage
    return [2] * k  # 2BW: the latest and the shadow


def _check(run: RunConfig, result: RunResult, schedule: str) -> None:
    ref = train_reference(run)
    torch.testing.assert_close(
        torch.tensor(result.losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-5
    )
    assert _max_param_error(run, result, ref.params) < 1e-5
    assert _versions(result) == _expected_versions(schedule, run.parallelism.n_stages)
    if run.parallelism.n_stages > 1:
        # The same data under the synchronous rule ends elsewhere: the test sees versions.
        sync = train_reference(dataclasses.replace(run, schedule_name="1f1b", vertical_sync=False))
        assert _max_param_error(run, result, sync.params) > 1e-4


SCHEDULES = ["pipedream", "pipedream+vs", "2bw"]
# make test-fast runs one case of each registered schedule: two stages, token slices.
FAST = {("pipedream", 2, True), ("2bw", 2, True)}
CASES = [
    pytest.param(
        schedule,
        k,
        sliced,
        id=f"{schedule}-{k}-{'token-sliced' if sliced else 'whole'}",
        marks=[pytest.mark.fast] if (schedule, k, sliced) in FAST else [],
    )
    for schedule in SCHEDULES
    for k in (1, 2, 4)
    for sliced in (False, True)
]


@pytest.mark.parametrize(("schedule", "k", "sliced"), CASES)
def test_matches_update_rule(
    pools: Callable[[int], LocalPool], schedule: str, k: int, sliced: bool
) -> None:
    if schedule == "pipedream+vs" and k == 1:
        pytest.skip("vertical sync on one stage is plain PipeDream")
    run = _config(schedule, k, sliced=sliced)
    result = pools(run.parallelism.world_size).run(run, Hooks(collect_params=True))
    _check(run, result, schedule)


@pytest.mark.parametrize(("r", "n_op"), [(2, 1), (1, 2)], ids=["2 replicas", "#Op 2"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_3d_layouts_match_update_rule(
    pools: Callable[[int], LocalPool], schedule: str, r: int, n_op: int
) -> None:
    run = _config(schedule, 2, sliced=True, r=r, n_op=n_op)
    result = pools(run.parallelism.world_size).run(run, Hooks(collect_params=True))
    _check(run, result, schedule)


def test_flush_holds_one_version(pools: Callable[[int], LocalPool]) -> None:
    run = dataclasses.replace(_config("2bw", 2), schedule_name="1f1b")
    result = pools(run.parallelism.world_size).run(run)
    assert _versions(result) == [1, 1]


def test_trace_names_each_actions_version(pools: Callable[[int], LocalPool]) -> None:
    run = _config("pipedream", 2, sliced=True)
    trace = pools(run.parallelism.world_size).run(run).trace
    compute = trace[trace.kind.isin(["F", "B"])]
    # Stage 0 runs minibatch t on version max(0, t - 1); stage 1 (the last) on version t.
    got = set(zip(compute.stage.tolist(), compute.b.tolist(), compute.v.tolist(), strict=True))
    want = {(s, t, max(0, t - (1 - s))) for s in (0, 1) for t in range(STEPS)}
    assert got == want
    updates = trace[trace.kind == "OPT"]
    assert sorted(updates.groupby("stage").size()) == [STEPS, STEPS]


def test_bad_input_is_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match=r"pipedream given plan .* 2 batch slices"):
        RunConfig(
            schedule_name="pipedream",
            parallelism=Parallelism(n_stages=2),
            data=Data(batch=2, seq_len=16),
            optim=Optim(grad_clip=0.0),
            slicing=1,
        )
    with pytest.raises(ValueError, match=r"2bw with m=2 microbatches .* 4 stages"):
        RunConfig(
            schedule_name="2bw",
            parallelism=Parallelism(n_stages=4),
            data=Data(batch=2, seq_len=16),
            optim=Optim(grad_clip=0.0),
            slicing=1,
        )
    with pytest.raises(ValueError, match=r"vertical_sync=True with schedule '2bw'"):
        RunConfig(
            schedule_name="2bw",
            vertical_sync=True,
            parallelism=Parallelism(n_stages=2),
            data=Data(batch=2, seq_len=16),
        )
    with pytest.raises(ValueError, match=r"grad_clip=1\.0: clipping to the global gradient norm"):
        RunConfig(
            schedule_name="2bw",
            parallelism=Parallelism(n_stages=2),
            data=Data(batch=2, seq_len=16),
            optim=Optim(grad_clip=1.0),
        )


def test_text_data_trains_the_same_rule(pools: Callable[[int], LocalPool]) -> None:
    # Byte-level text of the standard library, as the statistical-efficiency runs use.
    run = _config("2bw", 2, source="stdlib", model_overrides=(("vocab_size", 256),))
    result = pools(run.parallelism.world_size).run(run, Hooks(collect_params=True))
    _check(run, result, "2bw")
    assert result.losses[0] > result.losses[-1]  # text, unlike random ids, is learnable


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_recomputation_matches_update_rule(
    pools: Callable[[int], LocalPool], schedule: str, k: int
) -> None:
    # The recomputed forward must run on the unit's stashed version, not the latest.
    run = _config(schedule, k, sliced=True, recompute="full")
    result = pools(run.parallelism.world_size).run(run, Hooks(collect_params=True))
    _check(run, result, schedule)
