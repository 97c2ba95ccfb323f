"""The GPU check's driver: the node's checks, then every step in a process of its own
under its budget, a one-screen summary, and the results as one folder and one archive.

A step that overruns its budget is stopped (its process group killed, so no worker is
left holding the GPU) and reported as skipped; the later steps still run. The steps
write into a staging folder that replaces ``<out>/<device>/`` only once every step has
run, so an interrupted check leaves the previous results whole. With ``$GPU_CHECK_OUT``
set, the folder also goes there as ``gpu-check-<device>.tar.gz``, beside the summary as
``gpu-check-<device>.txt``: two files carry a node's whole result back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from tplib.gpucheck.node import Node, device_slug, inspect_node
from tplib.gpucheck.proofs import checkout_env
from tplib.gpucheck.result import RESULT_MARK, StepResult
from tplib.gpucheck.steps import STEPS
from tplib.util.files import atomic_write, write_json, write_text

__all__ = ["main", "run_check", "run_step", "summary_text"]

REHEARSAL = "cpu-rehearsal"  # the output folder of a dry run


def run_step(name: str, staging: Path, dry: bool, budget: float) -> StepResult:
    """Run step ``name`` in a process of its own, its output into ``logs/``; past
    ``budget`` seconds it is killed and reported as skipped."""
    log = staging / "logs" / f"{name.replace(' ', '-')}.log"
    command = [
        sys.executable,
        *("-m", "tplib.gpucheck.steps", name),
        *("--out", str(staging), "--mode", "dry" if dry else "gpu"),
    ]
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as sink:
        proc = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=checkout_env(),
        )
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return StepResult(
                name,
                "skipped",
                f"overran its budget of {budget:.0f} s and was stopped; see {log.name}",
                seconds=time.monotonic() - t0,
            )
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            # Workers a step started in its session (a pool's ranks) go with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    marked = [line for line in lines if line.startswith(RESULT_MARK)]
    if marked:
        return StepResult(**json.loads(marked[-1][len(RESULT_MARK) :]))
    last = next((line for line in reversed(lines) if line.strip()), "no output")
    return StepResult(
        name,
        "failed",
        f"exit code {proc.returncode} without a result: {last}",
        seconds=time.monotonic() - t0,
    )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def summary_text(
    node: Node, where: str, dry: bool, results: Sequence[StepResult], seconds: float
) -> str:
    """The one-screen summary: what ran where, each step's line, the targets."""
    failed = [r.name for r in results if not r.ok]
    budget = sum(STEPS[r.name][1] for r in results)
    verdict = f"FAILED: {', '.join(failed)}" if failed else f"all {len(results)} steps passed"
    machine = "CPU rehearsal" if dry else (node.gpus[0] if node.gpus else "GPU")
    lines = [
        f"gpu-check on {machine}: {verdict} in {_duration(seconds)} (budgets {_duration(budget)})",
        f"  {node.describe()}",
        f"  files: {where}/   {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"  {'step':<11} {'result':<8} {'time':>6}  what it found",
    ]
    for r in results:
        lines.append(f"  {r.name:<11} {r.status:<8} {_duration(r.seconds):>6}  {r.summary}")
    targets = [r for r in results if r.target]
    if targets:
        lines.append("  targets (not judged at a rehearsal's sizes):" if dry else "  targets:")
        lines += [f"    {r.name:<11} {r.target}" for r in targets]
    return "\n".join(lines) + "\n"


def _publish(staging: Path, final: Path) -> None:
    """Put the staging folder in place of the final one: the old results stay whole
    until the new ones are complete."""
    for leftover in staging.rglob(".*"):  # a killed step's temporary files
        if leftover.is_file():
            leftover.unlink()
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    if old.exists():
        shutil.rmtree(old)


def _archive(folder: Path, to: Path, summary: str) -> list[Path]:
    """``gpu-check-<device>.tar.gz`` of the folder and ``gpu-check-<device>.txt``, in ``to``."""
    to.mkdir(parents=True, exist_ok=True)
    base = f"gpu-check-{folder.name}"

    def pack(tmp: Path) -> None:
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(folder, arcname=folder.name)

    return [
        atomic_write(to / f"{base}.tar.gz", pack),
        write_text(to / f"{base}.txt", summary),
    ]


def run_check(
    out: Path, node: Node, *, dry: bool, names: Sequence[str], archive_to: Path | None
) -> int:
    """Every step in ``names``, then the summary and the files; 0 only if all passed."""
    slug = REHEARSAL if dry else device_slug(node.gpus[0])
    final = out / slug
    staging = out / f".{slug}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "logs").mkdir(parents=True)
    results: list[StepResult] = []
    t0 = time.monotonic()
    for i, name in enumerate(names, 1):
        budget = STEPS[name][1]
        print(f"gpu-check [{i}/{len(names)}] {name} (budget {budget:.0f} s) ...", flush=True)
        result = run_step(name, staging, dry, budget)
        print(f"  {result.status} in {_duration(result.seconds)}: {result.summary}", flush=True)
        results.append(result)
    summary = summary_text(node, str(final), dry, results, time.monotonic() - t0)
    write_text(staging / "summary.txt", summary)
    write_json(
        staging / "results.json",
        {"node": asdict(node), "dry": dry, "steps": [asdict(r) for r in results]},
    )
    _publish(staging, final)
    print(summary, end="")
    if archive_to is not None:
        for path in _archive(final, archive_to, summary):
            print(f"gpu-check: wrote {path}")
    return 0 if all(r.ok for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="The GPU check: exactness, Figure 3, slicing's cost, MFU and memory on a GPU."
    )
    p.add_argument("--out", type=Path, default=Path("results/gpu"), help="output folder")
    p.add_argument(
        "--dry",
        action="store_true",
        default=os.environ.get("GPU_CHECK_DRY", "") not in ("", "0"),
        help="the rehearsal: every step on the CPU at small sizes (GPU_CHECK_DRY=1)",
    )
    p.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"comma-separated steps to run (default all: {','.join(STEPS)})",
    )
    p.add_argument(
        "--archive-to",
        type=Path,
        default=Path(os.environ["GPU_CHECK_OUT"]) if os.environ.get("GPU_CHECK_OUT") else None,
        help="also write the results' archive and summary here (GPU_CHECK_OUT)",
    )
    args = p.parse_args(argv)
    names = [n.strip() for n in args.steps.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if unknown or not names:
        p.error(f"--steps {args.steps!r}: unknown {unknown}; choose from {list(STEPS)}")
    node = inspect_node()
    print(f"gpu-check: {node.describe()}", flush=True)
    refusal = node.refusal(args.dry)
    if refusal is not None:
        print(f"gpu-check: FAILED: {refusal}", file=sys.stderr)
        return 1
    if not args.dry and not node.cuda_available:
        print(
            "gpu-check: no GPU on this node (nvidia-smi lists none and there is no "
            "/dev/nvidia*); skipped, nothing written. On a GPU node it writes "
            f"{args.out}/<device>/: device.json, the exactness tests, a multi-rank run, "
            "Figure 3, slicing's cost, keyed dropout's cost, MFU and memory against the "
            "model. GPU_CHECK_DRY=1 rehearses every step on the CPU."
        )
        return 0
    return run_check(args.out, node, dry=args.dry, names=names, archive_to=args.archive_to)
