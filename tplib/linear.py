"""The model's matrix products: weight gradients accumulated in place, and the
row-parallel product of operation partitioning.

:class:`Linear` is ``nn.Linear`` for every product of a block. On the float32 path its
backward adds the weight and bias gradients straight into ``.grad`` inside the GEMM
(see :class:`_LinearAccumulate`); with an #Op group it is Megatron's row-parallel
product (:mod:`tplib.oppart`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tplib.oppart import OpGroup, reduce_from_group

__all__ = ["Linear"]


class _LinearAccumulate(torch.autograd.Function):
    """``x @ W.T + b`` whose backward adds the weight and bias gradients straight into
    ``.grad`` inside the GEMM (``addmm_`` with beta=1).

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
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if weight.requires_grad:
            if weight.grad is None:
                weight.grad = g2.t() @ x2
            else:
                weight.grad.addmm_(g2.t(), x2)
        if bias is not None and bias.requires_grad:
            if bias.grad is None:
                bias.grad = g2.sum(0)
            else:
                bias.grad.add_(g2.sum(0))
        grad_in = grad_out @ weight if ctx.needs_input_grad[0] else None  # type: ignore[attr-defined]
        return grad_in, None, None


class Linear(nn.Linear):
    """``nn.Linear`` that accumulates its parameter gradients in place (float32 path).

    Under autocast, or for other dtypes, it is a plain ``nn.Linear``. With an ``op``
    group of several ranks it is row-parallel: each rank multiplies its share of the
    input features, the partial products are summed over the group, then the
    (replicated) bias is added once.
    """

    def __init__(self, in_features: int, out_features: int, op: OpGroup | None = None) -> None:
        super().__init__(in_features, out_features)
        self.op = op if op is not None and op.size > 1 else None

    def _product(self, x: Tensor, bias: Tensor | None) -> Tensor:
        fused = (
            torch.is_grad_enabled()
            and self.weight.requires_grad
            and x.dtype == self.weight.dtype == torch.float32
            and not torch.is_autocast_enabled(x.device.type)
        )
        if fused:
            return _LinearAccumulate.apply(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.op is None:
            return self._product(x, self.bias)
        return reduce_from_group(self._product(x, None), self.op) + self.bias
