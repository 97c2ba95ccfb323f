"""Context parallelism (#CP): ring attention over the ranks that share each slice's tokens.

Megatron-LM's context parallelism cuts every token slice of length l (the whole sequence
when unsliced) into 2 x #CP equal chunks; CP rank r holds chunks r and 2 x #CP - 1 - r, so
each rank holds l / #CP tokens of every slice, and under the causal mask every rank has
about the same attention work (an early chunk paired with a late one).
:func:`cp_positions` gives the global positions a rank holds, :func:`cp_shard` its part of a
(batch, tokens) tensor. Everything outside attention is per token, so it runs on the
rank's tokens alone: embeddings (at their global positions), LayerNorms, products, MLP and
the loss. Only attention needs the keys and values of other ranks.

Attention is a ring over the #CP group. A rank's :class:`RingContext` holds only its own
keys and values: l / #CP per slice, in slice order (local slot ``i``), with the global
position of every slot of every rank (``positions``: each rank computes all of them, the
slicing being the same on every rank). For slice t at ``[start, end)`` each rank's keys
and values of positions ``[0, end)`` are the first ``end / #CP`` slots of its buffers, one
*block* of the same shape on every rank. A rank computes its queries against its own
block, then #CP - 1 times passes the block it holds to the next rank and receives one
from the previous (:attr:`CPGroup.shift`), merging the partial outputs by their
log-sum-exp, as :mod:`tplib.nn.context`'s split attention merges its two parts. The
first block, its own, holds every query's own position, so every row's log-sum-exp is
finite from then on and a block that hides all of a row's keys adds nothing to it.
Because chunks are cut along slices, a query chunk sees each block as at most two
contiguous key ranges, one whole and one causal, so on CPU (float32) every block is a
few calls of the fused flash kernel without a mask; elsewhere it is written out in
float32, masked by global position (:mod:`tplib.nn.ring_kernels`).

Backward goes round the ring once more. Each block travels with a gradient accumulator
for its keys and values; at each step a rank adds its queries' contribution
(the attention backward given the merged output and log-sum-exp, which makes each
block's part exact), and after #CP steps each accumulator is back at the block's owner,
holding the gradient from every rank's queries of this slice. The owner then applies
:mod:`tplib.nn.context`'s scheme on its local slots: the part for earlier slices' slots
goes into the context's gradient buffers, and its own slots' gradient is this slice's
plus what later slices accumulated there.

Why the gradient is exact. The gradient of the loss with respect to the key (or value) at
global position p is the sum over every query at a position >= p, of every slice and of
every rank, of that query's term. The queries of slice t are on all #CP ranks, and the
ring brings each rank's terms for p to p's owner in slice t's backward. Later slices run
backward first and leave their terms in the owner's gradient buffers, so when slice t's
backward hands the gradient of its own positions to autograd the sum is complete: the
whole-sequence gradient, for every slicing and every #CP.

Communication is injected, as :mod:`tplib.nn.oppart`'s collectives are: a
:class:`CPGroup` carries the rank's place and ``shift``, and the runtime builds it on
torch.distributed's point-to-point messages (:mod:`tplib.runtime.groups`). Every rank of
the group must run the same slices' attention in the same order, which the runtime's
ranks of a stage do: they walk the same list of actions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from tplib.nn.configs import check_cp_length
from tplib.nn.context import LayerContext, StageContext, fastest_impl
from tplib.nn.ring_kernels import (
    fused_backward,
    fused_forward,
    masked_backward,
    masked_forward,
    pieces,
)
from tplib.nn.selective import Core, attention_core

__all__ = [
    "CPGroup",
    "RingContext",
    "cp_positions",
    "cp_shard",
    "ring_attention",
    "ring_context",
]

# Sends a tensor to the next rank of the ring and returns the previous rank's (same
# shape and dtype).
Shift = Callable[[Tensor], Tensor]


def _no_shift(tensor: Tensor) -> Tensor:
    raise RuntimeError("this CPGroup has no ring (built for sizing only)")


@dataclass(frozen=True)
class CPGroup:
    """One rank's place in its #CP group, and the group's ring: ``shift`` sends a tensor
    to rank ``rank + 1`` and returns the one rank ``rank - 1`` sent (modulo ``size``)."""

    rank: int
    size: int
    shift: Shift = _no_shift

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"cp rank {self.rank} is outside the #CP group of {self.size}")


def _chunks(length: int, rank: int, n_cp: int) -> tuple[int, int, int]:
    """(chunk length, first offset, second offset) of ``rank``'s chunks in a slice."""
    check_cp_length(length, n_cp)
    c = length // (2 * n_cp)
    return c, rank * c, (2 * n_cp - 1 - rank) * c


def cp_positions(
    start: int, length: int, rank: int, n_cp: int, device: torch.device | str = "cpu"
) -> Tensor:
    """The global positions CP rank ``rank`` holds of the slice ``[start, start + length)``:
    chunks ``rank`` and ``2 x #CP - 1 - rank``, in that order."""
    c, a, b = _chunks(length, rank, n_cp)
    first = torch.arange(start + a, start + a + c, device=device)
    return torch.cat([first, torch.arange(start + b, start + b + c, device=device)])


def cp_shard(x: Tensor, group: CPGroup | None, dim: int = 1) -> Tensor:
    """This rank's part of ``x``, whose ``dim`` is a slice's tokens (token ids, targets)."""
    if group is None or group.size == 1:
        return x
    c, a, b = _chunks(x.shape[dim], group.rank, group.size)
    return torch.cat([x.narrow(dim, a, c), x.narrow(dim, b, c)], dim=dim)


class RingContext(LayerContext):
    """A :class:`~tplib.nn.context.LayerContext` of one CP rank: ``seq_len`` local slots
    (L / #CP), and ``positions`` (#CP, seq_len), the global position of each rank's slots."""

    def __init__(self, *args: object, n_cp: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.positions = torch.zeros((n_cp, self.seq_len), dtype=torch.long, device=self.k.device)


def ring_context(
    layer_ids: range,
    *,
    batch: int,
    n_head: int,
    seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    n_cp: int,
    impl: str | None = None,
) -> StageContext:
    """A stage's contexts for ``batch`` sequences of ``seq_len`` (global) tokens on one CP
    rank of ``n_cp``: each layer's a :class:`RingContext` of ``seq_len / #CP`` slots.
    ``impl`` must be None: the ring is its own attention (:mod:`tplib.nn.context`'s do
    not apply)."""
    if impl is not None:
        raise ValueError(
            f"attention impl {impl!r} with #CP={n_cp}: context parallelism runs the ring "
            "attention of tplib.nn.ring, not tplib.nn.context's; leave attention None"
        )
    check_cp_length(seq_len, n_cp, "a sequence")
    shape = (batch, n_head, seq_len // n_cp, head_dim)
    return StageContext(
        {i: RingContext(*shape, dtype=dtype, device=device, n_cp=n_cp) for i in layer_ids}
    )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: LayerContext | None,
    start: int,
    group: CPGroup,
    *,
    recompute: bool = False,
) -> Tensor:
    """Causal attention of this rank's queries of the slice at global ``start`` over the
    keys and values of positions ``[0, end)`` on every rank of ``group``.

    ``q``, ``k``, ``v`` are the rank's own (batch, heads, l / #CP, head_dim); with a
    ``layer`` its keys and values are written there, and earlier slices' are read from
    there; without one the slice is the whole sequence (``start`` 0). ``recompute``: keep
    only the core's inputs, as :func:`tplib.nn.context.slice_attention` does.
    """
    if layer is not None and not isinstance(layer, RingContext):
        raise ValueError(
            "a CP rank's K/V context is a RingContext of its own slots: allocate it with "
            "GPTStage.new_context of a stage built with its CPGroup"
        )
    if layer is None and start:
        raise ValueError(f"start={start} without a context: a slice needs its K/V context")
    if layer is not None and start == 0 and not layer.recomputing:
        layer.grad_k.zero_()  # a new pass over this sequence (see tplib.nn.context)
        layer.grad_v.zero_()
    core: Core = partial(_ring_core, layer=layer, start=start, group=group)
    return attention_core(core, q, k, v, recompute=recompute)


def _ring_core(
    q: Tensor, k: Tensor, v: Tensor, layer: RingContext | None, start: int, group: CPGroup
) -> Tensor:
    out: Tensor = _RingAttention.apply(q, k, v, layer, start, group)
    return out


def _layout(
    k: Tensor, v: Tensor, layer: RingContext | None, start: int, group: CPGroup
) -> tuple[int, int, Tensor, Tensor]:
    """(first local slot of the slice, end slot, own block of stacked keys and values,
    global positions of every rank's block); writes the slice into ``layer``."""
    n_cp, tokens = group.size, k.shape[2]
    length = tokens * n_cp
    lo = start // n_cp
    hi = lo + tokens
    mine = [cp_positions(start, length, r, n_cp, k.device) for r in range(n_cp)]
    if layer is None:
        return lo, hi, torch.stack([k, v]), torch.stack(mine)
    if hi > layer.seq_len:
        raise ValueError(
            f"slice [{start}, {start + length}) runs past the context buffer of "
            f"{layer.seq_len * n_cp} tokens"
        )
    layer.k[:, :, lo:hi].copy_(k)
    layer.v[:, :, lo:hi].copy_(v)
    layer.positions[:, lo:hi] = torch.stack(mine)
    return lo, hi, torch.stack([layer.k[:, :, :hi], layer.v[:, :, :hi]]), layer.positions[:, :hi]


def _fused(q: Tensor) -> bool:
    """Whether ``q``'s blocks take the fused CPU kernels (:mod:`tplib.nn.ring_kernels`)."""
    return fastest_impl(q) == "split"


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: RingContext | None,
        start: int,
        group: CPGroup,
    ) -> Tensor:
        lo, hi, block, positions = _layout(k, v, layer, start, group)
        chunk, qpos = q.shape[2] // 2, positions[group.rank, lo:hi]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(group.size):
            if step:
                block = group.shift(block.contiguous())
            # The first block is the rank's own: it holds every query's own position, so
            # every row's log-sum-exp is finite from then on.
            owner = (group.rank - step) % group.size
            if _fused(q):
                calls = pieces(group.rank, owner, lo, chunk)
                fused_forward(q, block[0], block[1], calls, out, lse)
            else:
                mask = qpos[:, None] >= positions[owner]
                masked_forward(q, block[0], block[1], mask, out, lse)
        ctx.save_for_backward(q, out, lse, *(() if layer is not None else (k, v)))
        where = (layer, group, lo, hi, positions.clone(), k.dtype, v.dtype)
        ctx.where = where  # type: ignore[attr-defined]
        return out.to(q.dtype)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        q, out, lse, *own = ctx.saved_tensors  # type: ignore[attr-defined]
        layer, group, lo, hi, positions, k_dtype, v_dtype = ctx.where  # type: ignore[attr-defined]
        keys, values = own if layer is None else (layer.k[:, :, :hi], layer.v[:, :, :hi])
        chunk, qpos = q.shape[2] // 2, positions[group.rank, lo:hi]
        grad_out = grad_out.contiguous()
        # The block's keys and values, then their gradient accumulator: one message a step.
        travel = torch.empty((4, *keys.shape), dtype=torch.float32, device=keys.device)
        travel[0].copy_(keys)
        travel[1].copy_(values)
        travel[2:].zero_()
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        for step in range(group.size):
            if step:
                travel = group.shift(travel)
            owner = (group.rank - step) % group.size
            into = (grad_q, travel[2], travel[3])
            if _fused(q):
                calls = pieces(group.rank, owner, lo, chunk)
                fused_backward(q, travel[0], travel[1], calls, out, lse, grad_out, into)
            else:
                mask = qpos[:, None] >= positions[owner]
                masked_backward(q, travel[0], travel[1], mask, out, lse, grad_out, into)
        # One more step takes each accumulator home to its block's owner.
        grads = group.shift(travel[2:].contiguous()) if group.size > 1 else travel[2:]
        if layer is None:
            return grad_q.to(q.dtype), grads[0].to(k_dtype), grads[1].to(v_dtype), None, None, None
        own = []
        for grad, acc, dtype in zip(
            grads, (layer.grad_k, layer.grad_v), (k_dtype, v_dtype), strict=True
        ):
            if lo:
                acc[:, :, :lo].add_(grad[:, :, :lo].to(acc.dtype))
            own.append((grad[:, :, lo:hi] + acc[:, :, lo:hi]).to(dtype))
        return grad_q.to(q.dtype), own[0], own[1], None, None, None
