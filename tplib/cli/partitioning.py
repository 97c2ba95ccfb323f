"""The layout commands: ``autoplan`` (TeraPipe's whole layout, searched) and
``partition`` (the planners of GPipe, PipeDream and PipeDream-2BW on a model's layer
chain). Both run on the V100-cluster model and never import torch."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

from tplib.autoplan import autoplan
from tplib.partition import Topology, cluster_chain
from tplib.partition.balance import balance, cell_costs
from tplib.partition.pipedream import pipedream_partition
from tplib.partition.twobw import twobw_plan

__all__ = ["autoplan_command", "partition_command"]

RECOMPUTE_CHOICES = {"both": ("none", "full"), "none": ("none",), "full": ("full",)}


def _json_safe(value: object) -> object:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def autoplan_command(args: argparse.Namespace) -> int:
    search = autoplan(
        args.model,
        args.gpus,
        args.batch,
        seq_len=args.seq_len,
        cluster=args.cluster,
        memory_gib=args.memory,
        recompute=RECOMPUTE_CHOICES[args.recompute],
    )
    if args.json:
        d = search.to_dict()
        d["candidates"] = [{k: _json_safe(v) for k, v in c.items()} for c in d["candidates"]]
        print(json.dumps(d))
        return 0
    print(search.report(args.top))
    return 0


Report = tuple[dict[str, object], list[str]]  # (the JSON object, the printed lines)


def _gpipe(args: argparse.Namespace) -> Report:
    if args.stages is None:
        raise ValueError("--stages is required with --planner gpipe: GPipe is given K")
    chain = cluster_chain(args.model, microbatch=args.microbatch, seq_len=args.seq_len)
    ranges = balance(chain, args.stages)
    costs = cell_costs([x.compute for x in chain.layers], ranges)
    lines = [
        f"  layers [{lo:>3}, {hi:>3}): {t * 1e3:8.2f} ms per microbatch"
        for (lo, hi), t in zip(ranges, costs, strict=True)
    ]
    return {"stage_ranges": ranges, "stage_seconds": costs, "chain": chain.source}, lines


def _pipedream(args: argparse.Namespace) -> Report:
    chain = cluster_chain(args.model, microbatch=args.microbatch, seq_len=args.seq_len)
    p = pipedream_partition(chain, Topology.cluster(args.gpus), memory=not args.no_memory_check)
    out = {
        "stages": [asdict(s) for s in p.stages],
        "slowest_seconds": p.slowest,
        "in_flight": p.in_flight,
        "chain": chain.source,
    }
    return out, str(p).splitlines()


def _twobw(args: argparse.Namespace) -> Report:
    if args.batch is None:
        raise ValueError("--batch is required with --planner 2bw: the global batch B")
    p = twobw_plan(
        lambda b: cluster_chain(args.model, microbatch=b, seq_len=args.seq_len),
        Topology.cluster(args.gpus),
        batch=args.batch,
    )
    top = p.candidates[: args.top]
    lines = [f"  best: {p.best}"] + [
        f"  {c!s:<44} {c.throughput:8.2f} samples/s  {c.memory / 2**30:5.1f} GiB "
        f"({'fits' if c.fits else 'does not fit'})"
        for c in top
    ]
    return {"best": asdict(p.best), "top": [asdict(c) for c in top]}, lines


PLANNERS = {"gpipe": _gpipe, "pipedream": _pipedream, "2bw": _twobw}


def partition_command(args: argparse.Namespace) -> int:
    found, lines = PLANNERS[args.planner](args)
    if args.json:
        print(
            json.dumps({"planner": args.planner, "model": args.model, "n_gpus": args.gpus} | found)
        )
        return 0
    print(f"{args.planner} on {args.model}, {args.gpus} GPUs (V100 cluster model)")
    print("\n".join(lines))
    return 0
