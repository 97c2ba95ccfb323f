"""Timings on one device that test the paper's premises on today's GPUs.

- :func:`time_layer_forward`: the paper's Figure 3, one layer's forward time for 1 to
  2048 tokens: how few tokens keep a GPU busy.
- :func:`time_slicing`: a stage's forward + backward over a whole sequence against the
  same in 8 or 16 token slices, with and without fused weight gradients (``W``): what
  slicing costs, which TeraPipe's gain must outweigh.
- :func:`time_dropout`: the position-keyed dropout (:mod:`tplib.nn.dropout`) against
  attention without it: whether runs with dropout can be timed as the paper's layouts.

On a GPU every timing is a pair of CUDA events around the work, read once it is done;
variants alternate (A B C A B C ...) so that clocks and neighbours affect them alike,
and each reports its median, minimum and maximum. The same code runs on CPU at small
sizes, which is how the check's rehearsal and the tests exercise it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from tplib.nn.configs import GPTConfig, n_params_per_layer
from tplib.nn.context import math_attention
from tplib.nn.dropout import SITE_PROBS, DropoutKey, StageDropout, layer_site
from tplib.nn.model import GPTStage, build_model
from tplib.nn.precision import autocast, param_dtype
from tplib.nn.slicing import run_pipeline_local
from tplib.plan import Plan

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "Timings",
    "layer_forward_flops",
    "time_alternating",
    "time_dropout",
    "time_layer_forward",
    "time_slicing",
]

Timings = dict[str, list[float]]  # variant -> milliseconds, one per round


def layer_forward_flops(cfg: GPTConfig, tokens: int) -> float:
    """Forward FLOPs of one block on ``tokens`` tokens of one sequence (multiply-add = 2).

    Counted: every parameter as a matmul weight (2 * params * tokens; biases and
    LayerNorms add < 0.1%) and causal attention's QK^T and AV, each 2 * tokens^2 * hidden
    over the full square, halved for the causal mask. Not counted: softmax, GELU, the
    LayerNorms' and residuals' elementwise work."""
    return 2.0 * n_params_per_layer(cfg) * tokens + 2 * 2 * tokens**2 * cfg.hidden / 2


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_alternating(
    variants: Mapping[str, Callable[[], object]],
    device: torch.device | str,
    *,
    repeats: int,
    warmup: int,
) -> Timings:
    """Milliseconds of each variant over ``repeats`` rounds, the variants alternating
    within each round, after ``warmup`` untimed rounds. On a GPU each timing is a pair of
    CUDA events around the work, read after the round."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1, warmup >= 0")
    device = torch.device(device)
    times: Timings = {name: [] for name in variants}
    for i in range(warmup + repeats):
        marks: list[tuple[str, object, object]] = []
        for name, fn in variants.items():
            _synchronize(device)  # each variant starts on an idle device
            if device.type == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                marks.append((name, start, end))
            else:
                t0 = time.perf_counter()
                fn()
                marks.append((name, t0, time.perf_counter()))
        _synchronize(device)
        if i < warmup:
            continue
        for name, a, b in marks:
            if isinstance(a, torch.cuda.Event) and isinstance(b, torch.cuda.Event):
                times[name].append(float(a.elapsed_time(b)))
            else:
                assert isinstance(a, float) and isinstance(b, float)
                times[name].append((b - a) * 1e3)
    return times


def _row(name: str, ms: Sequence[float]) -> dict[str, object]:
    return {
        "variant": name,
        "median_ms": statistics.median(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


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
    after ``warmup`` untimed ones, with tokens/s and TFLOP/s (:func:`layer_forward_flops`)."""
    import pandas as pd

    counts = sorted(set(tokens))
    if not counts or counts[0] < 1 or counts[-1] > cfg.seq_len:
        raise ValueError(f"token counts {counts} must lie in 1..{cfg.seq_len}, the model's context")
    device = torch.device(device)
    block = build_model(cfg.with_(n_layer=1), device=device, dtype=dtype).blocks["0"].eval()
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(1, n, cfg.hidden, generator=gen).to(device, dtype) for n in counts}
    times = time_alternating(
        {str(n): partial(block, x) for n, x in inputs.items()},
        device,
        repeats=repeats,
        warmup=warmup,
    )
    rows = [{"tokens": n, **_row(str(n), times[str(n)])} for n in counts]
    df = pd.DataFrame(rows).drop(columns="variant")
    seconds = df.median_ms * 1e-3
    df["tokens_per_s"] = df.tokens / seconds
    df["tflops"] = pd.Series([layer_forward_flops(cfg, n) for n in counts]) / seconds / 1e12
    return df


def _stage_pass(
    stage: GPTStage,
    x: Tensor,
    grad: Tensor,
    plan: Plan,
    *,
    precision: str,
    fused: bool,
) -> None:
    """One forward + backward of a middle stage over ``plan`` (what a pipeline stage
    computes for one sequence), the gradients cleared first."""
    stage.zero_grad(set_to_none=False)
    context_dtype = torch.bfloat16 if precision == "bf16" else param_dtype(precision)
    with autocast(precision, x.device.type):
        run_pipeline_local(
            [stage], x, plan, grad_output=grad, split_backward=fused, dtype=context_dtype
        )


def time_slicing(
    cfg: GPTConfig,
    *,
    layers: int,
    seq_len: int,
    slices: Sequence[int],
    precision: str,
    device: torch.device | str,
    repeats: int,
    warmup: int,
) -> pd.DataFrame:
    """Forward + backward of a middle stage of ``layers`` blocks over one sequence of
    ``seq_len`` tokens: whole, and in each of ``slices`` equal token slices, unfused
    and with fused ``W`` (one weight-gradient product per weight over the sequence).
    Rows: variant, slices, fused, median/min/max ms and ``ratio`` to the whole sequence's
    median."""
    import pandas as pd

    device = torch.device(device)
    if cfg.n_layer < layers + 2:
        cfg = cfg.with_(n_layer=layers + 2)  # a middle stage: layers on both sides
    stage = build_model(cfg, 1, 1 + layers, seed=0, device=device, dtype=param_dtype(precision))
    gen = torch.Generator().manual_seed(1)
    # The input needs its gradient: a middle stage sends it to the stage before.
    x = torch.randn(1, seq_len, cfg.hidden, generator=gen).to(device, param_dtype(precision))
    x.requires_grad_()
    grad = torch.randn(1, seq_len, cfg.hidden, generator=gen).to(device, x.dtype)
    variants: dict[str, tuple[int, bool]] = {"whole": (1, False)}
    for n in slices:
        if seq_len % n:
            raise ValueError(f"seq_len={seq_len} does not split into {n} equal token slices")
        variants[f"{n} slices"] = (n, False)
        variants[f"{n} slices, fused W"] = (n, True)
    plans = {name: Plan.uniform(1, seq_len, n_token_slices=n) for name, (n, _) in variants.items()}
    times = time_alternating(
        {
            name: partial(
                _stage_pass,
                stage,
                x,
                grad,
                plans[name],
                precision=precision,
                fused=fused,
            )
            for name, (_, fused) in variants.items()
        },
        device,
        repeats=repeats,
        warmup=warmup,
    )
    rows = [
        {**_row(name, times[name]), "slices": n, "fused": fused}
        for name, (n, fused) in variants.items()
    ]
    df = pd.DataFrame(rows)
    df["ratio"] = df.median_ms / df.median_ms[0]
    return df


def _attention(q: Tensor, k: Tensor, v: Tensor, drop: Callable[..., Tensor] | None) -> Tensor:
    if drop is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return math_attention(q, k, v, 0, drop)


def _forward_backward(
    fn: Callable[[], Tensor],
    inputs: Sequence[Tensor],
    ctx: Callable[[], AbstractContextManager[object]],
) -> None:
    for t in inputs:
        t.grad = None
    with ctx():
        out = fn()
    out.backward(torch.ones_like(out))


def time_dropout(
    cfg: GPTConfig,
    *,
    seq_len: int,
    precision: str,
    device: torch.device | str,
    repeats: int,
    warmup: int,
) -> pd.DataFrame:
    """Forward + backward at ``seq_len`` tokens (batch 1) of one block of ``cfg`` and of its
    attention alone, each without dropout (fused attention) and with the keyed dropout
    (attention written out, masks hashed from positions). The attention is also timed
    written out without dropout, which separates the cost of materialising the scores
    from the masks' own. Rows: variant, median/min/max ms, ``ratio`` to the variant
    without dropout of the same part."""
    import pandas as pd

    device = torch.device(device)
    p = cfg.dropout if cfg.dropout > 0 else 0.1
    cfg = cfg.with_(dropout=p)
    block_cfg = cfg if cfg.n_layer >= 3 else cfg.with_(n_layer=3)
    stage = build_model(block_cfg, 1, 2, seed=0, device=device, dtype=param_dtype(precision))
    gen = torch.Generator().manual_seed(2)
    dtype = param_dtype(precision)
    x = torch.randn(1, seq_len, cfg.hidden, generator=gen).to(device, dtype).requires_grad_()
    shape = (1, cfg.n_head, seq_len, cfg.head_dim)
    compute = torch.bfloat16 if precision == "bf16" else dtype
    q, k, v = (
        torch.randn(shape, generator=gen).to(device, compute).requires_grad_() for _ in "qkv"
    )
    key = DropoutKey.for_iteration(0, 0)
    probs = StageDropout(p, key, x, 0).probs(
        layer_site(1, SITE_PROBS), torch.arange(cfg.n_head, device=device)
    )
    ctx = partial(autocast, precision, device.type)
    variants: dict[str, Callable[[], object]] = {
        "layer": partial(_forward_backward, lambda: stage(x), [x], ctx),
        "layer, keyed dropout": partial(_forward_backward, lambda: stage(x, dropout=key), [x], ctx),
        "attention, fused": partial(
            _forward_backward, lambda: _attention(q, k, v, None), [q, k, v], ctx
        ),
        "attention, written out": partial(
            _forward_backward, lambda: _attention(q, k, v, lambda t, *_: t), [q, k, v], ctx
        ),
        "attention, keyed dropout": partial(
            _forward_backward, lambda: _attention(q, k, v, probs), [q, k, v], ctx
        ),
    }
    times = time_alternating(variants, device, repeats=repeats, warmup=warmup)
    df = pd.DataFrame([_row(name, times[name]) for name in variants])
    base = {"layer": df.median_ms[0], "attention": df.median_ms[2]}
    df["ratio"] = [m / base[n.split(",")[0]] for n, m in zip(df.variant, df.median_ms, strict=True)]
    return df
