"""Context parallelism (#CP) on gloo processes trains exactly as one device does.

Four ranks each, on one pool: #CP = 4 alone, whole sequences and TeraPipe's token slices
(with full recomputation); #CP = 2 with two pipeline stages (TeraPipe's slices, 1F1B's
split backward with selective recomputation, virtual stages), with #Op = 2 and with
#Data = 2 (the all-reduce, and the distributed optimizer sharded over #Data x #CP). After
one iteration the loss (every CP rank's share summed) and every gradient match the
single-process whole-batch reference, and after 2 AdamW steps (the clipping binding) so
do the parameters, fp32, 1e-5, as in tests/test_runtime.py; every CP rank holds the same
gradients and parameters. The refusals are checked without processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from tplib.plan import Plan
from tplib.runtime import Data, LocalPool, Parallelism, RunConfig, Timing
from tplib.runtime.runfile import run_config_from_dict, run_config_to_dict

from .test_runtime import COLLECT, OPTIM, _check_against_reference

SEQ_LEN = 32
BATCH = 2
WORLD = 4  # every case: one pool


def _config(
    schedule: str,
    plan: Plan | int,
    *,
    cp: int,
    k: int = 1,
    r: int = 1,
    n_op: int = 1,
    v: int = 1,
    sharded: bool = False,
    **kw: str,
) -> RunConfig:
    layout = Parallelism(
        n_stages=k, n_data=r, n_op=n_op, n_cp=cp, n_chunks=v, distributed_optimizer=sharded
    )
    return RunConfig(
        model="tiny",
        schedule_name=schedule,
        parallelism=layout,
        data=Data(batch=BATCH, seq_len=SEQ_LEN),
        slicing=plan,
        timing=Timing(steps=2, timeout_s=60),
        optim=OPTIM,
        **kw,  # type: ignore[arg-type]
    )


# Token slices are multiples of 2 x #CP: 8 with #CP = 4, 4 with #CP = 2.
CASES = [
    pytest.param(_config("terapipe", 1, cp=4), id="cp4-whole"),
    pytest.param(
        _config("terapipe", Plan((1, 1), ((8, 24), (16, 8, 8))), cp=4, recompute="full"),
        id="cp4-sliced-recompute",
    ),
    pytest.param(
        _config("terapipe", Plan((1, 1), ((12, 4, 16), (8, 24))), cp=2, k=2),
        marks=pytest.mark.fast,
        id="cp2-pipe2-sliced",
    ),
    pytest.param(
        _config("1f1b", Plan.uniform(BATCH, SEQ_LEN, n_token_slices=2), cp=2, n_op=2),
        id="cp2-op2-sliced",
    ),
    pytest.param(
        _config(
            "1f1b-zb",
            Plan.uniform(BATCH, SEQ_LEN, n_token_slices=2),
            cp=2,
            k=2,
            recompute="selective",
        ),
        id="cp2-pipe2-zero-bubble-selective",
    ),
    pytest.param(
        _config("terapipe-interleaved", Plan((1, 1), ((12, 4, 16), (8, 24))), cp=2, k=2, v=2),
        id="cp2-pipe2-virtual",
    ),
    pytest.param(_config("gpipe", Plan.gpipe(1, SEQ_LEN), cp=2, r=2), id="cp2-data2"),
    pytest.param(
        _config("terapipe", Plan((1,), ((12, 4, 16),)), cp=2, r=2, sharded=True),
        id="cp2-data2-distributed-optimizer",
    ),
]


@pytest.mark.parametrize("run", CASES)
def test_context_parallel_layouts_match_single_process(
    pools: Callable[[int], LocalPool], run: RunConfig
) -> None:
    assert run.parallelism.world_size == WORLD
    result = pools(WORLD).run(run, COLLECT)
    _check_against_reference(run, result)
    # After the reduction over #Data x #CP every CP rank holds the same gradients and
    # parameters (results keep CP rank 0's).
    for rank in result.ranks:
        twin = next(
            x
            for x in result.ranks
            if (x.replica, x.stage, x.op_rank, x.cp_rank)
            == (rank.replica, rank.stage, rank.op_rank, 0)
        )
        for name, p in rank.params.items():
            assert torch.equal(p, twin.params[name]), (name, rank.rank)
            assert torch.equal(rank.grads[name], twin.grads[name]), (name, rank.rank)
    assert sorted(r.cp_rank for r in result.ranks) == sorted(
        run.parallelism.position(r.rank)[3] for r in result.ranks
    )


def test_ranks_are_laid_out_op_innermost_then_cp_then_stage_then_replica() -> None:
    layout = Parallelism(n_stages=3, n_data=2, n_op=2, n_cp=2)
    assert layout.world_size == 24
    order = [layout.position(rank) for rank in range(24)]
    # (replica, stage, cp rank, op rank) counts up like a number, op the last digit.
    assert [(rep, s, c, o) for rep, s, o, c in order] == sorted(
        (rep, s, c, o) for rep in range(2) for s in range(3) for c in range(2) for o in range(2)
    )
    assert all(layout.rank_of(*order[rank]) == rank for rank in range(24))
    with pytest.raises(ValueError, match=r"world size 12 is not #Data x #Pipe x #CP x #Op = "):
        layout.check_world_size(12)


REFUSED = [
    ({"data": Data(batch=2, seq_len=30)}, r"seq_len of 30 tokens is not divisible by 2\*#CP = 4"),
    (
        {"slicing": Plan((1, 1), ((16, 16), (30, 2)))},
        r"token slice 0 of batch slice 1 .* of 30 tokens .*\(L not divisible by 2\*#CP\)",
    ),
    (
        {"schedule_name": "2bw", "optim": replace(OPTIM, grad_clip=0), "slicing": 1},
        r"n_cp=2 with an asynchronous schedule \(schedule '2bw'\)",
    ),
    ({"model_overrides": (("dropout", 0.1),)}, r"n_cp=2 with dropout=0\.1"),
    ({"parallelism": Parallelism(n_cp=2, n_op=2, sequence_parallel=True)}, "sequence_parallel"),
    ({"device": "cuda", "precision": "bf16"}, r"n_cp=2 with device='cuda'"),
]


@pytest.mark.parametrize(("fields", "match"), REFUSED)
def test_what_context_parallelism_cannot_run_is_refused_before_any_process(
    fields: dict[str, object], match: str
) -> None:
    base: dict[str, object] = {
        "parallelism": Parallelism(n_cp=2),
        "data": Data(batch=2, seq_len=SEQ_LEN),
        "slicing": 2,
        "schedule_name": "terapipe",
    }
    with pytest.raises(ValueError, match=match):
        RunConfig(**(base | fields))  # type: ignore[arg-type]


def test_a_run_file_keeps_n_cp() -> None:
    run = _config("terapipe", 2, cp=2, k=2)
    data = run_config_to_dict(run)
    assert data["parallelism"]["n_cp"] == 2
    assert run_config_from_dict(data) == run
    with pytest.raises(ValueError, match=r"Parallelism.n_cp=0"):
        Parallelism(n_cp=0)
