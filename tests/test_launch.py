"""Launching: bad input fails before any process starts; failures and hangs fail fast."""

from __future__ import annotations

import time

import pytest

from tplib.launch import LocalPool, WorkerError, launch, run_config_from_dict, run_config_to_dict
from tplib.plan import Plan
from tplib.runtime import RunConfig


def _fails_fast(run: RunConfig, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        launch(run)
    assert time.monotonic() - start < 1.0, "the error must come before processes start"


def test_plan_not_covering_the_batch() -> None:
    _fails_fast(
        RunConfig(n_stages=2, batch=4, seq_len=16, plan=Plan.gpipe(3, 16), schedule="gpipe"),
        r"sum to 3, not the batch size 4",
    )


def test_plan_not_covering_the_sequence() -> None:
    _fails_fast(
        RunConfig(n_stages=2, batch=1, seq_len=16, plan=Plan((1,), ((8, 4),))),
        r"token slices \[8, 4\] sum to 12, not the sequence length 16",
    )


def test_stage_layers_not_covering_the_model() -> None:
    _fails_fast(
        RunConfig(n_stages=2, stage_layers=((0, 2), (2, 3))),
        r"end at layer 3, not at the model's 4",
    )
    _fails_fast(
        RunConfig(n_stages=2, stage_layers=((0, 2), (3, 4))),
        r"stage 1 covers layers \[3, 4\) but must start at layer 2",
    )


def test_unknown_schedule() -> None:
    _fails_fast(RunConfig(schedule="zero-bubble"), r"zero-bubble")


def test_world_size_not_stages_times_replicas() -> None:
    with (
        LocalPool(1) as pool,
        pytest.raises(ValueError, match=r"world size 1 is not n_stages x n_replicas = 2 x 1 = 2"),
    ):
        pool.run(RunConfig(n_stages=2))


def test_bf16_needs_a_gpu() -> None:
    _fails_fast(RunConfig(bf16=True), r"bf16=True needs device='cuda'")


def test_failing_worker_fails_the_run_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(
        WorkerError,
        match=r"(?s)rank 1 \(stage 1, replica 0\) failed.*Traceback.*injected fault on rank 1",
    ):
        launch(RunConfig(n_stages=2, batch=2, seq_len=16, fault="raise:1", timeout_s=60))
    assert time.monotonic() - start < 50, "the run must not wait for the communication timeout"


def test_hanging_peer_times_out_naming_what_was_awaited() -> None:
    with pytest.raises(
        WorkerError,
        match=r"stage 1 \(rank 1\) waited 3 s for the activation from stage 0 of unit b0 t0",
    ):
        launch(RunConfig(n_stages=2, batch=1, seq_len=16, fault="hang:0", timeout_s=3))


def test_run_config_round_trips_through_json() -> None:
    run = RunConfig(
        n_stages=2,
        plan=Plan((1, 1), ((5, 11), (16,))),
        seq_len=16,
        batch=2,
        stage_layers=((0, 1), (1, 4)),
        model_overrides=(("n_layer", 4),),
    )
    assert run_config_from_dict(run_config_to_dict(run)) == run
    with pytest.raises(ValueError, match=r"unknown RunConfig fields \['stagez'\]"):
        run_config_from_dict({"stagez": 2})


def test_torchrun_entry_point_writes_results(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from tplib.launch import save_run_config

    run = RunConfig(n_stages=2, batch=2, seq_len=16, n_slices=2, steps=2, timeout_s=60)
    save_run_config(run, tmp_path / "run.json")
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "result.pt"
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "tplib.launch",
         "--config", str(tmp_path / "run.json"), "--out", str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(out, weights_only=False)
    assert [r.stage for r in saved["ranks"]] == [0, 1]
    assert len(saved["ranks"][1].losses) == 2
    assert not list(tmp_path.glob("*.tmp"))
