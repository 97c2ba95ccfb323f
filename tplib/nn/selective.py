"""Selective activation recomputation: the attention core kept by its inputs alone.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", §4.2) observe that the attention core of a layer, QK^T, its scale and mask, the
softmax, the dropout on the probabilities and their product with V, keeps the largest
tensors for backward (the 5as/h term of their sbh(34 + 5as/h) bytes per layer: scores and
probabilities of s x (c + s) per head) for a small share of the layer's FLOPs. Their
*selective* recomputation keeps everything else, and for the core only its inputs.

:func:`attention_core` runs a core ``core(q, k, v)`` that way when asked: autograd keeps
``q``, ``k`` and ``v`` (views of the QKV product, or aliases of the K/V context, which the
layer keeps anyway) and nothing the core would save. Its backward runs the core again,
with autograd on, on the same inputs under the forward's autocast state, then backward
through it. That is exact: the same kernels on the same inputs give the same output and
the same gradients as a forward that kept everything. Dropout on the probabilities is
keyed by position (:mod:`tplib.nn.dropout`), not drawn from a generator, so the
recomputation drops the same elements with no RNG state to save and restore.

The recomputed core's tensors live only while that layer's backward runs, one layer of
one unit at a time; they are saved under the hooks active in backward, so a
:class:`~tplib.runtime.memory.MemoryMeter` counts them, as
:mod:`tplib.cluster.runtime_memory` does. The written-out attention (with dropout) drops
its scores, softmax, masks and dropped probabilities this way; the fused kernels keep no
scores in the first place, and drop their log-sum-exp (and their output, where the output
projection reads a copy of it rather than a view).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["Core", "attention_core"]

# The attention core: queries, keys and values (batch, heads, positions, head_dim) to
# the heads' outputs, any other argument bound in.
Core = Callable[[Tensor, Tensor, Tensor], Tensor]


class _RecomputedCore(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, core: Core, q: Tensor, k: Tensor, v: Tensor
    ) -> Tensor:
        device = q.device.type
        autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.core, ctx.autocast = core, autocast  # type: ignore[attr-defined]
        ctx.save_for_backward(q, k, v)
        return core(q, k, v)  # a Function's forward runs without autograd: nothing saved

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[None, Tensor | None, Tensor | None, Tensor | None]:
        saved: tuple[Tensor, ...] = ctx.saved_tensors  # type: ignore[attr-defined]
        needs: tuple[bool, ...] = ctx.needs_input_grad[1:]  # type: ignore[attr-defined]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(saved, needs, strict=True)]
        device, enabled, dtype = ctx.autocast  # type: ignore[attr-defined]
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = ctx.core(*inputs)  # type: ignore[attr-defined]
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out))
        q, k, v = (next(grads) if t.requires_grad else None for t in inputs)
        return None, q, k, v


def attention_core(core: Core, q: Tensor, k: Tensor, v: Tensor, *, recompute: bool) -> Tensor:
    """``core(q, k, v)``; with ``recompute``, keeping only ``q``, ``k`` and ``v`` for
    backward and running the core again there (see the module docstring)."""
    if recompute and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out: Tensor = _RecomputedCore.apply(core, q, k, v)
        return out
    return core(q, k, v)
