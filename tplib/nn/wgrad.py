"""Deferred weight gradients: a backward split into its input gradient and its weight
gradients, the two halves zero-bubble schedules place apart.

A unit's backward through a matrix product Y = X W^T + b computes dX = dY W (what the
previous stage waits for) and dW = dY^T X, db = sum dY (what only the optimizer needs).
Under a schedule with ``W`` actions the stage's ``B`` computes dX only: each
:class:`tplib.nn.linear.Linear` hands its X and dY to the stage's
:class:`DeferredWeightGrads`, keyed by the unit, and the ``W`` action computes dW later.

``W`` over several token slices of one sequence is one product per weight: the slices'
rows of X and dY stacked, dW = [dY_1; ...; dY_M]^T [X_1; ...; X_M], which is the sum of
the slices' products computed as one GEMM of the whole sequence's length instead of M
short ones, each of which reads and writes the whole of ``W.grad``.

Only the model's :class:`~tplib.nn.linear.Linear` products defer: the four products of each
block and the LM head, which hold all but a sliver of the weight-gradient FLOPs.
LayerNorms, embeddings and the row-parallel products' biases get their gradients in
``B`` from autograd, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tplib.plan import Unit

__all__ = ["DeferredWeightGrads", "grad_buffer", "main_grad", "weight_grads_now"]


@dataclass
class _Product:
    """One product's deferred inputs over the units collected so far."""

    weight: Tensor
    bias: Tensor | None
    inputs: list[Tensor] = field(default_factory=list)  # X, (tokens, in)
    grads: list[Tensor] = field(default_factory=list)  # dY, (tokens, out)


class DeferredWeightGrads:
    """What a stage's ``B`` actions leave for its ``W`` actions.

    :meth:`collecting` opens a unit's backward: the stage's products defer into it.
    :meth:`compute` then computes the weight gradients of any set of collected units,
    one product per weight, and adds them into each weight's gradient buffer
    (:func:`grad_buffer`: fp16's fp32 ``main_grad``, else ``.grad``). ``hold``, if given, is told
    about every tensor kept between the two (a memory meter counts them)."""

    def __init__(self, hold: Callable[[Tensor], object] | None = None) -> None:
        self.hold = hold
        self.current: Unit | None = None  # the unit whose backward is running
        self._pending: dict[Unit, list[tuple[Tensor, Tensor | None, Tensor, Tensor]]] = {}
        self._held: dict[Unit, list[object]] = {}

    @contextmanager
    def collecting(self, unit: Unit) -> Iterator[None]:
        """Within this block, products defer their weight gradients to ``unit``."""
        if unit in self._pending:
            raise RuntimeError(f"weight gradients of {unit} deferred twice without a W")
        self._pending[unit] = []
        self._held[unit] = []
        self.current = unit
        try:
            yield
        finally:
            self.current = None

    def defer(self, weight: Tensor, bias: Tensor | None, x: Tensor, grad: Tensor) -> None:
        """Keep one product's input ``x`` and output gradient ``grad`` for later."""
        assert self.current is not None  # Linear defers only while collecting
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        self._pending[self.current].append((weight, bias, x2, g2))
        if self.hold is not None:
            self._held[self.current] += [self.hold(x2), self.hold(g2)]

    @property
    def pending(self) -> list[Unit]:
        """Units whose weight gradients are deferred and not yet computed."""
        return sorted(self._pending)

    @torch.no_grad()
    def compute(self, units: Sequence[Unit]) -> None:
        """Add the weight gradients of ``units`` into their gradient buffers: per weight,
        one product over all their rows."""
        missing = [u for u in units if u not in self._pending]
        if missing:
            raise RuntimeError(
                f"W of {missing} before their B: weight gradients are computed after the "
                "backward that deferred them, once"
            )
        products: dict[int, _Product] = {}  # by the weight's id, in backward order
        for u in units:
            for weight, bias, x, g in self._pending.pop(u):
                p = products.setdefault(id(weight), _Product(weight, bias))
                p.inputs.append(x)
                p.grads.append(g)
            del self._held[u]
        for p in products.values():
            x = p.inputs[0] if len(p.inputs) == 1 else torch.cat(p.inputs)
            g = p.grads[0] if len(p.grads) == 1 else torch.cat(p.grads)
            weight_grads_now(p.weight, p.bias, x, g)


def main_grad(param: Tensor) -> Tensor | None:
    """``param``'s fp32 ``main_grad``, where an fp16 run accumulates its gradient
    (:func:`tplib.nn.precision.attach_main_grads`), or None."""
    return getattr(param, "main_grad", None)


def grad_buffer(param: Tensor) -> Tensor | None:
    """Where ``param``'s gradient accumulates: its ``main_grad`` if it has one, else
    ``.grad``."""
    main = main_grad(param)
    return main if main is not None else param.grad


@torch.no_grad()
def weight_grads_now(weight: Tensor, bias: Tensor | None, x: Tensor, grad: Tensor) -> None:
    """Add dW = grad^T x (and db = the sum of grad) into each parameter's gradient
    buffer (:func:`grad_buffer`), over all leading dimensions of ``x`` and ``grad``."""
    g = grad.reshape(-1, grad.shape[-1])
    x = x.reshape(-1, x.shape[-1]).to(g.dtype)
    buffer = grad_buffer(weight)
    if buffer is not None and buffer.dtype == g.dtype:
        buffer.addmm_(g.t(), x)  # in place: no temporary of W's size
    else:
        _accumulate(weight, g.t() @ x)
    if bias is not None:
        _accumulate(bias, g.sum(0))


def _accumulate(param: Tensor, grad: Tensor) -> None:
    main = main_grad(param)
    if main is not None:
        # An fp16 product added in fp32: the sum over units keeps what fp16 would round
        # away (a slice's gradient below half the spacing of the sum so far).
        main.add_(grad)
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)
