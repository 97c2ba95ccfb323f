"""Local process pools and torchrun: failures and hangs fail fast, with the traceback or
with what was awaited; a worker killed mid-iteration fails the run at once, naming what it
was doing (under torchrun, from the progress each rank publishes to the agents' store),
and leaves no process and no result file behind; pool workers do not outlive their
parent; the torchrun entry point writes its results atomically. The backend: chosen by
the rule or asked for, refused before any process starts when it cannot work, and no
rank makes a GPU current unless it uses CUDA."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import tplib.runtime.pool
from tplib.runs.settings import setting_run
from tplib.runtime import (
    Data,
    Hooks,
    LocalPool,
    Parallelism,
    RunConfig,
    Timing,
    WorkerError,
    launch,
    save_run_config,
)
from tplib.runtime.backend import BackendError
from tplib.runtime.heartbeat import Beat
from tplib.runtime.rank import Progress

# psutil (which ipykernel requires) ships no type information: its objects are Any here.
psutil: Any = importlib.import_module("psutil")


def _standalone_torchrun(config: Path, out: Path) -> list[str]:
    """The torchrun line of a 2-process run on this machine of ``config`` into ``out``."""
    torchrun = Path(sys.executable).with_name("torchrun")
    module = ["tplib.runtime.torchrun", "--config", str(config), "--out", str(out)]
    return [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", *module]


def test_world_size_not_the_layout() -> None:
    with (
        LocalPool(1) as pool,
        pytest.raises(ValueError, match=r"world size 1 is not #Data x #Pipe x #Op = 1 x 2 x 1 = 2"),
    ):
        pool.run(RunConfig(parallelism=Parallelism(n_stages=2)))


def test_failing_worker_fails_the_run_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(
        WorkerError,
        match=r"(?s)rank 1 \(stage 1, replica 0\) failed.*Traceback.*injected fault on rank 1",
    ):
        launch(
            RunConfig(
                parallelism=Parallelism(n_stages=2),
                data=Data(batch=2, seq_len=16),
                timing=Timing(timeout_s=60),
            ),
            Hooks(fault="raise:1"),
        )
    assert time.monotonic() - start < 50, "the run must not wait for the communication timeout"


def test_hanging_peer_times_out_naming_what_was_awaited() -> None:
    with pytest.raises(
        WorkerError,
        match=r"stage 1 \(rank 1\) waited 3 s for the activation from stage 0 \(rank 0\) of unit b0 t0",
    ):
        launch(
            RunConfig(
                parallelism=Parallelism(n_stages=2),
                data=Data(batch=1, seq_len=16),
                timing=Timing(timeout_s=3),
            ),
            Hooks(fault="hang:0"),
        )


def test_torchrun_entry_point_writes_results(tmp_path: Path) -> None:
    run = RunConfig(
        parallelism=Parallelism(n_stages=2),
        data=Data(batch=2, seq_len=16),
        slicing=2,
        timing=Timing(steps=2, timeout_s=60),
    )
    save_run_config(run, tmp_path / "run.json")
    out = tmp_path / "result.pt"
    proc = subprocess.run(
        _standalone_torchrun(tmp_path / "run.json", out),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend gloo: 2 ranks on CPU; NCCL moves GPU tensors only\n" in proc.stdout
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
        result = pool.run(
            RunConfig(
                parallelism=Parallelism(n_stages=2),
                data=Data(batch=1, seq_len=16),
                timing=Timing(timeout_s=60),
            )
        )
        assert len(result.losses) == 1


# ---- backend and device: a rank touches CUDA only when it will use it ----------------------


class _Exited(Exception):
    """Raised by the stand-in for os._exit: the pool worker left its loop."""


@pytest.mark.parametrize(
    ("backend", "devices", "made_current"),
    [
        # A gloo pool: nothing before a CUDA run, then rank 4 % 3 GPUs, once.
        ("gloo", ["cpu", "cpu"], [[], []]),
        ("gloo", ["cpu", "cuda", "cuda", "cpu"], [[], [1], [1], [1]]),
        # NCCL binds its group to the GPU as the pool starts.
        ("nccl", ["cuda", "cuda"], [[1], [1]]),
    ],
)
def test_a_pool_worker_makes_a_gpu_current_only_for_cuda(
    monkeypatch: pytest.MonkeyPatch, backend: str, devices: list[str], made_current: list[list[int]]
) -> None:
    """The worker itself, in this process: its process group, its runs and its exit
    replaced, rank 4 of a pool on a machine with 3 GPUs. A CPU run on a GPU node used to
    make GPU 0 current (a CUDA context and its memory on every rank)."""
    current: list[int] = []
    seen: list[list[int]] = []  # the GPUs made current by the time each run started
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: None)

    def run_worker(run: RunConfig, rank: int, hooks: Hooks, progress: Any) -> str:
        seen.append(list(current))
        return run.device

    def exit_(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(tplib.runtime.pool, "run_worker", run_worker)
    monkeypatch.setattr(os, "_exit", exit_)
    jobs: queue.Queue[Any] = queue.Queue()
    results: queue.Queue[Any] = queue.Queue()
    for device in devices:
        jobs.put((RunConfig(parallelism=Parallelism(n_stages=2), device=device), Hooks()))
    jobs.put(None)
    with pytest.raises(_Exited):
        tplib.runtime.pool._pool_worker(4, 8, 0, backend, 60.0, jobs, results, Progress.local(8))
    assert seen == made_current
    replies = [results.get_nowait() for _ in range(len(devices) + 1)]
    assert replies == [("ready", 4, None)] + [("ok", 4, d) for d in devices]


def test_nccl_is_refused_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(BackendError, match=r"backend 'nccl' for a run on device 'cpu'"):
        launch(
            RunConfig(parallelism=Parallelism(n_stages=2), data=Data(batch=2, seq_len=16)),
            backend="nccl",
        )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        BackendError, match=r"backend 'nccl' with ranks 0, 1 share GPU cuda:0: NCCL refuses"
    ):
        LocalPool(2, backend="nccl")
    with pytest.raises(BackendError, match=r"backend='mpi': choose 'nccl' or 'gloo'"):
        LocalPool(2, backend="mpi")
    assert set(multiprocessing.active_children()) == before


def test_launch_takes_the_backend_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """What launch hands the pool: its own choice, or the one asked for (the pool here
    records it and runs nothing)."""
    backends: list[str] = []

    class Recorded:
        def __init__(self, world_size: int, *, backend: str, timeout_s: float) -> None:
            backends.append(backend)

        def __enter__(self) -> Recorded:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def run(self, run: RunConfig, hooks: Hooks) -> None:
            pass

    monkeypatch.setattr(tplib.runtime.pool, "LocalPool", Recorded)
    cuda = RunConfig(
        parallelism=Parallelism(n_stages=2), data=Data(batch=2, seq_len=16), device="cuda"
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launch(cuda)
    launch(cuda, backend="gloo")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    launch(cuda)
    assert backends == ["nccl", "gloo", "gloo"]


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
    config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str, **env: int
) -> None:
    from tplib.runtime.torchrun import main

    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    main(["--config", str(config), "--out", str(tmp_path / "result.pt"), *args])


@pytest.fixture()
def setting9(tmp_path: Path) -> Path:
    """Table 1 row (9): #Data x #Pipe x #Op = 1 x 96 x 4, eight ranks per node."""
    path = tmp_path / "setting9.json"
    save_run_config(setting_run(9, plan="gpipe"), path)
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
    save_run_config(
        RunConfig(parallelism=Parallelism(n_stages=2, n_op=2), data=Data(batch=2, seq_len=16)),
        config,
    )
    with pytest.raises(_ProcessGroupStarted):
        _torchrun_main(config, tmp_path, monkeypatch, WORLD_SIZE=4, LOCAL_WORLD_SIZE=1)
    assert no_process_group == ["gloo"]
    save_run_config(
        RunConfig(
            parallelism=Parallelism(n_stages=2, n_op=2, ranks_per_node=2),
            data=Data(batch=2, seq_len=16),
        ),
        config,
    )
    with pytest.raises(ValueError, match=r"started 4 processes per node, but .* puts 2 on each"):
        _torchrun_main(config, tmp_path, monkeypatch, WORLD_SIZE=4, LOCAL_WORLD_SIZE=4)
    assert no_process_group == ["gloo"]


def test_torchrun_takes_the_backend_asked_for(
    setting9: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_process_group: list[str]
) -> None:
    """Without torchrun's agents' store (no GPU UUIDs to compare) each process is taken to
    see every GPU of its node: 8 GPUs for 8 ranks a node are NCCL's, unless gloo is asked
    for; 1 GPU for 8 ranks is gloo's, and NCCL is refused before the process group."""
    monkeypatch.setattr(torch.cuda, "set_device", lambda gpu: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    env = {"WORLD_SIZE": 384, "LOCAL_WORLD_SIZE": 8, "LOCAL_RANK": 5}
    with pytest.raises(_ProcessGroupStarted):
        _torchrun_main(setting9, tmp_path, monkeypatch, "--backend", "gloo", **env)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        BackendError,
        match=r"backend 'nccl' with ranks 0, 1, 2, 3 and 4 more share GPU cuda:0 of node 0 "
        r"\(384 ranks on 48 shared GPUs\): NCCL refuses two ranks of a communicator on one GPU",
    ):
        _torchrun_main(setting9, tmp_path, monkeypatch, "--backend", "nccl", **env)
    assert no_process_group == ["gloo"]


def test_torchrun_cpu_run_touches_no_gpu(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_process_group: list[str],
    capfd: pytest.CaptureFixture[str],
) -> None:
    def touched(*args: object) -> None:
        raise AssertionError("a CPU run touched CUDA")

    for name in ("device_count", "set_device", "get_device_properties", "is_available"):
        monkeypatch.setattr(torch.cuda, name, touched)
    config = tmp_path / "run.json"
    save_run_config(
        RunConfig(parallelism=Parallelism(n_stages=2, n_op=2), data=Data(batch=2, seq_len=16)),
        config,
    )
    with pytest.raises(_ProcessGroupStarted):
        _torchrun_main(config, tmp_path, monkeypatch, WORLD_SIZE=4)
    # Rank 0 says which backend and why, in one line, before the process group starts.
    assert capfd.readouterr().out == "backend gloo: 4 ranks on CPU; NCCL moves GPU tensors only\n"
    with pytest.raises(BackendError, match=r"backend 'nccl' for a run on device 'cpu'"):
        _torchrun_main(config, tmp_path, monkeypatch, "--backend", "nccl", WORLD_SIZE=4)
    assert no_process_group == ["gloo"]


def test_torchrun_module_fails_on_a_wrong_world_size(tmp_path: Path) -> None:
    """As torchrun starts it: ``python -m tplib.runtime.torchrun`` with WORLD_SIZE set
    (and no rendezvous to reach: a process group would wait, then time out)."""
    config = tmp_path / "run.json"
    save_run_config(
        RunConfig(
            parallelism=Parallelism(n_stages=2),
            data=Data(batch=2, seq_len=16),
            timing=Timing(timeout_s=5),
        ),
        config,
    )
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


# ---- a worker killed without a word (SIGKILL, the out-of-memory killer) -------------------

# Long enough to be killed in the middle: 20 iterations of 130 actions a stage.
LONG = RunConfig(
    parallelism=Parallelism(n_stages=2),
    data=Data(batch=2, seq_len=64),
    slicing=16,
    timing=Timing(steps=20, timeout_s=5),
)


def _alive(pids: list[int]) -> list[int]:
    """The processes among ``pids`` still running (a zombie has ended)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Poll until none of ``pids`` runs or ``timeout_s`` passed; those still running."""
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(pids)


@dataclass
class Killer:
    """SIGKILLs ``rank`` of the pool ``find`` returns once it runs an action in the middle
    of its stage's list in iteration ``iteration`` or later (a thread of its own, so the
    run can be in flight in this one)."""

    find: Callable[[], LocalPool | None]
    rank: int
    iteration: int
    killed_at: float = 0.0
    pids: list[int] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._kill, daemon=True)
        self._thread.start()

    def _kill(self) -> None:
        try:
            deadline = time.monotonic() + 120
            while (pool := self.find()) is None or not pool.pids[self.rank]:
                assert time.monotonic() < deadline, "no pool started"
                time.sleep(0.01)
            n = len(LONG.schedule.actions[LONG.parallelism.position(self.rank)[1]])
            while True:
                iteration, position = pool.progress.where(self.rank)
                if iteration >= self.iteration and n // 4 <= position < 3 * n // 4:
                    break
                assert time.monotonic() < deadline, f"rank {self.rank} never got there"
                time.sleep(0.002)
            self.pids = pool.pids
            os.kill(self.pids[self.rank], signal.SIGKILL)
            self.killed_at = time.monotonic()
        except BaseException as exc:  # reported by join(): a thread's error is otherwise lost
            self.error = exc

    def join(self) -> None:
        self._thread.join(timeout=10)
        assert self.error is None, self.error
        assert self.killed_at, "the worker was not killed"


def _check_killed_run(err: WorkerError, killer: Killer, pool: LocalPool) -> None:
    took = time.monotonic() - killer.killed_at
    assert took < LONG.timing.timeout_s, f"the run took {took:.1f} s to fail"
    message = str(err)
    # What the dead rank was doing is what its progress said last: an action mid-list.
    doing = pool.progress.describe(LONG, 1)
    assert message.startswith(f"rank 1 (stage 1, replica 0) died (killed by SIGKILL) while {doing}")
    match = re.search(
        r"(running|waiting for) .*action (\d+) of 130 on stage 1, iteration (\d+) of 20", doing
    )
    assert match and 3 <= int(match[3]) < 20, doing
    assert "\nThe run was stopped; its other ranks:\n  rank 0 (stage 0, replica 0) was " in message
    assert _wait_gone(killer.pids, 5) == [], "a process of the run outlived it"
    assert not set(killer.pids) & {p.pid for p in multiprocessing.active_children()}


def test_a_worker_killed_mid_iteration_fails_the_run_naming_what_it_was_doing() -> None:
    pool = LocalPool(2, timeout_s=LONG.timing.timeout_s)
    killer = Killer(lambda: pool, rank=1, iteration=2)
    with pytest.raises(WorkerError) as err:
        pool.run(LONG)
    killer.join()
    _check_killed_run(err.value, killer, pool)
    with pytest.raises(RuntimeError, match="this LocalPool is closed"):
        pool.run(LONG)


def test_a_worker_killed_under_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[LocalPool] = []

    class Recorded(LocalPool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(tplib.runtime.pool, "LocalPool", Recorded)
    killer = Killer(lambda: started[0] if started else None, rank=1, iteration=2)
    with pytest.raises(WorkerError) as err:
        launch(LONG)
    killer.join()
    _check_killed_run(err.value, killer, started[0])


_HOLD_A_POOL = """
import sys
from tplib.runtime import LocalPool
pool = LocalPool(2, timeout_s=5)
pool.wait_ready()
print(*pool.pids, flush=True)
sys.stdin.read()
"""


def test_workers_exit_when_the_process_that_started_them_is_killed() -> None:
    """As when a notebook kernel holding a pool is killed: nothing would ever send the
    workers work again, nor stop them."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_A_POOL],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        pids = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(pids) == 2 and _alive(pids) == pids
    finally:
        proc.kill()
        proc.wait()
    left = _wait_gone(pids, 10)
    for pid in left:  # do not leave them behind for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert left == [], "pool workers outlived their parent"


def test_torchrun_with_a_killed_worker_fails_naming_what_it_was_doing(tmp_path: Path) -> None:
    """Rank 1 is killed mid-iteration (its progress, read from the agents' store, says
    where); rank 0's receive breaks, and its error names rank 1 and the action it last
    reported. No result file is left behind."""
    save_run_config(LONG, tmp_path / "run.json")
    out = tmp_path / "result.pt"
    proc = subprocess.Popen(
        _standalone_torchrun(tmp_path / "run.json", out),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    agent = psutil.Process(proc.pid)
    try:
        workers = _connected_workers(agent, 120)
        seen = _reported_mid_iteration(workers[1], rank=1, iteration=2)
        workers[1].kill()
        killed_at = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - killed_at
    assert proc.returncode != 0 and took < LONG.timing.timeout_s, took
    # torchrun's agent names the killed rank (SIGKILL leaves it no word of its own) ...
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9", stderr), stderr[-3000:]
    # ... and rank 0 what it was doing: its last report, no earlier than the test saw.
    match = re.search(
        r"RankLostError: rank 1 \(stage 1, replica 0\) on node 0 stopped reporting \(it exited, "
        r"was killed or froze\) while (running|waiting for) .*, action (\d+) of 130 on stage 1, "
        r"iteration (\d+) of 20\n.*rank 0 \(stage 0, replica 0\), which reports this, was ",
        stderr,
    )
    assert match, stderr[-3000:]
    assert (int(match[3]), int(match[2])) >= (seen.iteration + 1, seen.position + 1), seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # no result, no temp
    assert _wait_gone([w.pid for w in workers], 5) == []


def _reported_mid_iteration(worker: Any, rank: int, iteration: int) -> Beat:
    """Wait until ``worker`` (``rank`` of LONG under torchrun) has reported an action in
    the middle of its stage's list in ``iteration`` or later, in the agents' store."""
    env = worker.environ()
    store = torch.distributed.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    key = f"tplib/progress/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"
    n = len(LONG.schedule.actions[LONG.parallelism.position(rank)[1]])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if store.check([key]):
            beat = Beat.decode(store.get(key))
            if beat.iteration >= iteration and n // 4 <= beat.position < 3 * n // 4:
                return beat
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} never reported the middle of iteration {iteration}")


def _connected_workers(agent: Any, timeout_s: float) -> list[Any]:
    """torchrun's two workers, once they have joined their process group (gloo connects
    every pair of ranks as the group starts; training follows within milliseconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = agent.children()
        with contextlib.suppress(psutil.NoSuchProcess):
            if len(workers) == 2:
                ends = [{(c.laddr, c.raddr) for c in w.net_connections("tcp")} for w in workers]
                if any((raddr, laddr) in ends[1] for laddr, raddr in ends[0] if raddr):
                    return sorted(workers, key=lambda w: int(w.environ()["LOCAL_RANK"]))
        time.sleep(0.05)
    raise AssertionError("torchrun's workers never connected")
