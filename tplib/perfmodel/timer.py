"""Timing real stages with torch: the measuring half of the profiler.

:class:`StageTimer` times forward+backward of one slice through a stage, the ``measure``
that :func:`~tplib.perfmodel.build.build_profile` calls, and what the simulator needs
beyond Eq. 9: the forward's share of forward+backward, the weight gradients' share, and
the stage's optimizer step (:mod:`tplib.perfmodel.profiler` turns them into profiles).

A profile times either a middle stage of ``layers_per_stage`` blocks (what the paper's
uniform stages are) or an actual stage ``[lo, hi)`` of a K-stage pipeline: the first
stage with the embeddings, the last with the LM head and loss.

It times what a run does, since a plan is priced on it: the run's ``precision`` (fp32;
bf16 autocast over fp32 parameters; fp16 parameters whose gradients accumulate in fp32
main grads, as :mod:`tplib.nn.precision` and the runtime do), the model's ``dropout`` (keyed
masks through a :class:`~tplib.nn.dropout.DropoutKey`, with the attention written out, as
the runtime's executor trains), and the attention implementation the runtime picks for
the device unless one is named. The profile records all three.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager

import numpy as np
import torch
from torch import Tensor

from tplib.nn.configs import GPTConfig, check_precision
from tplib.nn.context import StageContext, attention_impls
from tplib.nn.dropout import DropoutKey
from tplib.nn.layer_ranges import check_stage_range
from tplib.nn.linear import Linear
from tplib.nn.model import build_model
from tplib.nn.precision import attach_main_grads, autocast, param_dtype
from tplib.nn.wgrad import DeferredWeightGrads, grad_buffer
from tplib.perfmodel.conditions import run_attention
from tplib.perfmodel.profile import (
    ProfileError,
    grid_steps,
)
from tplib.plan import Unit
from tplib.runtime.parts import Optim
from tplib.runtime.update import stage_optimizer

__all__ = ["StageTimer"]

WGRAD_REPEATS = 3  # the fewest timed runs wgrad_fraction takes its median over


class StageTimer:
    """``timer(b, l, c)``: median seconds of forward+backward of one slice of b x l tokens
    at ``start=c`` through a stage of ``layers_per_stage`` blocks.

    By default the stage is a middle one (no embedding, no head). With ``stage=(lo, hi)``
    it is exactly layers [lo, hi) of ``cfg`` as a pipeline builds them: the first stage
    takes token ids and embeds them, the last computes the LM head and the summed
    cross-entropy and starts backward from that loss, as the runtime does.

    It runs as a run in ``precision`` does (see the module docstring): fp16 gradients
    into fp32 main grads, bf16 forward and backward under autocast, each call one autocast
    region whose weight casts the warm-up runs absorb (a run caches them per iteration).
    It trains with dropout ``dropout`` (None: the model's, ``cfg.dropout``), and its
    attention is ``attention`` (None: the runtime's default for the device; with dropout
    it is written out and cannot be named). :attr:`attention_timed` says which.

    Every call also records the forward's share of the time (``forward_fractions``), and
    :meth:`optimizer_time` times the stage's optimizer step.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        layers_per_stage: int,
        *,
        seq_len: int,
        device: str = "cpu",
        precision: str = "fp32",
        dropout: float | None = None,
        attention: str | None = None,
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
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ProfileError(f"unknown device {device!r}: use cpu or cuda") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ProfileError(f"device {device!r}: CUDA is not available here, use cpu")
        try:
            check_precision(precision, dev.type)
        except ValueError as exc:
            raise ProfileError(str(exc)) from None
        dropout = cfg.dropout if dropout is None else dropout
        if isinstance(dropout, bool) or not (
            isinstance(dropout, int | float) and 0.0 <= dropout < 1.0
        ):
            raise ProfileError(f"dropout={dropout!r}: must be a rate in [0, 1)")
        if attention is not None and attention not in attention_impls(dev):
            raise ProfileError(
                f"attention {attention!r} on {dev.type}: choose one of {attention_impls(dev)}, "
                "or None for the runtime's default on the device"
            )
        if attention is not None and dropout > 0:
            raise ProfileError(
                f"attention={attention!r} with dropout={dropout}: a stage that drops writes "
                "attention out (tplib.nn.context.math_attention), as a run does; leave attention "
                "None, or time without dropout (dropout=0)"
            )
        if stage is None:
            # A middle stage is blocks [1, 1 + n) of a model with layers after them; a small
            # config gets more layers, which changes only init scales, not the time.
            n = layers_per_stage
            big = cfg if cfg.n_layer >= n + 2 else cfg.with_(n_layer=n + 2)
            lo, hi = 1, 1 + n
        else:
            big = cfg
        big = big.with_(dropout=dropout)
        self.dtype = param_dtype(precision)
        self.stage = build_model(big, lo, hi, seed=seed, device=device, dtype=self.dtype)
        if precision == "fp16":  # as the optimizer attaches them in a run
            attach_main_grads(self.stage.parameters())
        self.device, self.precision, self.seq_len = dev, precision, seq_len
        self.dropout, self.attention = dropout, attention
        # The K/V context in the dtype attention computes in, as the runtime's executor.
        self.context_dtype = torch.bfloat16 if precision == "bf16" else self.dtype
        self._key = DropoutKey.for_iteration(seed, 0) if dropout > 0 else None
        self.repeats, self.warmup = repeats, warmup
        self.forward_fractions: list[float] = []
        self._contexts: dict[int, StageContext] = {}

    @property
    def attention_timed(self) -> str:
        """The attention implementation timed, as a :class:`Profile` records it."""
        if self.dropout > 0:
            return run_attention(self.dropout)
        return self.attention or "default"

    def _context(self, batch: int) -> StageContext:
        if batch not in self._contexts:  # one batch size at a time: bounded memory
            self._contexts = {batch: self._new_context(batch)}
        return self._contexts[batch]

    def _new_context(self, batch: int) -> StageContext:
        return self.stage.new_context(
            batch, self.seq_len, dtype=self.context_dtype, attention=self.attention
        )

    def _autocast(self) -> AbstractContextManager[object]:
        return autocast(self.precision, self.device.type)

    def _forward(self, x: Tensor, start: int, ctx: StageContext, targets: Tensor | None) -> Tensor:
        return self.stage(x, start=start, context=ctx, targets=targets, dropout=self._key)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _inputs(self, batch: int, length: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The stage's input, the targets (last stage) and the output gradient (others), in
        the dtype that travels between stages (the parameters')."""
        cfg, shape = self.stage.cfg, (batch, length, self.stage.cfg.hidden)
        if self.stage.is_first:
            x = torch.randint(0, cfg.vocab_size, (batch, length), device=self.device)
        else:
            x = torch.randn(shape, device=self.device, dtype=self.dtype, requires_grad=True)
        if self.stage.is_last:
            targets = torch.randint(0, cfg.vocab_size, (batch, length), device=self.device)
            return x, targets, None
        return x, None, torch.randn(shape, device=self.device, dtype=self.dtype)

    def __call__(self, batch: int, length: int, context: int) -> float:
        ctx = self._context(batch)
        # Earlier slices would have left finite keys/values in [0, c); random ones cost the same.
        for layer in ctx.layers.values():
            layer.k[:, :, :context].normal_()
            layer.v[:, :, :context].normal_()
        x, targets, grad = self._inputs(batch, length)
        times, forwards = [], []
        with self._autocast():
            for _ in range(self.warmup + self.repeats):
                x.grad = None
                self._sync()
                t0 = time.perf_counter()
                out = self._forward(x, context, ctx, targets)
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
        ctx = self._context(batch)
        for layer in ctx.layers.values():
            layer.k.normal_()
            layer.v.normal_()
        inputs = [self._inputs(batch, granularity) for _ in range(steps)]
        self._sync()
        t0 = time.perf_counter()
        with self._autocast():
            for i, (x, targets, grad) in enumerate(inputs):
                out = self._forward(x, i * granularity, ctx, targets)
                out.backward(grad)
        self._sync()
        return time.perf_counter() - t0

    def wgrad_fraction(self, batch: int, length: int) -> float:
        """The weight gradients' median share of a whole-sequence forward + split
        backward of ``batch`` x ``length`` tokens: F, then B leaving the products' weight
        gradients to one W (:mod:`tplib.nn.wgrad`), then that W; over at least
        :data:`WGRAD_REPEATS` runs."""
        linears = [m for m in self.stage.modules() if isinstance(m, Linear)]
        store = DeferredWeightGrads()
        for m in linears:
            m.deferred = store
        try:
            ctx = self._new_context(batch)
            x, targets, grad = self._inputs(batch, length)
            shares = []
            # One share from one run is at the mercy of one descheduling: at repeats=1 a
            # W that lost its core read as 0.88 of the whole. The median of three is not.
            with self._autocast():
                for _ in range(self.warmup + max(self.repeats, WGRAD_REPEATS)):
                    x.grad = None
                    self._sync()
                    t0 = time.perf_counter()
                    out = self._forward(x, 0, ctx, targets)
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

    def optimizer_time(self, repeats: int = 5, grad_clip: float = 1.0) -> float:
        """Median seconds of what the runtime's ``OPT`` action does on this machine
        (:class:`tplib.runtime.update.Update`), in the timer's precision: fp16's unscaling
        of the main grads, the gradient norm and its clipping (``grad_clip`` > 0; the
        all-reduces of the overflow flag and the norm are communication, not timed here),
        one AdamW step with a run's default options (fp16: on the fp32 masters, copied
        back into the fp16 weights), and zeroing the gradient buffers, which stay
        allocated."""
        params = [p for p in self.stage.parameters() if p.requires_grad]
        opt = stage_optimizer(params, self.precision, Optim())
        buffers = [b for b in map(grad_buffer, params) if b is not None]
        times = []
        for _ in range(repeats + 1):  # the first step allocates AdamW's state: not timed
            for b in buffers:
                b.normal_(0.0, 1e-3)
            self._sync()
            t0 = time.perf_counter()
            skip = bool(opt.unscale_grads().item())
            if grad_clip > 0 and not skip:
                torch.nn.utils.clip_grad_norm_(opt.master_params, grad_clip)
            opt.step(skip)
            for b in buffers:
                b.zero_()
            self._sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))
