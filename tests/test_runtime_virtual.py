"""Virtual pipeline stages train exactly as one device does.

Every schedule with virtual stages (interleaved 1F1B, breadth-first, the V of ZB-V, and
their token-sliced forms) runs on gloo processes with v = 2 and 3 chunks per stage, on
K = 2 and 4 stages, with whole sequences and uneven token slices, with #Data = 2 and
with #Op = 2, with and without recomputation. The model has one layer per part, so every
chunk's boundary is a stage boundary of the model, and its embedding and LM head are
tied: under the interleaved placement the two copies sit on stages 0 and K-1, under the
V both on stage 0, where the runtime sums them locally. After one iteration the loss and
every gradient, and after 5 AdamW steps the parameters, match the single-process
reference (fp32, 1e-5), as in tests/test_runtime.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from tplib.plan import Plan
from tplib.runtime import Data, LocalPool, Parallelism, RunConfig, Timing

from .test_runtime import COLLECT, OPTIM, SEQ_LEN, _check_against_reference

WHOLE = Plan.gpipe(4, SEQ_LEN)  # four microbatches: a full group of K=2, and of K=4
UNEVEN = Plan((1, 1), ((5, 11), (2, 6, 8)))  # two sequences, different slice counts
SLICES = Plan.uniform(4, SEQ_LEN, n_token_slices=2)
# Each replica's share with #Data = 2: two sequences, so the global batch (4) keeps the
# gradient norm above the clipping threshold, which must bind to be tested.
REPLICA = Plan.uniform(2, SEQ_LEN, n_token_slices=2)

# (schedule, K, v, #Data, #Op, recompute, plan, fast): fast cases run in make test-fast,
# one per schedule. K = 4 and v = 3 run token-sliced (the harder case of each order).
CASES = [
    ("interleaved-1f1b", 2, 2, 1, 1, "none", WHOLE, True),
    ("terapipe-interleaved", 2, 2, 1, 1, "none", UNEVEN, True),
    ("terapipe-interleaved", 2, 3, 1, 1, "full", UNEVEN, False),
    ("terapipe-interleaved", 2, 2, 2, 1, "none", REPLICA, False),
    ("terapipe-interleaved", 2, 2, 1, 2, "none", UNEVEN, False),
    ("terapipe-interleaved", 4, 2, 1, 1, "none", SLICES, False),
    ("looped-bfs", 2, 3, 1, 1, "none", WHOLE, True),
    ("terapipe-bfs", 2, 2, 1, 1, "full", UNEVEN, True),
    ("zbv", 2, 2, 1, 1, "none", WHOLE, True),
    ("zbv", 4, 2, 1, 1, "none", WHOLE, False),
    ("terapipe-zbv", 2, 2, 1, 1, "none", UNEVEN, True),
    ("terapipe-zbv", 2, 2, 1, 2, "full", UNEVEN, False),
    ("terapipe-zbv", 2, 2, 2, 1, "none", REPLICA, False),
]


def _chunked(
    schedule: str,
    k: int,
    v: int,
    r: int,
    n_op: int,
    recompute: str,
    plan: Plan,
    dropout: float = 0.0,
) -> RunConfig:
    return RunConfig(
        model="tiny",
        # One layer per part.
        model_overrides=(("n_layer", k * v),) + ((("dropout", dropout),) if dropout else ()),
        schedule_name=schedule,
        parallelism=Parallelism(n_stages=k, n_data=r, n_op=n_op, n_chunks=v),
        data=Data(batch=plan.batch * r, seq_len=SEQ_LEN),
        slicing=plan,
        timing=Timing(steps=5, timeout_s=60),
        optim=OPTIM,
        recompute=recompute,
    )


@pytest.mark.parametrize(
    ("schedule", "k", "v", "r", "n_op", "recompute", "plan"),
    [
        pytest.param(
            *case[:7], marks=[pytest.mark.fast] if case[7] else [], id="-".join(map(str, case[:6]))
        )
        for case in CASES
    ],
)
def test_virtual_stages_match_single_process(
    pools: Callable[[int], LocalPool],
    schedule: str,
    k: int,
    v: int,
    r: int,
    n_op: int,
    recompute: str,
    plan: Plan,
) -> None:
    run = _chunked(schedule, k, v, r, n_op, recompute, plan)
    assert run.schedule.n_chunks == v and run.cfg.tie_embeddings
    result = pools(run.parallelism.world_size).run(run, COLLECT)
    _check_against_reference(run, result)
    # Each stage holds its v parts' layers: the model's layers c*K + k (interleaved) or
    # k and 2K-1-k (the V).
    for rank in result.ranks:
        names = {n for n in rank.params if n.startswith("blocks.")}
        layers = sorted({int(n.split(".")[1]) for n in names})
        placement = run.schedule.placement
        assert layers == [p for p in range(k * v) if placement[p] == rank.stage]


def test_selective_recompute_with_dropout_on_a_v_matches_single_process(
    pools: Callable[[int], LocalPool],
) -> None:
    """ZB-V's split backwards on a V of virtual stages over token slices, with dropout:
    each B recomputes its chunk's attention cores, dropping what their forwards dropped,
    and leaves the weight gradients to W."""
    run = _chunked("terapipe-zbv", 2, 2, 1, 1, "selective", UNEVEN, dropout=0.1)
    assert run.schedule.split_backward and run.cfg.dropout == 0.1
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


def test_every_chunked_schedule_has_a_fast_case() -> None:
    from tplib.schedule import REGISTRY

    fast = {case[0] for case in CASES if case[7]}
    assert fast == {name for name, entry in REGISTRY.items() if entry.chunked}


# ---- refused before any process starts ---------------------------------------------------


def test_chunks_that_do_not_divide_the_layers_per_stage_are_refused() -> None:
    with pytest.raises(ValueError, match="v must divide the layers per stage"):
        RunConfig(
            model="tiny",  # 4 layers: 2 per stage, not cut into 3 chunks
            schedule_name="interleaved-1f1b",
            parallelism=Parallelism(n_stages=2, n_chunks=3),
            data=Data(batch=4, seq_len=SEQ_LEN),
            slicing=WHOLE,
        )


def test_too_few_microbatches_for_the_interleaved_order_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 4 units per iteration"):
        RunConfig(
            model="tiny",
            model_overrides=(("n_layer", 8),),
            schedule_name="interleaved-1f1b",
            parallelism=Parallelism(n_stages=4, n_chunks=2),
            data=Data(batch=2, seq_len=SEQ_LEN),
            slicing=1,
        )


def test_a_one_chunk_schedule_refuses_chunks_and_zbv_wants_two() -> None:
    with pytest.raises(ValueError, match="n_chunks=2 with schedule '1f1b'"):
        RunConfig(schedule_name="1f1b", parallelism=Parallelism(n_stages=2, n_chunks=2))
    with pytest.raises(ValueError, match="n_chunks=1 with schedule 'zbv': it holds exactly 2"):
        RunConfig(schedule_name="zbv", parallelism=Parallelism(n_stages=2), data=Data(batch=2))


def test_distributed_optimizer_on_a_v_matches_single_process(
    pools: Callable[[int], LocalPool],
) -> None:
    """The V of ZB-V, #Data = 2, with the distributed optimizer and recomputation: a
    stage's two chunks and both copies of the tied embedding in one flat buffer, split
    backwards adding their weight gradients into it; two steps."""
    run = _chunked("terapipe-zbv", 2, 2, 2, 1, "full", REPLICA)
    run = replace(
        run,
        parallelism=replace(run.parallelism, distributed_optimizer=True),
        timing=replace(run.timing, steps=2),
    )
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))
