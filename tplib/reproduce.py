"""Running the reproduction: each table notebook under papermill, once per configuration.

A :class:`Job` is one notebook with one set of parameters; its executed copy, CSV and
figure land in ``results/<notebook>/``. :func:`run_jobs` skips a job whose results exist
(unless ``force``), so an interrupted ``make reproduce`` resumes where it stopped. Nothing
is ever half-written: papermill writes into a temporary file that is renamed into place
only when the notebook finished, and :func:`write_csv` / :func:`save_figure` do the same.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = [
    "NOTEBOOKS",
    "Job",
    "atomic_write",
    "default_jobs",
    "notebooks_dir",
    "repo_root",
    "results_dir",
    "run_job",
    "run_jobs",
    "save_figure",
    "write_csv",
]

NOTEBOOKS = ("main_results", "dp_ablation", "seqlen_sweep")


def repo_root() -> Path:
    """The checkout tplib runs from (where ``notebooks/`` and ``results/`` live)."""
    return Path(__file__).resolve().parents[1]


def notebooks_dir() -> Path:
    return repo_root() / "notebooks"


def results_dir(name: str, root: str | Path | None = None) -> Path:
    """``results/<name>/`` (created), under ``root`` if given."""
    path = Path(root) / name if root is not None else repo_root() / "results" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---- atomic files -----------------------------------------------------------------------


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_csv(df: pd.DataFrame, path: str | Path) -> Path:
    return atomic_write(path, lambda tmp: df.to_csv(tmp, index=False))


def save_figure(fig: Any, path: str | Path, dpi: int = 150) -> Path:
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, bbox_inches="tight"))


# ---- jobs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One papermill execution: ``notebook`` with ``parameters``, outputs in ``out_dir``.

    ``outputs`` are the files (relative to ``out_dir``) whose presence means the job is
    done; the executed notebook is always one of them.
    """

    notebook: str
    tag: str
    parameters: dict[str, Any] = field(default_factory=dict, hash=False)
    outputs: tuple[str, ...] = ()
    root: str | None = None  # results root; default ``results/``

    @property
    def out_dir(self) -> Path:
        return results_dir(self.notebook, self.root)

    @property
    def executed(self) -> Path:
        return self.out_dir / f"{self.notebook}-{self.tag}.ipynb"

    def done(self) -> bool:
        return all((self.out_dir / f).exists() for f in (self.executed.name, *self.outputs))


def default_jobs(mode: str = "simulate", root: str | None = None) -> list[Job]:
    """The jobs ``make reproduce`` runs for ``mode`` ("simulate", "measure" or "all")."""
    modes = {"simulate": ("simulate",), "measure": ("measure",), "all": ("simulate", "measure")}
    if mode not in modes:
        raise ValueError(f"mode={mode!r}: choose one of {sorted(modes)}")
    jobs = []
    for m in modes[mode]:
        for nb in NOTEBOOKS:
            jobs.append(Job(nb, m, {"mode": m}, (f"{nb}-{m}.csv", f"{nb}-{m}.png"), root))
        if m == "measure":
            # The simulator against the runtime on this machine (no "mode" parameter).
            nb = "simulator_validation"
            jobs.append(Job(nb, m, {}, (f"{nb}-{m}.csv", f"{nb}-{m}.png"), root))
    return jobs


def run_job(
    job: Job, *, force: bool = False, kernel: str = "python3", log_output: bool = False
) -> bool:
    """Execute ``job`` unless its results exist; return whether it ran."""
    import papermill as pm  # imported here: papermill is slow to import

    if job.done() and not force:
        return False
    source = notebooks_dir() / f"{job.notebook}.ipynb"
    if not source.exists():
        raise ValueError(f"no notebook {source}: known notebooks are {list(NOTEBOOKS)}")
    parameters = {"out_dir": str(job.out_dir), "tag": job.tag, **job.parameters}

    def execute(tmp: Path) -> None:
        pm.execute_notebook(
            str(source),
            str(tmp),
            parameters=parameters,
            kernel_name=kernel,
            cwd=str(notebooks_dir()),
            progress_bar=False,
            log_output=log_output,
        )

    atomic_write(job.executed, execute)
    return True


def run_jobs(jobs: Iterable[Job], *, force: bool = False, progress: bool = True) -> list[Job]:
    """Run every job in order, with a progress bar; return the jobs that ran."""
    from tqdm.auto import tqdm

    jobs = list(jobs)
    ran = []
    with tqdm(jobs, desc="reproduce", unit="notebook", disable=not progress) as bar:
        for job in bar:
            bar.set_postfix_str(f"{job.notebook} ({job.tag})")
            if run_job(job, force=force):
                ran.append(job)
            else:
                bar.write(f"skip {job.executed}: results exist (FORCE=1 reruns)")
    return ran
