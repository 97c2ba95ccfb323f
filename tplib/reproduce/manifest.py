"""The run manifest: what lets an interrupted ``make reproduce`` continue where it stopped.

``<results>/.run.json`` records the run in progress: the code version it runs (a hash of
tplib's sources, the notebooks and pyproject.toml), each job with its parameters, when
each job started and which have finished. It is rewritten atomically as each job starts
and finishes, so a job started but not finished is one that was interrupted (or failed)
while it ran. A run started again resumes when the manifest describes the same jobs,
parameters and code and has not finished, and redoes only the jobs it had not finished;
anything else (a finished run, other parameters, changed code, ``force``) starts a new
run, which redoes every job.

Under SLURM (:mod:`tplib.reproduce.slurm`) the jobs are the configurations, and a job
submitted also records its array, task and log (``"slurm"``), so that a later invocation
gathers an array an earlier one submitted instead of submitting the job again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tplib.reproduce.jobs import Job, repo_root
from tplib.util.files import write_json

__all__ = ["FORMAT", "Manifest", "code_version"]

FORMAT = "tplib.run/1"


def code_version(root: Path | None = None) -> str:
    """A hash of everything a run's results depend on in this checkout: tplib's Python
    sources, the notebooks and pyproject.toml (the pinned dependencies)."""
    root = root or repo_root()
    files = sorted(
        [*root.glob("tplib/**/*.py"), *root.glob("notebooks/*.ipynb"), root / "pyproject.toml"]
    )
    h = hashlib.sha256()
    for path in files:
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Manifest:
    """One run of ``make reproduce`` (see the module docstring)."""

    path: Path
    code: str
    jobs: list[dict[str, Any]]  # Job.record() plus "started", "finished", "seconds", "slurm"
    started: str = field(default_factory=_now)
    finished: str | None = None  # when the whole run finished

    @classmethod
    def new(cls, path: Path, code: str, jobs: Sequence[Job]) -> Manifest:
        records = [
            {**j.record(), "started": None, "finished": False, "seconds": None} for j in jobs
        ]
        manifest = cls(path, code, records)
        manifest.save()
        return manifest

    @classmethod
    def load(cls, path: Path) -> Manifest | None:
        """The manifest at ``path``; None if there is none or it is unreadable (a run
        then starts anew: the manifest is only ever replaced whole, so this means it was
        never written or was edited by hand)."""
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                return None
            return cls(path, data["code"], list(data["jobs"]), data["started"], data["finished"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self) -> None:
        write_json(
            self.path,
            {
                "format": FORMAT,
                "code": self.code,
                "started": self.started,
                "finished": self.finished,
                "jobs": self.jobs,
            },
        )

    def resumes(self, code: str, jobs: Sequence[Job]) -> bool:
        """Whether a run of ``jobs`` on code ``code`` continues this one."""
        same_jobs = [{k: r[k] for k in ("table", "mode", "tag", "params")} for r in self.jobs]
        return (
            self.finished is None
            and self.code == code
            and same_jobs == [json.loads(json.dumps(j.record())) for j in jobs]
        )

    def _record(self, job: Job) -> dict[str, Any]:
        for r in self.jobs:
            if (r["table"], r["mode"], r["tag"]) == (job.table, job.mode, job.tag or job.mode):
                return r
        raise KeyError(f"job {job.name} is not part of this run")

    def done(self, job: Job) -> bool:
        """Whether this run finished ``job`` (and its outputs are still there)."""
        return bool(self._record(job)["finished"]) and all(
            p.exists() for p in (job.executed, job.csv, job.figure)
        )

    def interrupted(self, job: Job) -> bool:
        """Whether ``job`` started earlier in this run and did not finish."""
        record = self._record(job)
        return bool(record.get("started")) and not record["finished"]

    def mark_started(self, job: Job) -> None:
        self._record(job)["started"] = _now()
        self.save()

    def mark_submitted(self, jobs: Sequence[Job], array: str, logs: Sequence[Path]) -> None:
        """``jobs`` were submitted as the tasks of SLURM array ``array``, in order, each
        logging to its entry of ``logs``."""
        for task, (job, log) in enumerate(zip(jobs, logs, strict=True)):
            record = self._record(job)
            # A job finished earlier whose outputs were removed since runs again.
            record["started"], record["finished"], record["seconds"] = _now(), False, None
            record["slurm"] = {"array": array, "task": task, "log": str(log), "failed": False}
        self.save()

    def submitted(self, job: Job) -> dict[str, Any] | None:
        """The SLURM array task that runs ``job`` (array, task, log), if one was submitted
        in this run and neither finished it nor was found to have failed."""
        record = self._record(job)
        task = record.get("slurm")
        if record["finished"] or not isinstance(task, dict) or task.get("failed"):
            return None
        return task

    def mark_failed(self, jobs: Sequence[Job]) -> None:
        """The array tasks of ``jobs`` ended without their outputs: submit them again."""
        for job in jobs:
            self._record(job)["slurm"]["failed"] = True
        self.save()

    def mark_done(self, job: Job, seconds: float) -> None:
        record = self._record(job)
        record["finished"], record["seconds"] = True, round(seconds, 3)
        self.save()

    def finish(self) -> None:
        self.finished = _now()
        self.save()
