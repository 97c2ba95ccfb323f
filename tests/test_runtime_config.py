"""RunConfig: every bad input fails when the config is made, naming the value and the
rule; configs round-trip through JSON for torchrun jobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tplib.plan import Plan
from tplib.runtime import (
    Hooks,
    RunConfig,
    load_run_config,
    run_config_from_dict,
    run_config_to_dict,
    save_run_config,
)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"n_stages": 2, "batch": 4, "seq_len": 16, "slicing": Plan.gpipe(3, 16)}, r"sum to 3, not the batch size 4"),
        ({"n_stages": 2, "seq_len": 16, "slicing": Plan((1,), ((8, 4),))}, r"token slices \[8, 4\] sum to 12, not the sequence length 16"),
        ({"n_stages": 2, "stage_ranges": ((0, 2), (2, 3))}, r"end at layer 3, not at the model's 4"),
        ({"n_stages": 2, "stage_ranges": ((0, 2), (3, 4))}, r"stage 1 covers layers \[3, 4\) but must start at layer 2"),
        ({"n_stages": 3, "stage_ranges": ((0, 2), (2, 4))}, r"give 2 stages for n_stages=3"),
        ({"schedule": "zero-bubble"}, r"unknown schedule 'zero-bubble'"),
        ({"precision": "fp16"}, r"precision 'fp16' needs device='cuda'"),
        ({"precision": "fp8"}, r"unknown precision 'fp8'"),
        ({"recompute": "selective"}, r"recompute='selective' is not a recompute mode"),
        ({"n_op": 3}, r"n_op=3 must divide tiny's 4 attention heads"),
        ({"n_op": 0}, r"RunConfig.n_op=0 must be a positive integer"),
        ({"n_op": 4, "ranks_per_node": 2}, r"n_op=4 with ranks_per_node=2: a stage's #Op ranks must lie on one node"),
        ({"batch": 3, "n_data": 2}, r"batch=3 is not divisible by n_data=2"),
        ({"seq_len": 100}, r"seq_len=100 exceeds the model's context of 64"),
        ({"slicing": 0, "seq_len": 8}, r"slicing=0 token slices per sequence is outside \[1, seq_len=8\]"),
        ({"n_stages": 0}, r"RunConfig.n_stages=0 must be a positive integer"),
        ({"timeout_s": 0}, r"timeout_s=0 must be positive"),
        ({"model": "gpt-5"}, r"unknown model 'gpt-5'"),
        ({"device": "tpu"}, r"device='tpu'"),
        ({"lr": 0.0}, r"RunConfig.lr=0.0 must be a finite positive learning rate"),
        ({"grad_clip": -1.0}, r"RunConfig.grad_clip=-1.0 must be a finite norm >= 0 \(0: no clipping\)"),
        ({"grad_clip": float("inf")}, r"RunConfig.grad_clip=inf must be a finite norm"),
        ({"weight_decay_params": "biases"}, r"weight_decay_params='biases': choose one of \('matrices', 'all'\)"),
        ({"lr_schedule": "linear"}, r"RunConfig.lr_schedule='linear': choose one of \('cosine', 'constant'\)"),
        ({"lr_warmup_steps": -1}, r"RunConfig.lr_warmup_steps=-1 must be an integer >= 0"),
        ({"lr_warmup_steps": 2.5}, r"RunConfig.lr_warmup_steps=2.5 must be an integer >= 0"),
        ({"lr_warmup_steps": 4, "lr_decay_steps": 3}, r"RunConfig.lr_decay_steps=3 must be an integer >= lr_warmup_steps=4"),
        ({"lr_schedule": "constant", "lr_decay_steps": 10}, r"lr_decay_steps=10 with lr_schedule='constant': only the cosine schedule decays"),
        ({"min_lr_ratio": 1.5}, r"RunConfig.min_lr_ratio=1.5 must lie in \[0, 1\]"),
    ],
)  # fmt: skip
def test_bad_input_fails_when_the_config_is_made(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig(**fields)  # type: ignore[arg-type]


def test_derived_values_are_computed_once() -> None:
    run = RunConfig(n_stages=2, n_data=2, batch=4, seq_len=16, slicing=4)
    assert run.pipeline_batch == 2 and run.world_size == 4
    assert run.plan == Plan.uniform(2, 16, n_token_slices=4)
    assert run.ranges == ((0, 2), (2, 4))
    assert run.cfg is run.cfg and run.schedule_data.n_stages == 2


def test_the_optimiser_is_gpt3s_by_default() -> None:
    run = RunConfig()
    assert (run.betas, run.adam_eps, run.weight_decay) == ((0.9, 0.95), 1e-8, 0.1)
    assert (run.weight_decay_params, run.grad_clip) == ("matrices", 1.0)
    assert (run.lr_schedule, run.lr_warmup_steps, run.min_lr_ratio) == ("cosine", 2, 0.1)
    # The cosine ends, by default, at the run's last iteration + 1, untimed ones included.
    schedule = RunConfig(warmup=3, steps=5).lr_schedule_data
    assert (schedule.kind, schedule.warmup_steps, schedule.decay_steps) == ("cosine", 2, 8)
    assert schedule.peak == 1e-3 and schedule.min_ratio == 0.1
    assert RunConfig(steps=5, lr_decay_steps=3).lr_schedule_data.decay_steps == 3
    # A run inside its warm-up needs no decay end of its own.
    assert RunConfig(steps=1, lr_warmup_steps=4).lr_schedule_data.decay_steps == 4
    constant = RunConfig(lr_schedule="constant", lr_warmup_steps=0).lr_schedule_data
    assert constant.decay_steps is None and constant.lr_at(7) == 1e-3
    RunConfig(grad_clip=0)  # no clipping


def test_one_way_to_say_the_slicing() -> None:
    explicit = Plan((1, 1), ((5, 11), (16,)))
    assert RunConfig(batch=2, seq_len=16, slicing=explicit).plan == explicit
    assert RunConfig(batch=2, seq_len=16, slicing=2).plan == Plan((1, 1), ((8, 8), (8, 8)))
    assert RunConfig(batch=2, seq_len=16).plan == Plan.gpipe(2, 16)  # default: one slice
    with pytest.raises(ValueError, match="give a Plan or a number"):
        RunConfig(slicing="[(1, [64])]")  # type: ignore[arg-type]


def test_hooks_are_checked() -> None:
    assert Hooks(fault="hang:3").fault_rank == 3 and Hooks().fault_rank is None
    with pytest.raises(ValueError, match=r"fault='explode:1'"):
        Hooks(fault="explode:1")


def test_run_config_round_trips_through_json(tmp_path: Path) -> None:
    run = RunConfig(
        n_stages=2,
        slicing=Plan((1, 1), ((5, 11), (16,))),
        seq_len=16,
        batch=2,
        stage_ranges=((0, 1), (1, 4)),
        model_overrides=(("n_layer", 4),),
        grad_clip=0.5,
        lr_schedule="cosine",
        lr_warmup_steps=3,
        lr_decay_steps=7,
        min_lr_ratio=0.2,
        weight_decay_params="all",
    )
    assert run_config_from_dict(run_config_to_dict(run)) == run
    save_run_config(run, tmp_path / "run.json")
    assert load_run_config(tmp_path / "run.json") == run
    uniform = RunConfig(batch=2, seq_len=16, slicing=4)
    assert run_config_to_dict(uniform)["slicing"] == 4
    assert run_config_from_dict(run_config_to_dict(uniform)) == uniform
    with pytest.raises(ValueError, match=r"unknown RunConfig fields \['stagez'\]"):
        run_config_from_dict({"stagez": 2})


def test_a_run_config_is_checked_without_torch() -> None:
    """Configs are made and checked on a login node: that must not load torch."""
    code = (
        "import sys\n"
        "from tplib.runtime import RunConfig\n"
        "RunConfig(n_stages=2, n_op=2, batch=2, seq_len=16, slicing=4, recompute='full')"
        ".lr_schedule_data.lr_at(3)\n"
        "try:\n"
        "    RunConfig(precision='fp16')\n"
        "except ValueError:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
