"""Cost of token slicing on one device: sliced vs whole-sequence forward+backward.

Runs a stage over L tokens as one slice and as N equal token slices (through the K/V
context), and N slices again with split backwards: each slice's backward computes its
input gradient only and the sequence's weight gradients follow in one product per
weight (``W b``, what ``terapipe-zb`` runs). The three alternate so machine noise hits
them alike; it prints the median times and their ratios to the whole sequence. Usage::

    python scripts/bench_slicing.py [--model small] [--seq-len 1024] [--slices 8] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tplib.nn.configs import get_config
from tplib.nn.data import synthetic_batch
from tplib.nn.model import build_model
from tplib.nn.slicing import run_pipeline_local
from tplib.plan import Plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--slices", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = get_config(args.model)
    model = build_model(cfg)
    tokens, targets = synthetic_batch(cfg, args.batch, args.seq_len)
    whole = Plan.uniform(args.batch, args.seq_len, batch_slice_size=args.batch)
    sliced = Plan.uniform(
        args.batch, args.seq_len, batch_slice_size=args.batch, n_token_slices=args.slices
    )
    variants = {"whole": (whole, False), "sliced": (sliced, False), "sliced_fused": (sliced, True)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(args.repeats + 1):  # the first round warms up
        for name, (plan, split) in variants.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            run_pipeline_local([model], tokens, plan, targets=targets, split_backward=split)
            if i:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (min(v) / med["whole"], max(v) / med["whole"]) for k, v in times.items()}
    result = {
        "model": cfg.name,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "slices": args.slices,
        "threads": torch.get_num_threads(),
        "whole_s": med["whole"],
        "sliced_s": med["sliced"],
        "sliced_fused_s": med["sliced_fused"],
        "ratio": med["sliced"] / med["whole"],
        "ratio_fused": med["sliced_fused"] / med["whole"],
        "ratio_fused_range": spread["sliced_fused"],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{cfg.name}, L={args.seq_len}, batch {args.batch}, {torch.get_num_threads()} threads, "
            f"median of {args.repeats}: whole {med['whole'] * 1e3:.1f} ms, "
            f"{args.slices} slices {med['sliced'] * 1e3:.1f} ms (ratio {result['ratio']:.3f}), "
            f"{args.slices} slices with fused W {med['sliced_fused'] * 1e3:.1f} ms "
            f"(ratio {result['ratio_fused']:.3f})"
        )


if __name__ == "__main__":
    main()
