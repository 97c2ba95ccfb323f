"""Training on one device: how much of its peak a training step reaches, and how the
runtime's measured memory compares with tplib's memory model.

- :func:`measure_efficiency`: tokens/s and model FLOPs utilisation (MFU) of forward +
  backward + optimizer over a whole model that fits one GPU (GPT3-1B), in bf16 with
  fused attention, against the GPU's dense bf16 peak (:data:`_PEAK_BF16`). torchtitan and
  Megatron report 40-55% on such GPUs; tplib's model is plain eager PyTorch.
- :func:`measure_memory`: the runtime's schedules on local processes sharing the device,
  each rank's peak (the CUDA allocator's on a GPU) beside what
  :func:`tplib.cluster.runtime_memory.stage_memory` predicts for its stage.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tplib.gpucheck.kernels import layer_forward_flops, time_alternating
from tplib.nn.configs import GPTConfig
from tplib.nn.data import synthetic_batch
from tplib.nn.model import build_model
from tplib.nn.optimizer import make_optimizer
from tplib.nn.precision import autocast
from tplib.nn.slicing import full_batch_loss
from tplib.plan import Plan

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "MemoryCase",
    "measure_efficiency",
    "measure_memory",
    "peak_bf16",
    "train_flops",
]

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets; the
# first name the device's contains wins, so the more specific come first.
_PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4),
    ("H200 NVL", 835.0),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM5 (HBM3)
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
)


def peak_bf16(device_name: str) -> float | None:
    """The dense bf16 peak (TFLOP/s) of a GPU by name; None for one not in the table."""
    for pattern, tflops in _PEAK_BF16:
        if pattern.lower() in device_name.lower():
            return tflops
    return None


def train_flops(cfg: GPTConfig, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step (no recomputation): three times the forward's,
    which is every block's (:func:`~tplib.gpucheck.kernels.layer_forward_flops`, causal
    attention counted once) and the LM head's product over every position."""
    forward = (
        cfg.n_layer * layer_forward_flops(cfg, seq_len)
        + 2.0 * cfg.hidden * cfg.vocab_size * seq_len
    )
    return 3.0 * batch * forward


@dataclass(frozen=True)
class Efficiency:
    """What :func:`measure_efficiency` measured (``mfu`` None where the peak is unknown)."""

    model: str
    n_params: int
    batch: int
    seq_len: int
    step_median_ms: float
    step_min_ms: float
    step_max_ms: float
    tokens_per_s: float
    achieved_tflops: float
    peak_bf16_tflops: float | None
    mfu: float | None
    peak_memory_gib: float | None


def measure_efficiency(
    cfg: GPTConfig,
    *,
    batch: int,
    seq_len: int,
    device: torch.device | str,
    repeats: int,
    warmup: int,
    device_name: str = "",
) -> Efficiency:
    """One training step of the whole ``cfg`` model on ``batch`` sequences of ``seq_len``
    tokens: bf16 autocast, fused causal attention (no dropout), AdamW as the runtime
    runs it and the gradient clipped to norm 1. The step's median time, tokens/s,
    achieved TFLOP/s and, where the peak is known, MFU."""
    device = torch.device(device)
    model = build_model(cfg, seed=0, device=device)
    params = list(model.parameters())
    optimizer = make_optimizer(
        params, "bf16", lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8
    )
    tokens, targets = (t.to(device) for t in synthetic_batch(cfg, batch, seq_len, seed=0))

    def step() -> None:
        with autocast("bf16", device.type):
            loss = full_batch_loss(model, tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step(False)
        optimizer.zero_grad()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = time_alternating({"step": step}, device, repeats=repeats, warmup=warmup)["step"]
    seconds = statistics.median(ms) / 1e3
    achieved = train_flops(cfg, batch, seq_len) / seconds / 1e12
    peak = peak_bf16(device_name) if device.type == "cuda" else None
    return Efficiency(
        model=cfg.name,
        n_params=sum(p.numel() for p in params),
        batch=batch,
        seq_len=seq_len,
        step_median_ms=statistics.median(ms),
        step_min_ms=min(ms),
        step_max_ms=max(ms),
        tokens_per_s=batch * seq_len / seconds,
        achieved_tflops=achieved,
        peak_bf16_tflops=peak,
        mfu=None if peak is None else achieved / peak,
        peak_memory_gib=(
            torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        ),
    )


MemoryCase = tuple[str, str]  # (schedule, recompute)


def _plan(schedule: str, batch: int, seq_len: int, token_slices: int) -> Plan:
    if schedule.startswith("terapipe"):
        return Plan.uniform(batch, seq_len, n_token_slices=token_slices)
    return Plan.gpipe(batch, seq_len)


def measure_memory(
    model: str,
    *,
    overrides: tuple[tuple[str, object], ...],
    n_stages: int,
    batch: int,
    seq_len: int,
    token_slices: int,
    precision: str,
    device: str,
    cases: Sequence[MemoryCase],
    timeout_s: float,
) -> pd.DataFrame:
    """Each case trained for two iterations (one warm-up) on ``n_stages`` local ranks
    sharing the device; per stage, the measured peak of its rank and the modelled one.
    Rows: schedule, recompute, stage, measured_bytes, modelled_bytes, error (modelled /
    measured - 1), source ("allocator" on a GPU, "counted" on CPU)."""
    import pandas as pd

    from tplib.runtime import Data, LocalPool, Parallelism, RunConfig, Timing
    from tplib.runtime.benchmark import bench

    rows = []
    with LocalPool(n_stages, backend="gloo", timeout_s=timeout_s) as pool:
        for schedule, recompute in cases:
            run = RunConfig(
                model=model,
                model_overrides=overrides,
                schedule_name=schedule,
                parallelism=Parallelism(n_stages=n_stages),
                data=Data(batch=batch, seq_len=seq_len),
                slicing=_plan(schedule, batch, seq_len, token_slices),
                recompute=recompute,
                precision=precision,
                device=device,
                timing=Timing(steps=1, warmup=1, timeout_s=timeout_s),
            )
            result = bench(run, pool.run(run), backend="gloo")
            for k, (measured, modelled) in enumerate(
                zip(result.stage_peak_bytes, result.modelled_peak_bytes, strict=True)
            ):
                rows.append(
                    {
                        "schedule": schedule,
                        "recompute": recompute,
                        "stage": k,
                        "measured_bytes": measured,
                        "modelled_bytes": modelled,
                        "error": modelled / measured - 1 if measured else float("nan"),
                        "source": result.memory_source,
                    }
                )
    return pd.DataFrame(rows)
