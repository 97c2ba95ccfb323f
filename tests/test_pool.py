"""Local process pools and torchrun: failures and hangs fail fast, with the traceback or
with what was awaited; the torchrun entry point writes its results atomically."""

from __future__ import annotations

import os
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


# ---- the torchrun entry point refuses a launch that is not the run's layout ---------------


class _ProcessGroupStarted(Exception):
    """Raised by the stand-in for init_process_group: the checks let the launch through."""


@pytest.fixture()
def no_process_group(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace init_process_group: record the backend asked for, then stop the run."""
    backends: list[str] = []

    def init(backend: str, **kwargs: object) -> None:
        backends.append(backend)
        raise _ProcessGroupStarted(backend)

    monkeypatch.setattr(torch.distributed, "init_process_group", init)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return backends


def _torchrun_main(
    config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: int
) -> None:
    from tplib.runtime.torchrun import main

    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    main(["--config", str(config), "--out", str(tmp_path / "result.pt")])


@pytest.fixture()
def setting9(tmp_path: Path) -> Path:
    """Table 1 row (9): #Data x #Pipe x #Op = 1 x 96 x 4, eight ranks per node."""
    path = tmp_path / "setting9.json"
    save_run_config(RunConfig.for_setting(9, plan="gpipe"), path)
    return path


@pytest.mark.parametrize("world", [1, 96, 383, 768])
def test_torchrun_refuses_a_world_size_that_is_not_the_layout(
    setting9: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_process_group: list[str],
    world: int,
) -> None:
    with pytest.raises(
        ValueError, match=rf"world size {world} is not #Data x #Pipe x #Op = 1 x 96 x 4 = 384"
    ):
        _torchrun_main(setting9, tmp_path, monkeypatch, WORLD_SIZE=world, LOCAL_WORLD_SIZE=8)
    assert no_process_group == [] and not torch.distributed.is_initialized()
    assert not (tmp_path / "result.pt").exists()


@pytest.mark.parametrize("per_node", [1, 4, 16])
def test_torchrun_refuses_other_processes_per_node(
    setting9: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_process_group: list[str],
    per_node: int,
) -> None:
    with pytest.raises(
        ValueError,
        match=rf"torchrun started {per_node} processes per node, but the run's layout puts 8 "
        r"on each \(ranks_per_node\): pass --nproc-per-node 8",
    ):
        _torchrun_main(setting9, tmp_path, monkeypatch, WORLD_SIZE=384, LOCAL_WORLD_SIZE=per_node)
    assert no_process_group == []


@pytest.mark.parametrize(("gpus", "backend", "device"), [(8, "nccl", 5), (1, "gloo", 0)])
def test_torchrun_lets_the_layout_through(
    setting9: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_process_group: list[str],
    gpus: int,
    backend: str,
    device: int,
) -> None:
    """The positive control: the right world and processes per node reach the process
    group, NCCL when every local rank has a GPU, gloo (staged) when they share one; local
    rank 5 takes GPU 5 of 8, or the only one."""
    devices: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    with pytest.raises(_ProcessGroupStarted):
        _torchrun_main(
            setting9, tmp_path, monkeypatch, WORLD_SIZE=384, LOCAL_WORLD_SIZE=8, LOCAL_RANK=5
        )
    assert no_process_group == [backend] and devices == [device]


def test_torchrun_without_ranks_per_node_accepts_any_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_process_group: list[str]
) -> None:
    config = tmp_path / "run.json"
    save_run_config(RunConfig(n_stages=2, n_op=2, batch=2, seq_len=16), config)
    with pytest.raises(_ProcessGroupStarted):
        _torchrun_main(config, tmp_path, monkeypatch, WORLD_SIZE=4, LOCAL_WORLD_SIZE=1)
    assert no_process_group == ["gloo"]
    save_run_config(RunConfig(n_stages=2, n_op=2, batch=2, seq_len=16, ranks_per_node=2), config)
    with pytest.raises(ValueError, match=r"started 4 processes per node, but .* puts 2 on each"):
        _torchrun_main(config, tmp_path, monkeypatch, WORLD_SIZE=4, LOCAL_WORLD_SIZE=4)
    assert no_process_group == ["gloo"]


def test_torchrun_module_fails_on_a_wrong_world_size(tmp_path: Path) -> None:
    """As torchrun starts it: ``python -m tplib.runtime.torchrun`` with WORLD_SIZE set
    (and no rendezvous to reach: a process group would wait, then time out)."""
    config = tmp_path / "run.json"
    save_run_config(RunConfig(n_stages=2, batch=2, seq_len=16, timeout_s=5), config)
    out = tmp_path / "result.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "RANK")}
    env |= {"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tplib.runtime.torchrun",
            "--config",
            str(config),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    assert "world size 3 is not #Data x #Pipe x #Op = 1 x 2 x 1 = 2" in proc.stderr
    assert not out.exists()
