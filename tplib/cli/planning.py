"""The numpy-only commands: ``profile`` (the one that times, with torch), ``plan`` and
``simulate``. ``plan`` and ``simulate`` never import torch: they start in a fraction of
a second.

``plan`` slices by TeraPipe's DP (``--slicing dp``), Seq1F1B's equal-FLOP rule
(``seq1f1b``, :mod:`tplib.planner.seq1f1b`) or uniformly (``uniform``), with
``--slices`` k fixed or the best k; with ``--memory-gib`` only plans whose peak fits,
by the cluster's memory model of the setting (:mod:`tplib.cluster.slice_memory`) for
the fill-drain or 1F1B schedule (``--schedule``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any, cast

from tplib.plan import Plan, grid_size
from tplib.planner import (
    FlopModel,
    NothingFitsError,
    SliceMemory,
    best_seq1f1b,
    best_uniform,
    peak_bytes,
    pipeline_latency,
    plan_slices,
    uniform,
)
from tplib.sim.costs import SliceCostModel

if TYPE_CHECKING:
    from tplib.perfmodel import Profile

__all__ = ["MEMORY_SCHEDULES", "SLICINGS", "plan_command", "profile_command", "simulate_command"]

SLICINGS = ("dp", "seq1f1b", "uniform")
MEMORY_SCHEDULES = ("terapipe", "1f1b")  # fill-drain, or sequence-level 1F1B
GIB = 2**30


def profile_command(args: argparse.Namespace) -> int:
    import torch  # times with torch: import only when asked

    from tplib.nn.configs import get_config
    from tplib.perfmodel import profile_stage

    cfg = get_config(args.model)
    if args.layers > cfg.n_layer:  # the timer would build them all (10**20 filled memory)
        raise ValueError(
            f"--layers {args.layers} is more than {cfg.name}'s {cfg.n_layer} layers: a stage "
            "holds at most the whole model"
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # What a run of the model does: fp16 on a GPU (the paper's V100 recipe, `run`'s
    # default), fp32 on CPU; the model's dropout (profile_stage's None).
    precision = args.dtype or ("fp16" if device.startswith("cuda") else "fp32")
    prof = profile_stage(
        args.model,
        layers_per_stage=args.layers,
        seq_len=args.seq_len,
        max_batch_slice_size=args.batch,
        granularity=args.granularity,
        repeats=args.repeats,
        rounds=args.rounds,
        device=device,
        precision=precision,
        dropout=args.dropout,
        attention=args.attention,
        link_bandwidth=args.link_bandwidth,
        link_latency=args.link_latency,
        threads=args.threads,
        progress=not args.quiet,
    )
    prof.save(args.out)
    print(
        f"profiled {prof.config.name}: {prof.layers_per_stage} layer(s) on {prof.timed()}, "
        f"L={prof.seq_len}, g={prof.granularity}, "
        f"batch slice sizes {list(prof.batch_slice_sizes)} -> {args.out}"
    )
    errors = zip(prof.batch_slice_sizes, prof.holdout_error, prof.holdout_error_ctx, strict=True)
    for b, e, e_ctx in errors:
        print(f"  b={b}: Eq. 9 held-out error {e:.2%} of t(b,l,c), {e_ctx:.2%} of the overhead")
    return 0


def _slices(p: Plan) -> dict[str, Any]:
    return {
        "batch_slices": list(p.batch_slices),
        "token_slices": [list(t) for t in p.token_slices],
        "paper": p.to_paper(),
    }


def _report(
    args: argparse.Namespace,
    header: str,
    meta: dict[str, Any],
    cost: SliceCostModel,
    p: Plan,
    uni: Plan,
    n_stages: int,
    plan_seconds: float,
    memory: SliceMemory | None = None,
) -> int:
    """Print the plan beside the best uniform slicing, both on the same yardstick: the
    fill-drain latency sum t + (K - 1) max t. For method="paper" the planner's own
    objective (Plan.latency) differs and is reported as ``objective``."""
    latency = pipeline_latency(p, cost, n_stages)
    uni_latency = pipeline_latency(uni, cost, n_stages)
    method = (args.method or "exact") if args.slicing == "dp" else None
    out = {
        **meta,
        "slicing": args.slicing,
        "method": method,
        "eps": args.eps,
        **_slices(p),
        "latency": latency,
        "objective": p.latency,
        "t_max": p.t_max,
        "plan_seconds": plan_seconds,
        "uniform": {**_slices(uni), "latency": uni_latency},
        "speedup_vs_uniform": uni_latency / latency,
    }
    if memory is not None:
        out |= {
            "memory_gib": args.memory_gib,
            "schedule": args.schedule or "terapipe",
            "peak_gib": peak_bytes(p, memory) / GIB,
        }
    if args.json:
        print(json.dumps(out))
        return 0
    print(header)
    label = f"dp, {method}" if method else args.slicing
    print(f"  plan ({label}): {p.to_paper()}")
    print(f"  predicted latency {latency:.4g} s (planned in {plan_seconds:.3f} s)")
    if memory is not None:
        print(
            f"  peak memory {out['peak_gib']:.2f} GiB of {args.memory_gib:g} GiB "
            f"({out['schedule']}'s units in flight)"
        )
    print(f"  best uniform: {uni.to_paper()}: {uni_latency:.4g} s")
    print(f"  uniform / plan = {uni_latency / latency:.3f}")
    return 0


def _check_slicing(args: argparse.Namespace) -> None:
    """Refuse options the asked slicing would ignore."""
    if args.slicing == "dp" and args.slices is not None:
        raise ValueError(
            "--slices applies to --slicing seq1f1b or uniform: the DP chooses its own slices"
        )
    if args.slicing != "dp" and args.method is not None:
        raise ValueError(f"--method applies to --slicing dp, not {args.slicing}")
    if args.schedule is not None and args.memory_gib is None:
        raise ValueError(
            "--schedule applies with --memory-gib: it names whose units the memory holds"
        )


def _make_plan(
    args: argparse.Namespace,
    cost: SliceCostModel,
    flops: FlopModel,
    memory: SliceMemory | None,
    *,
    seq_len: int,
    batch: int,
    n_stages: int,
    granularity: int,
    max_batch_slice_size: int | None = None,
) -> Plan:
    """The plan ``--slicing`` asks for, within ``--memory-gib`` if given."""
    capacity = None if memory is None else args.memory_gib * GIB
    shape = {"seq_len": seq_len, "batch": batch, "n_stages": n_stages}
    if args.slicing == "seq1f1b":
        return best_seq1f1b(
            cost, flops, **shape, granularity=granularity, n_slices=args.slices,
            memory=memory, capacity=capacity,
        )  # fmt: skip
    if args.slicing == "uniform":
        n = grid_size(seq_len, granularity)
        ks = [args.slices] if args.slices else [2**e for e in range(n.bit_length())]
        plans = [uniform(cost, seq_len, batch, n_stages, k, granularity=granularity) for k in ks]
        if memory is not None and capacity is not None:
            peaks = [peak_bytes(q, memory) for q in plans]
            plans = [q for q, peak in zip(plans, peaks, strict=True) if peak <= capacity]
            if not plans:
                raise NothingFitsError(
                    f"no uniform slicing ({ks[0]}..{ks[-1]} slices) fits in "
                    f"{args.memory_gib:g} GiB: the smallest peak is {min(peaks) / GIB:.3f} GiB",
                    min(peaks),
                )
        return min(plans, key=lambda q: pipeline_latency(q, cost, n_stages))
    return plan_slices(
        cost, **shape, granularity=granularity, eps=args.eps, method=args.method or "exact",
        max_batch_slice_size=max_batch_slice_size, memory=memory, capacity=capacity,
    )  # fmt: skip


def _plan_setting(args: argparse.Namespace) -> int:
    from tplib.cluster.slice_memory import ClusterSliceMemory
    from tplib.paper import setting
    from tplib.search.setting import GRANULARITY, cost_model

    s = setting(args.setting, args.seq_len)
    cost = cost_model(s)
    memory = None
    if args.memory_gib is not None:
        memory = ClusterSliceMemory.of(cost, args.schedule or "terapipe")
    t0 = time.perf_counter()
    p = _make_plan(
        args,
        cost,
        FlopModel.of(s.config),
        memory,
        seq_len=s.seq_len,
        batch=s.pipeline_batch,
        n_stages=s.n_stages,
        granularity=GRANULARITY,
    )
    seconds = time.perf_counter() - t0
    uni = best_uniform(cost, s.seq_len, s.pipeline_batch, s.n_stages, 1, GRANULARITY)
    meta = {
        "setting": args.setting,
        "model": s.model,
        "cost_model": "V100 cluster (tplib.cluster)",
        "seq_len": s.seq_len,
        "pipeline_batch": s.pipeline_batch,
        "n_stages": s.n_stages,
        "n_op": s.n_op,
        "n_data": s.n_data,
    }
    header = (
        f"setting ({args.setting}) {s.model}: L={s.seq_len}, B={s.pipeline_batch} per "
        f"pipeline, K={s.n_stages}, #Op={s.n_op}, #Data={s.n_data}; V100-cluster model"
    )
    return _report(args, header, meta, cost, p, uni, s.n_stages, seconds, memory)


def _best_uniform_sizes(cost: Any, seq_len: int, batch: int, n_stages: int, g: int) -> Plan:
    """The best uniform slicing over every profiled batch-slice size dividing the batch."""
    sizes = [b for b in cost.batch_slice_sizes if batch % b == 0]
    if not sizes:
        raise ValueError(
            f"no profiled batch slice size {list(cost.batch_slice_sizes)} divides "
            f"batch={batch}: uniform slicing needs equal batch slices"
        )
    plans = [best_uniform(cost, seq_len, batch, n_stages, b, g) for b in sizes]
    return min(plans, key=lambda u: pipeline_latency(u, cost, n_stages))


# What plan takes only with --profile; with --setting they used to be ignored in silence.
_PROFILE_ONLY = ("batch", "stages", "granularity", "max_batch_slice_size")


def plan_command(args: argparse.Namespace) -> int:
    from tplib.perfmodel import Profile

    if (args.profile is None) == (args.setting is None):
        raise ValueError("give exactly one of --profile FILE or --setting N")
    _check_slicing(args)
    if args.setting is not None:
        given = [f"--{n.replace('_', '-')}" for n in _PROFILE_ONLY if getattr(args, n) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} only to "
                "--profile: a paper setting fixes its batch, stages and grid"
            )
        return _plan_setting(args)
    for name in ("seq_len", "batch", "stages"):
        if getattr(args, name) is None:
            raise ValueError(f"--{name.replace('_', '-')} is required with --profile")
    if args.memory_gib is not None:
        raise ValueError(
            "--memory-gib needs --setting: a profile times a stage but has no memory model"
        )
    try:
        prof = Profile.load(args.profile)
    except OSError as exc:
        raise ValueError(f"cannot read profile {args.profile}: {exc.strerror or exc}") from None
    g = prof.granularity if args.granularity is None else args.granularity
    t0 = time.perf_counter()
    p = _make_plan(
        args,
        prof,
        FlopModel.of(prof.config),
        None,
        seq_len=args.seq_len,
        batch=args.batch,
        n_stages=args.stages,
        granularity=g,
        max_batch_slice_size=args.max_batch_slice_size,
    )
    seconds = time.perf_counter() - t0
    uni = _best_uniform_sizes(prof, args.seq_len, args.batch, args.stages, g)
    meta = {
        "profile": str(args.profile),
        "model": prof.config.name,
        "device": prof.device,
        "precision": prof.precision,
        "attention": prof.attention,
        "dropout": prof.dropout,
        "seq_len": args.seq_len,
        "pipeline_batch": args.batch,
        "n_stages": args.stages,
        "granularity": g,
    }
    header = (
        f"profile {args.profile} ({prof.config.name} on {prof.timed()}): K={args.stages}, "
        f"L={args.seq_len}, B={args.batch}, g={g}"
    )
    _warn_dropout(args.profile, prof)
    return _report(args, header, meta, prof, p, uni, args.stages, seconds)


def _warn_dropout(path: str, prof: Profile) -> None:
    """A run of the profiled model trains with its dropout: say so when the profile timed
    another rate (the precision and device a run will use are not known here)."""
    if prof.dropout != prof.config.dropout:
        print(
            f"warning: profile {path} timed dropout {prof.dropout:g}, but "
            f"{prof.config.name} trains with dropout {prof.config.dropout:g}: a run of it "
            "pays another cost than the plan is priced on (re-profile with --dropout "
            f"{prof.config.dropout:g})",
            file=sys.stderr,
        )


def simulate_command(args: argparse.Namespace) -> int:
    from tplib.paper import GPIPE, TERAPIPE, main_row, seqlen_row
    from tplib.search.setting import beside_paper, simulate_setting

    r = simulate_setting(args.setting, seq_len=args.seq_len, method=args.method, eps=args.eps)
    # Setting (5) at L = 2048 is in Tables 2 and 4 alike; Table 2 is the one it belongs to.
    seq_len = cast(int, r["seq_len"])
    if seq_len == 2048:
        g, t = main_row(args.setting, GPIPE), main_row(args.setting, TERAPIPE)
    else:
        g, t = seqlen_row(seq_len, GPIPE), seqlen_row(seq_len, TERAPIPE)
    r = beside_paper(r, g, t)
    if args.json:
        print(json.dumps(r, default=float))
        return 0
    print(
        f"setting ({args.setting}) {r['model']}: L={r['seq_len']}, B={r['pipeline_batch']} per "
        f"pipeline, K={r['n_stages']}, #Op={r['n_op']}, #Data={r['n_data']}"
    )
    rows = [
        ("", "ours (simulated V100 cluster)", f"paper's reference (Table {t.table}, measured)"),
        ("w/o TeraPipe (GPipe)", f"{r['latency_gpipe']:.4f} s", f"{g.latency:.3f} s"),
        ("w/  TeraPipe (DP)", f"{r['latency_terapipe']:.4f} s", f"{t.latency:.3f} s"),
        ("speedup", f"{r['speedup']:.2f}x", f"{r['paper_speedup']:.2f}x"),
    ]
    for name, ours, paper in rows:
        print(f"  {name:<21} {ours:<30} {paper}")
    print(f"  our plan:     {r['plan']}; TFLOPS per GPU {r['tflops_per_gpu']:.3f}")
    print(f"  paper's plan: {t.scheme}")
    return 0
