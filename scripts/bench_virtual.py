"""Virtual pipeline stages against one chunk per stage, measured on local processes.

Two comparisons, each schedule with virtual stages against its one-chunk counterpart on
the same plan: ``interleaved-1f1b`` (v chunks) against ``1f1b`` over whole-sequence
microbatches, and ``terapipe-interleaved`` (v chunks) against ``terapipe`` over
``--slices`` equal token slices per sequence. Each pair trains in alternating rounds
(A B A B ...) so that load from other jobs hits both alike; per round, the ratio of the
one-chunk schedule's median iteration latency to the chunked one's (above 1: the chunks
are faster). Memory is not counted (its hooks cost time). Usage::

    python scripts/bench_virtual.py [--model small] [--stages 2] [--chunks 2] \\
        [--microbatches 4] [--seq-len 1024] [--slices 8] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from tplib.runtime import Data, Parallelism, RunConfig, Timing, launch
from tplib.runtime.runconfig import Hooks

# (chunked schedule, its one-chunk counterpart, whether the plan cuts token slices)
PAIRS = (("interleaved-1f1b", "1f1b", False), ("terapipe-interleaved", "terapipe", True))


def _run(args: argparse.Namespace, name: str, n_chunks: int, sliced: bool) -> RunConfig:
    batch = args.batch if sliced else args.microbatches
    return RunConfig(
        model=args.model,
        schedule_name=name,
        parallelism=Parallelism(n_stages=args.stages, n_chunks=n_chunks),
        data=Data(batch=batch, seq_len=args.seq_len),
        slicing=args.slices if sliced else 1,
        timing=Timing(steps=args.iters, warmup=1, timeout_s=600),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--chunks", type=int, default=2, help="v of the chunked schedules")
    p.add_argument("--microbatches", type=int, default=4, help="sequences of the 1F1B pair")
    p.add_argument("--batch", type=int, default=1, help="sequences of the TeraPipe pair")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--slices", type=int, default=8, help="token slices of the TeraPipe pair")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3, help="timed iterations per round")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    # Every configuration is checked before the first process starts.
    pairs = [
        (_run(args, chunked, args.chunks, sliced), _run(args, one, 1, sliced))
        for chunked, one, sliced in PAIRS
    ]
    latency: dict[str, list[float]] = {}
    loads: list[float] = []
    for _ in range(args.rounds):
        for pair in pairs:
            for run in pair:
                loads.append(os.getloadavg()[0])
                result = launch(run, Hooks(count_memory=False))
                latency.setdefault(run.schedule_name, []).append(
                    statistics.median(result.iteration_s)
                )
    rows: list[dict[str, Any]] = []
    for chunked, one in pairs:
        a, b = latency[chunked.schedule_name], latency[one.schedule_name]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        rows.append(
            {
                "chunked": chunked.schedule_name,
                "one_chunk": one.schedule_name,
                "plan": chunked.plan.to_paper(),
                "chunked_latency_s": statistics.median(a),
                "one_chunk_latency_s": statistics.median(b),
                "speedup_median": statistics.median(ratios),
                "speedup_min": min(ratios),
                "speedup_max": max(ratios),
            }
        )
    summary = {
        "model": args.model,
        "n_stages": args.stages,
        "n_chunks": args.chunks,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "iters": args.iters,
        "load_average_max": max(loads),
        "pairs": rows,
    }
    if args.json:
        print(json.dumps(summary))
        return
    print(
        f"{args.model}, K={args.stages}, v={args.chunks}, L={args.seq_len}, {args.rounds} "
        f"alternating rounds of {args.iters} iterations (load average at most {max(loads):.2f})"
    )
    for r in rows:
        print(
            f"  {r['chunked']:>20} {r['chunked_latency_s'] * 1e3:8.1f} ms vs {r['one_chunk']:>8} "
            f"{r['one_chunk_latency_s'] * 1e3:8.1f} ms on {r['plan']}: speedup "
            f"{r['speedup_median']:.3f} (min {r['speedup_min']:.3f}, max {r['speedup_max']:.3f})"
        )


if __name__ == "__main__":
    main()
