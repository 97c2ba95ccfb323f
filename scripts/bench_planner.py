"""Benchmark the DP planner: wall-clock planning time on a GPU-like synthetic cost.

Not a test: it prints, per setting, the seconds each method takes (eps = 0.1 ms, the
paper's choice, and eps = 0, exact), the plan found, its predicted latency and its true
fill-drain latency (``pipeline_latency``), next to the best uniform slicing.

    .venv/bin/python scripts/bench_planner.py            # all settings
    .venv/bin/python scripts/bench_planner.py --quick    # the first setting only
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from tplib.planner import best_uniform, pipeline_latency, plan_slices


@dataclass(frozen=True)
class GpuLikeCost:
    """``t(b, s, c)``: a per-slice overhead (launches, send/receive), a per-token term that
    stays flat below ``flat_tokens`` tokens in the slice (an underused GPU, paper Fig. 3:
    one token costs as much as 256), and attention over the context plus the slice itself.
    Magnitudes resemble one stage of GPT3-13B setting (5): ~20 ms per 2048-token sequence."""

    overhead: float = 1e-3  # seconds per slice
    per_token: float = 8e-6  # seconds per token once the GPU is busy
    flat_tokens: int = 256  # b * s below this takes as long as this
    per_pair: float = 2.5e-9  # seconds per (query, key) pair of attention
    max_batch_slice_size: int | None = None  # analytic: any batch slice

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        tokens = batch_slice_size * np.asarray(length, dtype=float)
        keys = np.asarray(context) + (np.asarray(length) + 1) / 2  # causal within the slice
        return (
            self.overhead
            + self.per_token * np.maximum(tokens, self.flat_tokens)
            + self.per_pair * tokens * keys
        )


@dataclass(frozen=True)
class Setting:
    name: str
    seq_len: int
    batch: int
    n_stages: int
    granularity: int = 8


SETTINGS = [
    Setting("GPT3-13B (5): L=2048 B=32 K=40", 2048, 32, 40),
    Setting("long sequence: L=8192 B=2 K=40", 8192, 2, 40),
    Setting("GPT3-175B (9)-like: L=2048 B=2 K=96", 2048, 2, 96),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="run the first setting only")
    args = parser.parse_args()
    cost = GpuLikeCost()
    for s in SETTINGS[:1] if args.quick else SETTINGS:
        print(f"== {s.name} (g={s.granularity})")
        uni = best_uniform(cost, s.seq_len, s.batch, s.n_stages, granularity=s.granularity)
        print(f"   best uniform           latency {uni.latency:.4f} s   {uni}")
        for eps in (1e-4, 0.0):
            for method in ("paper", "exact"):
                start = time.perf_counter()
                p = plan_slices(
                    cost,
                    seq_len=s.seq_len,
                    batch=s.batch,
                    n_stages=s.n_stages,
                    granularity=s.granularity,
                    eps=eps,
                    method=method,
                )
                took = time.perf_counter() - start
                true = pipeline_latency(p, cost, s.n_stages)
                assert p.latency is not None and p.t_max is not None  # the planner sets both
                print(
                    f"   {method:5s} eps={eps:<6g} {took:6.2f} s   predicted {p.latency:.4f} s"
                    f"   true {true:.4f} s   t_max {p.t_max * 1e3:.2f} ms   {p}"
                )


if __name__ == "__main__":
    main()
