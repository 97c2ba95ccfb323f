"""Tests for tplib.nn.lr: the learning-rate schedule is what torch's own schedulers compute
(LinearLR, CosineAnnealingLR and ConstantLR chained by SequentialLR, built here), equals
values worked out by hand from GPT-3's description, and rejects what it cannot mean. The
reference trainer's schedulers (tplib.runtime.reference) agree with the runtime's rates
for whole run configs."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

from tplib.nn.lr import LR_SCHEDULES, LRSchedule
from tplib.runtime import Optim, RunConfig, Timing
from tplib.runtime.reference import torch_lr_scheduler


def _torch_rates(
    peak: float, warmup: int, decay: int | None, ratio: float, n: int, kind: str = "cosine"
) -> list[float]:
    """The rates torch's schedulers give ``n`` optimizer steps, built from their docs:
    LinearLR's factor goes from start_factor at epoch 0 to 1 at total_iters; the
    cosine starts from the optimizer's rate at its milestone; ConstantLR holds ``factor``
    times the initial rate until total_iters (set past the end)."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=peak)
    phases: list[tuple[int, torch.optim.lr_scheduler.LRScheduler]] = []
    if warmup:
        phases.append((0, LinearLR(opt, start_factor=1 / (warmup + 1), total_iters=warmup)))
    if kind == "constant":
        phases.append((warmup, ConstantLR(opt, factor=1.0, total_iters=n + 1)))
    else:
        assert decay is not None
        if decay > warmup:
            phases.append((warmup, CosineAnnealingLR(opt, decay - warmup, eta_min=ratio * peak)))
        phases.append((decay, ConstantLR(opt, factor=ratio, total_iters=n + 1)))
    sched = SequentialLR(opt, [s for _, s in phases], [start for start, _ in phases[1:]])
    rates = []
    for _ in range(n):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


CASES = [
    # (peak, warm-up, decay end, floor ratio, steps)
    (1.0, 2, 6, 0.1, 10),  # GPT-3's shape, the floor reached before the end
    (6e-4, 10, 100, 0.1, 150),  # long: torch's recursive cosine accumulates rounding
    (1e-3, 0, 5, 0.1, 5),  # no warm-up: the cosine from step 0
    (1e-3, 1, 4, 0.0, 8),  # decay to zero
    (1e-3, 3, 3, 0.1, 6),  # no cosine: the floor right after warm-up
    (2.0, 4, 9, 1.0, 12),  # floor = peak: constant after warm-up
    (1e-3, 5, 20, 0.25, 4),  # the run ends inside the warm-up
]


@pytest.mark.parametrize(("peak", "warmup", "decay", "ratio", "n"), CASES)
def test_cosine_is_what_torch_schedulers_compute(
    peak: float, warmup: int, decay: int, ratio: float, n: int
) -> None:
    ours = LRSchedule(peak, warmup_steps=warmup, decay_steps=decay, min_ratio=ratio)
    expected = _torch_rates(peak, warmup, decay, ratio, n)
    for s, want in enumerate(expected):
        assert ours.lr_at(s) == pytest.approx(want, rel=1e-12, abs=0), s


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_constant_is_what_torch_schedulers_compute(warmup: int) -> None:
    ours = LRSchedule(1e-3, kind="constant", warmup_steps=warmup)
    expected = _torch_rates(1e-3, warmup, None, 1.0, 8, kind="constant")
    assert [ours.lr_at(s) for s in range(8)] == pytest.approx(expected, rel=1e-12, abs=0)


def test_values_worked_out_by_hand() -> None:
    # Warm-up over 2 steps: 1/3, 2/3, then the peak at step 2; the cosine over steps
    # [2, 6) covers a quarter turn per step; the floor 0.1 from step 6 on.
    s = LRSchedule(1.0, warmup_steps=2, decay_steps=6, min_ratio=0.1)
    half = math.sqrt(0.5)
    expected = [1 / 3, 2 / 3, 1.0, 0.1 + 0.45 * (1 + half), 0.55, 0.1 + 0.45 * (1 - half)]
    expected += [0.1, 0.1, 0.1]
    assert [s.lr_at(i) for i in range(9)] == pytest.approx(expected, rel=1e-15, abs=1e-16)
    assert LRSchedule(0.5, warmup_steps=0, decay_steps=2, min_ratio=0).lr_at(1) == 0.25
    assert LRSchedule(0.5, warmup_steps=0, decay_steps=2, min_ratio=0).lr_at(2) == 0.0
    assert [LRSchedule(4.0, "constant", warmup_steps=3).lr_at(i) for i in range(5)] == [
        1.0,
        2.0,
        3.0,
        4.0,
        4.0,
    ]
    assert LRSchedule(4.0, "constant").lr_at(0) == 4.0  # no warm-up: the peak at once


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "linear"}, r"kind='linear' is not a learning-rate schedule: choose one of"),
        ({"peak": 0.0}, r"peak=0.0 must be a finite positive"),
        ({"peak": float("nan")}, r"peak=nan must be a finite positive"),
        ({"warmup_steps": -1}, r"warmup_steps=-1 must be an integer >= 0"),
        ({"warmup_steps": 1.5}, r"warmup_steps=1.5 must be an integer >= 0"),
        ({"decay_steps": None}, r"decay_steps=None with kind='cosine'"),
        ({"warmup_steps": 5, "decay_steps": 4}, r"decay_steps=4 must be an integer >= warmup_steps=5"),
        ({"min_ratio": 1.5}, r"min_ratio=1.5 must lie in \[0, 1\]"),
        ({"min_ratio": -0.1}, r"min_ratio=-0.1 must lie in \[0, 1\]"),
        ({"kind": "constant", "decay_steps": 4}, r"decay_steps=4 with kind='constant'"),
    ],
)  # fmt: skip
def test_rejects_what_it_cannot_mean(kwargs: dict[str, object], match: str) -> None:
    options: dict[str, object] = {"peak": 1e-3, "decay_steps": 10} | kwargs
    with pytest.raises(ValueError, match=match):
        LRSchedule(**options)  # type: ignore[arg-type]
    assert LR_SCHEDULES == ("cosine", "constant")


def test_a_negative_step_is_an_error() -> None:
    with pytest.raises(ValueError, match="step -1 is negative"):
        LRSchedule(1.0, decay_steps=3).lr_at(-1)


@pytest.mark.parametrize(
    ("timing", "optim"),
    [
        (Timing(steps=7), Optim()),  # the default: 2 warm-up steps, the cosine over the run
        (Timing(warmup=3, steps=6), Optim()),  # untimed iterations count as steps
        (Timing(steps=8), Optim(lr_decay_steps=5, min_lr_ratio=0.3)),  # decay before the end
        (Timing(steps=1), Optim()),  # the run ends inside the warm-up
        (Timing(steps=4), Optim(lr_warmup_steps=0, lr_schedule_name="constant")),
        (Timing(steps=6), Optim(lr_warmup_steps=3, lr_schedule_name="constant")),
    ],
)
def test_the_reference_schedulers_give_the_runtime_rates(timing: Timing, optim: Optim) -> None:
    run = RunConfig(timing=timing, optim=optim)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=run.optim.lr)
    sched = torch_lr_scheduler(opt, run)
    schedule = run.lr_schedule
    for step in range(run.timing.iterations):
        assert schedule.lr_at(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12), step
        opt.step()
        sched.step()
