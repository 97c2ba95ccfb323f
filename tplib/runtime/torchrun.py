"""Entry point for a run across nodes under torchrun: every rank trains, rank 0 writes
the gathered results::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m tplib.runtime.torchrun --config run.json --out result.pt

``run.json`` holds the :class:`~tplib.runtime.RunConfig` fields, as
:func:`~tplib.runtime.save_run_config` writes them; ``device`` should be ``"cuda"``
(NCCL) on GPU nodes. The results file (``torch.save`` of the config and every rank's
:class:`~tplib.runtime.RankResult`) is written atomically; :func:`load_result` reads it
back as a :class:`~tplib.runtime.RunResult`.

On nodes with several network interfaces, name the one the nodes share for gloo (and
NCCL's bootstrap): ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``); where a node's
hostname does not resolve to that interface's address, also pass torchrun
``--local-addr ADDR``: the address it publishes for the node (the workers' ``MASTER_ADDR``
when the node holds rank 0). ``tests/test_runtime_torchrun.py`` runs two nodes, network
namespaces on one machine, that way.

Every wait is bounded by the run's ``timeout_s``, joining included: under torchrun each
rank first marks its arrival in the agents' store and waits for every other, so a rank
that never comes (its node's worker failed before joining, or is stuck) ends the run
with :class:`MissingRanksError` naming the ranks and nodes it waited for, rather than
gloo's "wait timeout ... keys: /default_pg/...". A node whose torchrun never starts is
torchrun's to report: its rendezvous waits ``--rdzv-conf join_timeout=S`` (600 s by
default), then raises a bare ``RendezvousTimeoutError`` before this module runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from tplib.files import atomic_write
from tplib.runtime.config import RunConfig
from tplib.runtime.pool import RunResult
from tplib.runtime.runfile import load_run_config, run_config_from_dict, run_config_to_dict
from tplib.runtime.worker import RankResult, run_worker

__all__ = ["MissingRanksError", "load_result", "main"]


def load_result(path: str | os.PathLike[str]) -> RunResult:
    """The :class:`RunResult` a torchrun job wrote to ``path``."""
    payload = torch.load(path, weights_only=False)  # our own file: configs and dataclasses
    return RunResult(run_config_from_dict(payload["config"]), payload["ranks"])


class MissingRanksError(TimeoutError):
    """Ranks of a torchrun job never joined within the run's ``timeout_s``."""


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``: a node's ranks are consecutive, and a job may
    miss hundreds of them."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def _await_every_rank(run: RunConfig, timeout: datetime.timedelta) -> None:
    """Under torchrun, mark this rank's arrival in the agents' store and wait for every
    rank's; raise :class:`MissingRanksError` naming those that never arrived."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return  # no store to share before the group's: torch's env:// rendezvous reports
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    # The agents' store outlives a restart of the workers: keys of this attempt only.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    keys = [f"tplib/arrived/{attempt}/{r}" for r in range(world)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
    except dist.DistStoreError as e:
        missing = [r for r in range(world) if not store.check([keys[r]])]
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 1  # torchrun's: uniform
        nodes = _spans([r // per_node for r in missing])
        stages = _spans([run.position(r)[1] for r in missing])
        raise MissingRanksError(
            f"rank {rank} of {world} waited {run.timeout_s:g} s (RunConfig.timeout_s) at "
            f"{addr}:{port} for rank(s) {_spans(missing)} (node(s) {nodes}, stage(s) "
            f"{stages}) to join; they never arrived: a worker that failed or hangs before "
            "joining (see those nodes' logs)"
        ) from e


@record  # under torchrun, the failure summary shows our error, not only an exit code
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tplib.runtime.torchrun", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--config", required=True, help="RunConfig as JSON")
    p.add_argument("--out", required=True, help="results file written by rank 0 (torch.save)")
    args = p.parse_args(argv)
    run = load_run_config(args.config)  # every input error surfaces here, on every rank
    run.check_world_size(int(os.environ.get("WORLD_SIZE", "1")))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if run.ranks_per_node and per_node and per_node != run.ranks_per_node:
        raise ValueError(
            f"torchrun started {per_node} processes per node, but the run's layout puts "
            f"{run.ranks_per_node} on each (ranks_per_node): pass --nproc-per-node "
            f"{run.ranks_per_node} so each stage's #Op ranks share a node"
        )
    # NCCL with a GPU per process; gloo on CPU, or when processes share a GPU (staged).
    gpus = torch.cuda.device_count() if run.device == "cuda" else 0
    backend = "nccl" if gpus and gpus >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) else "gloo"
    if gpus:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    timeout = datetime.timedelta(seconds=run.timeout_s)
    _await_every_rank(run, timeout)
    dist.init_process_group(backend, timeout=timeout)
    rank = dist.get_rank()
    result = run_worker(run, rank)
    gathered: list[object] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        ranks = [r for r in gathered if isinstance(r, RankResult)]
        payload = {"config": run_config_to_dict(run), "ranks": ranks}
        atomic_write(args.out, lambda tmp: torch.save(payload, tmp))
        res = RunResult(run, ranks)
        print(f"median iteration latency {res.median_latency_s:.4f} s -> {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
