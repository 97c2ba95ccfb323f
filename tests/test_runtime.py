"""Pipelined training on gloo processes computes what one device computes.

Every schedule runs with 1, 2 and 4 stages, 1 and 2 data-parallel replicas and several
slicings; and on the 3D layouts (#Data, #Pipe, #Op) = (1, 2, 2), (2, 1, 2), (2, 2, 2)
with token slices, with and without recomputation. After one iteration the loss and every
gradient match a single-process whole-batch reference, and after 5 AdamW steps so do the
parameters (fp32, 1e-5).

Every run trains with GPT-3's optimiser recipe, the runtime's default: weight decay on the
matrices only, the gradient clipped to a global norm of 1.0, linear LR warm-up then cosine
decay. The reference applies it with torch's own tools on the whole model; the pipeline's
global gradient norm, assembled from every stage, op rank and replica, must equal the
reference's clip_grad_norm_ at every step, and it exceeds 1.0 at every step of these runs
(checked), so the clipping binds throughout. One run checks the old recipe (no clipping,
constant rate, decay on every parameter), and the erf GELU runs each schedule.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from tplib.nn.oppart import shard_spec
from tplib.plan import Plan
from tplib.runtime import (
    Data,
    Hooks,
    LocalPool,
    Optim,
    Parallelism,
    ReferenceResult,
    RunConfig,
    RunResult,
    Timing,
    train_reference,
)
from tplib.runtime.worker import TRACE_COLUMNS, Worker
from tplib.schedule import NO_VERSION, Kind, registered, schedule_names

from .conftest import Pools

SEQ_LEN = 16
BATCH_PER_REPLICA = 2
SLICINGS = {
    "gpipe": [Plan.gpipe(2, SEQ_LEN), Plan((2,), ((SEQ_LEN,),))],
    "terapipe": [
        Plan.uniform(2, SEQ_LEN, n_token_slices=4),
        Plan((1, 1), ((7, 1, 8), (3, 13))),
        Plan((2,), ((1,) * 4 + (12,),)),
    ],
    "1f1b": [
        Plan((1, 1), ((SEQ_LEN,), (SEQ_LEN,))),
        Plan.uniform(2, SEQ_LEN, n_token_slices=3),
        Plan((1, 1), ((5, 11), (2, 6, 8))),
    ],
    # Split backwards: uneven slices, and sequences with different slice counts.
    "terapipe-zb": [Plan((1, 1), ((7, 1, 8), (3, 13)))],
    "1f1b-zb": [Plan((1, 1), ((5, 11), (2, 6, 8)))],
}
# The case of each schedule that make test-fast runs (two stages, one replica, token
# slices where the schedule takes them): the slicing's index in SLICINGS.
FAST = {"gpipe": 0, "terapipe": 1, "1f1b": 2, "terapipe-zb": 0, "1f1b-zb": 0}
CASES = [
    pytest.param(
        schedule, k, r, i, marks=[pytest.mark.fast] if (k, r, i) == (2, 1, FAST[schedule]) else []
    )
    for schedule, plans in SLICINGS.items()
    for k in (1, 2, 4)
    for r in (1, 2)
    for i in range(len(plans))
]


OPTIM = Optim(
    lr=1e-3,  # wrong or missing gradients move parameters ~1e-3, 100x the tolerance
    # The attention key bias has a gradient that is exactly zero in exact arithmetic
    # (softmax ignores a shift common to all keys), so both runs hold rounding noise
    # there, ~1e-10. With Adam's default eps=1e-8 that noise is divided by its own
    # magnitude and moves the bias by ~lr; eps=1e-6 keeps noise-level gradients
    # noise-level without touching any real gradient (all >> 1e-6 here).
    adam_eps=1e-6,
)


def _config(
    schedule: str,
    k: int,
    r: int,
    plan: Plan,
    *,
    n_op: int = 1,
    optim: Optim = OPTIM,
    **fields: Any,
) -> RunConfig:
    return RunConfig(
        model="tiny",
        schedule_name=schedule,
        parallelism=Parallelism(n_stages=k, n_data=r, n_op=n_op),
        data=Data(batch=BATCH_PER_REPLICA * r, seq_len=SEQ_LEN),
        slicing=plan,
        timing=Timing(steps=5, timeout_s=60),
        optim=optim,
        **fields,
    )


COLLECT = Hooks(collect_grads=True, collect_params=True)
_references: dict[tuple[object, ...], ReferenceResult] = {}


def _reference(run: RunConfig) -> ReferenceResult:
    # The reference depends only on the global batch, the model, the optimiser recipe and
    # the steps (the data are fixed by _config).
    key = (run.data, run.model_overrides, run.optim, run.timing.steps)
    if key not in _references:
        _references[key] = train_reference(run)
    return _references[key]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _model_name(run: RunConfig, stage: int, name: str) -> str:
    # The last part's LM head is the model's tied token embedding, whichever stage holds
    # it (the last; with a V of virtual stages the first, beside the embedding).
    return "wte.weight" if name == "head.weight" and run.cfg.tie_embeddings else name


def _check_against_reference(run: RunConfig, result: RunResult) -> None:
    ref = _reference(run)
    r = run.parallelism.n_data
    # Losses of every step (the first one is the loss after one iteration).
    _close(torch.tensor(result.losses), torch.tensor(ref.losses), "losses")
    # The global gradient norm every rank clipped with is the whole model's.
    assert (
        len(result.grad_norms)
        == len(ref.grad_norms)
        == (run.timing.steps if run.optim.grad_clip else 0)
    )
    torch.testing.assert_close(
        torch.tensor(result.grad_norms), torch.tensor(ref.grad_norms), rtol=1e-5, atol=0
    )
    assert all(n > run.optim.grad_clip for n in ref.grad_norms), "clipping must bind to be tested"
    assert all(r.grad_norms == result.grad_norms for r in result.ranks), "ranks disagree"
    for replica in range(r):
        grads, params = result.grads(replica), result.params(replica)
        covered = {_model_name(run, s, n) for s, n in grads}
        assert covered == set(ref.grads), "every parameter lives on exactly one stage"
        for (stage, name), g in grads.items():
            _close(g, ref.grads[_model_name(run, stage, name)], f"grad {name}")
        for (stage, name), p in params.items():
            _close(p, ref.params[_model_name(run, stage, name)], f"param {name} after 5 steps")


@pytest.mark.parametrize(("schedule", "k", "r", "i"), CASES)
def test_pipeline_matches_single_process(
    pools: Callable[[int], LocalPool], schedule: str, k: int, r: int, i: int
) -> None:
    run = _config(schedule, k, r, SLICINGS[schedule][i])
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


# (#Data, #Pipe, #Op): the shapes of Table 1's layouts, scaled down.
LAYOUTS = [(1, 2, 2), (2, 1, 2), (2, 2, 2)]
SLICED = {
    "gpipe": Plan.gpipe(2, SEQ_LEN),
    "terapipe": Plan((1, 1), ((5, 11), (2, 6, 8))),
    "1f1b": Plan.uniform(2, SEQ_LEN, n_token_slices=3),
    "terapipe-zb": Plan((1, 1), ((5, 11), (2, 6, 8))),
    "1f1b-zb": Plan.uniform(2, SEQ_LEN, n_token_slices=3),
}


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("schedule", list(SLICED))
@pytest.mark.parametrize(("r", "k", "n_op"), LAYOUTS)
def test_3d_layouts_match_single_process(
    pools: Callable[[int], LocalPool], r: int, k: int, n_op: int, schedule: str, recompute: str
) -> None:
    run = _config(schedule, k, r, SLICED[schedule], n_op=n_op, recompute=recompute)
    result = pools(run.parallelism.world_size).run(run, COLLECT)
    _check_against_reference(run, result)
    # Replicated parameters (LayerNorms, biases after row-parallel products, positions)
    # stay identical on every op rank without any synchronisation of their own.
    for replica, stage in itertools.product(range(r), range(k)):
        ranks = [x for x in result.ranks if (x.replica, x.stage) == (replica, stage)]
        assert len(ranks) == n_op
        for name, p in ranks[0].params.items():
            if shard_spec(name) is None:
                for other in ranks[1:]:
                    assert torch.equal(other.params[name], p), (name, other.op_rank)


def test_distributed_optimizer_matches_single_process(pools: Callable[[int], LocalPool]) -> None:
    """Megatron's distributed optimizer on a 3D layout, TeraPipe's uneven token slices:
    the optimizer state sharded over #Data, two steps with clipping binding (checked)."""
    run = _config("terapipe", 2, 2, SLICED["terapipe"], n_op=2)
    run = replace(
        run,
        parallelism=replace(run.parallelism, distributed_optimizer=True),
        timing=replace(run.timing, steps=2),
    )
    result = pools(run.parallelism.world_size).run(run, COLLECT)
    _check_against_reference(run, result)
    # Each replica kept Adam's m and v of half its stage: 4 bytes per parameter, not 8.
    for r in result.ranks:
        assert r.memory is not None
        assert r.memory.optimizer < 0.6 * 2 * r.memory.params, (r.rank, r.memory)


def test_distributed_optimizer_in_bf16_matches_the_unsharded_optimizer(
    pools: Callable[[int], LocalPool],
) -> None:
    """bf16 autocast, K = 2, #Data = 2: sharded, the optimizer computes what the
    all-reduce and the whole optimizer compute (the global norm's sum is grouped
    otherwise; nothing else differs)."""
    run = _config("terapipe", 2, 2, SLICED["terapipe"], precision="bf16")
    run = replace(run, timing=replace(run.timing, steps=2))
    sharded = replace(run, parallelism=replace(run.parallelism, distributed_optimizer=True))
    want, got = (pools(run.parallelism.world_size).run(r, COLLECT) for r in (run, sharded))
    _close(torch.tensor(got.losses), torch.tensor(want.losses), "losses")
    _close(torch.tensor(got.grad_norms), torch.tensor(want.grad_norms), "grad norms")
    assert all(n > run.optim.grad_clip for n in want.grad_norms), "clipping must bind"
    for replica in range(2):
        for what, tensors in (("grad", got.grads), ("param", got.params)):
            whole = (want.grads if what == "grad" else want.params)(replica)
            mine = tensors(replica)
            assert mine.keys() == whole.keys()
            for key, t in mine.items():
                _close(t, whole[key], f"{what} {key} of replica {replica}")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_recompute_matches_single_process(pools: Callable[[int], LocalPool], k: int) -> None:
    run = _config("terapipe", k, 1, SLICINGS["terapipe"][1], recompute="full")
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


def test_selective_recompute_on_a_3d_layout_matches_single_process(
    pools: Callable[[int], LocalPool],
) -> None:
    """Selective recomputation composed: token slices (each unit's cores recomputed over
    its K/V context), #Op = 2 (each rank its heads' cores) and #Data = 2."""
    run = _config("terapipe", 2, 2, SLICED["terapipe"], n_op=2, recompute="selective")
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


def test_padded_vocabulary_matches_single_process(pools: Callable[[int], LocalPool]) -> None:
    # 95 words over #Op = 2: 48 rows each, the last one padding, masked out of the loss.
    run = _config(
        "terapipe", 1, 1, SLICED["terapipe"], n_op=2, model_overrides=(("vocab_size", 95),)
    )
    assert run.padded_vocab == 96
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


def test_old_recipe_matches_single_process(pools: Callable[[int], LocalPool]) -> None:
    """No clipping, a constant rate, decay on every parameter: torch AdamW's defaults."""
    run = _config(
        "terapipe",
        2,
        1,
        SLICINGS["terapipe"][1],
        optim=replace(
            OPTIM,
            grad_clip=0.0,
            lr_schedule_name="constant",
            lr_warmup_steps=0,
            weight_decay_params="all",
        ),
    )
    result = pools(run.parallelism.world_size).run(run, COLLECT)
    _check_against_reference(run, result)
    ref = _reference(run)
    assert ref.lrs == [run.optim.lr] * run.timing.steps and not result.grad_norms
    # The default recipe trains differently: this case is not the default one again.
    default = _reference(_config("terapipe", 2, 1, SLICINGS["terapipe"][1]))
    assert default.lrs[0] == run.optim.lr / 3 and default.lrs[-1] < run.optim.lr
    gap = max((default.params[n] - ref.params[n]).abs().max().item() for n in ref.params)
    assert gap > 1e-4


@pytest.mark.parametrize("schedule", list(SLICED))
def test_erf_gelu_matches_single_process(pools: Callable[[int], LocalPool], schedule: str) -> None:
    run = _config(schedule, 2, 1, SLICED[schedule], model_overrides=(("gelu", "erf"),))
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


@pytest.mark.parametrize("schedule", list(SLICED))
def test_dropout_matches_single_process(pools: Callable[[int], LocalPool], schedule: str) -> None:
    # Masks keyed by position: every slice, stage and replica drops what the whole batch
    # drops in the reference (tplib.nn.dropout), recomputed or not.
    run = _config(
        schedule, 2, 2, SLICED[schedule], recompute="full", model_overrides=(("dropout", 0.1),)
    )
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


def test_dropout_on_a_3d_layout_matches_single_process(pools: Callable[[int], LocalPool]) -> None:
    run = _config("terapipe", 2, 2, SLICED["terapipe"], n_op=2, model_overrides=(("dropout", 0.1),))
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_sequence_parallel_3d_layout_with_dropout_matches_single_process(
    pools: Callable[[int], LocalPool], recompute: str
) -> None:
    """Sequence parallelism on (#Data, #Pipe, #Op) = (2, 2, 2), token slices, dropout:
    each op rank holds and sends its half of every slice's tokens, its dropout masks are
    its half's rows, and the replicated parameters' gradients are summed over #Op. The
    gradients (replicated ones included) and parameters are equal on every op rank. With
    selective recomputation and the distributed optimizer too: Megatron's recipe, all
    three composed."""
    plan = Plan((1, 1), ((6, 10), (2, 6, 8)))  # every slice's length divisible by #Op
    run = _config(
        "terapipe", 2, 2, plan, n_op=2, recompute=recompute, model_overrides=(("dropout", 0.1),)
    )
    megatron = recompute == "selective"
    layout = replace(run.parallelism, sequence_parallel=True, distributed_optimizer=megatron)
    run = replace(run, parallelism=layout)
    result = pools(run.parallelism.world_size).run(run, COLLECT)
    _check_against_reference(run, result)
    for replica, stage in itertools.product(range(2), range(2)):
        ranks = [x for x in result.ranks if (x.replica, x.stage) == (replica, stage)]
        for name in (n for n in ranks[0].params if shard_spec(n) is None):
            assert torch.equal(ranks[1].grads[name], ranks[0].grads[name]), (name, stage)
            assert torch.equal(ranks[1].params[name], ranks[0].params[name]), (name, stage)


def test_trace_has_every_action(pools: Callable[[int], LocalPool]) -> None:
    run = _config("terapipe", 2, 1, SLICINGS["terapipe"][1])
    result = pools(2).run(run)
    trace = result.trace
    assert list(trace.columns) == list(TRACE_COLUMNS)
    # Each rank's rows carry its own place in the layout, every timed iteration has its
    # rows, and a synchronous schedule names no weight version.
    for r in result.ranks:
        rows = trace[trace["rank"] == r.rank]
        assert len(rows) == len(r.trace) > 0
        assert (rows.stage == r.stage).all() and (rows.replica == r.replica).all()
        assert (rows.op_rank == r.op_rank).all()
    assert set(trace.iteration) == set(range(len(result.losses)))
    assert (trace.v == NO_VERSION).all()
    for stage in range(2):
        rows = trace[(trace.stage == stage) & (trace.iteration == 0)]
        listed = [str(a) for a in run.schedule.actions[stage]]
        traced = [
            kind if kind in ("AR", "OPT") else f"{kind} b{b} t{t}"
            for kind, b, t in zip(rows.kind, rows.b, rows.t, strict=True)
        ]
        assert traced == listed  # the schedule describes the whole iteration, update included
    assert (trace.end >= trace.start).all()


def test_every_kind_has_a_handler() -> None:
    assert set(Worker.DISPATCH) == set(Kind)


def test_memory_is_counted_unless_turned_off(pools: Callable[[int], LocalPool]) -> None:
    run = _config("1f1b", 2, 1, SLICINGS["1f1b"][1])
    counted = pools(2).run(run)
    assert all(r.memory is not None and r.memory.source == "counted" for r in counted.ranks)
    assert all(r.memory is not None and r.memory.activations_peak > 0 for r in counted.ranks)
    off = pools(2).run(run, Hooks(count_memory=False))
    assert all(r.memory is None for r in off.ranks)
    assert off.losses == counted.losses  # counting does not change what is computed


# ---- determinism: the same configuration and seed, the same bits ---------------------------

# Every registered schedule on 2 stages, token-sliced where it slices; the synchronous ones
# with dropout, whose masks are keyed by position and seed (the asynchronous ones refuse it).
DETERMINISM = {
    "gpipe": Plan.gpipe(2, SEQ_LEN),
    "terapipe": Plan((1, 1), ((5, 11), (2, 6, 8))),
    "1f1b": Plan.uniform(2, SEQ_LEN, n_token_slices=3),
    "terapipe-zb": Plan((1, 1), ((5, 11), (2, 6, 8))),
    "1f1b-zb": Plan((1, 1), ((5, 11), (2, 6, 8))),
    "pipedream": Plan((2,), ((5, 11),)),
    "2bw": Plan((1, 1), ((5, 11), (5, 11))),
    # Virtual stages: two chunks per stage, one of tiny's four layers each.
    "interleaved-1f1b": Plan.gpipe(2, SEQ_LEN),
    "terapipe-interleaved": Plan((1, 1), ((5, 11), (2, 6, 8))),
    "looped-bfs": Plan.gpipe(2, SEQ_LEN),
    "terapipe-bfs": Plan((1, 1), ((5, 11), (2, 6, 8))),
    "zbv": Plan.gpipe(2, SEQ_LEN),
    "terapipe-zbv": Plan((1, 1), ((5, 11), (2, 6, 8))),
}


@pytest.fixture(scope="module")
def other_pools() -> Iterator[Callable[[int], LocalPool]]:
    """``other_pools(world)``: a second pool of ``world`` ranks, other processes with other
    hash seeds and histories than ``pools(world)``'s."""
    made = Pools()
    yield made
    made.close()


def _determinism_config(schedule: str, seed: int = 0) -> RunConfig:
    entry = registered(schedule)
    asynchronous = entry.asynchronous
    return RunConfig(
        model="tiny",
        schedule_name=schedule,
        parallelism=Parallelism(n_stages=2, n_chunks=entry.default_chunks),
        data=Data(batch=DETERMINISM[schedule].batch, seq_len=SEQ_LEN),
        slicing=DETERMINISM[schedule],
        timing=Timing(steps=3, timeout_s=60),
        optim=Optim(grad_clip=0.0 if asynchronous else 1.0),
        seed=seed,
        model_overrides=() if asynchronous else (("dropout", 0.1),),
    )


def _assert_identical(a: RunResult, b: RunResult, what: str) -> None:
    # Python floats, compared exactly: a replicated run's loss is a sum of float32 shares
    # that float32 cannot hold (a float64-vs-float32 tensor comparison failed on it).
    assert a.losses == b.losses, f"{what}: losses {a.losses} != {b.losses}"
    assert a.grad_norms == b.grad_norms, f"{what}: gradient norms"
    for name, tensors in (("gradient", RunResult.grads), ("parameter", RunResult.params)):
        mine, theirs = tensors(a), tensors(b)
        assert mine.keys() == theirs.keys()
        for key, t in mine.items():
            diff = (t - theirs[key]).abs().max().item()
            assert torch.equal(t, theirs[key]), f"{what}: {name} {key} differs by up to {diff:.3e}"


def test_make_test_fast_runs_one_exactness_case_per_registered_schedule() -> None:
    from tests import test_runtime_async, test_runtime_virtual

    fast = [
        str(case.values[0]).split("+")[0]
        for case in [*CASES, *test_runtime_async.CASES]
        if any(m.name == "fast" for m in case.marks)
    ]
    fast += [case[0] for case in test_runtime_virtual.CASES if case[7]]
    assert sorted(fast) == sorted(schedule_names())


def test_determinism_covers_every_registered_schedule() -> None:
    assert set(DETERMINISM) == set(schedule_names())


@pytest.mark.parametrize("schedule", list(DETERMINISM))
def test_same_configuration_and_seed_give_identical_bits(
    pools: Callable[[int], LocalPool], other_pools: Callable[[int], LocalPool], schedule: str
) -> None:
    run = _determinism_config(schedule)
    first = pools(2).run(run, COLLECT)
    # The same processes again (nothing a run leaves behind changes the next), then others.
    _assert_identical(first, pools(2).run(run, COLLECT), "the same pool, run again")
    _assert_identical(first, other_pools(2).run(run, COLLECT), "another pool")
    assert len(first.losses) == 3 and len(set(first.losses)) == 3  # it trains


def test_another_seed_gives_other_bits(pools: Callable[[int], LocalPool]) -> None:
    """The comparison above can fail: a change of seed alone shows up in every parameter."""
    run = _determinism_config("terapipe")
    a, b = pools(2).run(run, COLLECT), pools(2).run(_determinism_config("terapipe", 1), COLLECT)
    assert a.losses != b.losses
    assert all(not torch.equal(p, b.params()[key]) for key, p in a.params().items())


def _bf16_3d_config(seed: int = 0) -> RunConfig:
    """The smallest layout with #Data = 2 and #Op = 2 (K = 1: 4 ranks), in bf16, sliced
    and with dropout: the replicas' gradient all-reduce, the op ranks' all-reduces and
    the vocabulary-parallel loss, all under autocast."""
    return RunConfig(
        model="tiny",
        schedule_name="terapipe",
        parallelism=Parallelism(n_stages=1, n_data=2, n_op=2),
        data=Data(batch=2 * BATCH_PER_REPLICA, seq_len=SEQ_LEN),
        slicing=Plan((1, 1), ((5, 11), (2, 6, 8))),
        precision="bf16",
        timing=Timing(steps=3, timeout_s=60),
        seed=seed,
        model_overrides=(("dropout", 0.1),),
    )


def test_bf16_with_data_and_op_parallelism_gives_identical_bits(
    pools: Callable[[int], LocalPool], other_pools: Callable[[int], LocalPool]
) -> None:
    run = _bf16_3d_config()
    assert (run.parallelism.n_data, run.parallelism.n_op, run.precision) == (2, 2, "bf16")
    first = pools(4).run(run, COLLECT)
    _assert_identical(first, pools(4).run(run, COLLECT), "bf16 #Data=2 #Op=2, the same pool")
    _assert_identical(first, other_pools(4).run(run, COLLECT), "bf16 #Data=2 #Op=2, another pool")
    assert len(first.losses) == 3 and len(set(first.losses)) == 3  # it trains
    # Both replicas end with the same parameters, bit for bit, on each op rank.
    for op_rank in range(run.parallelism.n_op):
        a, b = (
            next(r for r in first.ranks if (r.replica, r.op_rank) == (i, op_rank)) for i in (0, 1)
        )
        assert all(torch.equal(p, b.params[n]) for n, p in a.params.items()), op_rank
    # The comparison can fail: another seed changes every parameter.
    other = pools(4).run(_bf16_3d_config(seed=1), COLLECT)
    assert first.losses != other.losses
    assert all(not torch.equal(p, other.params()[key]) for key, p in first.params().items())
