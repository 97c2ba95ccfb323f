"""Benchmark the memory-aware planner at long context: L = 131072, g = 128 (1024 grid
points, the most the explorer plans), GPT3-13B on DGX H100 nodes.

Not a test: it prints, per batch B and memory rule, the median wall time of a few runs
of :func:`tplib.planner.exact_joint` with a memory model and the GPU's capacity (and
their spread), the plan's shape and its peak, beside the planner without memory.

    .venv/bin/python scripts/bench_planner_long.py               # B = 1, 2, 4, 8
    .venv/bin/python scripts/bench_planner_long.py --batch 8 --runs 1
"""

from __future__ import annotations

import argparse
import statistics
import time

from tplib.cluster import CALIBRATIONS, DGX_H100, ClusterCostModel, Implementation
from tplib.cluster.slice_memory import ClusterSliceMemory
from tplib.nn.configs import get_config
from tplib.planner import NothingFitsError, exact_joint, peak_bytes

SEQ_LEN, GRANULARITY = 131072, 128
N_STAGES, N_OP = 8, 8  # 40 layers: 5 per stage, each over one node's 8 GPUs
SP = Implementation(attention="flash", sequence_parallel=True, distributed_optimizer=True)
NO_SP = Implementation(attention="flash", distributed_optimizer=True)
# (label, implementation, recompute, schedule, capacity in GiB or None: the GPU's). The
# first two rarely bind at 80 GiB; the others do: the slices the memory allows decide.
CASES = (
    ("terapipe, full recomputation", SP, "full", "terapipe", None),
    ("1f1b, no recomputation", SP, "none", "1f1b", None),
    ("terapipe, full recomputation, 9 GiB", SP, "full", "terapipe", 9),
    ("1f1b, no recomputation, no sequence parallelism", NO_SP, "none", "1f1b", None),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--runs", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--eps", type=float, default=0.0, help="t_max tolerance, s")
    args = parser.parse_args()
    cfg = get_config("GPT3-13B").with_(seq_len=SEQ_LEN)
    for label, impl, recompute, schedule, gib in CASES:
        cost = ClusterCostModel(
            cfg,
            n_stages=N_STAGES,
            n_op=N_OP,
            seq_len=SEQ_LEN,
            calibration=CALIBRATIONS[DGX_H100.name],
            hardware=DGX_H100,
            implementation=impl,
            recompute=recompute,
        )
        memory = ClusterSliceMemory.of(cost, schedule)
        capacity = memory.capacity if gib is None else gib * 2**30
        print(f"== {label}: {cost}, capacity {capacity / 2**30:.0f} GiB, eps={args.eps}")
        for batch in args.batch:
            kw = {"seq_len": SEQ_LEN, "batch": batch, "n_stages": cost.n_stages}
            kw |= {"granularity": GRANULARITY, "eps": args.eps}
            start = time.perf_counter()
            free = exact_joint(cost, **kw)
            free_s = time.perf_counter() - start
            times, outcome = [], ""
            for _ in range(args.runs):
                start = time.perf_counter()
                try:
                    p = exact_joint(cost, **kw, memory=memory, capacity=capacity)
                    outcome = (
                        f"latency {p.latency:.4g} s (no limit {free.latency:.4g} s), peak "
                        f"{peak_bytes(p, memory) / 2**30:.1f} GiB, {p.n_batch_slices} batch "
                        f"slice(s) of {sorted(set(p.batch_slices))}, "
                        f"{max(map(len, p.token_slices))} token slices"
                    )
                except NothingFitsError as exc:
                    outcome = f"nothing fits: {exc.smallest_peak / 2**30:.1f} GiB at least"
                times.append(time.perf_counter() - start)
            print(
                f"  B={batch}: {statistics.median(times):6.2f} s median "
                f"(min {min(times):.2f}, max {max(times):.2f}; without memory {free_s:.2f} s)"
                f"  {outcome}"
            )


if __name__ == "__main__":
    main()
