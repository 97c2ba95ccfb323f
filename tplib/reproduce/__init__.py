"""``make reproduce``: run every table notebook, then compare with the paper and with the
committed results.

================  ====================================================================
module            what it holds
================  ====================================================================
``jobs``          :class:`Job`: one notebook, one mode, one set of parameters (papermill)
``manifest``      the run manifest ``results/.run.json``: resuming an interrupted run
``summary``       ``results/SUMMARY.md``: reproduced numbers beside the paper's and the
                  committed reference's
``split``         one job per configuration (a setting, a sequence length), and the
                  table gathered back from their CSVs
``slurm``         ``launcher="slurm"``: the configurations as one SLURM array, each task
                  a papermill run; waiting, gathering, failed tasks
================  ====================================================================

:func:`reproduce` regenerates every table: the committed outputs are the reference it
compares against, never a reason to skip. A run that is interrupted (Ctrl-C, a killed
process, a reboot) and started again continues where it stopped, skipping only the jobs
this same run finished; a finished run, other parameters or changed code start anew.
With ``launcher="slurm"`` each configuration is one task of a SLURM array
(:mod:`tplib.reproduce.slurm`), and the tables are gathered from them.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from tplib.reproduce.jobs import Job, default_jobs, notebooks_dir, repo_root, results_root, run_job
from tplib.reproduce.manifest import Manifest, code_version
from tplib.reproduce.summary import section
from tplib.util.files import write_text
from tplib.util.machine import cpu_count

__all__ = [
    "Job",
    "Report",
    "default_jobs",
    "notebooks_dir",
    "repo_root",
    "reproduce",
    "results_root",
    "run_job",
]

MANIFEST = ".run.json"
REFERENCE = ".reference"  # the committed results as they were when the run started
SUMMARY = "SUMMARY.md"


@dataclass(frozen=True)
class Report:
    """What :func:`reproduce` did: the jobs it ran and skipped, and the summary. Under
    SLURM the jobs are the configurations, and ``pending`` those still queued or running
    when it returned without waiting (then no summary yet: ``summary`` is empty)."""

    ran: list[Job]
    skipped: list[Job]
    resumed: bool
    summary: str
    summary_path: Path
    pending: list[Job] = field(default_factory=list)


def _own_git_checkout(root: Path) -> bool:
    """Whether ``root`` is the top of a git repository (not a copy inside another one)."""
    try:
        top = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False  # no git
    return top.returncode == 0 and Path(top.stdout.strip()).resolve() == root.resolve()


def _committed(path: Path, git: bool) -> str | None:
    """The committed content of results file ``path``: git's HEAD version when ``git``
    (the checkout is its own repository) and it tracks the file, else the file as it is
    now (a fresh copy of the repository holds the committed files)."""
    root = repo_root()
    try:
        rel = path.resolve().relative_to(root)
        if git:
            out = subprocess.run(
                ["git", "-C", str(root), "show", f"HEAD:{rel.as_posix()}"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if out.returncode == 0:
                return out.stdout
    except (ValueError, OSError, subprocess.SubprocessError):
        pass  # not inside the checkout, or git failed: fall back to the file
    return path.read_text() if path.is_file() else None


def _snapshot_references(jobs: list[Job], root: Path) -> None:
    """Keep the committed CSV of every job beside the run, before the run overwrites it."""
    git = _own_git_checkout(repo_root())
    for job in jobs:
        text = _committed(job.csv, git)
        target = root / REFERENCE / job.csv.name
        if text is None:
            target.unlink(missing_ok=True)
        else:
            write_text(target, text)


def _summary(jobs: list[Job], root: Path, code: str, started: str, seconds: float) -> str:
    from tplib.tables import get_table

    lines = [
        "# Reproduction summary",
        "",
        f"Run started {started}; its last invocation took {seconds / 60:.1f} min on "
        f"{cpu_count()} cores; code version "
        f"`{code}`. Reproduced: this run's tables. Paper: the paper's appendix C tables. "
        "Reference: the results committed in the repository when the run started.",
        "",
    ]
    for job in jobs:
        if not job.csv.exists():
            lines += [f"### {job.name}", "", "Not produced by this run.", ""]
            continue
        ref_path = root / REFERENCE / job.csv.name
        reference = pd.read_csv(ref_path) if ref_path.exists() else None
        table = get_table(job.table)
        lines.append(
            section(table, table.check(job.mode, job.params), pd.read_csv(job.csv), reference)
        )
    return "\n".join(lines)


def reproduce(
    mode: str = "all",
    *,
    force: bool = False,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    only: tuple[str, ...] = (),
    root: str | os.PathLike[str] | None = None,
    progress: bool = True,
    launcher: str = "local",
    sbatch_args: str | Sequence[str] = (),
    wait: bool = True,
    poll_s: float = 30.0,
) -> Report:
    """Run the table notebooks of ``mode`` ("simulate", "measure" or "all"), resuming an
    interrupted run of the same jobs, parameters and code unless ``force``; then write
    ``<root>/SUMMARY.md`` and return a :class:`Report`. ``params`` maps a table to its
    parameters (see :func:`~tplib.reproduce.jobs.default_jobs`).

    ``launcher="slurm"`` runs one job per configuration as one SLURM array instead, with
    ``sbatch_args`` on its ``sbatch`` line, waits for it unless ``wait`` is False (then
    call again to gather) and gathers the tables (see :mod:`tplib.reproduce.slurm`)."""
    if launcher not in ("local", "slurm"):
        raise ValueError(f"launcher={launcher!r}: choose 'local' (this machine) or 'slurm'")
    if launcher == "local" and (sbatch_args or not wait):
        raise ValueError("sbatch_args and wait=False: only with launcher 'slurm'")
    cluster = None
    if launcher == "slurm":
        from tplib.reproduce.slurm import Slurm

        cluster = Slurm.checked(sbatch_args, wait, poll_s)  # before any work
    base = Path(root) if root is not None else results_root()
    jobs = default_jobs(mode, params, root, only)
    tables = [(job, [job]) for job in jobs]
    if cluster is not None:
        from tplib.reproduce.split import split_jobs

        tables = split_jobs(jobs)
    units = [p for _, ps in tables for p in ps]
    code = code_version()
    manifest = None if force else Manifest.load(base / MANIFEST)
    resumed = manifest is not None and manifest.resumes(code, units)
    if manifest is None or not resumed:
        _snapshot_references(jobs, base)
        manifest = Manifest.new(base / MANIFEST, code, units)
    t0 = time.perf_counter()
    if cluster is not None:
        from tplib.reproduce.slurm import run_array

        outcome = run_array(tables, manifest, cluster, base, print if progress else _quiet)
        if outcome.pending:
            path = base / SUMMARY
            return Report(outcome.ran, outcome.skipped, resumed, "", path, outcome.pending)
        ran, skipped = outcome.ran, outcome.skipped
    else:
        ran, skipped = _run_here(jobs, manifest, progress)
    # The run finishes with its summary: should that fail, running again resumes, skips
    # every notebook and writes the summary.
    text = _summary(jobs, base, code, manifest.started, time.perf_counter() - t0)
    path = write_text(base / SUMMARY, text)
    manifest.finish()
    return Report(ran, skipped, resumed, text, path)


def _quiet(line: str) -> None:
    """Progress lines unsaid."""


def _run_here(jobs: list[Job], manifest: Manifest, progress: bool) -> tuple[list[Job], list[Job]]:
    """Run ``jobs`` one after another on this machine, skipping those this run finished."""
    from tqdm.auto import tqdm

    ran, skipped = [], []
    with tqdm(jobs, desc="reproduce", unit="notebook", disable=not progress) as bar:
        for job in bar:
            label = f"{job.table} ({job.mode})"
            if manifest.done(job):
                bar.write(f"skip {label}: finished earlier in this run")
                skipped.append(job)
                continue
            bar.set_postfix_str(label)
            if manifest.interrupted(job):
                bar.write(f"redo {label}: started earlier in this run, did not finish")
            # A run killed mid-notebook leaves the temporary files of atomic_write behind.
            for stale in job.out_dir.glob(f".{job.name}-*"):
                stale.unlink()
            manifest.mark_started(job)
            start = time.perf_counter()
            run_job(job)
            manifest.mark_done(job, time.perf_counter() - start)
            bar.write(f"ran  {label} in {time.perf_counter() - start:.0f} s -> {job.csv}")
            ran.append(job)
    return ran, skipped
