"""The commands that run things: ``run`` (a Table-1 setting's torchrun config for GPU
nodes), ``table`` (one paper table without Jupyter) and ``reproduce`` (every table
notebook); ``bench`` is :mod:`tplib.cli.bench`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

__all__ = ["reproduce_command", "run_command", "table_command"]


def _json_arg(text: str | None, what: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {text!r} must be a JSON object, e.g. '{{\"settings\": [9]}}'")
    return value


def table_command(args: argparse.Namespace) -> int:
    import pandas as pd

    from tplib.tables import run_table

    result = run_table(args.name, args.mode, **_json_arg(args.params, "--params"))
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(result.show().to_string(index=False))
    print()
    print(result.findings)
    if args.out:
        csv, png = result.save(Path(args.out), args.tag)
        print(f"\nwrote {csv} and {png}")
    return 0


def _check_reproduce_params(args: argparse.Namespace, params: dict[str, Any]) -> None:
    """Every notebook's parameters, checked as run_table will check them, before the
    run starts: a bad one used to fail inside its notebook, after the run had begun."""
    from tplib.reproduce import default_jobs
    from tplib.tables import get_table

    for table, given in params.items():
        inner = (
            given.values()
            if isinstance(given, dict) and set(given) <= {"simulate", "measure"}
            else ()
        )
        if not isinstance(given, dict) or not all(isinstance(g, dict) for g in inner):
            raise ValueError(
                f"--params {table!r}: {given!r} is not a JSON object of the table's parameters "
                '(or of them per mode, {"simulate": {...}, "measure": {...}})'
            )
    for job in default_jobs(args.mode, params, args.results, tuple(args.only or ())):
        get_table(job.table).check(job.mode, job.params)
        if args.launcher == "slurm":
            from tplib.reproduce.split import split_job

            split_job(job)  # a configuration named twice


def reproduce_command(args: argparse.Namespace) -> int:
    from tplib.reproduce import reproduce
    from tplib.reproduce.slurm import TaskFailed

    if args.launcher == "local" and (args.sbatch_args or args.no_wait):
        given = [
            o for o, v in (("--sbatch-args", args.sbatch_args), ("--no-wait", args.no_wait)) if v
        ]
        raise ValueError(f"{', '.join(given)}: only with --launcher slurm")
    params = _json_arg(args.params, "--params")
    _check_reproduce_params(args, params)
    try:
        report = reproduce(
            args.mode,
            force=args.force,
            params=params,
            only=tuple(args.only or ()),
            root=args.results,
            launcher=args.launcher,
            sbatch_args=args.sbatch_args,
            wait=not args.no_wait,
            poll_s=args.poll,
        )
    except TaskFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    how = "resumed an interrupted run" if report.resumed else "started a new run"
    if report.pending:
        print(
            f"{how}: {len(report.pending)} configurations queued or running on SLURM "
            f"({len(report.ran) + len(report.skipped)} finished); run the same command again "
            "to gather them and write the summary"
        )
        return 0
    n = len(report.ran) + len(report.skipped)
    print(
        f"{how}: ran {len(report.ran)} of {n} notebooks ({len(report.skipped)} finished earlier "
        f"in this run); summary in {report.summary_path}\n"
    )
    print(report.summary)
    return 0


def run_command(args: argparse.Namespace) -> int:
    from tplib.nn.configs import check_precision, check_recompute
    from tplib.runs.settings import launch_commands, setting_run
    from tplib.runtime import save_run_config

    check_precision(args.dtype)  # before the setting is planned, not after
    check_recompute(args.recompute)
    run = setting_run(
        args.setting,
        plan=args.plan,
        seq_len=args.seq_len,
        precision=args.dtype,
        recompute=args.recompute,
        steps=args.steps,
        warmup=args.warmup,
    )
    if args.sequence_parallel:  # checked (the slices against #Op) as the run is remade
        layout = dataclasses.replace(run.parallelism, sequence_parallel=True)
        run = dataclasses.replace(run, parallelism=layout)
    if args.packed:
        data = dataclasses.replace(run.data, source=f"{args.packed}-documents")
        run = dataclasses.replace(run, data=data)
    if args.distributed_optimizer:
        sharded = dataclasses.replace(run.parallelism, distributed_optimizer=True)
        run = dataclasses.replace(run, parallelism=sharded)
    save_run_config(run, args.out)
    par = run.parallelism
    print(
        f"setting ({args.setting}): {run.model}, L={run.data.seq_len}, B={run.data.batch}, "
        f"#Data={par.n_data} x #Pipe={par.n_stages} x #Op={par.n_op} = {par.world_size} GPUs"
        f"{' (sequence-parallel)' if par.sequence_parallel else ''}, "
        f"{run.precision}, recompute={run.recompute}, "
        f"{'distributed optimizer, ' if par.distributed_optimizer else ''}{run.schedule_name} plan "
        f"{run.plan.to_paper()}"
    )
    if run.padded_vocab != run.cfg.vocab_size:
        print(f"vocabulary padded from {run.cfg.vocab_size} to {run.padded_vocab} rows")
    print(f"wrote {args.out}; on every node (HEAD_NODE: the first node's address):")
    commands = launch_commands(run, args.out, args.result)
    print(f"  {commands['torchrun']}\nor under SLURM:\n  {commands['slurm']}")
    return 0
