"""Entry point for a run across nodes under torchrun: every rank trains, rank 0 writes
the gathered results::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m tplib.runtime.torchrun --config run.json --out result.pt

``run.json`` holds the :class:`~tplib.runtime.RunConfig` fields, as
:func:`~tplib.runtime.save_run_config` writes them; ``device`` should be ``"cuda"`` on GPU
nodes. The results file (``torch.save`` of the config and every rank's
:class:`~tplib.runtime.RankResult`; ``--collect grads params`` adds the first iteration's
gradients and the parameters after the last step) is written atomically;
:func:`load_result` reads it back as a :class:`~tplib.runtime.RunResult`.

The backend (:mod:`tplib.runtime.backend`): on CUDA each rank takes GPU ``LOCAL_RANK %
device_count`` of those it sees, and the ranks compare their GPUs' UUIDs in the agents'
store: NCCL when no two ranks share a physical GPU (also when a scheduler shows each
process a single GPU, as SLURM's ``--gpus-per-task=1`` does), gloo otherwise, tensors
staged through host memory; gloo on CPU, where no rank touches CUDA. Rank 0 prints the
choice and why (``backend nccl: 16 ranks, each with a GPU of its own``). ``--backend
nccl|gloo`` overrides it; NCCL on CPU, or with two ranks on one GPU, is refused before any
process group starts.

On nodes with several network interfaces, name the one the nodes share for gloo (and
NCCL's bootstrap): ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``); where a node's
hostname does not resolve to that interface's address, also pass torchrun
``--local-addr ADDR``: the address it publishes for the node (the workers' ``MASTER_ADDR``
when the node holds rank 0). ``tests/test_runtime_torchrun.py`` runs two nodes, network
namespaces on one machine, that way.

Every wait is bounded by the run's ``timing.timeout_s``, joining included: under torchrun each
rank first marks its arrival in the agents' store and waits for every other, so a rank
that never comes (its node's worker failed before joining, or is stuck) ends the run
with :class:`MissingRanksError` naming the ranks and nodes it waited for, rather than
gloo's "wait timeout ... keys: /default_pg/...". A node whose torchrun never starts is
torchrun's to report: its rendezvous waits ``--rdzv-conf join_timeout=S`` (600 s by
default), then raises a bare ``RendezvousTimeoutError`` before this module runs.

A rank that dies mid-run (SIGKILL, the out-of-memory killer, a lost node) is named with
what it was doing, as :class:`~tplib.runtime.LocalPool` names it: each rank publishes
its :class:`~tplib.runtime.rank.Progress` to the agents' store four times a second
(:mod:`tplib.runtime.heartbeat`), and a rank whose receive breaks or times out, or whom
its agent stops (SIGTERM, once a rank of its node has died), raises
:class:`~tplib.runtime.heartbeat.RankLostError` naming the ranks that stopped reporting
and their last action.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from tplib.runtime.backend import BACKENDS, BackendChoice, choose_backend, gpu_index
from tplib.runtime.heartbeat import (
    Heartbeat,
    RankLostError,
    doing_message,
    lost_message,
    watch,
)
from tplib.runtime.rank import Progress, spans
from tplib.runtime.result import RunResult
from tplib.runtime.runconfig import Hooks, RunConfig
from tplib.runtime.runfile import load_run_config, run_config_from_dict, run_config_to_dict
from tplib.runtime.worker import RankResult, run_worker
from tplib.util.files import atomic_write

__all__ = ["MissingRanksError", "RankLostError", "StoppedError", "load_result", "main"]


def load_result(path: str | os.PathLike[str]) -> RunResult:
    """The :class:`RunResult` a torchrun job wrote to ``path``."""
    payload = torch.load(path, weights_only=False)  # our own file: configs and dataclasses
    return RunResult(run_config_from_dict(payload["config"]), payload["ranks"])


class MissingRanksError(TimeoutError):
    """Ranks of a torchrun job never joined within the run's ``timing.timeout_s``."""


def _agent_store(timeout: datetime.timedelta) -> dist.TCPStore | None:
    """A client of torchrun's agents' store, or None when not under torchrun's agent."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # no store to share before the group's: torch's env:// rendezvous reports
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout)


def _attempt() -> str:
    # The agents' store outlives a restart of the workers: keys of this attempt only.
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _await_every_rank(
    run: RunConfig, timeout: datetime.timedelta, gpu: str = "cpu"
) -> list[str] | None:
    """Under torchrun, mark this rank's arrival in the agents' store with ``gpu`` (the
    UUID of its GPU) and wait for every rank's; raise :class:`MissingRanksError` naming
    those that never arrived. Every rank's GPU, or None when not under torchrun."""
    store = _agent_store(timeout)
    if store is None:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    keys = [f"tplib/arrived/{_attempt()}/{r}" for r in range(world)]
    store.set(keys[rank], gpu)
    try:
        store.wait(keys, timeout)
    except dist.DistStoreError as e:
        missing = [r for r in range(world) if not store.check([keys[r]])]
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 1  # torchrun's: uniform
        nodes = spans([r // per_node for r in missing])
        stages = spans([run.parallelism.position(r)[1] for r in missing])
        raise MissingRanksError(
            f"rank {rank} of {world} waited {run.timing.timeout_s:g} s (Timing.timeout_s) at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} for rank(s) "
            f"{spans(missing)} (node(s) {nodes}, stage(s) {stages}) to join; they never "
            "arrived: a worker that failed or hangs before joining (see those nodes' logs)"
        ) from e
    return [v.decode() for v in store.multi_get(keys)]


class StoppedError(Exception):
    """torchrun's agent (or the scheduler) stopped this rank with SIGTERM."""


class _OnSigterm:
    """SIGTERM as :class:`StoppedError` in the main thread, so that a rank stopped by its
    agent (which stops a node's ranks once one of them fails) still says what the ranks
    were doing; ignored while it writes that (the agent waits 30 s before its SIGKILL)."""

    def __init__(self) -> None:
        self.reporting = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.reporting:
            raise StoppedError(
                "stopped by SIGTERM: torchrun's agent stops every rank of a node once one of "
                "them has failed (or the job was cancelled)"
            )


def _failure(run: RunConfig, rank: int, progress: Progress, exc: BaseException) -> BaseException:
    """The error to raise for ``exc`` on ``rank``: :class:`RankLostError` naming the ranks
    that stopped reporting and what they were doing, else ``exc`` with a note of what
    every rank is doing (:mod:`tplib.runtime.heartbeat`)."""
    try:
        store = _agent_store(_STORE_READ_TIMEOUT)
        assert store is not None  # only called under torchrun's agent
        silent, beats = watch(store, _progress_prefix(), run.parallelism.world_size)
    except Exception as e:  # the report is best effort; the cause stays
        exc.add_note(f"(what the other ranks were doing is unknown: the agents' store: {e})")
        return exc
    silent = [r for r in silent if r != rank]  # this rank's own thread writes on
    if silent:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 1
        own = progress.where(rank)
        return RankLostError(lost_message(run, rank, own, exc, beats, silent, per_node))
    exc.add_note(doing_message(run, beats))
    return exc


def _progress_prefix() -> str:
    return f"tplib/progress/{_attempt()}"


_STORE_READ_TIMEOUT = datetime.timedelta(seconds=5)  # the agents' store answers in ms


def _backend(run: RunConfig, asked: str | None, timeout: datetime.timedelta) -> BackendChoice:
    """Make this rank's GPU current (device "cuda" only), meet every rank in the agents'
    store, and choose the backend: NCCL when no two ranks share a physical GPU, compared
    by UUID (:mod:`tplib.runtime.backend`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if run.device != "cuda":
        choice = choose_backend(run.device, world, asked=asked)  # refused before any wait
        _await_every_rank(run, timeout)
        return choice
    count = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = gpu_index(local_rank, count)
    torch.cuda.set_device(gpu)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        uuids = _await_every_rank(run, timeout, str(torch.cuda.get_device_properties(gpu).uuid))
        assert uuids is not None
        return choose_backend(run.device, world, uuids, asked)
    # No agents' store to compare GPUs in (started by hand, not by torchrun): assume each
    # process sees every GPU of its node, as it does without a scheduler binding GPUs.
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 1
    gpus = [f"cuda:{gpu_index(r % per_node, count)} of node {r // per_node}" for r in range(world)]
    return choose_backend(run.device, world, gpus, asked)


@record  # under torchrun, the failure summary shows our error, not only an exit code
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tplib.runtime.torchrun", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--config", required=True, help="RunConfig as JSON")
    p.add_argument("--out", required=True, help="results file written by rank 0 (torch.save)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        help="instead of the automatic choice (nccl when no two ranks share a GPU, else gloo)",
    )
    p.add_argument(
        "--collect",
        nargs="+",
        choices=("grads", "params"),
        default=[],
        help="also save the first iteration's gradients / the parameters after the last step",
    )
    args = p.parse_args(argv)
    run = load_run_config(args.config)  # every input error surfaces here, on every rank
    run.parallelism.check_world_size(int(os.environ.get("WORLD_SIZE", "1")))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if run.parallelism.ranks_per_node and per_node and per_node != run.parallelism.ranks_per_node:
        raise ValueError(
            f"torchrun started {per_node} processes per node, but the run's layout puts "
            f"{run.parallelism.ranks_per_node} on each (ranks_per_node): pass --nproc-per-node "
            f"{run.parallelism.ranks_per_node} so each stage's #Op ranks share a node"
        )
    hooks = Hooks(collect_grads="grads" in args.collect, collect_params="params" in args.collect)
    timeout = datetime.timedelta(seconds=run.timing.timeout_s)
    progress = Progress.local(run.parallelism.world_size)
    store = _agent_store(timeout)  # the heartbeat's own client
    heartbeat = None
    on_sigterm = _OnSigterm()
    if store is not None:
        # Before this rank marks its arrival: every rank that arrived has an entry.
        heartbeat = Heartbeat(store, _progress_prefix(), int(os.environ["RANK"]), progress)
        heartbeat.start()
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        choice = _backend(run, args.backend, timeout)
        if int(os.environ.get("RANK", "0")) == 0:
            print(choice, flush=True)  # before the group: NCCL's start is where jobs hang
        dist.init_process_group(choice.backend, timeout=timeout)
        rank = dist.get_rank()
        try:
            result = run_worker(run, rank, hooks, progress)
        except (RuntimeError, ConnectionError, TimeoutError, StoppedError) as exc:
            if heartbeat is None:
                raise
            on_sigterm.reporting = True
            error = _failure(run, rank, progress, exc)
            if error is exc:
                raise
            raise error from exc
        gathered: list[object] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if rank == 0:
            assert gathered is not None
            ranks = [r for r in gathered if isinstance(r, RankResult)]
            payload = {"config": run_config_to_dict(run), "ranks": ranks}
            atomic_write(args.out, lambda tmp: torch.save(payload, tmp))
            res = RunResult(run, ranks)
            print(f"median iteration latency {res.median_latency_s:.4f} s -> {args.out}")
    finally:
        if heartbeat is not None:
            heartbeat.stop()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        # Recorded for torchrun (@record) and printed here; then out without the
        # interpreter's teardown, whose destruction of a broken process group held a
        # surviving rank for seconds after it had said what happened.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
