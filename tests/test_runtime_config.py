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
        "RunConfig(n_stages=2, n_op=2, batch=2, seq_len=16, slicing=4, recompute='full')\n"
        "try:\n"
        "    RunConfig(precision='fp16')\n"
        "except ValueError:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
