"""Notebook jobs: one papermill execution of one table notebook with one set of
parameters.

A :class:`Job` runs ``notebooks/<table>.ipynb`` in ``mode`` with the table's ``params``;
its executed copy, CSV and figure land in ``<results>/<table>/``. The executed notebook
is written to a temporary file and renamed into place when the notebook has finished,
and the notebook writes its CSV and figure atomically, so nothing is half-written.

The kernel talks to papermill over Unix sockets in a directory of the job's own, not
over TCP: the kernel is always on this machine, and ipykernel warns at every start that
TCP carries code and outputs unencrypted. The private directory also keeps jobs running
side by side (SLURM tasks sharing a node) from contending for ports.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tplib.tables import TABLE_NAMES, get_table
from tplib.util.files import atomic_write

__all__ = [
    "Job",
    "default_jobs",
    "notebooks_dir",
    "repo_root",
    "results_root",
    "run_job",
]

RUN_MODES = {"simulate": ("simulate",), "measure": ("measure",), "all": ("simulate", "measure")}


def repo_root() -> Path:
    """The checkout tplib runs from (where ``notebooks/`` and ``results/`` live)."""
    return Path(__file__).resolve().parents[2]


def notebooks_dir() -> Path:
    return repo_root() / "notebooks"


def results_root() -> Path:
    return repo_root() / "results"


@dataclass(frozen=True)
class Job:
    """One papermill execution: notebook ``table`` in ``mode`` with ``params`` (the
    table's own parameters), outputs in ``<root>/<table>/`` named ``<table>-<tag>.*``."""

    table: str
    mode: str
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)
    root: str | None = None  # results root; default ``results/``
    tag: str = ""  # the output files' suffix; default the mode

    @property
    def name(self) -> str:
        """``<table>-<tag>``: the stem of the job's output files."""
        return f"{self.table}-{self.tag or self.mode}"

    @property
    def out_dir(self) -> Path:
        return (
            Path(self.root) / self.table if self.root is not None else results_root() / self.table
        )

    @property
    def executed(self) -> Path:
        return self.out_dir / f"{self.name}.ipynb"

    @property
    def csv(self) -> Path:
        return self.out_dir / f"{self.name}.csv"

    @property
    def figure(self) -> Path:
        return self.out_dir / f"{self.name}.png"

    @property
    def parameters(self) -> dict[str, Any]:
        """What papermill injects into the notebook's ``parameters`` cell."""
        return {
            "mode": self.mode,
            "params": dict(self.params),
            "out_dir": str(self.out_dir),
            "tag": self.tag or self.mode,
        }

    def record(self) -> dict[str, Any]:
        """The job as the run manifest records it."""
        return {
            "table": self.table,
            "mode": self.mode,
            "tag": self.tag or self.mode,
            "params": dict(self.params),
        }


def default_jobs(
    mode: str = "simulate",
    params: Mapping[str, Mapping[str, Any]] | None = None,
    root: str | os.PathLike[str] | None = None,
    only: tuple[str, ...] = (),
) -> list[Job]:
    """The jobs ``make reproduce`` runs for ``mode`` ("simulate", "measure" or "all"):
    every table notebook of each mode, with ``params[table]`` (the table's parameters,
    for both modes; a table's ``{"simulate": {...}, "measure": {...}}`` gives each mode
    its own), optionally ``only`` some tables."""
    if mode not in RUN_MODES:
        raise ValueError(f"mode={mode!r}: choose one of {sorted(RUN_MODES)}")
    params = dict(params or {})
    for name in [*params, *only]:
        if name not in TABLE_NAMES:
            raise ValueError(f"unknown table {name!r}: the notebooks are {sorted(TABLE_NAMES)}")
    jobs = []
    for m in RUN_MODES[mode]:
        # Every table notebook that runs in this mode, in the tables' order.
        for table in (name for name in TABLE_NAMES if m in get_table(name).modes):
            if only and table not in only:
                continue
            given = dict(params.get(table, {}))
            if set(given) <= {"simulate", "measure"} and given:
                given = dict(given.get(m, {}))
            jobs.append(Job(table, m, given, None if root is None else str(root)))
    return jobs


def _kernel_config(sockets: Path) -> Any:
    """The kernel manager's configuration for a kernel whose channels are Unix sockets
    named ``<sockets>/kernel-<n>``; the default (TCP) where zmq has no IPC transport."""
    import zmq
    from traitlets.config import Config

    if not zmq.has("ipc"):
        return Config()
    # An absolute path: the kernel starts in the notebooks' directory, papermill elsewhere,
    # and both must name the same sockets.
    return Config({"KernelManager": {"transport": "ipc", "ip": str(sockets.resolve() / "kernel")}})


def run_job(job: Job, *, kernel: str = "python3", log_output: bool = False) -> None:
    """Execute ``job``'s notebook with papermill; the executed copy appears only when
    the notebook has finished. The kernel imports this checkout's tplib."""
    import papermill as pm  # imported here: papermill is slow to import

    source = notebooks_dir() / f"{job.table}.ipynb"
    if not source.exists():
        raise ValueError(f"no notebook {source}: known notebooks are {list(TABLE_NAMES)}")
    job.out_dir.mkdir(parents=True, exist_ok=True)
    env_before = os.environ.get("PYTHONPATH")
    # The kernel is a new process: put this checkout first on its path, so a copy of the
    # repository runs its own tplib rather than the one installed in the environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), env_before) if p)

    def execute(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="tplib-kernel-") as sockets:
            pm.execute_notebook(
                str(source),
                str(tmp),
                parameters=job.parameters,
                kernel_name=kernel,
                cwd=str(notebooks_dir()),
                progress_bar=False,
                log_output=log_output,
                config=_kernel_config(Path(sockets)),
            )

    try:
        atomic_write(job.executed, execute)
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_before
