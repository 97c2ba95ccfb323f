"""The GPU check's steps: each measures one thing, writes its files into the output folder
only once it has finished, and says in one line what it found.

Each step runs in a process of its own (``python -m tplib.gpucheck.steps NAME --out DIR
--mode gpu|dry``), so that the driver (:mod:`tplib.gpucheck.driver`) can stop one that
overruns its budget, and a CUDA error cannot poison the steps after it; the process's
last line is the :class:`StepResult` as JSON after :data:`RESULT_MARK`. ``--mode dry``
runs the same step on the CPU at the sizes of :data:`DRY` (the rehearsal).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from subprocess import PIPE
from typing import TYPE_CHECKING, Any

import torch

from tplib.config import get_config
from tplib.files import save_figure, write_csv, write_json, write_text

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "DRY",
    "GPU",
    "RESULT_MARK",
    "STEPS",
    "Sizes",
    "StepResult",
    "checkout_env",
    "main",
    "pytest_counts",
]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/ lives here
RESULT_MARK = "GPU_CHECK_RESULT "
TAIL_LINES = 40
_OUTCOME = r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)"


@dataclass(frozen=True)
class StepResult:
    """One step's outcome: ``status`` "ok", "failed" or "skipped"; ``summary`` its line in
    the printed summary; ``target`` what it was held to and whether it met it."""

    name: str
    status: str
    summary: str
    target: str = ""
    seconds: float = 0.0
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Sizes:
    """What the steps measure, on a GPU or (the rehearsal) on the CPU."""

    device: str
    model: str  # Figure 3, slicing, dropout, efficiency
    fig3_tokens: tuple[int, ...]
    fig3_dtype: str
    seq_len: int  # slicing and dropout
    stage_layers: int
    slices: tuple[int, ...]
    precision: str  # slicing, dropout, memory
    efficiency_batch: int
    efficiency_seq_len: int
    memory_model: str
    memory_overrides: tuple[tuple[str, object], ...]
    memory_batch: int
    memory_seq_len: int
    repeats: int
    warmup: int
    multi_rank_model: str = "tiny"


GPU = Sizes(
    device="cuda",
    model="GPT3-1B",
    fig3_tokens=tuple(2**i for i in range(12)),  # 1 ... 2048: the paper's Figure 3
    fig3_dtype="float16",  # the paper's V100 runs
    seq_len=2048,
    stage_layers=2,
    slices=(8, 16),
    precision="bf16",
    efficiency_batch=4,
    efficiency_seq_len=2048,
    memory_model="GPT3-1B",
    memory_overrides=(("n_layer", 4), ("dropout", 0.0)),
    memory_batch=4,
    memory_seq_len=1024,
    repeats=10,
    warmup=3,
)
DRY = Sizes(
    device="cpu",
    model="tiny",
    fig3_tokens=(1, 4, 16, 64),
    fig3_dtype="float32",
    seq_len=64,
    stage_layers=2,
    slices=(8, 16),
    precision="bf16",
    efficiency_batch=2,
    efficiency_seq_len=64,
    memory_model="tiny",
    memory_overrides=(),
    memory_batch=4,
    memory_seq_len=16,
    repeats=2,
    warmup=1,
)
MEMORY_CASES = tuple((s, r) for s in ("gpipe", "1f1b", "terapipe") for r in ("none", "full"))
SLICING_TARGET = 1.10  # sliced / whole at 8 slices
MFU_TARGET = 0.40
MEMORY_TARGET = 0.10


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


def multi_rank_command(sizes: Sizes) -> tuple[str, ...]:
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
    command = tuple(command or multi_rank_command(sizes))
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


def figure3(df: pd.DataFrame, title: str) -> Figure:
    """Two panels, as the paper's Figure 3: forward time and throughput against tokens."""
    import seaborn as sns
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    sns.lineplot(df, x="tokens", y="median_ms", marker="o", label="median", ax=ax1)
    ax1.fill_between(df.tokens, df.min_ms, df.max_ms, alpha=0.25, label="min..max")
    ax1.legend()
    ax1.set(yscale="log", xlabel="input tokens", ylabel="forward time (ms)")
    sns.lineplot(df, x="tokens", y="tokens_per_s", marker="o", ax=ax2)
    ax2.set(xlabel="input tokens", ylabel="throughput (tokens/s)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
    fig.suptitle(title)
    return fig


def _device_name(sizes: Sizes) -> str:
    return torch.cuda.get_device_name() if sizes.device == "cuda" else "cpu"


def figure3_step(out: Path, sizes: Sizes) -> StepResult:
    """One layer's forward for 1..2048 tokens: ``fig3_layer_forward.csv`` and ``.png``,
    both or neither."""
    from tplib.gpucheck.kernels import time_layer_forward

    cfg = get_config(sizes.model)
    dtype = getattr(torch, sizes.fig3_dtype)
    df = time_layer_forward(
        cfg,
        sizes.fig3_tokens,
        device=sizes.device,
        dtype=dtype,
        repeats=2 * sizes.repeats,
        warmup=sizes.warmup,
    )
    title = (
        f"One {cfg.name} layer, forward, {sizes.fig3_dtype}, on {_device_name(sizes)} (Figure 3)"
    )
    fig = figure3(df, title)
    write_csv(df, out / "fig3_layer_forward.csv")
    save_figure(fig, out / "fig3_layer_forward.png")
    at = df.set_index("tokens").median_ms
    counts = list(at.index)
    shown = [n for n in (1, 256, 2048) if n in counts]
    if len(shown) < 3:  # a rehearsal's few counts: the first, the middle and the last
        shown = sorted({counts[0], counts[len(counts) // 2], counts[-1]})
    return StepResult("figure 3", "ok", ", ".join(f"{n} tok {at[n]:.3f} ms" for n in shown))


def slicing_step(out: Path, sizes: Sizes) -> StepResult:
    """A stage's forward + backward, whole against token-sliced: ``slicing.csv``."""
    from tplib.gpucheck.kernels import time_slicing

    cfg = get_config(sizes.model)
    df = time_slicing(
        cfg,
        layers=sizes.stage_layers,
        seq_len=sizes.seq_len,
        slices=sizes.slices,
        precision=sizes.precision,
        device=sizes.device,
        repeats=sizes.repeats,
        warmup=sizes.warmup,
    )
    write_csv(df, out / "slicing.csv")
    ratio = df.set_index("variant").ratio
    parts = [
        f"{n} slices x{ratio[f'{n} slices']:.3f} (fused W x{ratio[f'{n} slices, fused W']:.3f})"
        for n in sizes.slices
    ]
    first = sizes.slices[0]
    at = float(ratio[f"{first} slices"])
    met = "met" if at <= SLICING_TARGET else "missed"
    return StepResult(
        "slicing",
        "ok",
        f"{cfg.name}, {sizes.stage_layers} layers, L={sizes.seq_len}, {sizes.precision}: "
        + ", ".join(parts),
        target=f"<= {SLICING_TARGET:.2f}x at {first} slices: {met} ({at:.3f}x)",
        values={"ratios": ratio.to_dict()},
    )


def dropout_step(out: Path, sizes: Sizes) -> StepResult:
    """The keyed dropout against attention without it: ``dropout.csv``."""
    from tplib.gpucheck.kernels import time_dropout

    cfg = get_config(sizes.model)
    df = time_dropout(
        cfg,
        seq_len=sizes.seq_len,
        precision=sizes.precision,
        device=sizes.device,
        repeats=sizes.repeats,
        warmup=sizes.warmup,
    )
    write_csv(df, out / "dropout.csv")
    r = df.set_index("variant").ratio
    return StepResult(
        "dropout",
        "ok",
        f"L={sizes.seq_len}: layer x{r['layer, keyed dropout']:.2f} with dropout; attention "
        f"written out x{r['attention, written out']:.2f}, with keyed dropout "
        f"x{r['attention, keyed dropout']:.2f} of fused",
        values={"ratios": r.to_dict()},
    )


def efficiency_step(out: Path, sizes: Sizes) -> StepResult:
    """A whole model's training step: tokens/s and MFU, into ``efficiency.json``."""
    from tplib.gpucheck.training import measure_efficiency

    cfg = get_config(sizes.model)
    record = measure_efficiency(
        cfg,
        batch=sizes.efficiency_batch,
        seq_len=sizes.efficiency_seq_len,
        device=sizes.device,
        repeats=sizes.repeats,
        warmup=sizes.warmup,
        device_name=_device_name(sizes),
    )
    write_json(out / "efficiency.json", asdict(record))
    head = (
        f"{cfg.name} bf16, {sizes.efficiency_batch} x {sizes.efficiency_seq_len} tokens: "
        f"{record.tokens_per_s:,.0f} tokens/s, {record.achieved_tflops:.3g} TFLOP/s"
    )
    if record.mfu is None:
        return StepResult("efficiency", "ok", head, target="MFU: no peak known for this device")
    met = "met" if record.mfu >= MFU_TARGET else "missed"
    return StepResult(
        "efficiency",
        "ok",
        f"{head}, MFU {record.mfu:.1%}",
        target=f">= {MFU_TARGET:.0%} MFU: {met}",
        values={"mfu": record.mfu},
    )


def memory_step(out: Path, sizes: Sizes) -> StepResult:
    """Each rank's peak beside the memory model's, gpipe / 1f1b / terapipe, with and
    without recomputation: ``memory.csv``."""
    from tplib.gpucheck.training import measure_memory

    df = measure_memory(
        sizes.memory_model,
        overrides=sizes.memory_overrides,
        n_stages=2,
        batch=sizes.memory_batch,
        seq_len=sizes.memory_seq_len,
        token_slices=4,
        precision=sizes.precision,
        device=sizes.device,
        cases=MEMORY_CASES,
        timeout_s=120,
    )
    write_csv(df, out / "memory.csv")
    worst = df.iloc[int(df.error.abs().to_numpy().argmax())]
    met = "met" if abs(worst.error) <= MEMORY_TARGET else "missed"
    where = f"{worst.schedule}, recompute {worst.recompute}, stage {worst.stage}"
    return StepResult(
        "memory",
        "ok",
        f"{len(MEMORY_CASES)} runs on 2 ranks ({df.source.iloc[0]}): modelled / measured - 1 "
        f"in [{df.error.min():+.1%}, {df.error.max():+.1%}]",
        target=f"within {MEMORY_TARGET:.0%}: {met} (worst {worst.error:+.1%}, {where})",
        values={"errors": df.error.tolist()},
    )


Step = Callable[[Path, Sizes], StepResult]
# name -> (the step, its budget in seconds on one H100): the whole check stays under 8
# minutes, whatever overruns.
STEPS: dict[str, tuple[Step, float]] = {
    "device": (device_step, 20),
    "exactness": (exactness_step, 150),
    "multi-rank": (multi_rank_step, 45),
    "figure 3": (figure3_step, 30),
    "slicing": (slicing_step, 45),
    "dropout": (dropout_step, 25),
    "efficiency": (efficiency_step, 45),
    "memory": (memory_step, 75),
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tplib.gpucheck.steps", description="Run one step of the GPU check."
    )
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=("gpu", "dry"), default="gpu")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    sizes = GPU if args.mode == "gpu" else DRY
    args.out.mkdir(parents=True, exist_ok=True)
    step, _ = STEPS[args.step]
    t0 = time.perf_counter()
    try:
        result = step(args.out, sizes)
    except Exception as exc:  # reported as the step's outcome; the traceback goes to its log
        import traceback

        traceback.print_exc()
        result = StepResult(args.step, "failed", f"{type(exc).__name__}: {exc}".splitlines()[0])
    result = StepResult(**(asdict(result) | {"seconds": time.perf_counter() - t0}))
    print(RESULT_MARK + json.dumps(asdict(result)), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
