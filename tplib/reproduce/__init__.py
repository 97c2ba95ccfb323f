"""``make reproduce``: run every table notebook, then compare with the paper and with the
committed results.

================  ====================================================================
module            what it holds
================  ====================================================================
``jobs``          :class:`Job`: one notebook, one mode, one set of parameters (papermill)
``manifest``      the run manifest ``results/.run.json``: resuming an interrupted run
``summary``       ``results/SUMMARY.md``: reproduced numbers beside the paper's and the
                  committed reference's
================  ====================================================================

:func:`reproduce` regenerates every table: the committed outputs are the reference it
compares against, never a reason to skip. A run that is interrupted (Ctrl-C, a killed
process, a reboot) and started again continues where it stopped, skipping only the jobs
this same run finished; a finished run, other parameters or changed code start anew.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from tplib.files import write_text
from tplib.machine import cpu_count
from tplib.reproduce.jobs import Job, default_jobs, notebooks_dir, repo_root, results_root, run_job
from tplib.reproduce.manifest import Manifest, code_version
from tplib.reproduce.summary import section

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
    """What :func:`reproduce` did: the jobs it ran and skipped, and the summary."""

    ran: list[Job]
    skipped: list[Job]
    resumed: bool
    summary: str
    summary_path: Path


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
) -> Report:
    """Run the table notebooks of ``mode`` ("simulate", "measure" or "all"), resuming an
    interrupted run of the same jobs, parameters and code unless ``force``; then write
    ``<root>/SUMMARY.md`` and return a :class:`Report`. ``params`` maps a table to its
    parameters (see :func:`~tplib.reproduce.jobs.default_jobs`)."""
    from tqdm.auto import tqdm

    base = Path(root) if root is not None else results_root()
    jobs = default_jobs(mode, params, root, only)
    code = code_version()
    manifest = None if force else Manifest.load(base / MANIFEST)
    resumed = manifest is not None and manifest.resumes(code, jobs)
    if manifest is None or not resumed:
        _snapshot_references(jobs, base)
        manifest = Manifest.new(base / MANIFEST, code, jobs)
    t0 = time.perf_counter()
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
    # The run finishes with its summary: should that fail, running again resumes, skips
    # every notebook and writes the summary.
    text = _summary(jobs, base, code, manifest.started, time.perf_counter() - t0)
    path = write_text(base / SUMMARY, text)
    manifest.finish()
    return Report(ran, skipped, resumed, text, path)
