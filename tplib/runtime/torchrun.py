"""Entry point for a run across nodes under torchrun: every rank trains, rank 0 writes
the gathered results::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m tplib.runtime.torchrun --config run.json --out result.pt

``run.json`` holds the :class:`~tplib.runtime.RunConfig` fields, as
:func:`~tplib.runtime.save_run_config` writes them; ``device`` should be ``"cuda"``
(NCCL) on GPU nodes. The results file (``torch.save`` of the config and every rank's
:class:`~tplib.runtime.RankResult`) is written atomically; :func:`load_result` reads it
back as a :class:`~tplib.runtime.RunResult`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from tplib.files import atomic_write
from tplib.runtime.config import load_run_config, run_config_from_dict, run_config_to_dict
from tplib.runtime.pool import RunResult
from tplib.runtime.worker import RankResult, run_worker

__all__ = ["load_result", "main"]


def load_result(path: str | os.PathLike[str]) -> RunResult:
    """The :class:`RunResult` a torchrun job wrote to ``path``."""
    payload = torch.load(path, weights_only=False)  # our own file: configs and dataclasses
    return RunResult(run_config_from_dict(payload["config"]), payload["ranks"])


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
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=run.timeout_s))
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
