"""Mixed precision for the training runtime: fp32, bf16 autocast, fp16 with master weights.

Three precisions, chosen per run:

- ``"fp32"``: float32 parameters and a plain AdamW.
- ``"bf16"``: float32 parameters, forward and backward under ``torch.autocast`` with
  bfloat16 (CPU and CUDA). bf16 has float32's exponent range, so gradients neither
  underflow nor overflow and no loss scaling is needed.
- ``"fp16"``: the Megatron/apex "O2" recipe of the paper's V100 runs (V100s have no bf16).
  The model's parameters are float16; the optimizer keeps fp32 master copies, because an
  fp16 weight cannot absorb an update below its spacing (``1 + 1e-4 == 1`` in fp16) and
  Adam's second moment needs float32's range. fp16's smallest subnormal is about 6e-8, so
  small gradients would flush to zero: the loss is multiplied by a
  :class:`~tplib.nn.optimizer.DynamicLossScaler`'s scale before backward and the gradients divided by it again
  in fp32, where they are representable.

  Gradients accumulate in fp32, as Megatron's ``main_grad``: a stage adds one gradient per
  unit (every token slice of every batch slice), and in fp16 a unit's gradient below half
  the spacing of the sum so far would be rounded away (after a 1.0, anything under 2^-11).
  Each fp16 parameter gets an fp32 ``main_grad`` (:func:`attach_main_grads`, allocated
  once and kept): the model's products add their fp16 weight gradients into it
  (:mod:`tplib.nn.linear`, :mod:`tplib.nn.wgrad`), and the parameters autograd accumulates
  (LayerNorms, embeddings, row-parallel biases) have their fp16 ``.grad`` moved into it and
  freed by a post-accumulate-grad hook. ``main_grad`` is also the master gradient the
  optimizer unscales in place, so there is no second fp32 gradient buffer.

Per parameter, fp16 holds 2 (weight) + 4 (main grad) + 4 (master) + 4 + 4 (Adam m, v)
= 18 bytes, the figure the memory model charges; the fp16 ``.grad`` lives only between an
autograd accumulation and its hook. The main grads are allocated once and kept, so that
peak is what every step uses, not a transient.

The optimizers of the three precisions, and the fp16 step: :mod:`tplib.nn.optimizer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from tplib.nn.configs import PRECISIONS, check_precision
from tplib.nn.wgrad import main_grad

__all__ = ["PRECISIONS", "attach_main_grads", "autocast", "check_precision", "param_dtype"]


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the model's parameters are built in."""
    check_precision(precision)
    return torch.float16 if precision == "fp16" else torch.float32


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager[object]:
    """The context forward (and backward) run under: bf16 autocast for ``"bf16"``.

    fp16 needs none: its parameters already are float16.
    """
    check_precision(precision)
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _move_to_main_grad(param: Tensor) -> None:
    # Runs after autograd has accumulated into param.grad: one fp16 gradient of one unit.
    # It also runs where a product returned no gradient (tplib.nn.linear adds into main_grad
    # itself), with nothing in .grad.
    main = main_grad(param)
    assert main is not None  # attached with the hook
    if param.grad is not None:
        main.add_(param.grad)
        param.grad = None


def attach_main_grads(
    params: Iterable[Tensor], buffers: Sequence[Tensor] | None = None
) -> list[Tensor]:
    """Give each parameter an fp32 ``main_grad`` its gradient accumulates in (see the
    module docstring), once: a parameter that has one keeps it. Returns them in order.
    ``buffers``: zeroed fp32 tensors to use, one per parameter in order (views of one
    flat buffer, :mod:`tplib.nn.sharded_optimizer`); by default each is allocated.

    The model's products add into ``main_grad`` themselves; for every other use of the
    parameter a post-accumulate-grad hook moves the fp16 ``.grad`` autograd leaves into
    it and frees the ``.grad``."""
    mains = []
    for i, p in enumerate(params):
        main = main_grad(p)
        if main is None:
            main = torch.zeros_like(p, dtype=torch.float32) if buffers is None else buffers[i]
            p.main_grad = main  # type: ignore[attr-defined]
            p.register_post_accumulate_grad_hook(_move_to_main_grad)
        mains.append(main)
    return mains
