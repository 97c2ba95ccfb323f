"""Packed documents through the runtime: every synchronous schedule, #Op = 2 and
#Data = 2, recomputation and per-batch plans, exact against each document run alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tplib.plan import Plan
from tplib.runtime import Data, LocalPool, Parallelism, RunConfig, Timing
from tplib.schedule import registered, schedule_names

from .test_runtime import COLLECT, OPTIM, _check_against_reference

L = 32  # the tiny model's context; log-normal documents of median L / 8 = 4 tokens
SYNCHRONOUS = [n for n in schedule_names() if not registered(n).asynchronous]
# Two rows as two batch slices; token slices that cut documents, unevenly.
CUT = Plan((1, 1), ((7, 9, 16), (12, 20)))
WHOLE = Plan((1, 1), ((L,), (L,)))


def _packed(schedule: str, plan: Plan, *, k: int = 2, r: int = 1, **fields: Any) -> RunConfig:
    reg = registered(schedule)
    v = max(reg.min_chunks, 2 if reg.max_chunks is None else reg.max_chunks)
    return RunConfig(
        model="tiny",
        schedule_name=schedule,
        parallelism=Parallelism(
            n_stages=k, n_data=r, n_chunks=v if k > 1 else 1, n_op=fields.pop("n_op", 1)
        ),
        data=Data(batch=2 * r, seq_len=L, source="lognormal-documents"),
        slicing=plan if reg.token_slices else WHOLE,
        timing=Timing(steps=2, timeout_s=60),
        **{"optim": OPTIM, **fields},
    )


@pytest.mark.parametrize("schedule", SYNCHRONOUS)
def test_every_synchronous_schedule_matches_documents_run_alone(
    pools: Callable[[int], LocalPool], schedule: str
) -> None:
    run = _packed(schedule, CUT)
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_op_and_data_parallel_packed_rows_with_recomputation(
    pools: Callable[[int], LocalPool], recompute: str
) -> None:
    run = _packed("terapipe", CUT, r=2, n_op=2, recompute=recompute)
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


def test_packed_rows_with_dropout_match_the_whole_rows(pools: Callable[[int], LocalPool]) -> None:
    """Dropout is keyed by the rows' positions: the reference is the packed rows whole."""
    run = _packed("1f1b", CUT, model_overrides=(("dropout", 0.1),))
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


def test_per_batch_plans_match_documents_run_alone(pools: Callable[[int], LocalPool]) -> None:
    """Each iteration its own token slicing (one cutting documents, one whole)."""
    plans = (CUT, Plan((1, 1), ((3, 29), (16, 8, 8))))
    run = _packed("1f1b", CUT, batch_plans=plans)
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


def test_packing_without_document_masking_matches_its_own_reference(
    pools: Callable[[int], LocalPool],
) -> None:
    """Scheme (b): rows attend across documents; exact against the rows run whole."""
    run = _packed("terapipe", CUT)
    run = RunConfig(**{**_fields(run), "data": Data(batch=2, seq_len=L,
                    source="lognormal-documents", document_masking=False)})  # fmt: skip
    _check_against_reference(run, pools(run.parallelism.world_size).run(run, COLLECT))


def _fields(run: RunConfig) -> dict[str, Any]:
    names = ("model", "schedule_name", "parallelism", "slicing", "timing", "optim")
    return {n: getattr(run, n) for n in names}


def test_bad_packed_runs_are_refused_before_they_start() -> None:
    with pytest.raises(ValueError, match="synchronous schedules"):
        _packed("2bw", CUT, optim=OPTIM.__class__(grad_clip=0.0))
    with pytest.raises(ValueError, match="one plan per iteration"):
        _packed("terapipe", CUT, batch_plans=(CUT,))
    with pytest.raises(ValueError, match="keeps the run's batch split"):
        _packed("terapipe", CUT, batch_plans=(CUT, Plan((2,), ((16, 16),))))
    with pytest.raises(ValueError, match=r"Data\.packing='best'"):
        Data(source="corpus-documents", packing="best")
