"""Megatron's distributed optimizer, the pure part: AdamW on one rank's shard of a stage's
parameters (ZeRO stage 1: optimizer state sharded over the #Data replicas).

A stage's parameters lie end to end in one flat buffer, and so do their gradient buffers
(fp16's fp32 ``main_grad``, else ``.grad``; :mod:`tplib.nn.precision`): each parameter and
each gradient buffer is a view of its range (:class:`FlatLayout`), as Megatron's
contiguous buffers are. The flat length is padded with zeros to a multiple of #Data, so
that replica ``i`` owns the ``i``-th of #Data equal contiguous *shards*. Its step is::

    reduce-scatter(flat_grads)           # the runtime's: replica i gets shard i, summed
    found = opt.unscale_grads()          # fp16: the shard only; all-reduce MAX, as before
    clip(opt.grads())                    # the shard's pieces; the norm from every shard
    opt.step(bool(found.item()))         # AdamW on the shard; fp16: masters -> params
    all-gather(flat_params)              # the runtime's: every replica whole again

A shard's bounds cut through parameters: it holds *pieces*, the parts of the parameters
that lie in it (:meth:`FlatLayout.pieces`), and AdamW steps each piece as a tensor of its
own, in its parameter's weight-decay group. AdamW is elementwise (its moments, its decay
and its update of an element read only that element and the step count), so stepping the
pieces computes what stepping the whole parameters computes from the same gradients.
fp16 keeps fp32 master weights of its shard only; fp32 and bf16 (whose parameters stay
fp32) step the parameters' own shard in place. Adam's m and v exist for the shard only:
the state per parameter falls from 12 (fp16: 16) bytes to that over #Data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tplib.nn.bytecount import optimizer_bytes, storage_bytes
from tplib.nn.configs import check_precision
from tplib.nn.optimizer import Decay, DynamicLossScaler, set_groups_lr
from tplib.nn.precision import attach_main_grads

__all__ = ["FlatLayout", "Piece", "ShardedOptimizer", "decay_mask", "flat_views", "flatten"]


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` in a shard: flat elements ``[start, end)``."""

    param: int
    start: int
    end: int


@dataclass(frozen=True)
class FlatLayout:
    """Tensors of ``numels`` elements laid end to end, padded to ``n_shards`` equal
    contiguous shards."""

    numels: tuple[int, ...]
    n_shards: int

    def __post_init__(self) -> None:
        if isinstance(self.n_shards, bool) or not isinstance(self.n_shards, int):
            raise ValueError(f"n_shards={self.n_shards!r} must be a positive integer")
        if self.n_shards < 1:
            raise ValueError(f"n_shards={self.n_shards!r} must be a positive integer")
        if not self.numels or any(n < 1 for n in self.numels):
            raise ValueError(f"numels={self.numels!r} must be one or more positive sizes")

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each tensor starts in the flat buffer."""
        starts, at = [], 0
        for n in self.numels:
            starts.append(at)
            at += n
        return tuple(starts)

    @property
    def numel(self) -> int:
        """The tensors' elements, padding left out."""
        return sum(self.numels)

    @property
    def shard_size(self) -> int:
        return -(-self.numel // self.n_shards)

    @property
    def padded(self) -> int:
        """The flat buffer's length: ``n_shards`` shards."""
        return self.shard_size * self.n_shards

    def shard(self, index: int) -> tuple[int, int]:
        """Shard ``index``'s flat elements ``[lo, hi)``."""
        if not 0 <= index < self.n_shards:
            raise ValueError(
                f"shard {index} of {self.n_shards}: choose one in [0, {self.n_shards})"
            )
        return index * self.shard_size, (index + 1) * self.shard_size

    def pieces(self, index: int) -> list[Piece]:
        """The pieces of shard ``index``, in flat order (none in its padding)."""
        lo, hi = self.shard(index)
        return [
            Piece(i, max(at, lo), min(at + n, hi))
            for i, (at, n) in enumerate(zip(self.offsets, self.numels, strict=True))
            if at < hi and at + n > lo
        ]


def flat_views(flat: Tensor, shapes: Sequence[torch.Size], layout: FlatLayout) -> list[Tensor]:
    """The tensors of ``layout`` as views of ``flat``, in the given shapes."""
    return [
        flat[at : at + n].view(shape)
        for at, n, shape in zip(layout.offsets, layout.numels, shapes, strict=True)
    ]


def flatten(tensors: Sequence[Tensor], n_shards: int) -> tuple[Tensor, FlatLayout]:
    """A new flat buffer holding ``tensors`` end to end, zero-padded to ``n_shards``
    shards, and its layout."""
    layout = FlatLayout(tuple(t.numel() for t in tensors), n_shards)
    flat = tensors[0].new_zeros(layout.padded)
    for view, t in zip(flat_views(flat, [t.shape for t in tensors], layout), tensors, strict=True):
        view.copy_(t)
    return flat, layout


def decay_mask(layout: FlatLayout, decays: Sequence[bool], index: int) -> Tensor:
    """Whether AdamW decays each element of shard ``index``: its parameter's ``decays``
    flag (padding: False)."""
    lo, _ = layout.shard(index)
    mask = torch.zeros(layout.shard_size, dtype=torch.bool)
    for piece in layout.pieces(index):
        mask[piece.start - lo : piece.end - lo] = decays[piece.param]
    return mask


class ShardedOptimizer:
    """AdamW on shard ``shard`` of ``n_shards`` of ``params``, the interface of
    :class:`~tplib.nn.optimizer.MixedPrecisionOptimizer` (fp16: with its loss scaling
    and master weights, of the shard) and :class:`~tplib.nn.optimizer.PlainOptimizer`.

    It moves ``params`` into :attr:`flat_params` and gives them gradient buffers in
    :attr:`flat_grads` (see the module docstring); the collectives between the replicas'
    shards are the caller's. :meth:`grads` are the shard's pieces of the gradient buffers
    (:attr:`pieces` says whose)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        precision: str,
        *,
        shard: int,
        n_shards: int,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float,
        decay: Decay,
        scaler: DynamicLossScaler | None = None,
    ) -> None:
        check_precision(precision)
        self.params = list(params)
        if not self.params:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        want = torch.float16 if precision == "fp16" else torch.float32
        for i, p in enumerate(self.params):
            if p.dtype != want:
                raise ValueError(
                    f"parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}: "
                    f"precision {precision!r} keeps {want} parameters"
                )
        self.mixed = precision == "fp16"
        self.scaler = scaler if scaler is not None else DynamicLossScaler()
        self.steps_skipped = 0
        self.layout = layout = FlatLayout(tuple(p.numel() for p in self.params), n_shards)
        shapes = [p.shape for p in self.params]
        device = self.params[0].device
        self.flat_params = torch.zeros(layout.padded, dtype=want, device=device)
        self.flat_grads = torch.zeros(layout.padded, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, view in zip(
                self.params, flat_views(self.flat_params, shapes, layout), strict=True
            ):
                view.copy_(p)
                p.data = view  # the parameter now lives in the flat buffer
        grad_views = flat_views(self.flat_grads, shapes, layout)
        if self.mixed:
            attach_main_grads(self.params, grad_views)
        else:
            for p, view in zip(self.params, grad_views, strict=True):
                p.grad = view
        lo, hi = layout.shard(shard)
        self.param_shard = self.flat_params[lo:hi]
        self.grad_shard = self.flat_grads[lo:hi]
        # fp16: fp32 masters of the shard only; else the parameters' shard itself.
        self.master_shard = self.param_shard.float() if self.mixed else self.param_shard
        self.pieces = layout.pieces(shard)
        self._masters: list[Tensor] = []
        for piece in self.pieces:
            master = self.master_shard[piece.start - lo : piece.end - lo]
            master.grad = self.grad_shard[piece.start - lo : piece.end - lo]
            self._masters.append(master)
        keep = [decay(self.params[piece.param]) for piece in self.pieces]
        groups: list[dict[str, Any]] = [
            {"params": [m for m, k in zip(self._masters, keep, strict=True) if k], "weight_decay": weight_decay},
            {"params": [m for m, k in zip(self._masters, keep, strict=True) if not k], "weight_decay": 0.0},
        ]  # fmt: skip
        groups = [g for g in groups if g["params"]]
        # A shard of padding only (fewer elements than shards) has nothing to step.
        self.inner = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps) if groups else None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.mixed else 1.0

    @property
    def master_params(self) -> list[Tensor]:
        """The tensors AdamW updates: the shard's pieces (fp16: of the masters)."""
        return list(self._masters)

    def unscale_grads(self) -> Tensor:
        """fp16: divide the shard's gradients (summed over the replicas) by the loss scale;
        1.0 if any of them is inf or NaN, else 0.0, a 0-d float32 tensor to all-reduce with
        MAX. Any overflow of the model shows in some shard: a sum holding an inf or NaN
        is one. fp32, bf16: always 0.0, as :class:`~tplib.nn.optimizer.PlainOptimizer`."""
        if not self.mixed:
            return torch.zeros((), dtype=torch.float32, device=self.flat_grads.device)
        self.grad_shard.div_(self.scaler.scale)
        return torch.isfinite(self.grad_shard).all().logical_not().to(torch.float32)

    def grads(self) -> list[Tensor | None]:
        """The gradients :meth:`step` uses, one per piece: views of the shard of the
        gradient buffers, which clipping scales in place."""
        return [m.grad for m in self._masters]

    def set_lr(self, lr: float) -> None:
        if self.inner is not None:
            set_groups_lr(self.inner, lr)

    @torch.no_grad()
    def step(self, found_inf: bool) -> bool:
        """Step the shard unless fp16 found an overflow (then update the scaler only);
        fp16 rounds the shard's masters into the parameters. Return whether it stepped."""
        if self.mixed and not self.scaler.update(found_inf):
            self.steps_skipped += 1
            return False
        if self.inner is not None:
            self.inner.step()
        if self.mixed:
            self.param_shard.copy_(self.master_shard)
        return True

    def state_bytes(self) -> int:
        """Bytes held beyond the flat parameter and gradient buffers: fp16's master
        shard, and Adam's state of the shard (from the first step that is not skipped)."""
        masters = storage_bytes([self.master_shard]) if self.mixed else 0
        return masters + (optimizer_bytes(self.inner) if self.inner is not None else 0)
