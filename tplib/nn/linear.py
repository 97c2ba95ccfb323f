"""The model's matrix products: weight gradients accumulated in place or deferred, and
the row-parallel product of operation partitioning.

:class:`Linear` is ``nn.Linear`` for every product of a block and for the LM head. On
the float32 path its backward adds the weight and bias gradients straight into ``.grad``
inside the GEMM (see :class:`_LinearAccumulate`), and on the fp16 path into the fp32
``main_grad`` (:func:`tplib.nn.precision.attach_main_grads`); with an #Op group it is Megatron's
row-parallel product (:mod:`tplib.nn.oppart`). Given a
:class:`~tplib.nn.wgrad.DeferredWeightGrads` (``deferred``), a backward run while it
collects computes the input gradient only and leaves the weight gradients to it
(:class:`_LinearDeferred`), in any precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tplib.nn.oppart import OpGroup, leave_tensor_parallel
from tplib.nn.wgrad import DeferredWeightGrads, main_grad, weight_grads_now

__all__ = ["Linear"]


class _LinearAccumulate(torch.autograd.Function):
    """``x @ W.T + b`` whose backward adds the weight and bias gradients straight into
    ``.grad`` inside the GEMM (``addmm_`` with beta=1), or an fp16 product into the
    parameters' fp32 ``main_grad``.

    A stage runs backward once per token slice, so each weight receives one gradient per
    slice; letting autograd allocate each and add it to ``.grad`` costs a full pass over
    every weight per slice. Autograd never sees these gradients (``None`` is returned), so
    parameter hooks do not fire; tplib reduces gradients itself after backward.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor | None
    ) -> Tensor:
        ctx.save_for_backward(x)
        # The parameters themselves, not saved copies: backward writes into their .grad
        # (a saved-tensor hook, such as the memory meter's, may hand back another tensor).
        ctx.weight, ctx.bias = weight, bias  # type: ignore[attr-defined]
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[Tensor | None, None, None]:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        weight: Tensor = ctx.weight  # type: ignore[attr-defined]
        bias: Tensor | None = ctx.bias  # type: ignore[attr-defined]
        # Linear builds this product only for a weight that requires its gradient.
        weight_grads_now(
            weight, bias if bias is not None and bias.requires_grad else None, x, grad_out
        )
        grad_in = grad_out @ weight if ctx.needs_input_grad[0] else None  # type: ignore[attr-defined]
        return grad_in, None, None


class _LinearDeferred(torch.autograd.Function):
    """``x @ W.T + b`` whose backward, while its store collects, returns the input
    gradient and hands ``x`` and the output gradient to the store for a later ``W``
    (otherwise it computes the weight gradients at once, as autograd would)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        store: DeferredWeightGrads,
    ) -> Tensor:
        if torch.is_autocast_enabled(x.device.type):
            # Keep the input in the dtype the product runs in, as autograd would.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store  # type: ignore[attr-defined]
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[Tensor | None, None, None, None]:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        weight: Tensor = ctx.weight  # type: ignore[attr-defined]
        bias: Tensor | None = ctx.bias  # type: ignore[attr-defined]
        store: DeferredWeightGrads = ctx.store  # type: ignore[attr-defined]
        if store.current is not None:
            store.defer(weight, bias, x, grad_out)
        else:
            weight_grads_now(weight, bias, x, grad_out)
        needs_input = ctx.needs_input_grad[0]  # type: ignore[attr-defined]
        grad_in = grad_out @ weight.to(grad_out.dtype) if needs_input else None
        return grad_in, None, None, None


class Linear(nn.Linear):
    """``nn.Linear`` that accumulates its parameter gradients in place: float32 into
    ``.grad``, fp16 with a ``main_grad`` into that.

    Under autocast, or for other dtypes, it is a plain ``nn.Linear``. With an ``op``
    group of several ranks it is row-parallel: each rank multiplies its share of the
    input features, the partial products are summed over the group (each rank keeping
    its tokens of the sum under sequence parallelism), then the (replicated) bias is
    added once.
    """

    def __init__(
        self, in_features: int, out_features: int, op: OpGroup | None = None, bias: bool = True
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.op = op if op is not None and op.size > 1 else None
        self.deferred: DeferredWeightGrads | None = None  # set by a split-backward executor

    def _product(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.deferred is not None and torch.is_grad_enabled() and self.weight.requires_grad:
            return _LinearDeferred.apply(x, self.weight, bias, self.deferred)
        weight = self.weight
        fused = (
            torch.is_grad_enabled()
            and weight.requires_grad
            and x.dtype == weight.dtype
            and (weight.dtype == torch.float32 or main_grad(weight) is not None)
            and not torch.is_autocast_enabled(x.device.type)
        )
        if fused:
            return _LinearAccumulate.apply(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.op is None:
            return self._product(x, self.bias)
        # Summed over the group (reduce-scattered into sequence shards under sequence
        # parallelism), then the bias: added once, not once per rank.
        out = leave_tensor_parallel(self._product(x, None), self.op)
        return out if self.bias is None else out + self.bias
