"""Local pipeline processes: a pool of ranks on this machine, embedded in a notebook.

:func:`launch` starts one local process per rank (rendezvous on 127.0.0.1), runs a
:class:`~tplib.runtime.RunConfig` and returns a :class:`RunResult` with the trace as a
DataFrame. :class:`LocalPool` keeps the processes (and their process group) alive so
several runs of the same world size reuse them; that is how the test suite and the
measured tables stay fast::

    with LocalPool(4) as pool:
        four = Parallelism(n_stages=4)
        a = pool.run(RunConfig(schedule_name="gpipe", parallelism=four, data=Data(batch=4)))
        b = pool.run(RunConfig(parallelism=four, data=Data(batch=4), slicing=4))  # terapipe

A worker that raises fails the whole run at once with that worker's traceback; the other
workers are terminated rather than left waiting. Receives time out after the run's
``timing.timeout_s`` with a message naming the waiting stage and what it waited for.
A worker that dies without a word (SIGKILL, the out-of-memory killer) fails the run
within a second, with what it was doing (its :class:`~tplib.runtime.rank.Progress`) and
what every other rank was doing; a worker whose parent dies exits too. The same worker
runs across nodes under torchrun: :mod:`tplib.runtime.torchrun`.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tplib.runtime.backend import (
    BackendChoice,
    choose_backend,
    gpu_index,
    local_gpus,
    needs_gpu,
)
from tplib.runtime.rank import Progress, rank_label
from tplib.runtime.result import RunResult
from tplib.runtime.runconfig import Hooks, RunConfig
from tplib.runtime.worker import RankResult, run_worker
from tplib.util.machine import threads_per_process

__all__ = ["LocalPool", "WorkerError", "free_port", "launch"]


class WorkerError(RuntimeError):
    """A pipeline process failed; the message carries its traceback."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a local rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# How long a failed run waits for a dead worker to show: a killed worker's peers see its
# connections close (and report that) a moment before the pool sees its exit.
_DEATH_GRACE_S = 1.0


def _exit_with_parent() -> None:
    """Exit as soon as the process that started the pool is gone (killed, say, with the
    notebook kernel that held the pool): nobody is left to send work or read results, and
    the queues would keep this process waiting forever."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()
        os._exit(1)


def _pool_worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    jobs: Any,
    results: Any,
    progress: Progress,
) -> None:
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    gpu: int | None = None  # the GPU this rank made current, once it needs one

    def use_gpu(device: str | None) -> None:
        nonlocal gpu
        if gpu is None and needs_gpu(backend, device):
            gpu = gpu_index(rank, torch.cuda.device_count())
            torch.cuda.set_device(gpu)

    try:
        torch.set_num_threads(threads_per_process(world_size))
        use_gpu(None)  # NCCL binds the group to a GPU as it starts
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        return
    results.put(("ready", rank, None))
    while True:
        job = jobs.get()
        if job is None:
            break
        run, hooks = job
        try:
            use_gpu(run.device)
            torch.set_num_threads(run.timing.threads or threads_per_process(world_size))
            results.put(("ok", rank, run_worker(run, rank, hooks, progress)))
            progress.set(rank, 0, Progress.IDLE)
        except BaseException:
            results.put(("error", rank, traceback.format_exc()))
    # Exit without the interpreter's teardown: destroy_process_group() waits on peers, and
    # torch's teardown of the group takes over a second; nothing is left to send (the pool
    # read every result before it asked the workers to stop).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LocalPool:
    """``world_size`` local processes in one process group, reused across runs."""

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 180.0) -> None:
        """``backend``: the pool's for every run, "gloo" (CPU runs, and CUDA runs staged
        through host memory) or "nccl" (CUDA runs only, one GPU per rank: refused on a
        machine with fewer GPUs than ``world_size``)."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        if backend == "nccl":
            count = torch.cuda.device_count()
            choose_backend("cuda", world_size, local_gpus("cuda", world_size, count), backend)
        else:
            choose_backend("cpu", world_size, asked=backend)  # names a backend that is neither
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self.progress = Progress.shared(ctx, world_size)  # where each worker is
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(
                    rank,
                    world_size,
                    port,
                    backend,
                    timeout_s,
                    self._jobs[rank],
                    self._results,
                    self.progress,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._closed = False
        self._ready: set[int] = set()
        self._run: RunConfig | None = None  # the run in flight

    @property
    def pids(self) -> list[int]:
        """Each rank's process id."""
        return [p.pid or 0 for p in self._procs]

    def _who(self, rank: int) -> str:
        return f"rank {rank}" if self._run is None else rank_label(self._run, rank)

    def _doing(self, rank: int) -> str:
        if self._run is None:
            return "starting" if rank not in self._ready else "waiting for a run"
        return self.progress.describe(self._run, rank)

    def _dead(self) -> list[int]:
        return [r for r, p in enumerate(self._procs) if not p.is_alive()]

    def _fail(self, message: str) -> WorkerError:
        """Stop every worker; the error to raise."""
        self.close(force=True)
        return WorkerError(message)

    def _died(self, dead: list[int], reports: dict[int, str]) -> WorkerError:
        """The error for workers that exited without a result: what each was doing then,
        and what the others were doing (and said) when the run was stopped."""
        lines = []
        for r in dead:
            code = self._procs[r].exitcode
            how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit {code}"
            lines.append(f"{self._who(r)} died ({how}) while {self._doing(r)}")
        alive = [r for r in range(self.world_size) if r not in dead]
        if alive:
            lines.append("The run was stopped; its other ranks:")
        for r in alive:
            said = reports[r].strip().splitlines()[-1] if r in reports else ""
            lines.append(
                f"  {self._who(r)} was {self._doing(r)}" + (f"; it said: {said}" if said else "")
            )
        return self._fail("\n".join(lines))

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every process has started and joined the process group: from then
        on the pool's processes only wait for work (they use no CPU)."""
        wait_s = timeout_s or 120.0 + self.timeout_s
        deadline = time.monotonic() + wait_s
        while len(self._ready) < self.world_size:
            status, rank, payload = self._next(deadline, f"start within {wait_s:.0f} s")
            if status != "ready":
                raise self._fail(f"rank {rank} failed to start:\n{payload}")
            self._ready.add(rank)

    def _next(self, deadline: float, what: str) -> tuple[str, int, Any]:
        """The next message from a worker; WorkerError if one died or time ran out."""
        while True:
            try:
                message: tuple[str, int, Any] = self._results.get(timeout=0.2)
                return message
            except queue.Empty:
                dead = self._dead()
                if dead:
                    raise self._died(dead, {}) from None
                if time.monotonic() > deadline:
                    doing = "".join(
                        f"\n  {self._who(r)} was {self._doing(r)}" for r in range(self.world_size)
                    )
                    raise self._fail(f"the pool's processes did not {what}:{doing}") from None

    def _failed(self, rank: int, payload: str) -> WorkerError:
        """The error for a worker that reported one: its own, unless a worker died (whose
        peers then report a broken connection, not the cause)."""
        reports = {rank: payload}
        deadline = time.monotonic() + _DEATH_GRACE_S
        while not self._dead() and time.monotonic() < deadline:
            try:
                status, other, text = self._results.get(timeout=0.05)
            except queue.Empty:
                continue
            if status == "error":
                reports.setdefault(other, text)
        dead = self._dead()
        if dead:
            return self._died(dead, reports)
        return self._fail(f"{self._who(rank)} failed:\n{payload}")

    def run(self, run: RunConfig, hooks: Hooks = Hooks()) -> RunResult:
        """Run ``run`` on the pool's processes and gather every rank's result."""
        if self._closed:
            raise RuntimeError("this LocalPool is closed (a run failed or close() was called)")
        run.parallelism.check_world_size(self.world_size)
        if run.device != "cuda":  # a CUDA run suits either (the GPUs were checked at start)
            choose_backend(run.device, self.world_size, asked=self.backend)
        self.wait_ready()
        self._run = run
        for q in self._jobs:
            q.put((run, hooks))
        ranks: dict[int, RankResult] = {}
        # A safety net only: every receive already times out on its own after timeout_s.
        budget = 60.0 + max(run.timing.timeout_s, self.timeout_s) * (run.timing.iterations + 2)
        deadline = time.monotonic() + budget
        while len(ranks) < self.world_size:
            status, rank, payload = self._next(deadline, f"finish the run within {budget:.0f} s")
            if status == "error":
                raise self._failed(rank, payload)
            ranks[rank] = payload
        self._run = None
        return RunResult(run, [ranks[r] for r in range(self.world_size)])

    def close(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=2)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():  # deaf to SIGTERM: no process of the pool outlives it
                p.kill()
                p.join()

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


def local_backend(run: RunConfig, asked: str | None = None) -> BackendChoice:
    """The backend of ``run`` on local processes (:mod:`tplib.runtime.backend`): NCCL when
    the run is on CUDA and this machine has a GPU per rank, gloo otherwise (on CPU, or
    several ranks sharing one GPU, their tensors staged through host memory); or
    ``asked``, if it can work."""
    count = torch.cuda.device_count() if run.device == "cuda" else 0  # no CUDA for CPU runs
    gpus = local_gpus(run.device, run.parallelism.world_size, count)
    return choose_backend(run.device, run.parallelism.world_size, gpus, asked)


def launch(run: RunConfig, hooks: Hooks = Hooks(), backend: str | None = None) -> RunResult:
    """Start ``run.parallelism.world_size`` local processes, run, and return the gathered results.
    ``backend``: "nccl" or "gloo" instead of :func:`local_backend`'s choice (refused
    before any process starts if it cannot work)."""
    choice = local_backend(run, backend)
    with LocalPool(
        run.parallelism.world_size, backend=choice.backend, timeout_s=run.timing.timeout_s
    ) as pool:
        return pool.run(run, hooks)
