"""``predict``: what a Megatron-style GPT training run costs on a cluster.

``python -m tplib predict --cluster dgx-h100 --gpus 512 --layers 96 --hidden 12288
--heads 96 --tp 8 --pp 8 --interleave 4 --batch 1536 --microbatch 1 --recompute selective
--sequence-parallel --distributed-optimizer`` (``--cp`` for context parallelism) prints the iteration time, TFLOPS per GPU
and MFU (Narayanan et al. 2021's FLOP formula, stated in the output), the busiest GPU's
memory and whether it fits; ``--json`` gives the same as one JSON object
(``iteration_s``, ``tflops_per_gpu``, ``mfu``, ``memory_gib``, ``fits`` and more). The
run is checked whole first (:class:`~tplib.search.megatron.MegatronRun`): a rule it
breaks is named and the command exits with 2. Numpy only: no torch is imported.
"""

from __future__ import annotations

import argparse
import json

from tplib.cli.arguments import COUNT, rate
from tplib.cluster.hardware import CLUSTERS
from tplib.cluster.implementation import ATTENTIONS, RECOMPUTES
from tplib.search.megatron import SCHEDULES, MegatronRun, predict

__all__ = ["add_predict", "predict_command"]

_FORMULA = {
    True: "96 B s l h^2 (1 + s/6h + V/16lh), with recomputation's extra forward",
    False: "72 B s l h^2 (1 + s/6h + V/12lh)",
}


def add_predict(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``predict`` on the command line's subparsers."""
    p = sub.add_parser("predict", help="a Megatron-style GPT run priced on a cluster")
    p.add_argument("--cluster", choices=sorted(CLUSTERS), required=True)
    p.add_argument("--gpus", type=COUNT, required=True, help="N, whole nodes")
    for name, what in (("layers", "l"), ("hidden", "h"), ("heads", "a")):
        p.add_argument(f"--{name}", type=COUNT, required=True, help=what)
    p.add_argument("--vocab", type=COUNT, default=51200, help="V (default 51200)")
    p.add_argument("--seq-len", type=COUNT, default=2048, help="s (default 2048)")
    p.add_argument("--tp", type=COUNT, default=1, help="T, tensor parallel (#Op)")
    p.add_argument("--pp", type=COUNT, default=1, help="P, pipeline stages (#Pipe)")
    p.add_argument("--cp", type=COUNT, default=1, help="C, context parallel (#CP)")
    p.add_argument("--batch", type=COUNT, required=True, help="B, global batch")
    p.add_argument("--microbatch", type=COUNT, default=1, help="m (default 1)")
    p.add_argument("--interleave", type=COUNT, default=1, help="v chunks per stage")
    p.add_argument("--recompute", choices=RECOMPUTES, default="none")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--schedule", choices=SCHEDULES, help="default: 1f1b, or interleaved")
    p.add_argument("--attention", choices=ATTENTIONS, help="default: flash where it runs")
    p.add_argument("--dropout", type=rate, default=0.1, help="default 0.1")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=predict_command)


def predict_command(args: argparse.Namespace) -> int:
    run = MegatronRun(
        cluster=args.cluster,
        gpus=args.gpus,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        batch=args.batch,
        vocab=args.vocab,
        seq_len=args.seq_len,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        microbatch=args.microbatch,
        interleave=args.interleave,
        recompute=args.recompute,
        sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        schedule=args.schedule,
        attention=args.attention,
        dropout=args.dropout,
    )
    p = predict(run)
    if args.json:
        print(json.dumps(p.as_dict(), indent=1))
        return 0
    counted = _FORMULA[run.recompute == "full"]
    print(
        f"{run.cluster}: {run.gpus} GPUs, T={run.tp}"
        + (f" C={run.cp}" if run.cp > 1 else "")
        + f" P={run.pp} #Data={run.n_data}"
        + (f" v={run.interleave}" if run.interleave > 1 else "")
        + f"; {run.microbatches} microbatches of {run.microbatch} per pipeline; "
        f"{run.schedule_name}, attention {run.implementation.attention}, "
        f"recompute {run.recompute}"
        + (", sequence parallel" if run.sequence_parallel else "")
        + (", distributed optimizer" if run.distributed_optimizer else "")
    )
    print(f"  iteration   {p.iteration_s:.3f} s (bubble {p.bubble_fraction:.1%})")
    print(f"  TFLOPS/GPU  {p.tflops_per_gpu:.1f}   FLOPs: Narayanan et al. 2021, {counted}")
    print(f"  MFU         {p.mfu:.1%}   model FLOPs {_FORMULA[False]} / dense peak")
    fits = "fits" if p.fits else "does NOT fit"
    print(f"  memory      {p.memory_gib:.1f} GiB of {p.capacity_gib:.0f} GiB per GPU: {fits}")
    return 0
