"""``make reproduce LAUNCHER=slurm``: the table notebooks as one SLURM array, one task
per configuration.

The launcher splits every table's job into its configurations
(:mod:`tplib.reproduce.split`), writes them to a job list
(``<results>/slurm/jobs-<time>.json``) and submits one array with ``sbatch --array=0-N
scripts/slurm/tplib-reproduce.sbatch JOB_LIST PYTHON``; task ``i`` runs entry ``i`` with
``srun python -m tplib.reproduce.slurm JOB_LIST i``, which executes that configuration's
notebook with papermill into its own executed notebook, CSV and figure, logs to
``<results>/slurm/logs/<array>_<i>.log`` and, once its outputs are written, leaves a
status file naming its array. The launcher then waits for the array (asking ``squeue``
every ``poll_s`` seconds), or with ``wait=False`` returns and lets a later invocation
gather it, and gathers each table whose configurations all finished into the table's
CSV and figure.

The run manifest records each configuration's array, task and log, so an invocation
never submits a configuration that is queued, running or finished again: a configuration
is done when its task's status names the array it was submitted in and its outputs are
there. A task that ended without them is reported with its configuration and log, and
submitted again by the next invocation. Your cluster's options (partition, account,
time, GPUs) go to sbatch as given (``sbatch_args``) or in sbatch's own ``SBATCH_*``
environment variables; tplib names none.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tplib.reproduce.jobs import Job, repo_root, run_job
from tplib.reproduce.manifest import Manifest
from tplib.reproduce.split import PARTS_DIR, describe, gather
from tplib.util.files import write_json

__all__ = ["LAUNCHERS", "SCRIPT", "Outcome", "Slurm", "TaskFailed", "main", "run_array"]

LAUNCHERS = ("local", "slurm")
SCRIPT = Path("scripts/slurm/tplib-reproduce.sbatch")  # in the checkout
JOB_LIST = "tplib.slurm-jobs/1"
# Options the launcher sets itself: the array is one task per configuration, and the
# logs and working directory are where the launcher looks for them.
OWN_OPTIONS = {"--array": "-a", "--output": "-o", "--error": "-e", "--chdir": "-D"}
COMMANDS = ("sbatch", "squeue")


class TaskFailed(RuntimeError):
    """Array tasks ended without their configuration's outputs (see the message)."""


@dataclass(frozen=True)
class Slurm:
    """How to submit: ``sbatch_args`` added to every ``sbatch`` line; ``wait`` for the
    array to end (asking ``squeue`` every ``poll_s`` seconds) or return once submitted."""

    sbatch_args: tuple[str, ...] = ()
    wait: bool = True
    poll_s: float = 30.0

    @classmethod
    def checked(
        cls, sbatch_args: str | Sequence[str] = (), wait: bool = True, poll_s: float = 30.0
    ) -> Slurm:
        """A :class:`Slurm`, once ``sbatch`` and ``squeue`` are on PATH and the options
        are usable; ``ValueError`` naming what is not."""
        if isinstance(sbatch_args, str):
            try:
                args = tuple(shlex.split(sbatch_args))
            except ValueError as exc:
                raise ValueError(f"sbatch_args {sbatch_args!r} cannot be split: {exc}") from None
        else:
            args = tuple(sbatch_args)
        for arg in args:
            for long, short in OWN_OPTIONS.items():
                if arg.split("=", 1)[0] == long or (arg.startswith(short) and arg != "-"):
                    raise ValueError(
                        f"sbatch_args {arg!r}: tplib sets {long} itself (one array task per "
                        "configuration, logs under <results>/slurm/logs/, the checkout as "
                        "working directory); pass the cluster's options only"
                    )
        if not (poll_s > 0 and poll_s < float("inf")):
            raise ValueError(f"poll_s={poll_s!r}: give a positive number of seconds")
        missing = [c for c in COMMANDS if shutil.which(c) is None]
        if missing:
            raise ValueError(
                f"launcher 'slurm' needs {' and '.join(missing)} on PATH, and it is not there "
                f"(PATH={os.environ.get('PATH', '')}): run on a SLURM login node, or use "
                "launcher 'local'"
            )
        return cls(args, wait, poll_s)

    def submit(self, jobs: Sequence[Job], base: Path) -> tuple[str, list[Path]]:
        """Submit ``jobs`` as one array; return its id and each task's log."""
        folder = base / PARTS_DIR
        logs = folder / "logs"
        logs.mkdir(parents=True, exist_ok=True)  # SLURM does not create the log's folder
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
        job_list = write_json(
            folder / f"jobs-{stamp}.json",
            {"format": JOB_LIST, "jobs": [_entry(job) for job in jobs]},
        )
        command = [
            "sbatch",
            f"--array=0-{len(jobs) - 1}",
            f"--output={logs / '%A_%a.log'}",
            f"--chdir={repo_root()}",
            *self.sbatch_args,
            str(repo_root() / SCRIPT),
            str(job_list),
            sys.executable,
        ]
        out = subprocess.run(command, capture_output=True, text=True)
        # sbatch's own words, or the bare id of --parsable ("42" or "42;cluster").
        found = re.search(r"(?:Submitted batch job |^)(\d+)\b", out.stdout, re.MULTILINE)
        if out.returncode != 0 or found is None:
            raise TaskFailed(
                f"sbatch did not submit the array (exit {out.returncode}): "
                f"{(out.stderr or out.stdout).strip()[-2000:]}\ncommand: {shlex.join(command)}"
            )
        array = found.group(1)
        return array, [logs / f"{array}_{i}.log" for i in range(len(jobs))]

    def active(self, array: str) -> bool:
        """Whether array ``array`` still has tasks queued or running."""
        out = subprocess.run(
            ["squeue", "--noheader", f"--jobs={array}", "--format=%i"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode == 0:
            return bool(out.stdout.strip())
        if "Invalid job id" in out.stderr:  # gone from the controller's memory: ended
            return False
        raise TaskFailed(f"squeue could not say whether array {array} runs: {out.stderr.strip()}")


@dataclass(frozen=True)
class Outcome:
    """What :func:`run_array` did with the configurations: those its arrays finished, those
    finished earlier in this run, and those still queued or running (``wait=False``)."""

    ran: list[Job] = field(default_factory=list)
    skipped: list[Job] = field(default_factory=list)
    pending: list[Job] = field(default_factory=list)


def _entry(job: Job) -> dict[str, Any]:
    root = None if job.root is None else str(Path(job.root).resolve())
    return {**job.record(), "root": root}


def _status(folder: Path, job: Job) -> Path:
    """Where ``job``'s array task says it finished: beside the job lists, in ``folder``."""
    return folder / "status" / f"{job.name}.json"


def _finished(folder: Path, job: Job, task: dict[str, Any]) -> float | None:
    """The seconds ``job``'s notebook took, if its task in array ``task["array"]``
    finished it and its outputs are there; None if not."""
    try:
        status = json.loads(_status(folder, job).read_text())
    except (OSError, ValueError):
        return None
    if status.get("array") != task["array"]:
        return None  # an earlier array's: this one did not get that far
    if not all(p.exists() for p in (job.executed, job.csv, job.figure)):
        return None
    return float(status.get("seconds", 0.0))


def _last_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log: the task did not start, or the log is on another file system)"
    return lines[-1].strip()[:300] if lines else "(empty log)"


def run_array(
    tables: Sequence[tuple[Job, list[Job]]],
    manifest: Manifest,
    cluster: Slurm,
    base: Path,
    say: Callable[[str], None] = print,
) -> Outcome:
    """Run every configuration of ``tables`` (each table's job with its configurations)
    that this run has not finished: gather arrays submitted earlier, submit the rest as
    one array, wait for them (unless ``cluster.wait`` is False), then gather each table
    whose configurations all finished. Raises :class:`TaskFailed` naming each
    configuration whose task ended without its outputs, and its log."""
    base = base.resolve()  # the tasks run in the checkout, perhaps elsewhere than here
    parts = [p for _, ps in tables for p in ps]
    skipped = [p for p in parts if manifest.done(p)]
    arrays: dict[str, list[Job]] = {}
    todo = []
    for p in parts:
        if p in skipped:
            say(f"skip {describe(p)}: finished earlier in this run")
        elif (task := manifest.submitted(p)) is not None:
            arrays.setdefault(task["array"], []).append(p)
        else:
            todo.append(p)
    for array, jobs in arrays.items():
        say(f"wait for SLURM array {array}: {len(jobs)} configurations submitted earlier")
    if todo:
        array, logs = cluster.submit(todo, base)
        manifest.mark_submitted(todo, array, logs)
        say(f"submitted SLURM array {array}: {len(todo)} configurations, logs in {logs[0].parent}")
        arrays[array] = todo
    ran: list[Job] = []
    failed: list[tuple[Job, dict[str, Any]]] = []
    waited = False
    while True:
        for array in [a for a in arrays if not cluster.active(a)]:
            for p in arrays.pop(array):
                task = manifest.submitted(p)
                assert task is not None  # submitted in this run and not yet settled
                seconds = _finished(base / PARTS_DIR, p, task)
                if seconds is None:
                    failed.append((p, task))
                else:
                    manifest.mark_done(p, seconds)
                    say(f"ran  {describe(p)} in array task {array}_{task['task']}")
                    ran.append(p)
        if not arrays or not cluster.wait:
            break
        if not waited:
            say(f"waiting for SLURM array {', '.join(arrays)}: squeue every {cluster.poll_s:g} s")
            waited = True
        time.sleep(cluster.poll_s)
    if failed:
        manifest.mark_failed([p for p, _ in failed])
    for job, ps in tables:
        if all(manifest.done(p) for p in ps):
            gather(job, ps)
    if failed:
        lines = [
            f"  {describe(p)}: array task {t['array']}_{t['task']}, log {t['log']}: "
            f"{_last_line(Path(t['log']))}"
            for p, t in failed
        ]
        raise TaskFailed(
            f"{len(failed)} of {len(parts)} configurations ended without their outputs:\n"
            + "\n".join(lines)
            + "\nRun the same command again to submit them again; the configurations that "
            "finished are kept."
        )
    return Outcome(ran, skipped, [p for jobs in arrays.values() for p in jobs])


# ---- one array task --------------------------------------------------------------------


def _read_job_list(path: Path) -> list[Job]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != JOB_LIST:
        raise ValueError(f"{path} is not a job list of tplib's launcher ({JOB_LIST})")
    return [Job(e["table"], e["mode"], e["params"], e["root"], e["tag"]) for e in data["jobs"]]


def main(argv: Sequence[str] | None = None) -> int:
    """One array task: execute entry ``index`` of job list ``jobs`` with papermill, then
    write its status file (the launcher counts the configuration done only then)."""
    parser = argparse.ArgumentParser(
        prog="python -m tplib.reproduce.slurm",
        description="run one configuration of a reproduce array (sbatch starts this)",
    )
    parser.add_argument("jobs", type=Path, help="the job list the launcher wrote")
    parser.add_argument("index", type=int, help="the entry to run: SLURM_ARRAY_TASK_ID")
    args = parser.parse_args(argv)
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if not array:
        parser.error("SLURM_ARRAY_JOB_ID is not set: sbatch --array starts this, once per task")
    jobs = _read_job_list(args.jobs)
    if not 0 <= args.index < len(jobs):
        parser.error(f"index {args.index} is not an entry of {args.jobs} (0..{len(jobs) - 1})")
    job = jobs[args.index]
    print(f"array task {array}_{args.index}: {describe(job)} -> {job.out_dir}", flush=True)
    # An earlier task killed mid-notebook leaves the temporary files of atomic_write.
    for stale in job.out_dir.glob(f".{job.name}-*"):
        stale.unlink()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # papermill's cell output
    start = time.perf_counter()
    run_job(job, log_output=True)
    seconds = time.perf_counter() - start
    status = {"array": array, "task": args.index, "seconds": round(seconds, 3)}
    write_json(_status(args.jobs.parent, job), status)
    print(f"array task {array}_{args.index}: done in {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
