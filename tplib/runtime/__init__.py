"""The pipeline runtime on torch.distributed (gloo on CPU, NCCL on GPU).

================  ====================================================================
module            what it holds
================  ====================================================================
``runconfig``     :class:`RunConfig` (one training run, checked whole) and :class:`Hooks`
``parts``         its parts: :class:`Parallelism`, :class:`Data`, :class:`Optim`,
                  :class:`Timing`, each checking its own fields
``runfile``       a :class:`RunConfig` as JSON, for torchrun jobs and batch scripts
``worker``        the per-process interpreter: a dispatch table from action kind to method
``groups``        a rank's process groups, its peers between stages, staged collectives
``backend``       NCCL or gloo (the rule, or the one asked for), and each rank's GPU
``heartbeat``     each torchrun rank's progress in the agents' store: who died, doing what
``update``        the optimizer step: global-norm clipping, learning rate, fp16 skips
``pool``          :class:`LocalPool` and :func:`launch`: ranks as local processes
``torchrun``      the entry point for runs across nodes; :func:`load_result` reads its file
``memory``        measured memory of a stage: the CPU counter and the CUDA allocator's peak
``reference``     :func:`train_reference`, the single-device run every pipeline matches
``link``          :func:`measure_link`, a ping-pong between two local processes
``benchmark``     :func:`bench`, median iteration latency, runtime overhead, peak memory
``torchorders``   torch.distributed.pipelining's own schedules, read from torch and priced
``torchpipe``     a tplib schedule run by torch's pipeline runtime, on tplib's stages
================  ====================================================================

This is the only place, with :mod:`tplib.runtime.torchrun`, where torch.distributed is
used. :class:`RunConfig`, its parts, :class:`Hooks` and their JSON import without torch;
the rest loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tplib.runtime.parts import Data, Optim, Parallelism, Timing
from tplib.runtime.runconfig import Hooks, RunConfig
from tplib.runtime.runfile import (
    load_run_config,
    run_config_from_dict,
    run_config_to_dict,
    save_run_config,
)

if TYPE_CHECKING:
    from tplib.runtime.benchmark import BenchResult, bench
    from tplib.runtime.link import fit_link, measure_link
    from tplib.runtime.pool import LocalPool, WorkerError, launch
    from tplib.runtime.reference import ReferenceResult, train_reference
    from tplib.runtime.result import RunResult
    from tplib.runtime.worker import TRACE_COLUMNS, RankResult, run_worker

_LAZY = {
    "BenchResult": "benchmark",
    "bench": "benchmark",
    "fit_link": "link",
    "measure_link": "link",
    "LocalPool": "pool",
    "RunResult": "result",
    "WorkerError": "pool",
    "launch": "pool",
    "ReferenceResult": "reference",
    "train_reference": "reference",
    "TRACE_COLUMNS": "worker",
    "RankResult": "worker",
    "run_worker": "worker",
}

__all__ = [
    "TRACE_COLUMNS",
    "BenchResult",
    "Data",
    "Hooks",
    "LocalPool",
    "Optim",
    "Parallelism",
    "RankResult",
    "ReferenceResult",
    "RunConfig",
    "RunResult",
    "Timing",
    "WorkerError",
    "bench",
    "fit_link",
    "launch",
    "load_run_config",
    "measure_link",
    "run_config_from_dict",
    "run_config_to_dict",
    "run_worker",
    "save_run_config",
    "train_reference",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"tplib.runtime.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'tplib.runtime' has no attribute {name!r}")
