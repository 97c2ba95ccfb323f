"""Starting pipeline processes: embedded in a notebook, or under torchrun across nodes.

**Embedded (default).** :func:`launch` starts one local process per rank (rendezvous on
127.0.0.1), runs a :class:`~tplib.runtime.RunConfig` and returns a :class:`RunResult`
with the trace as a DataFrame. :class:`LocalPool` keeps the processes (and their process
group) alive so several runs of the same world size reuse them; that is how the test
suite stays fast::

    with LocalPool(4) as pool:
        a = pool.run(RunConfig(schedule="gpipe", n_stages=4, batch=4))
        b = pool.run(RunConfig(schedule="terapipe", n_stages=4, batch=4, n_slices=4))

A worker that raises fails the whole run at once with that worker's traceback; the other
workers are terminated rather than left waiting. Receives time out after
``RunConfig.timeout_s`` with a message naming the waiting stage and what it waited for.

**Several nodes.** The same worker runs under torchrun; rank 0 writes the results::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m tplib.launch --config run.json --out result.pt

``run.json`` holds the RunConfig fields (:meth:`RunConfig` as written by
:func:`save_run_config`); ``device`` should be ``"cuda"`` (NCCL) on GPU nodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tplib.plan import Plan
from tplib.runtime import TRACE_COLUMNS, RankResult, RunConfig, run_worker

__all__ = [
    "LocalPool",
    "RunResult",
    "WorkerError",
    "launch",
    "load_run_config",
    "measure_link",
    "run_config_from_dict",
    "run_config_to_dict",
    "save_run_config",
]


class WorkerError(RuntimeError):
    """A pipeline process failed; the message carries its traceback."""


@dataclass
class RunResult:
    """Results of a run, gathered from every rank."""

    config: RunConfig
    ranks: list[RankResult]

    @property
    def trace(self) -> pd.DataFrame:
        """Every traced action: rank, stage, replica, iteration, kind, b, t, start, end (s)."""
        rows = [row for r in self.ranks for row in r.trace]
        return pd.DataFrame(rows, columns=list(TRACE_COLUMNS))

    @property
    def losses(self) -> list[float]:
        """The global mean loss of each timed iteration (summed over replicas' shares)."""
        last = [r for r in self.ranks if r.stage == self.config.n_stages - 1]
        return [sum(vals) for vals in zip(*(r.losses for r in last), strict=True)]

    @property
    def iteration_s(self) -> list[float]:
        """Wall time of each timed iteration (the slowest rank's, barrier to barrier)."""
        return [max(vals) for vals in zip(*(r.iteration_s for r in self.ranks), strict=True)]

    @property
    def median_latency_s(self) -> float:
        return statistics.median(self.iteration_s)

    def grads(self, replica: int = 0) -> dict[tuple[int, str], torch.Tensor]:
        """First-iteration gradients, keyed by (stage, parameter name)."""
        return {
            (r.stage, n): g for r in self.ranks if r.replica == replica for n, g in r.grads.items()
        }

    def params(self, replica: int = 0) -> dict[tuple[int, str], torch.Tensor]:
        """Parameters after the last step, keyed by (stage, parameter name)."""
        return {
            (r.stage, n): p for r in self.ranks if r.replica == replica for n, p in r.params.items()
        }


# ---- RunConfig <-> JSON (for torchrun and batch jobs) ------------------------------------


def run_config_to_dict(run: RunConfig) -> dict[str, Any]:
    out = dataclasses.asdict(run)
    out["plan"] = None if run.plan is None else run.plan.to_paper()
    out["model_overrides"] = dict(run.model_overrides)
    return out


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown RunConfig fields {unknown}: known fields are {sorted(known)}")
    data = dict(data)
    if data.get("plan") is not None:
        data["plan"] = Plan.from_paper(data["plan"])
    if data.get("stage_layers") is not None:
        data["stage_layers"] = tuple(tuple(x) for x in data["stage_layers"])
    if "betas" in data:
        data["betas"] = tuple(data["betas"])
    data["model_overrides"] = tuple(sorted(dict(data.get("model_overrides") or {}).items()))
    return RunConfig(**data)


def save_run_config(run: RunConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(run_config_to_dict(run), indent=2))


def load_run_config(path: str | Path) -> RunConfig:
    return run_config_from_dict(json.loads(Path(path).read_text()))


# ---- embedded launch ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_process(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _pool_worker(
    rank: int, world_size: int, port: int, backend: str, timeout_s: float, jobs: Any, results: Any
) -> None:
    try:
        torch.set_num_threads(_threads_per_process(world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
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
    while True:
        run = jobs.get()
        if run is None:
            break
        try:
            if run.threads:
                torch.set_num_threads(run.threads)
            results.put(("ok", rank, run_worker(run, rank)))
        except BaseException:
            results.put(("error", rank, traceback.format_exc()))
    # No destroy_process_group(): it waits on peers, and the process is exiting anyway.


class LocalPool:
    """``world_size`` local processes in one process group, reused across runs."""

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 180.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: choose 'gloo' (CPU) or 'nccl' (GPU)")
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(rank, world_size, port, backend, timeout_s, self._jobs[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._closed = False

    def run(self, run: RunConfig) -> RunResult:
        """Run ``run`` on the pool's processes and gather every rank's result."""
        if self._closed:
            raise RuntimeError("this LocalPool is closed (a run failed or close() was called)")
        run.validate()  # every input error surfaces here, before any process works
        if run.world_size != self.world_size:
            raise ValueError(
                f"world size {self.world_size} is not n_stages x n_replicas = "
                f"{run.n_stages} x {run.n_replicas} = {run.world_size}"
            )
        if (run.device == "cuda") != (self.backend == "nccl"):
            raise ValueError(f"device={run.device!r} does not match backend={self.backend!r}")
        for q in self._jobs:
            q.put(run)
        ranks: dict[int, RankResult] = {}
        # A safety net only: every receive already times out on its own after timeout_s.
        # The margin covers process start-up, which a fresh pool is still doing.
        budget = 120.0 + max(run.timeout_s, self.timeout_s) * (run.steps + run.warmup + 2)
        deadline = time.monotonic() + budget
        while len(ranks) < self.world_size:
            try:
                status, rank, payload = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.close(force=True)
                    raise WorkerError(f"worker processes exited without a result: {dead}") from None
                if time.monotonic() > deadline:
                    self.close(force=True)
                    raise WorkerError(f"run did not finish within {budget:.0f} s") from None
                continue
            if status == "error":
                self.close(force=True)
                stage, replica = rank % run.n_stages, rank // run.n_stages
                raise WorkerError(
                    f"rank {rank} (stage {stage}, replica {replica}) failed:\n{payload}"
                )
            ranks[rank] = payload
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

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


def launch(run: RunConfig) -> RunResult:
    """Start ``run.world_size`` local processes, run, and return the gathered results."""
    run.validate()
    backend = "nccl" if run.device == "cuda" else "gloo"
    with LocalPool(run.world_size, backend=backend, timeout_s=run.timeout_s) as pool:
        return pool.run(run)


# ---- link measurement --------------------------------------------------------------------


def _ping_pong_worker(
    rank: int, port: int, backend: str, sizes: list[int], repeats: int, results: Any
) -> None:
    try:
        torch.set_num_threads(1)  # copying bytes needs no thread pool
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        one_way = []
        for n in sizes:
            buf = torch.zeros(max(1, n // 4), dtype=torch.float32, device=device)
            times = []
            for i in range(repeats + 2):  # two untimed round trips set the connection up
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 2:
                    times.append((time.perf_counter() - t0) / 2)
            # The least time: a round trip is only ever slowed down by other work.
            one_way.append(min(times))
        if rank == 0:
            results.put(("ok", one_way))
        dist.barrier()
    except BaseException:
        results.put(("error", traceback.format_exc()))


def measure_link(
    n_bytes_list: tuple[int, ...] = (2**10, 2**14, 2**17, 2**20, 2**22),
    repeats: int = 10, backend: str = "gloo", timeout_s: float = 120.0,
) -> tuple[float, float]:  # fmt: skip
    """Bandwidth (bytes/s) and latency (s) of the link between two local processes,
    from a ping-pong: the one-way time of each message size is half the least round-trip
    time over ``repeats``, and ``latency + n_bytes / bandwidth`` is fitted to them by
    least squares on relative errors. ``backend`` "gloo" times CPU tensors over
    loopback, "nccl" GPU tensors. Takes a few seconds, mostly the two processes' start."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: choose 'gloo' (CPU) or 'nccl' (GPU)")
    sizes = sorted({int(n) for n in n_bytes_list})
    if len(sizes) < 2 or sizes[0] < 4 or repeats < 1:
        raise ValueError(
            f"n_bytes_list={n_bytes_list}, repeats={repeats}: the fit needs at least two "
            "distinct message sizes of >= 4 bytes and at least one repeat"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_ping_pong_worker, args=(r, port, backend, sizes, repeats, results), daemon=True
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        status, payload = results.get(timeout=timeout_s)
    except queue.Empty:
        raise WorkerError(f"link measurement did not finish within {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if status == "error":
        raise WorkerError(f"link measurement failed:\n{payload}")
    n_bytes = torch.tensor([4 * max(1, n // 4) for n in sizes], dtype=torch.float64)
    seconds = torch.tensor(payload, dtype=torch.float64)
    # Relative residuals: small messages pin the latency, large ones the bandwidth, and an
    # absolute fit would let the largest message's noise swamp the latency.
    design = torch.stack([torch.ones_like(n_bytes), n_bytes], dim=1) / seconds[:, None]
    latency, per_byte = (
        torch.linalg.lstsq(design, torch.ones_like(seconds)[:, None]).solution[:, 0].tolist()
    )
    # Timing noise can tilt the fit: the slope between the extreme sizes is always sane,
    # and the smallest message's time bounds the latency from above.
    if per_byte <= 0:
        per_byte = max(float(seconds[-1] - seconds[0]), 1e-12) / float(n_bytes[-1] - n_bytes[0])
    if latency <= 0:
        latency = max(float(seconds[0] - n_bytes[0] * per_byte), float(seconds[0]) / 2)
    return 1.0 / per_byte, latency


# ---- torchrun entry point ---------------------------------------------------------------


def torchrun_main(argv: list[str] | None = None) -> int:
    """Worker entry under torchrun: every rank trains, rank 0 writes the results file."""
    p = argparse.ArgumentParser(prog="python -m tplib.launch", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="RunConfig as JSON")
    p.add_argument("--out", required=True, help="results file written by rank 0 (torch.save)")
    args = p.parse_args(argv)
    run = load_run_config(args.config)
    run.validate()
    backend = "nccl" if run.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=run.timeout_s))
    rank = dist.get_rank()
    result = run_worker(run, rank)
    gathered: list[RankResult] | None = [None] * dist.get_world_size() if rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        out = Path(args.out)
        tmp = out.with_name(out.name + ".tmp")
        torch.save({"config": run_config_to_dict(run), "ranks": gathered}, tmp)
        os.replace(tmp, out)  # never a half-written results file
        res = RunResult(run, gathered)  # type: ignore[arg-type]
        print(f"median iteration latency {res.median_latency_s:.4f} s -> {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main())
