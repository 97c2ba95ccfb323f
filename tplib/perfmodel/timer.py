"""Timing real stages with torch: the measuring half of the profiler.

:class:`StageTimer` times forward+backward of one slice through a stage, the ``measure``
that :func:`~tplib.perfmodel.build.build_profile` calls; :func:`profile_stage` profiles
one stage that way, and also records what the simulator needs beyond Eq. 9: the
forward's share of forward+backward and the stage's optimizer step.
:func:`profile_pipeline` profiles every stage of a pipeline, one
:class:`~tplib.perfmodel.profile.Profile` each.

A profile times either a middle stage of ``layers_per_stage`` blocks (what the paper's
uniform stages are) or an actual stage ``[lo, hi)`` of a K-stage pipeline: the first
stage with the embeddings, the last with the LM head and loss.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tplib.config import GPTConfig, get_config
from tplib.context import StageContext
from tplib.linear import Linear
from tplib.machine import threads_per_process
from tplib.model import build_model
from tplib.perfmodel.build import build_profile
from tplib.perfmodel.profile import (
    DEFAULT_LINK_BANDWIDTH,
    DEFAULT_LINK_LATENCY,
    DTYPE_BYTES,
    Profile,
    ProfileError,
    grid_steps,
)
from tplib.plan import Unit
from tplib.stages import balanced_stages, check_stage_range, check_stage_ranges
from tplib.wgrad import DeferredWeightGrads

__all__ = ["DTYPES", "StageTimer", "profile_pipeline", "profile_stage"]

DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}
WGRAD_REPEATS = 3  # the fewest timed runs wgrad_fraction takes its median over


class StageTimer:
    """``timer(b, l, c)``: median seconds of forward+backward of one slice of b x l tokens
    at ``start=c`` through a stage of ``layers_per_stage`` blocks.

    By default the stage is a middle one (no embedding, no head). With ``stage=(lo, hi)``
    it is exactly layers [lo, hi) of ``cfg`` as a pipeline builds them: the first stage
    takes token ids and embeds them, the last computes the LM head and the summed
    cross-entropy and starts backward from that loss, as the runtime does.

    Every call also records the forward's share of the time (``forward_fractions``), and
    :meth:`optimizer_time` times the stage's AdamW step.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        layers_per_stage: int,
        *,
        seq_len: int,
        device: str = "cpu",
        dtype: str = "float32",
        repeats: int = 5,
        warmup: int = 1,
        seed: int = 0,
        stage: tuple[int, int] | None = None,
    ) -> None:
        if seq_len > cfg.seq_len:
            raise ProfileError(
                f"seq_len {seq_len} exceeds model {cfg.name}'s context {cfg.seq_len}"
            )
        if stage is not None:
            lo, hi = stage
            try:
                check_stage_range(cfg, lo, hi)
            except ValueError as exc:
                raise ProfileError(f"stage={stage}: {exc}") from None
            layers_per_stage = hi - lo
        if layers_per_stage < 1 or repeats < 1 or warmup < 0:
            raise ProfileError(
                "need layers_per_stage >= 1, repeats >= 1, warmup >= 0: "
                f"{layers_per_stage, repeats, warmup}"
            )
        if dtype not in DTYPES:
            raise ProfileError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ProfileError(f"unknown device {device!r}: use cpu or cuda") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ProfileError(f"device {device!r}: CUDA is not available here, use cpu")
        if stage is None:
            # A middle stage is blocks [1, 1 + n) of a model with layers after them; a small
            # config gets more layers, which changes only init scales, not the time.
            n = layers_per_stage
            big = cfg if cfg.n_layer >= n + 2 else cfg.with_(n_layer=n + 2)
            lo, hi = 1, 1 + n
        else:
            big = cfg
        self.stage = build_model(big, lo, hi, seed=seed, device=device, dtype=DTYPES[dtype])
        self.device, self.dtype, self.seq_len = dev, DTYPES[dtype], seq_len
        self.repeats, self.warmup = repeats, warmup
        self.forward_fractions: list[float] = []
        self._contexts: dict[int, StageContext] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _inputs(self, batch: int, length: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The stage's input, the targets (last stage) and the output gradient (others)."""
        cfg, opts = self.stage.cfg, {"device": self.device, "dtype": self.dtype}
        if self.stage.is_first:
            x = torch.randint(0, cfg.vocab_size, (batch, length), device=self.device)
        else:
            x = torch.randn(batch, length, cfg.hidden, **opts, requires_grad=True)
        if self.stage.is_last:
            targets = torch.randint(0, cfg.vocab_size, (batch, length), device=self.device)
            return x, targets, None
        return x, None, torch.randn(batch, length, cfg.hidden, **opts)

    def __call__(self, batch: int, length: int, context: int) -> float:
        if batch not in self._contexts:  # one batch size at a time: bounded memory
            self._contexts = {batch: self.stage.new_context(batch, self.seq_len)}
        ctx = self._contexts[batch]
        # Earlier slices would have left finite keys/values in [0, c); random ones cost the same.
        for layer in ctx.layers.values():
            layer.k[:, :, :context].normal_()
            layer.v[:, :, :context].normal_()
        x, targets, grad = self._inputs(batch, length)
        times, forwards = [], []
        for _ in range(self.warmup + self.repeats):
            x.grad = None
            self._sync()
            t0 = time.perf_counter()
            out = self.stage(x, start=context, context=ctx, targets=targets)
            self._sync()
            t1 = time.perf_counter()
            out.backward(grad)  # grad is None for the last stage's scalar loss
            self._sync()
            times.append(time.perf_counter() - t0)
            forwards.append(t1 - t0)
        total = float(np.median(times[self.warmup :]))
        self.forward_fractions.append(float(np.median(forwards[self.warmup :])) / total)
        return total

    def sequence_time(self, batch: int, granularity: int) -> float:
        """Seconds of one sequence's work through the stage as a uniform plan cuts it:
        forward+backward of each ``granularity``-token slice at its place in the
        sequence, back to back, every input made before the clock starts."""
        steps = grid_steps(self.seq_len, granularity)
        if batch not in self._contexts:
            self._contexts = {batch: self.stage.new_context(batch, self.seq_len)}
        ctx = self._contexts[batch]
        for layer in ctx.layers.values():
            layer.k.normal_()
            layer.v.normal_()
        inputs = [self._inputs(batch, granularity) for _ in range(steps)]
        self._sync()
        t0 = time.perf_counter()
        for i, (x, targets, grad) in enumerate(inputs):
            out = self.stage(x, start=i * granularity, context=ctx, targets=targets)
            out.backward(grad)
        self._sync()
        return time.perf_counter() - t0

    def wgrad_fraction(self, batch: int, length: int) -> float:
        """The weight gradients' median share of a whole-sequence forward + split
        backward of ``batch`` x ``length`` tokens: F, then B leaving the products' weight
        gradients to one W (:mod:`tplib.wgrad`), then that W; over at least
        :data:`WGRAD_REPEATS` runs."""
        linears = [m for m in self.stage.modules() if isinstance(m, Linear)]
        store = DeferredWeightGrads()
        for m in linears:
            m.deferred = store
        try:
            ctx = self.stage.new_context(batch, self.seq_len)
            x, targets, grad = self._inputs(batch, length)
            shares = []
            # One share from one run is at the mercy of one descheduling: at repeats=1 a
            # W that lost its core read as 0.88 of the whole. The median of three is not.
            for _ in range(self.warmup + max(self.repeats, WGRAD_REPEATS)):
                x.grad = None
                self._sync()
                t0 = time.perf_counter()
                out = self.stage(x, start=0, context=ctx, targets=targets)
                with store.collecting(Unit(0, 0)):
                    out.backward(grad)
                self._sync()
                t1 = time.perf_counter()
                store.compute([Unit(0, 0)])
                self._sync()
                t2 = time.perf_counter()
                shares.append((t2 - t1) / (t2 - t0))
            return float(np.median(shares[self.warmup :]))
        finally:
            for m in linears:
                m.deferred = None

    def optimizer_time(self, repeats: int = 5, grad_clip: float = 1.0, **adamw: float) -> float:
        """Median seconds of what the runtime's ``OPT`` action does on this machine: the
        gradient norm and its clipping (``grad_clip`` > 0; the all-reduce of the norm is
        communication, not timed here), one AdamW step, and zeroing the gradients, which
        stay allocated. ``adamw`` are optimizer options (the runtime's: lr, betas, ...)."""
        params = [p for p in self.stage.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, **adamw)  # type: ignore[arg-type]
        times = []
        for _ in range(repeats + 1):  # the first step allocates AdamW's state: not timed
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            self._sync()
            t0 = time.perf_counter()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            for p in params:
                assert p.grad is not None
                p.grad.zero_()
            self._sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))


def profile_stage(
    model: str | GPTConfig,
    *,
    layers_per_stage: int = 1,
    seq_len: int | None = None,
    max_batch_slice_size: int = 1,
    batch_slice_sizes: Sequence[int] | None = None,
    granularity: int = 8,
    repeats: int = 5,
    warmup: int = 1,
    device: str | None = None,
    dtype: str = "float32",
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH,
    link_latency: float = DEFAULT_LINK_LATENCY,
    rounds: int = 1,
    threads: int | None = None,
    progress: bool = True,
    seed: int = 0,
    stage: tuple[int, int] | None = None,
    smooth: bool = False,
    reduce: str = "min",
) -> Profile:
    """Profile a middle stage of ``layers_per_stage`` blocks of ``model`` (or, with
    ``stage=(lo, hi)``, exactly that stage of a pipeline, embeddings or head included) on
    ``device`` (CUDA when present, else CPU) for batch slices of ``batch_slice_sizes``
    sequences (default 1..max_batch_slice_size). The profile also records the forward's
    median share of the time and the stage's optimizer step.

    On a machine shared with other jobs, use ``rounds`` > 1 (each point timed at several
    moments, keeping the least) and ``threads`` (torch's CPU threads while measuring,
    restored after) below the core count: spin-waiting threads that lose their core
    make timings many times slower and noisier. Where the machine stays busy, the
    typical time (``reduce="median"``) predicts a pipeline run better than the least,
    and ``smooth`` fits the table t(b, l, 0) by
    :func:`~tplib.perfmodel.build.smooth_lengths` against what is left of the noise."""
    cfg = get_config(model) if isinstance(model, str) else model
    seq_len = cfg.seq_len if seq_len is None else seq_len
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if batch_slice_sizes is None:
        sizes = list(range(1, max_batch_slice_size + 1))
    else:
        sizes = list(batch_slice_sizes)
    if not sizes or min(sizes) < 1:
        raise ProfileError(f"batch slice sizes {sizes}: need at least one, all >= 1")
    grid_steps(seq_len, granularity)  # fail before building anything
    timer = StageTimer(
        cfg,
        layers_per_stage,
        seq_len=seq_len,
        device=device,
        dtype=dtype,
        repeats=repeats,
        warmup=warmup,
        seed=seed,
        stage=stage,
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        desc = "profiling" if stage is None else f"profiling layers [{stage[0]}, {stage[1]})"
        prof = build_profile(
            timer,
            config=cfg,
            layers_per_stage=len(timer.stage.blocks),
            seq_len=seq_len,
            granularity=granularity,
            batch_slice_sizes=sizes,
            rounds=rounds,
            progress=progress,
            seed=seed,
            desc=desc,
            device=str(timer.device),
            dtype=dtype,
            link_bandwidth=link_bandwidth,
            link_latency=link_latency,
            repeats=repeats,
            threads=torch.get_num_threads(),
            stage=stage,
            smooth=smooth,
            reduce=reduce,
            torch_version=torch.__version__,
        )
        # Measured after the sweep, in the same thread setting. The forward share is the
        # median over every timed point: it varies little with (b, l, c).
        return replace(
            prof,
            fwd_fraction=float(np.median(timer.forward_fractions)),
            optimizer_time=timer.optimizer_time(repeats),
            wgrad_fraction=timer.wgrad_fraction(sizes[0], seq_len),
        )
    finally:
        torch.set_num_threads(before)


def profile_pipeline(
    model: str | GPTConfig,
    n_stages: int,
    *,
    stage_ranges: Sequence[tuple[int, int]] | None = None,
    n_data: int = 1,
    threads: int | None = None,
    progress: bool = True,
    **kwargs: Any,
) -> list[Profile]:
    """Profile every stage of a ``n_stages``-stage pipeline of ``model``, one
    :class:`~tplib.perfmodel.profile.Profile` per stage: layers ``stage_ranges``
    (default: :func:`~tplib.stages.balanced_stages`), the first with the embeddings, the
    last with the LM head and loss. ``kwargs`` go to :func:`profile_stage` (seq_len,
    batch_slice_sizes, granularity, repeats, rounds, ...).

    ``threads`` defaults to what each process of a local pipeline of
    ``n_stages x n_data`` processes gets: a stage timed with all cores runs several
    times faster than it does in the pipeline."""
    cfg = get_config(model) if isinstance(model, str) else model
    ranges = list(stage_ranges or balanced_stages(cfg.n_layer, n_stages))
    check_stage_ranges(cfg, ranges, n_stages)
    threads = threads or threads_per_process(n_stages * n_data)
    return [
        profile_stage(cfg, stage=(lo, hi), threads=threads, progress=progress, **kwargs)
        for lo, hi in ranges
    ]
