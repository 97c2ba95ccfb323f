"""The steps that prove the CUDA path runs: the device and its software stack, the CUDA
exactness tests, and a multi-rank bench, each recorded with what it ran.

The tests and the bench run as commands of their own, in a process group killed whole on
a timeout, from the checkout (:func:`checkout_env`: a node's own Python runs them
without tplib installed).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from subprocess import PIPE
from typing import Any

import torch

from tplib.gpucheck.result import StepResult
from tplib.gpucheck.sizes import Sizes
from tplib.util.files import write_json, write_text

__all__ = [
    "ROOT",
    "checkout_env",
    "device_step",
    "exactness_command",
    "exactness_step",
    "multi_rank_step",
    "pytest_counts",
]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/ lives here
TAIL_LINES = 40
_OUTCOME = r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)"


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(
    command: Sequence[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr); the exit code is None when it ran past ``timeout``.
    It runs in its own process group, killed whole on a timeout or Ctrl-C: worker
    processes must not outlive it holding the GPU."""
    proc = subprocess.Popen(
        list(command),
        cwd=ROOT,
        stdout=PIPE,
        stderr=PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, f"{err}\ntimed out after {timeout:.0f} s"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on the module path: a node's
    own Python runs the check without installing tplib."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | {"PYTHONPATH": path} | extra


# ---- the steps ------------------------------------------------------------------------


def _nccl_version() -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL: the check goes on, gloo still works
        return "none"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def device_step(out: Path, sizes: Sizes) -> StepResult:
    """The device and the software stack, into ``device.json``."""
    from tplib.gpucheck.node import inspect_node
    from tplib.gpucheck.training import peak_bf16

    node = inspect_node()
    info: dict[str, Any] = {
        "python": node.python,
        "torch": node.torch,
        "torch_cuda": node.torch_cuda,
        "driver": node.driver,
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if sizes.device != "cuda":
        write_json(out / "device.json", info | {"device": "cpu", "rehearsal": True})
        return StepResult("device", "ok", f"CPU rehearsal on {os.cpu_count()} cores")
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    name = torch.cuda.get_device_name(index)
    cuda = {
        "name": name,
        "capability": list(torch.cuda.get_device_capability(index)),
        "memory_bytes": int(props.total_memory),
        "memory_gib": round(props.total_memory / 2**30, 2),
        "multiprocessors": props.multi_processor_count,
        "gpu_count": torch.cuda.device_count(),
        "cudnn": torch.backends.cudnn.version(),
        "nccl": _nccl_version(),
        "bf16_supported": torch.cuda.is_bf16_supported(),
        "peak_bf16_tflops": peak_bf16(name),
    }
    write_json(out / "device.json", info | cuda)
    major, minor = cuda["capability"]
    return StepResult(
        "device",
        "ok",
        f"{name}, {cuda['memory_gib']} GiB, sm_{major}{minor}, "
        f"{cuda['multiprocessors']} SMs, NCCL {cuda['nccl']}",
        values=cuda,
    )


def pytest_counts(output: str) -> dict[str, int]:
    """Outcome counts from pytest's final line, e.g. ``{"passed": 3, "failed": 1}``."""
    counts: dict[str, int] = {}
    for number, word in re.findall(_OUTCOME, output):
        counts["errors" if word == "error" else word] = int(number)
    return counts


# Only the file the check runs: a node without the notebooks' packages collects it.
EXACTNESS_TESTS = ("tests/test_runtime_cuda.py",)


def exactness_command() -> tuple[str, ...]:
    return (
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "cuda",
        *EXACTNESS_TESTS,
    )


def exactness_step(out: Path, sizes: Sizes, command: Sequence[str] | None = None) -> StepResult:
    """The CUDA exactness tests (on the CPU in the rehearsal); counts and the output's
    tail into ``exactness.txt``."""
    command = tuple(command or exactness_command())
    # No third-party pytest plugins: a node may lack them, and the tests need none.
    env = checkout_env(TPLIB_TEST_DEVICE=sizes.device, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    code, stdout, stderr = _run(command, timeout=3600, env=env)
    counts = pytest_counts(_tail(stdout, 1))  # pytest's last line sums up the run
    ok = code == 0 and counts.get("passed", 0) > 0
    words = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no test outcomes"
    if not counts.get("passed"):  # no cuda test passing means nothing was checked
        words += "; no test marked cuda passed"
    write_text(
        out / "exactness.txt",
        f"command: TPLIB_TEST_DEVICE={sizes.device} {shlex.join(command)}\nexit code: {code}\n"
        f"result: {'PASS' if ok else 'FAIL'} ({words})\n\n{_tail(stdout + stderr)}\n",
    )
    return StepResult("exactness", "ok" if ok else "failed", words, values=counts)


def _multi_rank_command(sizes: Sizes) -> tuple[str, ...]:
    return (
        sys.executable,
        *shlex.split(f"-m tplib bench --model {sizes.multi_rank_model} --schedule terapipe"),
        *shlex.split("--stages 2 --batch 2 --seq-len 64 --slices 4 --json"),
        *("--device", sizes.device),
    )


def multi_rank_step(out: Path, sizes: Sizes, command: Sequence[str] | None = None) -> StepResult:
    """A 2-stage TeraPipe ``tplib bench`` on the device, ranks sharing it;
    ``multi_rank.json`` records the command, whether it passed, and the bench's JSON
    (``bench``) or, when it failed, its stderr tail."""
    command = tuple(command or _multi_rank_command(sizes))
    t0 = time.perf_counter()
    code, stdout, stderr = _run(command, timeout=1200, env=checkout_env())
    record: dict[str, Any] = {"command": shlex.join(command), "returncode": code}
    record["wall_s"] = round(time.perf_counter() - t0, 3)
    last = stdout.strip().splitlines()[-1:]  # the JSON: anything else printed comes before
    try:
        bench = json.loads(last[0]) if code == 0 and last else None
    except json.JSONDecodeError:
        bench = None
    if not isinstance(bench, dict):
        failed = {"ok": False, "stderr_tail": _tail(stderr), "stdout_tail": _tail(stdout, 5)}
        write_json(out / "multi_rank.json", record | failed)
        why = _tail(stderr, 1) or "no JSON on stdout"
        return StepResult("multi-rank", "failed", f"exit code {code}: {why}")
    write_json(out / "multi_rank.json", record | {"ok": True, "bench": bench})
    latency = bench.get("median_latency_s")
    detail = f"median latency {latency * 1e3:.1f} ms" if isinstance(latency, float) else "ran"
    backend = bench.get("backend", "?")
    return StepResult(
        "multi-rank", "ok", f"terapipe, 2 stages on {backend}, 4 token slices: {detail}"
    )
