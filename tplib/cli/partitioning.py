"""The layout commands: ``autoplan`` (TeraPipe's whole layout, searched) and
``partition`` (the planners of GPipe, PipeDream and PipeDream-2BW on a model's layer
chain), on the V100-cluster model or on stage profiles measured with ``python -m tplib
profile`` (``partition --profiles``). Neither imports torch. With ``--out``, each writes
what it chose as a run file for ``python -m tplib run`` / torchrun
(:mod:`tplib.runs.partitioned`)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from tplib.nn.configs import get_config
from tplib.partition import LayerChain, Topology, cluster_chain, profile_chain
from tplib.partition.balance import balance, cell_costs
from tplib.partition.pipedream import pipedream_partition
from tplib.partition.simulated import twobw_simulated
from tplib.partition.twobw import twobw_plan
from tplib.perfmodel.conditions import UNKNOWN
from tplib.perfmodel.profile import Profile
from tplib.search.layout import autoplan

if TYPE_CHECKING:
    from tplib.runtime import RunConfig, Timing

__all__ = ["autoplan_command", "partition_command"]

RECOMPUTE_CHOICES = {
    "both": ("none", "full"),
    "all": ("none", "selective", "full"),
    "none": ("none",),
    "selective": ("selective",),
    "full": ("full",),
}


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
        schedules=tuple(dict.fromkeys(args.schedules)),
        context_parallel=_cp_values(args.cp),
    )
    if args.json:
        d = search.to_dict()
        d["candidates"] = [{k: _json_safe(v) for k, v in c.items()} for c in d["candidates"]]
        print(json.dumps(d))
    else:
        print(search.report(args.top))
    if args.out:
        from tplib.runs.partitioned import search_run

        _write_run(args, search_run(search, timing=_timing(args)), "the best layout's run")
    return 0


def _cp_values(values: list[int]) -> tuple[int, ...] | None:
    """``--cp``: the #CP values to search; 0 alone means every one that can run."""
    if values == [0]:
        return None
    if 0 in values:
        raise ValueError(f"--cp {' '.join(map(str, values))}: 0 (every #CP) stands alone")
    return tuple(sorted(set(values)))


def _timing(args: argparse.Namespace) -> Timing:
    from tplib.runtime import Timing

    return Timing(steps=args.steps, warmup=args.warmup)


def _write_run(args: argparse.Namespace, run: RunConfig, what: str) -> None:
    """Save ``run`` to ``--out`` and say how to launch it (unless ``--json``)."""
    from tplib.runs.settings import launch_commands
    from tplib.runtime import save_run_config

    save_run_config(run, args.out)
    commands = launch_commands(run, args.out, args.result)
    if not args.json:
        print(f"wrote {what} to {args.out}; on every node:")
        print(f"  {commands['torchrun']}\nor under SLURM:\n  {commands['slurm']}")


Model = tuple[str, tuple[tuple[str, object], ...]]  # a run's model name and overrides


def _without_dropout(model: Model, args: argparse.Namespace) -> Model:
    """An asynchronous schedule's run trains without dropout, which the runtime cannot
    key by iteration across weight versions yet (RunConfig refuses it); say so."""
    name, overrides = model
    p = get_config(name, overrides).dropout
    if p == 0:
        return model
    if not args.json:
        print(
            f"note: the {args.planner} run sets dropout {p} to 0: asynchronous schedules run without dropout"
        )
    return name, tuple(sorted({**dict(overrides), "dropout": 0.0}.items()))


Report = tuple[dict[str, object], list[str]]  # (the JSON object, the printed lines)


@dataclass(frozen=True)
class Source:
    """Where the chain comes from: the cluster model, or stage profiles measured here."""

    chain_for: Callable[[int], LayerChain]  # microbatch size -> chain
    topology: Topology
    microbatches: tuple[int, ...]  # the sizes 2BW may choose among
    name: str
    model: Model


def _source(args: argparse.Namespace) -> Source:
    if not args.profiles:
        if args.memory is not None:
            raise ValueError("--memory applies to --profiles; the cluster's GPUs have 16 GiB")
        return Source(
            lambda b: cluster_chain(args.model, microbatch=b, seq_len=args.seq_len),
            Topology.cluster(args.gpus),
            (1, 2, 4, 8),
            f"{args.model}, {args.gpus} GPUs (V100 cluster model)",
            (args.model, ()),
        )
    profiles = []
    for path in args.profiles:
        try:
            profiles.append(Profile.load(path))
        except OSError as exc:
            raise ValueError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    capacity = args.memory * 2**30 if args.memory is not None else float("inf")
    first = profiles[0]
    return Source(
        lambda b: profile_chain(
            profiles, microbatch=b, seq_len=args.seq_len, precision=_precision(first, args),
            capacity=capacity,
        ),
        Topology.flat(args.gpus, first.link_bandwidth, f"{args.gpus} local processes"),
        first.batch_slice_sizes,
        f"{first.config.name}, {args.gpus} workers (profiles measured on {first.device})",
        _profiled_model(first, args),
    )  # fmt: skip


def _profiled_model(
    prof: Profile, args: argparse.Namespace
) -> tuple[str, tuple[tuple[str, object], ...]]:
    """The profiled model as a run names it: its config's name, and the fields where it
    differs from that named config (a profile of ``small`` with 4 layers, say)."""
    try:
        named = get_config(prof.config.name)
    except ValueError:
        if args.out:
            raise ValueError(
                f"profile {args.profiles[0]} timed a model named {prof.config.name!r}, which "
                "is not a named config, so --out cannot name it in a run file"
            ) from None
        return prof.config.name, ()
    changed = tuple(
        (f.name, getattr(prof.config, f.name))
        for f in fields(prof.config)
        if getattr(prof.config, f.name) != getattr(named, f.name)
    )
    return prof.config.name, changed


def _precision(prof: Profile, args: argparse.Namespace) -> str:
    """The precision the profiles timed, which prices each stage's memory."""
    if prof.precision == UNKNOWN:
        raise ValueError(
            f"profile {args.profiles[0]} does not say which precision it timed (an older "
            "file timed in bfloat16): re-profile it with python -m tplib profile --dtype "
            "fp32, bf16 or fp16"
        )
    return prof.precision


def _gpipe(args: argparse.Namespace, src: Source) -> Report:
    if args.stages is None:
        raise ValueError("--stages is required with --planner gpipe: GPipe is given K")
    chain = src.chain_for(args.microbatch)
    ranges = balance(chain, args.stages)
    costs = cell_costs([x.compute for x in chain.layers], ranges)
    lines = [
        f"  layers [{lo:>3}, {hi:>3}): {t * 1e3:8.2f} ms per microbatch"
        for (lo, hi), t in zip(ranges, costs, strict=True)
    ]
    if args.out:
        from tplib.runs.partitioned import balance_run

        if args.batch is None:
            raise ValueError("--out with --planner gpipe needs --batch: the run's global batch B")
        name, overrides = src.model
        run = balance_run(
            ranges, name, chain.seq_len, args.batch, args.microbatch,
            model_overrides=overrides, timing=_timing(args),
        )  # fmt: skip
        _write_run(args, run, "GPipe's balance as a gpipe run")
    return {"stage_ranges": ranges, "stage_seconds": costs, "chain": chain.source}, lines


def _pipedream(args: argparse.Namespace, src: Source) -> Report:
    chain = src.chain_for(args.microbatch)
    p = pipedream_partition(chain, src.topology, memory=not args.no_memory_check)
    out = {
        "stages": [asdict(s) for s in p.stages],
        "slowest_seconds": p.slowest,
        "in_flight": p.in_flight,
        "chain": chain.source,
    }
    if args.out:
        from tplib.runs.partitioned import pipedream_run

        name, overrides = _without_dropout(src.model, args)
        run = pipedream_run(
            p, name, chain.seq_len, args.microbatch,
            model_overrides=overrides, timing=_timing(args),
        )  # fmt: skip
        _write_run(args, run, "PipeDream's partition as a pipedream run")
    return out, str(p).splitlines()


def _twobw(args: argparse.Namespace, src: Source) -> Report:
    if args.batch is None:
        raise ValueError("--batch is required with --planner 2bw: the global batch B")
    p = twobw_plan(src.chain_for, src.topology, batch=args.batch, microbatches=src.microbatches)
    top = p.candidates[: args.top]
    # Each closed form beside the simulated 2bw schedule of the same configuration.
    sims = [twobw_simulated(src.chain_for(c.microbatch), src.topology, c) for c in top]
    lines = [f"  best: {p.best}"] + [
        f"  {c!s:<44} {c.throughput:8.2f} samples/s  {c.memory / 2**30:5.1f} GiB "
        f"({'fits' if c.fits else 'does not fit'}); {c.seconds_per_microbatch * 1e3:.1f} ms "
        f"per microbatch, simulated {sim * 1e3:.1f} ms"
        for c, sim in zip(top, sims, strict=True)
    ]
    found = [
        asdict(c) | {"simulated_seconds_per_microbatch": t} for c, t in zip(top, sims, strict=True)
    ]
    if args.out:
        from tplib.runs.partitioned import twobw_run

        seq_len = src.chain_for(p.best.microbatch).seq_len
        name, overrides = _without_dropout(src.model, args)
        run = twobw_run(p.best, name, seq_len, model_overrides=overrides, timing=_timing(args))
        _write_run(args, run, "2BW's best configuration as a 2bw run")
    return {"best": asdict(p.best), "top": found}, lines


PLANNERS = {"gpipe": _gpipe, "pipedream": _pipedream, "2bw": _twobw}


def partition_command(args: argparse.Namespace) -> int:
    if (args.model is None) == (not args.profiles):
        raise ValueError("give exactly one of --model NAME or --profiles FILE ...")
    src = _source(args)
    found, lines = PLANNERS[args.planner](args, src)
    if args.json:
        print(json.dumps({"planner": args.planner, "on": src.name, "n_gpus": args.gpus} | found))
        return 0
    print(f"{args.planner} on {src.name}")
    print("\n".join(lines))
    return 0
