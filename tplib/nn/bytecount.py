"""Byte counters: the bytes behind a set of tensors, a module's parameters and gradients,
an optimizer's state.

Bytes are those of *untyped storages*, not of tensors: a storage counts once however many
tensors, views or tied weights refer to it, and a view counts its whole storage, since it
keeps all of it alive. The memory model's checks, the fp16 optimizer's report and the
runtime's measured memory (:mod:`tplib.runtime.memory`) all count this way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from tplib.nn.context import StageContext
from tplib.nn.wgrad import main_grad

__all__ = [
    "context_tensors",
    "gradient_bytes",
    "optimizer_bytes",
    "parameter_bytes",
    "static_bytes",
    "storage_bytes",
    "storage_key",
]

StorageKey = tuple[torch.device, int]


def storage_key(tensor: Tensor) -> tuple[StorageKey, int] | None:
    """The storage key and size of ``tensor``, or None where there is nothing to count."""
    if tensor.layout != torch.strided:
        return None
    storage = tensor.untyped_storage()
    ptr = storage.data_ptr()
    if ptr == 0:  # empty, or meta: no memory behind it
        return None
    return (storage.device, ptr), storage.nbytes()


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a shared storage counts once)."""
    sizes: dict[StorageKey, int] = {}
    for t in tensors:
        found = storage_key(t)
        if found is not None:
            sizes[found[0]] = found[1]
    return sum(sizes.values())


def context_tensors(contexts: Iterable[StageContext]) -> list[Tensor]:
    """The K/V buffers of ``contexts`` and their gradient buffers, to exclude and to count
    as static."""
    return [t for ctx in contexts for t in ctx.buffers()]


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters; a tied weight counts once."""
    return storage_bytes(module.parameters())


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of the gradient buffers of ``module``'s parameters that exist now: each
    ``.grad`` (after a backward; none before the first, nor after
    ``zero_grad(set_to_none=True)``) and fp16's fp32 ``main_grad``
    (:func:`tplib.nn.precision.attach_main_grads`), kept from the optimizer's start."""
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    mains = [m for m in map(main_grad, params) if m is not None]
    return storage_bytes(grads + mains)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer``'s state (AdamW's moments and step counters;
    none before its first step)."""
    return storage_bytes(
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)
    )


def static_bytes(module: nn.Module, optimizer_state_bytes: int, contexts: Iterable[Tensor]) -> int:
    """Parameters, their gradients, optimizer state and the K/V context buffers."""
    return (
        parameter_bytes(module)
        + gradient_bytes(module)
        + optimizer_state_bytes
        + storage_bytes(contexts)
    )
