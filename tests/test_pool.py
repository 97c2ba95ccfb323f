"""Local process pools and torchrun: failures and hangs fail fast, with the traceback or
with what was awaited; the torchrun entry point writes its results atomically."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tplib.runtime import Hooks, LocalPool, RunConfig, WorkerError, launch, save_run_config


def test_world_size_not_the_layout() -> None:
    with (
        LocalPool(1) as pool,
        pytest.raises(ValueError, match=r"world size 1 is not #Data x #Pipe x #Op = 1 x 2 x 1 = 2"),
    ):
        pool.run(RunConfig(n_stages=2))


def test_failing_worker_fails_the_run_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(
        WorkerError,
        match=r"(?s)rank 1 \(stage 1, replica 0\) failed.*Traceback.*injected fault on rank 1",
    ):
        launch(RunConfig(n_stages=2, batch=2, seq_len=16, timeout_s=60), Hooks(fault="raise:1"))
    assert time.monotonic() - start < 50, "the run must not wait for the communication timeout"


def test_hanging_peer_times_out_naming_what_was_awaited() -> None:
    with pytest.raises(
        WorkerError,
        match=r"stage 1 \(rank 1\) waited 3 s for the activation from stage 0 \(rank 0\) of unit b0 t0",
    ):
        launch(RunConfig(n_stages=2, batch=1, seq_len=16, timeout_s=3), Hooks(fault="hang:0"))


def test_torchrun_entry_point_writes_results(tmp_path: Path) -> None:
    run = RunConfig(n_stages=2, batch=2, seq_len=16, slicing=2, steps=2, timeout_s=60)
    save_run_config(run, tmp_path / "run.json")
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "result.pt"
    proc = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "tplib.runtime.torchrun",
            "--config",
            str(tmp_path / "run.json"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(out, weights_only=False)
    assert [r.stage for r in saved["ranks"]] == [0, 1]
    assert len(saved["ranks"][1].losses) == 2
    assert saved["config"]["slicing"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.pt", "run.json"]


def test_a_pool_is_ready_once_every_process_joined_the_group() -> None:
    with LocalPool(2, timeout_s=60) as pool:
        pool.wait_ready()
        assert pool._ready == {0, 1}
        pool.wait_ready()  # idempotent
        result = pool.run(RunConfig(n_stages=2, batch=1, seq_len=16, timeout_s=60))
        assert len(result.losses) == 1
