"""Command line: ``python -m tplib <command> ...`` (also installed as ``tplib``).

=============  ===========================================================================
command        what it does
=============  ===========================================================================
``profile``    time one pipeline stage on this machine and save a profile (JSON)
``plan``       the DP planner (or Seq1F1B's or uniform slicing) on a saved profile or
               a paper setting, within a memory capacity if given, beside the best
               uniform slicing
``simulate``   a paper setting with and without TeraPipe on the simulated V100 cluster
``autoplan``   search TeraPipe's whole layout (#Data, #Pipe, #Op, recomputation, plan)
               for a model, a GPU count and a batch
``partition``  the planners of GPipe, PipeDream and PipeDream-2BW on a model's layers
``bench``      train iterations of a schedule on local processes: latency, overhead and
               each stage's peak memory beside the memory model's
``run``        write the torchrun config of a Table-1 setting and print how to launch it
``table``      one paper table in simulate or measure mode, without Jupyter
``reproduce``  every table notebook under papermill (resumable), then the summary; with
               ``--launcher slurm`` one SLURM array task per configuration
``schedule``   schedules in torch.distributed.pipelining's action CSV: ``export`` a
               registered one, ``import`` and check torch's, ``show`` either's grid and
               simulated latency
``predict``    a Megatron-style GPT run on a cluster (DGX A100, DGX H100, p3.16xlarge):
               iteration time, TFLOPS per GPU, MFU, memory
=============  ===========================================================================

Each command is one small function from parsed arguments to an exit code, registered in
:func:`build_parser`. Bad input (a ``ValueError`` from the library, an unreadable file)
prints ``error: ...`` and exits with 2, as argparse does for usage errors; no traceback.
Numbers are checked as they are parsed (:func:`integer`, :func:`number`), before any
work: that they are numbers, finite, and in the ranges the library does not name itself.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tplib.cli.arguments import (
    ANY_INT,
    COUNT,
    DISTRIBUTED_OPTIMIZER,
    INT_LIMIT,
    integer,
    number,
    rate,
)
from tplib.cli.bench import add_bench
from tplib.cli.partitioning import autoplan_command, partition_command
from tplib.cli.planning import (
    MEMORY_SCHEDULES,
    SLICINGS,
    plan_command,
    profile_command,
    simulate_command,
)
from tplib.cli.predict import add_predict
from tplib.cli.runs import reproduce_command, run_command, table_command
from tplib.cli.schedule import export_command, import_command, show_command
from tplib.nn.configs import PRECISIONS
from tplib.perfmodel import DEFAULT_LINK_BANDWIDTH, DEFAULT_LINK_LATENCY
from tplib.perfmodel.conditions import IMPLS
from tplib.search.pricing import SEARCHED_SCHEDULES
from tplib.tables import TABLE_NAMES

__all__ = ["INT_LIMIT", "build_parser", "integer", "main", "number"]


def _add_profile(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("profile", help="time one pipeline stage and save a profile (JSON)")
    p.add_argument("--model", required=True, help="named config, e.g. tiny, small, GPT3-1B")
    p.add_argument("--layers", type=COUNT, default=1, help="layers in the stage (default 1)")
    p.add_argument("--seq-len", type=COUNT, help="L: longest slice + context (default: model's)")
    p.add_argument("--batch", type=COUNT, default=1, help="profile batch slice sizes 1..B")
    p.add_argument("--granularity", type=COUNT, default=8, help="g: lengths g, 2g, ..., L")
    p.add_argument("--repeats", type=COUNT, default=5, help="timings per point (median)")
    p.add_argument(
        "--rounds",
        type=COUNT,
        default=1,
        help="sweeps in random order (min); >1 on a shared machine",
    )
    p.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    # What a run of the model does, since the plan is priced on it.
    p.add_argument(
        "--dtype",
        choices=PRECISIONS,
        help="the run's precision: fp32, bf16 (autocast) or fp16 (CUDA); default fp16 on "
        "CUDA (as `run`), fp32 on CPU",
    )
    p.add_argument("--dropout", type=rate, help="dropout rate to train with (default: the model's)")
    p.add_argument(
        "--attention",
        choices=IMPLS,
        help="slice attention (default: the runtime's for the device; with dropout it is "
        "written out)",
    )
    p.add_argument(
        "--link-bandwidth",
        type=number(0, above=True),
        default=DEFAULT_LINK_BANDWIDTH,
        help="bytes/s",
    )
    p.add_argument(
        "--link-latency", type=number(0), default=DEFAULT_LINK_LATENCY, help="s per message"
    )
    p.add_argument("--threads", type=COUNT, help="torch CPU threads while timing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--out", required=True, help="profile file to write")
    p.set_defaults(func=profile_command)


def _add_plan_and_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="plan the slicing from a saved profile or a paper setting")
    p.add_argument("--profile", help="profile file (from `tplib profile`)")
    p.add_argument("--setting", type=ANY_INT, help="paper setting 1..10, on the V100-cluster model")
    p.add_argument("--seq-len", type=COUNT, help="L: tokens per sequence")
    p.add_argument("--batch", type=COUNT, help="B: sequences per pipeline per iteration (profile)")
    p.add_argument("--stages", type=ANY_INT, help="K: pipeline stages (profile)")
    p.add_argument("--eps", type=number(0), default=0.0, help="t_max tolerance, s (0: exact)")
    p.add_argument(
        "--method", choices=("exact", "paper"), help="the DP's objective (default exact)"
    )
    p.add_argument("--granularity", type=COUNT, help="g (default: the profile's)")
    p.add_argument("--max-batch-slice-size", type=COUNT, help="largest batch slice (profile)")
    p.add_argument(
        "--slicing",
        choices=SLICINGS,
        default="dp",
        help="dp: TeraPipe's DP (default); seq1f1b: equal-FLOP slices (Seq1F1B); uniform",
    )
    p.add_argument(
        "--slices", type=COUNT, help="token slices per sequence (seq1f1b, uniform; default: best)"
    )
    p.add_argument(
        "--memory-gib",
        type=number(0, above=True),
        help="GPU memory, GiB: only plans whose peak fits (--setting: the cluster's memory model)",
    )
    p.add_argument(
        "--schedule",
        choices=MEMORY_SCHEDULES,
        help="whose units the memory holds at once: terapipe (fill-drain, default) or 1f1b",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=plan_command)

    p = sub.add_parser("simulate", help="a paper setting with and without TeraPipe, simulated")
    p.add_argument("--setting", type=ANY_INT, required=True, help="paper setting 1..10 (Table 1)")
    p.add_argument("--seq-len", type=COUNT, help="longer sequences as in Table 4 (setting 5)")
    p.add_argument("--method", choices=("exact", "paper"), default="exact")
    p.add_argument("--eps", type=number(0), default=1e-4, help="t_max tolerance, s")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=simulate_command)


def _add_layouts(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("autoplan", help="search TeraPipe's layout for a model, GPUs and batch")
    p.add_argument("--model", required=True, help="named config, e.g. GPT3-44B")
    p.add_argument("--gpus", type=COUNT, required=True, help="#GPUs = #Data x #Pipe x #Op")
    p.add_argument("--batch", type=COUNT, required=True, help="B: the global batch, sequences")
    p.add_argument("--seq-len", type=COUNT, help="L (default: the model's)")
    p.add_argument("--cluster", default="p3.16xlarge", help="instance type (p3.16xlarge)")
    p.add_argument(
        "--memory", type=number(0, above=True), help="GiB per GPU (default: the cluster's)"
    )
    p.add_argument(
        "--recompute",
        choices=("both", "all", "none", "selective", "full"),
        default="both",
        help="recomputation to search: none, selective, full, both (none and full) or all",
    )
    p.add_argument("--schedules", nargs="+", choices=SEARCHED_SCHEDULES, default=["terapipe"],
                   help="the schedules to search (default terapipe)")  # fmt: skip
    p.add_argument("--cp", nargs="+", type=integer(0), default=[1],
                   help="#CP values to search (default 1); 0 alone: every one that can run")  # fmt: skip
    p.add_argument("--top", type=COUNT, default=5, help="configurations to print")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="write the best layout's torchrun config here (JSON)")
    p.add_argument("--result", default="result.pt", help="where its rank 0 writes results")
    p.add_argument("--steps", type=COUNT, default=10, help="its timed iterations")
    p.add_argument("--warmup", type=integer(0), default=2, help="its untimed iterations first")
    p.set_defaults(func=autoplan_command)

    p = sub.add_parser("partition", help="GPipe, PipeDream or 2BW's planner on a model")
    p.add_argument("--planner", choices=("gpipe", "pipedream", "2bw"), required=True)
    p.add_argument("--model", help="named config, e.g. GPT3-1B (the cluster model)")
    p.add_argument("--profiles", nargs="+", help="measured profiles of every stage, instead")
    p.add_argument("--memory", type=number(0, above=True), help="GiB per worker (with --profiles)")
    p.add_argument("--gpus", type=COUNT, default=8, help="GPUs or workers (pipedream, 2bw)")
    p.add_argument("--stages", type=ANY_INT, help="K (gpipe)")
    p.add_argument("--batch", type=COUNT, help="the global batch (2bw)")
    p.add_argument("--microbatch", type=COUNT, default=1, help="sequences per microbatch")
    p.add_argument("--seq-len", type=COUNT, help="L (default: the model's)")
    p.add_argument("--top", type=COUNT, default=5, help="configurations to print (2bw)")
    p.add_argument("--no-memory-check", action="store_true", help="pipedream: ignore GPU memory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="write the chosen partition as a run config here (JSON)")
    p.add_argument("--result", default="result.pt", help="where its rank 0 writes results")
    p.add_argument("--steps", type=COUNT, default=10, help="its timed iterations")
    p.add_argument("--warmup", type=integer(0), default=2, help="its untimed iterations first")
    p.set_defaults(func=partition_command)


def _add_runs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_bench(sub)

    p = sub.add_parser("run", help="write a Table-1 setting's torchrun config for GPU nodes")
    p.add_argument("--setting", type=ANY_INT, required=True, help="Table 1 row, 1..10")
    p.add_argument("--plan", default="cluster", help="cluster, paper, gpipe or a profile JSON")
    p.add_argument("--seq-len", type=COUNT, help="Table 4's L for setting 5")
    p.add_argument("--dtype", default="fp16", help="fp16 (default, as the paper), bf16, fp32")
    p.add_argument("--recompute", default="none", help="none, selective or full")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split LayerNorms, dropouts and residual adds along the tokens over #Op",
    )
    p.add_argument("--distributed-optimizer", action="store_true", help=DISTRIBUTED_OPTIMIZER)
    p.add_argument("--steps", type=COUNT, default=10, help="timed iterations")
    p.add_argument("--warmup", type=integer(0), default=2, help="untimed iterations first")
    p.add_argument(
        "--packed",
        choices=("corpus", "lognormal"),
        help="train on rows of whole documents, packed first-fit decreasing",
    )
    p.add_argument("--out", default="run.json", help="the config file to write")
    p.add_argument("--result", default="result.pt", help="where rank 0 writes the results")
    p.set_defaults(func=run_command)

    p = sub.add_parser("table", help="one paper table, printed (and saved with --out)")
    p.add_argument("name", choices=TABLE_NAMES)
    p.add_argument("--mode", choices=("simulate", "measure"), default="simulate")
    p.add_argument("--params", help="the table's parameters as JSON, e.g. '{\"settings\": [9]}'")
    p.add_argument("--out", help="folder for the CSV and figure")
    p.add_argument("--tag", help="the files' suffix (default: the mode)")
    p.set_defaults(func=table_command)

    p = sub.add_parser("reproduce", help="execute the table notebooks with papermill")
    p.add_argument("--mode", choices=("simulate", "measure", "all"), default="simulate")
    p.add_argument("--only", nargs="*", choices=TABLE_NAMES, help="tables (default: all)")
    p.add_argument(
        "--params",
        help='per-table parameters as JSON, e.g. \'{"main_results": {"settings": [9]}}\'',
    )
    p.add_argument("--results", help="results folder (default: results/ of this checkout)")
    p.add_argument("--force", action="store_true", help="start a new run even if one can resume")
    p.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local: here, one notebook after another; slurm: one SLURM array task per "
        "configuration (table, setting), then the tables gathered",
    )
    p.add_argument(
        "--sbatch-args",
        default="",
        help="slurm: options for sbatch, e.g. '--partition=gpu --account=me --gpus=1' "
        "(or sbatch's SBATCH_* variables)",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="slurm: return once submitted; run the same command again to gather",
    )
    p.add_argument(
        "--poll", type=number(0, above=True), default=30.0, help="slurm: seconds between squeues"
    )
    p.set_defaults(func=reproduce_command)


def _add_schedule(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("schedule", help="schedules in torch.distributed.pipelining's CSV")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def shape(q: argparse.ArgumentParser) -> None:
        q.add_argument("--stages", type=COUNT, help="K: ranks (pipeline stages)")
        q.add_argument("--chunks", type=COUNT, help="v: chunks per rank (virtual stages)")
        q.add_argument("--microbatches", type=COUNT, help="M: microbatches of one sequence")
        q.add_argument("--seq-len", type=COUNT, default=1, help="L of the plan (default 1)")

    q = verbs.add_parser("export", help="a registered schedule as torch's CSV")
    q.add_argument("name", help="a registered schedule, e.g. 1f1b, interleaved-1f1b, zbv")
    shape(q)
    q.add_argument("--format", choices=("compute_only", "compute_comms"), required=True)
    q.add_argument("--out", required=True, help="the CSV to write")
    q.set_defaults(func=export_command)

    q = verbs.add_parser("import", help="read and check a torch CSV (either format)")
    q.add_argument("file", help="torch's CSV: one row per rank")
    q.add_argument("--seq-len", type=COUNT, default=1, help="L of each microbatch (default 1)")
    q.add_argument("--name", help="the schedule's name (default: the file's)")
    q.add_argument("--out", help="write it as tplib's schedule CSV here")
    q.set_defaults(func=import_command)

    q = verbs.add_parser("show", help="the grid and simulated latency of a schedule")
    q.add_argument("name", help="a registered schedule, a torch class or a CSV file")
    shape(q)
    q.add_argument("--t-f", type=number(0), default=1.0, help="a stage's forward (default 1)")
    q.add_argument("--t-b", type=number(0), default=2.0, help="its backward (default 2)")
    q.add_argument("--t-w", type=number(0), default=1.0, help="W's part of --t-b (default 1)")
    q.add_argument("--t-send", type=number(0), default=0.0, help="a message (default 0)")
    q.set_defaults(func=show_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tplib", description="TeraPipe kit: profile, plan, simulate and reproduce."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_profile(sub)
    _add_plan_and_simulate(sub)
    _add_layouts(sub)
    _add_runs(sub)
    _add_schedule(sub)
    add_predict(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors and --help: return the code, don't exit
        return exc.code if isinstance(exc.code, int) else 2
    try:
        code: int = args.func(args)
        return code
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
