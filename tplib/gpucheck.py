"""The GPU check (``make gpu-check``): what a user runs once on a machine with an NVIDIA GPU.

In order, each step writing its file into the output folder only once it has finished:

1. ``device.json``: the GPU, its capability and memory, torch and CUDA versions, the date;
2. ``exactness.txt``: the CUDA exactness tests (``pytest -m cuda tests/``), counts and tail;
3. ``multi_rank.json``: a 2-stage TeraPipe ``tplib bench`` run on the GPU;
4. ``fig3_layer_forward.csv`` / ``.png``: the paper's Figure 3 on this GPU, the forward
   time and throughput of one GPT3-1B layer in fp16 for 1, 2, 4, ..., 2048 tokens.

A failing step does not stop the later ones; the exit code is 0 only if every step passed.
Without a CUDA GPU it prints one line, writes nothing and exits 0, so it is safe anywhere.
:func:`time_layer_forward` also runs on CPU, which is how the tests exercise it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from subprocess import PIPE
from typing import TYPE_CHECKING, Any

import torch

from tplib.config import GPTConfig, get_config, n_params_per_layer
from tplib.files import save_figure, write_csv, write_json, write_text

# pandas, seaborn, matplotlib and the model (torch._dynamo) are imported where used:
# without a GPU the check needs only torch and answers in seconds.
if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "FIG3_TOKENS",
    "StepResult",
    "device_check",
    "exactness_check",
    "figure3_check",
    "layer_forward_flops",
    "main",
    "multi_rank_check",
    "run_gpu_check",
    "time_layer_forward",
]

ROOT = Path(__file__).resolve().parents[1]  # the checkout: tests/ lives here
FIG3_TOKENS = tuple(2**i for i in range(12))  # 1, 2, 4, ..., 2048: the paper's Figure 3
EXACTNESS_COMMAND = (sys.executable, *shlex.split("-m pytest -q -p no:cacheprovider -m cuda tests"))
MULTI_RANK_COMMAND = (
    sys.executable,
    *shlex.split("-m tplib bench --model tiny --schedule terapipe --stages 2 --batch 2"),
    *shlex.split("--seq-len 64 --slices 4 --device cuda --json"),
)
TAIL_LINES = 40
REPEATS = 20  # timings per Figure 3 point: the median, min and max over them
_OUTCOME = r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)"


@dataclass(frozen=True)
class StepResult:
    """One step's outcome: ``summary`` is its line in the printed summary."""

    name: str
    ok: bool
    summary: str


def device_check(out: Path) -> StepResult:
    """The current CUDA device and the software stack, into ``device.json``."""
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    info = {
        "name": torch.cuda.get_device_name(index),
        "capability": list(torch.cuda.get_device_capability(index)),
        "memory_bytes": int(props.total_memory),
        "memory_gib": round(props.total_memory / 2**30, 2),
        "gpu_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    write_json(out / "device.json", info)
    return StepResult(
        "device", True, f"{info['name']}, {info['memory_gib']} GiB, CUDA {info['cuda']}"
    )


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(command: Sequence[str], timeout: float) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr); the exit code is None when it ran past ``timeout``.

    The command runs in its own process group, killed whole on a timeout or Ctrl-C: the
    bench's worker processes must not outlive it holding the GPU."""
    proc = subprocess.Popen(
        list(command), cwd=ROOT, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True
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


def pytest_counts(output: str) -> dict[str, int]:
    """Outcome counts from pytest's final line, e.g. ``{"passed": 3, "failed": 1}``."""
    counts: dict[str, int] = {}
    for number, word in re.findall(_OUTCOME, output):
        counts["errors" if word == "error" else word] = int(number)
    return counts


def exactness_check(out: Path, command: Sequence[str] = EXACTNESS_COMMAND) -> StepResult:
    """Run the CUDA exactness tests; record the counts and output tail in exactness.txt."""
    code, stdout, stderr = _run(command, timeout=3600)
    counts = pytest_counts(_tail(stdout, 1))  # pytest's last line sums up the run
    ok = code == 0 and counts.get("passed", 0) > 0
    words = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no test outcomes"
    if not counts.get("passed"):  # on a GPU, no cuda test passing means nothing was checked
        words += "; no test marked cuda passed"
    write_text(
        out / "exactness.txt",
        f"command: {shlex.join(command)}\nexit code: {code}\n"
        f"result: {'PASS' if ok else 'FAIL'} ({words})\n\n{_tail(stdout + stderr)}\n",
    )
    return StepResult("exactness", ok, words)


def multi_rank_check(out: Path, command: Sequence[str] = MULTI_RANK_COMMAND) -> StepResult:
    """A 2-stage TeraPipe bench on the GPU; ``multi_rank.json`` records the command, whether
    it passed, and the bench's JSON (``bench``) or, when it failed, its stderr tail."""
    t0 = time.perf_counter()
    code, stdout, stderr = _run(command, timeout=1200)
    record: dict[str, Any] = {"command": shlex.join(command), "returncode": code}
    record["wall_s"] = round(time.perf_counter() - t0, 3)
    last = stdout.strip().splitlines()[-1:]  # the JSON: anything else printed comes before it
    try:
        bench = json.loads(last[0]) if code == 0 and last else None
    except json.JSONDecodeError:
        bench = None
    if not isinstance(bench, dict):
        failed = {"ok": False, "stderr_tail": _tail(stderr), "stdout_tail": _tail(stdout, 5)}
        write_json(out / "multi_rank.json", record | failed)
        why = _tail(stderr, 1) or "no JSON on stdout"
        return StepResult("multi-rank", False, f"exit code {code}: {why}")
    write_json(out / "multi_rank.json", record | {"ok": True, "bench": bench})
    latency = bench.get("median_latency_s")
    detail = f"median latency {latency * 1e3:.1f} ms" if isinstance(latency, float) else "ran"
    return StepResult("multi-rank", True, f"terapipe, 2 stages, 4 token slices: {detail}")


def layer_forward_flops(cfg: GPTConfig, tokens: int) -> float:
    """Forward FLOPs of one block on ``tokens`` tokens of one sequence (multiply-add = 2).

    Counted: every parameter as a matmul weight (2 * params * tokens; biases and
    LayerNorms add < 0.1%) and causal attention's QK^T and AV, each 2 * tokens^2 * hidden
    over the full square, halved for the causal mask. Not counted: softmax, GELU, the
    LayerNorms' and residuals' elementwise work."""
    return 2.0 * n_params_per_layer(cfg) * tokens + 2 * 2 * tokens**2 * cfg.hidden / 2


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@torch.no_grad()
def time_layer_forward(
    cfg: GPTConfig,
    tokens: Sequence[int],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    repeats: int,
    warmup: int,
) -> pd.DataFrame:
    """Forward time of one block of ``cfg`` (batch 1, whole-sequence causal attention over
    positions 0..n-1) for each token count n: median, min and max over ``repeats`` timings
    after ``warmup`` untimed ones (CUDA events on a GPU, the wall clock on CPU)."""
    import pandas as pd

    from tplib.model import build_model

    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1, warmup >= 0")
    counts = sorted(set(tokens))
    if not counts or counts[0] < 1 or counts[-1] > cfg.seq_len:
        raise ValueError(f"token counts {counts} must lie in 1..{cfg.seq_len}, the model's context")
    device = torch.device(device)
    block = build_model(cfg.with_(n_layer=1), device=device, dtype=dtype).blocks["0"].eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in counts:
        x = torch.randn(1, n, cfg.hidden, generator=gen).to(device=device, dtype=dtype)
        for _ in range(warmup):
            block(x)
        if device.type == "cuda":  # each timing starts on an idle GPU, launch latency included
            torch.cuda.synchronize(device)
        ms = [_time_ms(partial(block, x), device) for _ in range(repeats)]
        rows.append((n, statistics.median(ms), min(ms), max(ms)))
    df = pd.DataFrame(rows, columns=["tokens", "median_ms", "min_ms", "max_ms"])
    seconds = df.median_ms * 1e-3
    df["tokens_per_s"] = df.tokens / seconds
    df["tflops"] = pd.Series([layer_forward_flops(cfg, n) for n in counts]) / seconds / 1e12
    return df


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


def figure3_check(
    out: Path, cfg: GPTConfig, *, device: str = "cuda", tokens: Sequence[int] = FIG3_TOKENS
) -> StepResult:
    """Time the layer (fp16 on a GPU, float32 on CPU), then write the CSV and the figure:
    both or, when timing fails, neither."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    df = time_layer_forward(cfg, tokens, device=device, dtype=dtype, repeats=REPEATS, warmup=5)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    dtype_name = str(dtype).removeprefix("torch.")
    fig = figure3(df, f"One {cfg.name} layer, forward, {dtype_name}, on {name} (Figure 3)")
    write_csv(df, out / "fig3_layer_forward.csv")
    save_figure(fig, out / "fig3_layer_forward.png")
    at = df.set_index("tokens").median_ms
    shown = [n for n in (1, 256, 2048) if n in at.index] or list(at.index[:3])
    return StepResult("figure 3", True, ", ".join(f"{n} tok {at[n]:.3f} ms" for n in shown))


def _guarded(name: str, step: Callable[[], StepResult]) -> StepResult:
    try:
        return step()
    except Exception as exc:  # a failed step is reported; the later steps still run
        return StepResult(name, False, f"{type(exc).__name__}: {exc}")


def run_gpu_check(out: Path) -> int:
    """Every step on the GPU, in order, then the summary; 0 only if all passed."""
    gpt3_1b = get_config("GPT3-1B")
    plan: dict[str, Callable[[], StepResult]] = {
        "device": lambda: device_check(out),
        "exactness": lambda: exactness_check(out),
        "multi-rank": lambda: multi_rank_check(out),
        "figure 3": lambda: figure3_check(out, gpt3_1b),
    }
    steps = []
    for i, (name, step) in enumerate(plan.items(), 1):
        print(f"gpu-check [{i}/{len(plan)}] {name} ...", flush=True)
        steps.append(_guarded(name, step))
    print("gpu-check summary:")
    for s in steps:
        print(f"  {s.name:<11} {'ok  ' if s.ok else 'FAIL'}  {s.summary}")
    failed = [s.name for s in steps if not s.ok]
    print(f"files in {out}/")
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The GPU check: exactness, multi-rank and Figure 3.")
    p.add_argument("--out", type=Path, default=Path("results/gpu"), help="output folder")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA GPU is present (torch.cuda.is_available() is False); skipped, "
            "nothing written. On an NVIDIA GPU it writes device.json, runs the CUDA exactness "
            "tests (pytest -m cuda), a 2-stage TeraPipe bench on cuda and the Figure 3 "
            f"layer timing (GPT3-1B, fp16) into {args.out}/"
        )
        return 0
    return run_gpu_check(args.out)
