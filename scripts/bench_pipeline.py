"""Schedules against each other on local processes: latency ratios to GPipe.

Trains each schedule for a few iterations on K local processes (the real runtime), round
after round in turn (A B C A B C ...) so that load from other jobs hits them alike, and
prints each one's median latency and, per round, its speedup over ``gpipe`` (median,
min and max over the rounds). ``gpipe`` runs one microbatch per sequence, every other
schedule ``--slices`` equal token slices. Memory is not counted (its hooks cost time).
Usage::

    python scripts/bench_pipeline.py [--model small] [--stages 2] [--batch 1] \\
        [--seq-len 1024] [--slices 8] [--rounds 5] [--schedules gpipe terapipe terapipe-zb]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from tplib.runtime import Data, Parallelism, RunConfig, Timing, launch
from tplib.runtime.runconfig import Hooks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--slices", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3, help="timed iterations per round")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "terapipe", "terapipe-zb"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if "gpipe" not in args.schedules:
        raise SystemExit("--schedules must include gpipe: ratios are to it")
    runs = {
        name: RunConfig(
            model=args.model,
            schedule_name=name,
            parallelism=Parallelism(n_stages=args.stages),
            data=Data(batch=args.batch, seq_len=args.seq_len),
            slicing=1 if name == "gpipe" else args.slices,
            timing=Timing(steps=args.iters, warmup=1, timeout_s=600),
        )
        for name in args.schedules
    }
    latency: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            result = launch(run, Hooks(count_memory=False))
            latency[name].append(statistics.median(result.iteration_s))
    speedups = {
        name: [g / x for g, x in zip(latency["gpipe"], lat, strict=True)]
        for name, lat in latency.items()
    }
    summary = {
        "model": args.model,
        "n_stages": args.stages,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "slices": args.slices,
        "rounds": args.rounds,
        "load_average": os.getloadavg()[0],
        "latency_s": {k: statistics.median(v) for k, v in latency.items()},
        "speedup": {k: statistics.median(v) for k, v in speedups.items()},
        "speedup_range": {k: (min(v), max(v)) for k, v in speedups.items()},
    }
    if args.json:
        print(json.dumps(summary))
        return
    print(
        f"{args.model}, K={args.stages}, B={args.batch}, L={args.seq_len}, {args.slices} slices, "
        f"{args.rounds} alternating rounds of {args.iters} iterations"
    )
    for name in runs:
        lo, hi = summary["speedup_range"][name]
        print(
            f"  {name:>12}: {summary['latency_s'][name] * 1e3:7.1f} ms median, speedup over "
            f"gpipe {summary['speedup'][name]:.3f} (min {lo:.3f}, max {hi:.3f})"
        )


if __name__ == "__main__":
    main()
