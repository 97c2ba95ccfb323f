"""``python -m tplib bench``: time a schedule on local processes, the real runtime.

One run of :class:`~tplib.runtime.RunConfig` from the command line: the layout (#Pipe,
#Data, #Op, #CP, virtual stages), the data (synthetic rows, or with ``--packed`` rows of
whole documents, packed or padded, :mod:`tplib.runtime.batches`), recomputation,
precision and the optimizer's recipe; it prints the median iteration, the runtime's
overhead, each stage's measured and modelled peak memory, and for packed rows the real
tokens per second.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from tplib.cli.arguments import ANY_INT, COUNT, DISTRIBUTED_OPTIMIZER, integer, number
from tplib.nn.lr import LR_SCHEDULES

if TYPE_CHECKING:
    from tplib.runtime import Optim

__all__ = ["add_bench", "bench_command"]


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="time a schedule on local processes (the real runtime)")
    p.add_argument(
        "--schedule", required=True, help="gpipe, terapipe, 1f1b, terapipe-zb, 1f1b-zb, ..."
    )
    p.add_argument("--stages", type=ANY_INT, required=True, help="K: pipeline stages")
    p.add_argument("--batch", type=COUNT, required=True, help="B: sequences per iteration")
    p.add_argument("--seq-len", type=COUNT, required=True, help="L: tokens per sequence")
    p.add_argument("--slices", type=COUNT, default=1, help="equal token slices per sequence")
    p.add_argument("--model", default="small", help="named config (default small)")
    p.add_argument("--data", type=COUNT, default=1, help="#Data: data-parallel replicas")
    p.add_argument("--op", type=ANY_INT, default=1, help="#Op: operation-partitioning ranks/stage")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split LayerNorms, dropouts and residual adds along the tokens over #Op",
    )
    p.add_argument(
        "--cp",
        type=ANY_INT,
        default=1,
        help="#CP: context-parallel ranks per stage and op rank (ring attention; every "
        "token slice divisible by 2 x #CP)",
    )
    p.add_argument(
        "--packed",
        choices=("corpus", "lognormal"),
        help="rows of whole documents: each stdlib file, or log-normal lengths",
    )
    p.add_argument(
        "--packing",
        choices=("ffd", "greedy", "pad"),
        default="ffd",
        help="with --packed: first-fit decreasing, streaming greedy, or one "
        "document per row padded to L",
    )
    p.add_argument(
        "--no-document-masking",
        action="store_true",
        help="with --packed: attend across the documents of a row",
    )
    p.add_argument(
        "--chunks",
        type=ANY_INT,
        help="v: chunks (virtual stages) per stage, for the schedules that place them "
        "(default: the schedule's, 2 for interleaved-1f1b, zbv, ...)",
    )
    p.add_argument(
        "--recompute",
        default="none",
        help="none, selective (the attention core again in backward) or full (the whole "
        "forward again in backward)",
    )
    p.add_argument("--distributed-optimizer", action="store_true", help=DISTRIBUTED_OPTIMIZER)
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 (autocast) or fp16 (CUDA)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        help="instead of the rule: nccl for cuda with a GPU per rank, gloo otherwise",
    )
    p.add_argument("--iters", type=COUNT, default=5, help="timed iterations")
    p.add_argument("--warmup", type=integer(0), default=1, help="untimed iterations first")
    p.add_argument(
        "--timeout", type=number(0, above=True), default=300.0, help="communication timeout, s"
    )
    p.add_argument("--threads", type=integer(0), help="torch threads per process (0: share)")
    # The optimizer's recipe, left None when not given: an asynchronous schedule then gets
    # a recipe it accepts (bench_command), where a given one is the user's to keep.
    p.add_argument(
        "--grad-clip",
        type=number(0),
        help="clip the global gradient norm to this, 0: no clipping (default 1.0; 0 for "
        "the asynchronous pipedream and 2bw, which refuse clipping)",
    )
    p.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        help="cosine (linear warm-up, cosine decay to a floor; default) or constant",
    )
    p.add_argument(
        "--weight-decay-params",
        help="which parameters AdamW decays: matrices (ndim >= 2, as GPT-3; default) or all",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=bench_command)


def _bench_recipe(args: argparse.Namespace) -> tuple[Optim, str]:
    """The optimizer's recipe of ``bench``'s options, and a line saying what an
    asynchronous schedule's recipe changed from the default ("" if nothing).

    The default recipe (GPT-3's) clips gradients, which pipedream and 2bw refuse: clipping
    to the global norm needs every stage at once, a flush. Where the user left
    ``--grad-clip`` out they train unclipped; where they gave a norm, it is refused here,
    naming the option."""
    from tplib.runtime import Optim
    from tplib.schedule import registered

    given: dict[str, Any] = {
        field: value
        for field, value in (
            ("grad_clip", args.grad_clip),
            ("lr_schedule_name", args.lr_schedule),
            ("weight_decay_params", args.weight_decay_params),
        )
        if value is not None
    }
    if not registered(args.schedule).asynchronous:
        return Optim(**given), ""
    if given.get("grad_clip", 0) > 0:
        raise ValueError(
            f"--grad-clip={args.grad_clip} with --schedule {args.schedule}: an asynchronous "
            "schedule updates each stage without a flush, and clipping to the global "
            "gradient norm needs one; give --grad-clip 0 or leave it out"
        )
    if "grad_clip" in given:
        return Optim(**given), ""
    default = Optim().grad_clip
    return Optim(**given, grad_clip=0.0), (
        f"note: --schedule {args.schedule} is asynchronous and refuses gradient clipping "
        f"(it needs a flush), so bench trains it with --grad-clip 0 instead of the default "
        f"{default:g}"
    )


def bench_command(args: argparse.Namespace) -> int:
    from tplib.runtime import (  # starts processes: import only when asked
        Data,
        Parallelism,
        RunConfig,
        Timing,
        bench,
    )
    from tplib.runtime.pool import local_backend
    from tplib.schedule import registered

    entry = registered(args.schedule)
    if not entry.token_slices and args.slices != 1:
        raise ValueError(
            f"--slices={args.slices} with {args.schedule}: {args.schedule} runs whole "
            "sequences (microbatches) and does not slice tokens"
        )
    chunks = entry.default_chunks if args.chunks is None else args.chunks
    optim, changed = _bench_recipe(args)
    run = RunConfig(
        model=args.model,
        schedule_name=args.schedule,
        parallelism=Parallelism(
            n_stages=args.stages,
            n_data=args.data,
            n_op=args.op,
            n_cp=args.cp,
            n_chunks=chunks,
            sequence_parallel=args.sequence_parallel,
            distributed_optimizer=args.distributed_optimizer,
        ),
        recompute=args.recompute,
        precision=args.dtype,
        device=args.device,
        data=Data(
            batch=args.batch,
            seq_len=args.seq_len,
            source=f"{args.packed}-documents" if args.packed else "synthetic",
            packing=args.packing,
            document_masking=not args.no_document_masking,
        ),
        slicing=args.slices,
        timing=Timing(
            steps=args.iters, warmup=args.warmup, timeout_s=args.timeout, threads=args.threads or 0
        ),
        optim=optim,
    )
    choice = local_backend(run, args.backend)  # refused here, before any process starts
    if changed:
        print(changed, file=sys.stderr)
    result = bench(run, backend=choice.backend)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    par, data = run.parallelism, run.data
    print(
        f"{run.schedule_name}: {run.model}, K={par.n_stages}, #Data={par.n_data}, "
        f"#Op={par.n_op}{' sequence-parallel' if par.sequence_parallel else ''}"
        f"{f', #CP={par.n_cp}' if par.n_cp > 1 else ''}"
        f"{' (distributed optimizer)' if par.distributed_optimizer else ''}, "
        f"B={data.batch}, L={data.seq_len}, recompute={run.recompute}, "
        f"{run.precision} on {run.device}, plan {result.plan}"
    )
    if run.padded_vocab != run.cfg.vocab_size:
        print(f"  vocabulary padded from {run.cfg.vocab_size} to {run.padded_vocab} rows")
    print(f"  {choice}")
    print(
        f"  median iteration latency {result.median_latency_s:.4f} s over {result.iterations} "
        f"iterations (mean {result.latency_mean_s:.4f} ± {result.latency_std_s:.4f})"
    )
    if data.packed:
        from tplib.runtime.batches import real_tokens

        real = real_tokens(run.cfg, data, range(run.timing.warmup, run.timing.iterations))
        mean = sum(real) / len(real)
        print(
            f"  {data.source} packed {data.packing}, document masking "
            f"{'on' if data.document_masking else 'off'}: {mean:.0f} real tokens per "
            f"iteration ({1 - mean / (data.batch * data.seq_len):.1%} padding), "
            f"{mean / result.median_latency_s:.0f} real tokens/s"
        )
    print(
        f"  busiest stage's own work {result.busiest_work_s:.4f} s; "
        f"runtime overhead {result.overhead_s:.4f} s"
    )
    mib = 2**20
    for k, (got, want) in enumerate(
        zip(result.stage_peak_bytes, result.modelled_peak_bytes, strict=True)
    ):
        print(
            f"  stage {k} peak memory {got / mib:.2f} MiB ({result.memory_source}); "
            f"model {want / mib:.2f} MiB ({want / got - 1:+.1%})"
            + (" (the model does not know #CP: it prices whole slices)" if par.n_cp > 1 else "")
        )
    return 0
