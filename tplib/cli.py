"""Command line: ``python -m tplib <command> ...`` (also installed as ``tplib``).

Commands:

- ``profile``: time one pipeline stage on this machine and save a :class:`~tplib.perfmodel.Profile`.
- ``plan``: run the DP planner on a saved profile and compare with the best uniform slicing.
- ``bench``: train iterations of a schedule on local processes; median latency and overhead.

Each command is one small function from parsed arguments to an exit code; add a command
by writing one and registering it in :func:`build_parser`. Bad input (a ``ValueError``
from the library, an unreadable file) prints ``error: ...`` and exits with 2, as
argparse does for usage errors; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from tplib.perfmodel import DEFAULT_BANDWIDTH, DEFAULT_LATENCY, DTYPES, Profile, profile_stage
from tplib.plan import Plan
from tplib.planner import best_uniform, pipeline_latency, plan

__all__ = ["build_parser", "main"]


def _profile(args: argparse.Namespace) -> int:
    prof = profile_stage(
        args.model, n_layers=args.layers, seq_len=args.seq_len, max_batch=args.batch,
        granularity=args.granularity, repeats=args.repeats, rounds=args.rounds,
        device=args.device, dtype=args.dtype, bandwidth=args.bandwidth, latency=args.latency,
        threads=args.threads, progress=not args.quiet,
    )  # fmt: skip
    prof.save(args.out)
    print(
        f"profiled {prof.config.name}: {prof.n_layers} layer(s) on {prof.device} "
        f"({prof.dtype}), L={prof.seq_len}, g={prof.granularity}, "
        f"batch sizes {list(prof.batch_sizes)} -> {args.out}"
    )
    errors = zip(prof.batch_sizes, prof.holdout_error, prof.holdout_error_ctx, strict=True)
    for b, e, e_ctx in errors:
        print(f"  b={b}: Eq. 9 held-out error {e:.2%} of t(b,l,c), {e_ctx:.2%} of the overhead")
    return 0


def _best_uniform(prof: Profile, seq_len: int, batch: int, n_stages: int, g: int) -> Plan:
    """The best uniform slicing over every profiled batch-slice size dividing the batch."""
    sizes = [b for b in prof.batch_sizes if batch % b == 0]
    if not sizes:
        raise ValueError(
            f"no profiled batch size {list(prof.batch_sizes)} divides batch={batch}: "
            "uniform slicing needs equal batch slices"
        )
    plans = [best_uniform(prof, seq_len, batch, n_stages, b, g) for b in sizes]
    return min(plans, key=lambda p: pipeline_latency(p, prof, n_stages))


def _plan_setting(args: argparse.Namespace) -> int:
    """Plan a paper setting on the V100-cluster model (tplib.cluster)."""
    from tplib import experiments
    from tplib.paper import setting

    s = setting(args.setting, args.seq_len)
    cost = experiments.cost_model(s)
    t0 = time.perf_counter()
    p = experiments.plan_terapipe(s, method=args.method, eps=args.eps)
    plan_seconds = time.perf_counter() - t0
    uni = best_uniform(cost, s.seq_len, s.pipeline_batch, s.n_stages, 1, experiments.GRANULARITY)
    latency = pipeline_latency(p, cost, s.n_stages)
    uni_latency = pipeline_latency(uni, cost, s.n_stages)
    out = {
        "setting": args.setting, "model": s.model, "cost_model": "V100 cluster (tplib.cluster)",
        "method": args.method, "seq_len": s.seq_len, "batch": s.pipeline_batch,
        "n_stages": s.n_stages, "n_op": s.n_op, "n_data": s.n_data, "eps": args.eps,
        "batch_slices": list(p.batch_slices), "token_slices": [list(t) for t in p.token_slices],
        "paper": p.to_paper(), "latency": latency, "objective": p.latency, "t_max": p.t_max,
        "plan_seconds": plan_seconds,
        "uniform": {"paper": uni.to_paper(), "latency": uni_latency},
        "speedup_vs_uniform": uni_latency / latency,
    }  # fmt: skip
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"setting ({args.setting}) {s.model}: L={s.seq_len}, B={s.pipeline_batch} per pipeline, "
          f"K={s.n_stages}, #Op={s.n_op}, #Data={s.n_data}; V100-cluster model")  # fmt: skip
    print(f"  plan ({args.method}): {out['paper']}")
    print(f"  predicted latency {latency:.4f} s (planned in {plan_seconds:.3f} s)")
    print(f"  best uniform: {uni.to_paper()}: {uni_latency:.4f} s ({uni_latency / latency:.3f}x)")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from tplib import experiments

    r = experiments.simulate_setting(
        args.setting, seq_len=args.seq_len, method=args.method, eps=args.eps
    )
    if args.json:
        print(json.dumps(r, default=float))
        return 0
    print(f"setting ({args.setting}) {r['model']}: L={r['seq_len']}, B={r['batch']} per pipeline, "
          f"K={r['n_stages']}, #Op={r['n_op']}, #Data={r['n_data']} (simulated V100 cluster)")  # fmt: skip
    print(f"  w/o TeraPipe (GPipe): {r['latency_gpipe']:.4f} s")
    print(f"  w/  TeraPipe (DP):    {r['latency_terapipe']:.4f} s  plan {r['plan']}")
    print(f"  speedup {r['speedup']:.2f}x; TFLOPS per GPU {r['tflops_per_gpu']:.3f}")
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    from tplib import reproduce

    jobs = reproduce.default_jobs(args.mode)
    if args.only:
        jobs = [j for j in jobs if j.notebook in args.only]
    ran = reproduce.run_jobs(jobs, force=args.force)
    print(
        f"ran {len(ran)} of {len(jobs)} notebooks; results in {reproduce.repo_root() / 'results'}"
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    if (args.profile is None) == (args.setting is None):
        raise ValueError("give exactly one of --profile FILE or --setting N")
    if args.setting is not None:
        return _plan_setting(args)
    for name in ("seq_len", "batch", "stages"):
        if getattr(args, name) is None:
            raise ValueError(f"--{name.replace('_', '-')} is required with --profile")
    try:
        prof = Profile.load(args.profile)
    except OSError as exc:
        raise ValueError(f"cannot read profile {args.profile}: {exc.strerror or exc}") from None
    g = args.granularity or prof.granularity
    t0 = time.perf_counter()
    p = plan(
        prof, seq_len=args.seq_len, batch=args.batch, n_stages=args.stages, granularity=g,
        eps=args.eps, method=args.method, max_batch_slice=args.max_batch_slice,
    )  # fmt: skip
    plan_seconds = time.perf_counter() - t0
    uni = _best_uniform(prof, args.seq_len, args.batch, args.stages, g)
    # Both on the same yardstick, the fill-drain latency sum t + (K - 1) max t; for
    # method="paper" the planner's own objective (Plan.latency) differs and is reported too.
    latency = pipeline_latency(p, prof, args.stages)
    uni_latency = pipeline_latency(uni, prof, args.stages)
    out = {
        "profile": str(args.profile), "model": prof.config.name, "device": prof.device,
        "method": args.method, "seq_len": args.seq_len, "batch": args.batch,
        "n_stages": args.stages, "eps": args.eps, "granularity": g,
        "batch_slices": list(p.batch_slices), "token_slices": [list(t) for t in p.token_slices],
        "paper": p.to_paper(), "latency": latency, "objective": p.latency, "t_max": p.t_max,
        "plan_seconds": plan_seconds,
        "uniform": {
            "batch_slices": list(uni.batch_slices),
            "token_slices": [list(t) for t in uni.token_slices],
            "paper": uni.to_paper(), "latency": uni_latency,
        },
        "speedup_vs_uniform": uni_latency / latency,
    }  # fmt: skip
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"plan ({args.method}, K={args.stages}, L={args.seq_len}, B={args.batch}, g={g}):")
    print(f"  {out['paper']}")
    print(f"  predicted latency {latency * 1e3:.3f} ms (planned in {plan_seconds:.3f} s)")
    print(f"best uniform: {out['uniform']['paper']}")
    print(f"  latency {uni_latency * 1e3:.3f} ms; uniform / plan = {uni_latency / latency:.3f}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tplib.bench import bench  # starts processes: import only when asked
    from tplib.runtime import RunConfig

    if args.schedule == "gpipe" and args.slices != 1:
        raise ValueError(f"--slices={args.slices} with gpipe: gpipe does not slice tokens")
    run = RunConfig(
        model=args.model, schedule=args.schedule, n_stages=args.stages,
        n_replicas=args.replicas, batch=args.batch, seq_len=args.seq_len,
        n_slices=args.slices, steps=args.iters, warmup=args.warmup,
        timeout_s=args.timeout, threads=args.threads or 0,
    )  # fmt: skip
    result = bench(run)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(
        f"{run.schedule}: {run.model}, K={run.n_stages}, R={run.n_replicas}, B={run.batch}, "
        f"L={run.seq_len}, plan {result.plan}"
    )
    print(
        f"  median iteration latency {result.median_latency_s:.4f} s over {result.iterations} "
        f"iterations (mean {result.latency_mean_s:.4f} ± {result.latency_std_s:.4f})"
    )
    print(
        f"  busiest stage compute {result.busiest_compute_s:.4f} s; "
        f"runtime overhead {result.overhead_s:.4f} s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tplib", description="TeraPipe kit: profile, plan and benchmark pipelines."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("profile", help="time one pipeline stage and save a profile (JSON)")
    p.add_argument("--model", required=True, help="named config, e.g. tiny, small, GPT3-1B")
    p.add_argument("--layers", type=int, default=1, help="blocks in the stage (default 1)")
    p.add_argument("--seq-len", type=int, help="L: longest slice + context (default: model's)")
    p.add_argument("--batch", type=int, default=1, help="profile batch sizes 1..B")
    p.add_argument("--granularity", type=int, default=8, help="g: lengths g, 2g, ..., L")
    p.add_argument("--repeats", type=int, default=5, help="timings per point (median)")
    p.add_argument(
        "--rounds", type=int, default=1, help="sweeps in random order (min); >1 on a shared machine"
    )
    p.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH, help="link, bytes/s")
    p.add_argument("--latency", type=float, default=DEFAULT_LATENCY, help="per message, s")
    p.add_argument("--threads", type=int, help="torch CPU threads while timing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--out", required=True, help="profile file to write")
    p.set_defaults(func=_profile)

    p = sub.add_parser("plan", help="plan the slicing from a saved profile")
    p.add_argument("--profile", help="profile file (from `tplib profile`)")
    p.add_argument("--setting", type=int, help="paper setting 1..10, on the V100-cluster model")
    p.add_argument("--seq-len", type=int, help="L: tokens per sequence")
    p.add_argument("--batch", type=int, help="B: sequences per iteration")
    p.add_argument("--stages", type=int, help="K: pipeline stages")
    p.add_argument("--eps", type=float, default=0.0, help="t_max tolerance, s (0: exact)")
    p.add_argument("--method", choices=("exact", "paper"), default="exact")
    p.add_argument("--granularity", type=int, help="g (default: the profile's)")
    p.add_argument("--max-batch-slice", type=int, help="largest batch slice allowed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_plan)

    p = sub.add_parser("bench", help="time a schedule on local processes (the real runtime)")
    p.add_argument("--schedule", required=True, help="gpipe, terapipe or 1f1b")
    p.add_argument("--stages", type=int, required=True, help="K: pipeline stages")
    p.add_argument("--batch", type=int, required=True, help="B: sequences per iteration")
    p.add_argument("--seq-len", type=int, required=True, help="L: tokens per sequence")
    p.add_argument("--slices", type=int, default=1, help="equal token slices per sequence")
    p.add_argument("--model", default="small", help="named config (default small)")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--iters", type=int, default=5, help="timed iterations")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--timeout", type=float, default=300.0, help="communication timeout, s")
    p.add_argument("--threads", type=int, help="torch threads per process")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_bench)

    p = sub.add_parser("simulate", help="a paper setting with and without TeraPipe, simulated")
    p.add_argument("--setting", type=int, required=True, help="paper setting 1..10 (Table 1)")
    p.add_argument("--seq-len", type=int, help="longer sequences as in Table 4 (setting 5)")
    p.add_argument("--method", choices=("exact", "paper"), default="exact")
    p.add_argument("--eps", type=float, default=1e-4, help="t_max tolerance, s")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_simulate)

    p = sub.add_parser("reproduce", help="execute the table notebooks with papermill")
    p.add_argument("--mode", choices=("simulate", "measure", "all"), default="simulate")
    p.add_argument("--only", nargs="*", help="notebook names (default: all)")
    p.add_argument("--force", action="store_true", help="rerun even where results exist")
    p.set_defaults(func=_reproduce)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors and --help: return the code, don't exit
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
