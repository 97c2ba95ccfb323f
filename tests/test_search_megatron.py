"""A Megatron-style run priced on a cluster: its checks, its FLOP count, the periodic
extrapolation of long pipelines, and how the prediction moves with the run's choices."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tplib.cluster.hardware import CLUSTERS
from tplib.search.megatron import (
    MegatronRun,
    _simulate,
    cost_model,
    narayanan_flops,
    predict,
)

_SMALL = dict(cluster="dgx-a100", layers=8, hidden=512, heads=8, vocab=1024, seq_len=256)


def _run(**changes: object) -> MegatronRun:
    fields: dict[str, object] = dict(_SMALL, gpus=16, tp=2, pp=4, batch=64, microbatch=2)
    fields.update(changes)
    return MegatronRun(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [
        {},  # 1F1B, #Data = 2, 16 microbatches per pipeline
        {"interleave": 2},
        {"schedule": "gpipe", "batch": 72},
        {"recompute": "full", "attention": "fused-softmax", "tp": 1, "gpus": 8, "batch": 56},
        {"sequence_parallel": True, "distributed_optimizer": True, "overlap_grad_reduce": True},
    ],
)
def test_extrapolated_iteration_equals_simulating_every_microbatch(
    changes: dict[str, object],
) -> None:
    run = _run(**changes)
    assert run.microbatches > 2 * run.pp  # the extrapolated path
    p = predict(run)
    assert p.simulated_microbatches == 2 * run.pp
    whole, busy, _ = _simulate(run, run.microbatches, cost_model(run))
    assert p.iteration_s == pytest.approx(whole, rel=1e-9)
    assert p.bubble_fraction == pytest.approx(1 - busy / (whole * run.pp), abs=1e-9)


def test_flop_count_is_the_sum_of_the_models_products() -> None:
    run = _run()
    b, s, h, v, n = run.batch, run.seq_len, run.hidden, run.vocab, run.layers
    # Forward multiply-adds x 2 of each product of a layer: QKV, the scores, scores x V,
    # the output projection, the two MLP products; and the LM head.
    layer = 2 * b * s * (h * 3 * h + s * h + s * h + h * h + h * 4 * h + 4 * h * h)
    head = 2 * b * s * h * v
    forward = n * layer + head
    assert narayanan_flops(run, recompute=False) == pytest.approx(3 * forward)
    assert narayanan_flops(run, recompute=True) == pytest.approx(3 * forward + n * layer)


def test_tflops_and_mfu_divide_the_count_by_time_and_gpus() -> None:
    run = _run(recompute="full", attention="fused-softmax")
    p = predict(run)
    gpu_seconds = p.iteration_s * run.gpus
    assert p.tflops_per_gpu * 1e12 * gpu_seconds == pytest.approx(
        narayanan_flops(run, recompute=True)
    )
    peak = CLUSTERS["dgx-a100"].peak_fp16
    assert p.mfu * peak * gpu_seconds == pytest.approx(narayanan_flops(run, recompute=False))


def test_the_runs_choices_move_the_prediction_the_right_way() -> None:
    base = _run(gpus=64, tp=8, pp=4, batch=64, microbatch=1, recompute="full")  # #Data 2
    full = predict(base)
    assert predict(dataclasses.replace(base, cluster="dgx-h100")).iteration_s < full.iteration_s
    assert predict(dataclasses.replace(base, recompute="selective")).iteration_s < (
        full.iteration_s
    )
    inter = predict(dataclasses.replace(base, interleave=2))
    assert inter.bubble_fraction < full.bubble_fraction
    none = predict(dataclasses.replace(base, recompute="none"))
    assert none.memory_gib > full.memory_gib
    sharded = predict(dataclasses.replace(base, distributed_optimizer=True))
    assert sharded.memory_gib < full.memory_gib
    sp = predict(dataclasses.replace(base, sequence_parallel=True, recompute="selective"))
    selective = predict(dataclasses.replace(base, recompute="selective"))
    assert sp.memory_gib < selective.memory_gib


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        ({"cluster": "dgx-b200"}, "known clusters"),
        ({"gpus": 12, "batch": 48}, "gpus=12 is not whole nodes"),
        ({"tp": 3}, "tp=3 must divide the 8 GPUs of a node"),
        ({"heads": 5, "hidden": 520}, "heads=5 is not divisible by tp=2"),
        ({"layers": 6}, "layers=6 is not divisible by pp x interleave"),
        ({"interleave": 4}, "layers=8 is not divisible by pp x interleave = 4 x 4"),
        ({"batch": 62}, "batch=62 is not divisible by microbatch x #Data = 2 x 2"),
        ({"recompute": "some"}, "recompute='some'"),
        ({"sequence_parallel": True, "tp": 1, "gpus": 8}, "sequence parallelism needs tp > 1"),
        ({"sequence_parallel": True, "seq_len": 255}, "seq_len=255 is not divisible by tp=2"),
        ({"interleave": 2, "schedule": "1f1b"}, "use interleaved-1f1b"),
        ({"interleave": 2, "batch": 40}, "a multiple of pp=4 microbatches"),
        ({"cluster": "p3.16xlarge", "attention": "flash"}, "its GPUs do not run it"),
        ({"schedule": "zbv"}, "schedule='zbv'"),
        ({"cp": 3}, "gpus=16 is not a multiple of tp x cp x pp = 24"),
        ({"cp": 3, "gpus": 48}, "tp x cp = 6 must divide the 8 GPUs of a node"),
        ({"cp": 2, "seq_len": 254}, "seq_len=254 is not divisible by 2 x cp = 4"),
        ({"cp": 2, "attention": "fused-softmax"}, "ring attention over FlashAttention"),
    ],
)
def test_bad_runs_are_refused_naming_the_rule(changes: dict[str, object], rule: str) -> None:
    with pytest.raises(ValueError, match=rule.replace("(", r"\(").replace("+", r"\+")):
        _run(**changes)


def test_memory_fit_follows_the_gpus_capacity() -> None:
    big = _run(layers=16, hidden=8192, heads=64, gpus=8, tp=8, pp=1, batch=4, microbatch=1)
    p = predict(big)
    assert p.capacity_gib == 80
    assert p.fits == (p.memory_gib <= 80)
    assert math.isfinite(p.memory_gib) and p.memory_gib > 0
