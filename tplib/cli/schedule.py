"""``schedule``: tplib's schedules in torch.distributed.pipelining's action CSV and back.

- ``export NAME``: a registered schedule of whole microbatches as torch's CSV
  (:mod:`tplib.schedule.torchio`), ``compute_only`` or ``compute_comms``;
- ``import FILE``: a torch CSV (either format) read, what it holds printed, made a tplib
  schedule and checked (the validator, NCCL's rendezvous replay); ``--out`` saves tplib's
  CSV of it;
- ``show NAME-or-FILE``: the stage x step grid, and the simulated latency and bubble
  under uniform costs (``--t-f``, ``--t-b`` with its ``--t-w``, ``--t-send``): NAME is a
  registered schedule or one of torch's classes (``ScheduleZBVZeroBubble``, read from
  torch itself), FILE a torch CSV or tplib's own.

Only a torch class name imports torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tplib.plan import Plan
from tplib.schedule import Schedule, draw_schedule, make_schedule, registered, validate
from tplib.schedule.chunks import identity, interleaved, v_shape
from tplib.schedule.nccl import check_nccl
from tplib.schedule.registry import REGISTRY
from tplib.schedule.torchio import TorchOrder, read_torch, to_torch, write_torch_csv

__all__ = ["export_command", "import_command", "show_command"]

TORCH_CLASSES = (  # tplib.runtime.torchorders.TORCH_SCHEDULES, named here without torch
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)


def _registered(args: argparse.Namespace) -> Schedule:
    """The registered schedule ``args.name`` on ``--stages`` K and ``--microbatches`` M."""
    entry = registered(args.name)
    for option in ("stages", "microbatches"):
        if getattr(args, option) is None:
            raise ValueError(f"schedule {args.name!r} needs --{option}")
    if args.chunks is not None and not entry.chunked:
        raise ValueError(
            f"--chunks {args.chunks} with schedule {args.name!r}: it places one chunk per "
            f"stage; the schedules with virtual stages are "
            f"{[n for n, e in REGISTRY.items() if e.chunked]}"
        )
    plan = Plan.gpipe(args.microbatches, args.seq_len)
    return make_schedule(args.name, args.stages, plan, n_chunks=args.chunks)


def export_command(args: argparse.Namespace) -> int:
    schedule = _registered(args)
    write_torch_csv(to_torch(schedule, args.format), args.out)
    v = f", {schedule.n_chunks} stages per rank" if schedule.n_chunks > 1 else ""
    print(
        f"{schedule.name}: {schedule.n_stages} ranks{v}, {schedule.plan.n_batch_slices} "
        f"microbatches, torch {args.format} CSV -> {args.out}"
    )
    return 0


def _placement_kind(order: TorchOrder) -> str:
    k, v = order.n_ranks, order.n_chunks
    if order.placement == identity(k):
        return "one stage per rank"
    if order.placement == interleaved(k, v):
        return "interleaved: stage i on rank i % K"
    if v == 2 and order.placement == v_shape(k):
        return "V-shape: stages r and 2K-1-r on rank r"
    return f"stages on ranks {order.placement}"


def _describe(order: TorchOrder) -> list[str]:
    lines = [
        f"format: {order.fmt}",
        f"ranks (K): {order.n_ranks}, stages per rank (v): {order.n_chunks}",
        f"placement: {_placement_kind(order)}",
        f"microbatches: {order.n_microbatches}",
    ]
    if order.split_backward:
        lines.append("backwards split into I (tplib's B) and W")
    if order.n_combined:
        lines.append(f"combined actions: {order.n_combined} OVERLAP_F_B, each run as its parts")
    if order.fmt == "compute_comms":
        lines.append("its sends and receives: consistent (replaced by tplib's own)")
    return lines


def _checked(schedule: Schedule) -> list[str]:
    validate(schedule)
    check_nccl(schedule)
    return [
        "valid: complete, in dependency order, FIFO on every link, no deadlock; "
        "no deadlock on NCCL's rendezvous messages"
    ]


def import_command(args: argparse.Namespace) -> int:
    order = read_torch(args.file)
    schedule = order.to_schedule(args.seq_len, name=args.name or Path(args.file).stem)
    print("\n".join([f"{args.file}:", *_describe(order), *_checked(schedule)]))
    if args.out:
        schedule.to_csv(args.out)
        print(f"tplib CSV -> {args.out}")
    return 0


def _tplib_csv(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        return f.readline().startswith("# name:")


def _shown(args: argparse.Namespace) -> Schedule:
    """The schedule ``show`` names: a file, a registered name or one of torch's classes."""
    path = Path(args.name)
    if path.is_file():
        if _tplib_csv(path):
            return Schedule.from_csv(path)
        return read_torch(path).to_schedule(args.seq_len, name=path.stem)
    if args.name in TORCH_CLASSES:
        from tplib.runtime.torchorders import torch_schedule

        if args.stages is None or args.microbatches is None:
            raise ValueError(f"{args.name} needs --stages and --microbatches")
        return torch_schedule(
            args.name, args.stages, args.microbatches, args.chunks, seq_len=args.seq_len
        )
    if args.name not in REGISTRY:
        raise ValueError(
            f"{args.name!r} is neither a file, a registered schedule {list(REGISTRY)} nor "
            f"one of torch's {list(TORCH_CLASSES)}"
        )
    return _registered(args)


def show_command(args: argparse.Namespace) -> int:
    from tplib.runtime.torchorders import UniformCosts
    from tplib.sim.simulate import simulate

    if args.t_w > args.t_b:
        raise ValueError(
            f"--t-w {args.t_w} is more than --t-b {args.t_b}: the weight gradients are "
            "part of the backward"
        )
    schedule = _shown(args)
    validate(schedule)
    costs = UniformCosts(args.t_f, args.t_b, args.t_w, args.t_send)
    result = simulate(schedule, costs.placed(schedule.placement))
    w = f" (W {args.t_w}, when split)" if schedule.split_backward else ""
    print(draw_schedule(schedule))
    print(
        f"{schedule.name}: {schedule.n_stages} ranks x {schedule.n_chunks} chunk(s), "
        f"{schedule.plan.n_batch_slices} microbatches; costs per stage: F {args.t_f}, "
        f"B {args.t_b}{w}, send {args.t_send} (a chunk's work 1/v of its stage's)"
    )
    print(f"latency {result.latency:.4g}, bubble {result.bubble_fraction:.1%}")
    return 0
