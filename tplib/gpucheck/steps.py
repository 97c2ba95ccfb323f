"""The GPU check's steps: each measures one thing, writes its files into the output folder
only once it has finished, and says in one line what it found (:data:`STEPS`, with each
one's budget).

Each step runs in a process of its own (``python -m tplib.gpucheck.steps NAME --out DIR
--mode gpu|dry``), so that the driver (:mod:`tplib.gpucheck.driver`) can stop one that
overruns its budget, and a CUDA error cannot poison the steps after it; the process's
last line is the :class:`~tplib.gpucheck.result.StepResult` as JSON after
:data:`~tplib.gpucheck.result.RESULT_MARK`. ``--mode dry`` runs the same step on the CPU
at the sizes of :data:`~tplib.gpucheck.sizes.DRY` (the rehearsal).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from tplib.gpucheck.measures import (
    dropout_step,
    efficiency_step,
    figure3_step,
    memory_step,
    slicing_step,
)
from tplib.gpucheck.proofs import device_step, exactness_step, multi_rank_step
from tplib.gpucheck.result import RESULT_MARK, StepResult
from tplib.gpucheck.sizes import DRY, GPU, Sizes

__all__ = ["STEPS", "main"]


Step = Callable[[Path, Sizes], StepResult]
# name -> (the step, its budget in seconds on one H100): the whole check stays under 8
# minutes, whatever overruns.
STEPS: dict[str, tuple[Step, float]] = {
    "device": (device_step, 20),
    "exactness": (exactness_step, 150),
    "multi-rank": (multi_rank_step, 45),
    "figure 3": (figure3_step, 30),
    "slicing": (slicing_step, 45),
    "dropout": (dropout_step, 25),
    "efficiency": (efficiency_step, 45),
    "memory": (memory_step, 75),
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tplib.gpucheck.steps", description="Run one step of the GPU check."
    )
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=("gpu", "dry"), default="gpu")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    sizes = GPU if args.mode == "gpu" else DRY
    args.out.mkdir(parents=True, exist_ok=True)
    step, _ = STEPS[args.step]
    t0 = time.perf_counter()
    try:
        result = step(args.out, sizes)
    except Exception as exc:  # reported as the step's outcome; the traceback goes to its log
        import traceback

        traceback.print_exc()
        result = StepResult(args.step, "failed", f"{type(exc).__name__}: {exc}".splitlines()[0])
    result = StepResult(**(asdict(result) | {"seconds": time.perf_counter() - t0}))
    print(RESULT_MARK + json.dumps(asdict(result)), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
