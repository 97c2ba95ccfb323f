"""Per-sequence key/value context: what lets attention run exactly over token slices.

When a sequence is cut into token slices l1..lM, slice t attends causally to itself and
to the keys and values of every earlier slice. A :class:`LayerContext` holds one layer's
keys and values for a batch slice's whole sequence in buffers allocated once; each slice
writes its own keys and values into its range and attends to the prefix ``[0, end)``.
Nothing is concatenated.

Each slice's autograd graph stops at the context: it reads earlier keys and values from
the buffer, not from the earlier slices' tensors. Backward therefore runs slice by slice,
last to first. When slice t's backward reaches the context, the gradient for positions
before it is added into the context's gradient buffers, and the gradient for its own
positions is this slice's plus what later slices accumulated there. Because later slices
run backward first, that sum is complete when slice t needs it, and the result is the same
gradient the whole-sequence computation gives.

Recomputation runs a slice's forward again inside its backward, after later slices have
already added their gradients into the buffers; :meth:`StageContext.recomputing` marks
that pass, so the first slice's forward does not clear what they accumulated.

Two implementations of a slice's attention, chosen by :func:`slice_attention`:

- ``"split"`` (CPU only): attention over the context ``[0, start)`` without a mask and
  over the slice itself with the causal kernel, merged by their log-sum-exp. Backward
  gives each part the merged output and log-sum-exp, which makes the parts' gradients
  exact. Masked attention is several times slower than these two kernels on CPU. Its
  kernel (``_scaled_dot_product_flash_attention_for_cpu``) exists for CPU tensors only,
  so a context on another device refuses it.
- ``"masked"`` (any device): one attention call over ``[0, end)`` with a bottom-right
  causal mask; CUDA's fused kernels take that mask natively.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache, partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from tplib.nn.selective import Core, attention_core

__all__ = [
    "ATTENTION_IMPLS",
    "LayerContext",
    "ProbsDropout",
    "StageContext",
    "append_kv",
    "attention_impls",
    "causal_attention",
    "fastest_impl",
    "math_attention",
    "merge_partials",
    "slice_attention",
]

# Drops attention probabilities (batch, heads, queries, keys) given the queries' and
# keys' absolute positions; see tplib.nn.dropout.
ProbsDropout = Callable[[Tensor, Tensor, Tensor], Tensor]

ATTENTION_IMPLS = ("split", "masked")


def attention_impls(device: torch.device | str) -> tuple[str, ...]:
    """The slice-attention implementations that run on ``device``."""
    return ATTENTION_IMPLS if torch.device(device).type == "cpu" else ("masked",)


class LayerContext:
    """Keys, values and their gradients for one layer and one batch slice.

    Buffers have shape ``(batch, n_head, seq_len, head_dim)``.
    """

    def __init__(
        self,
        batch: int,
        n_head: int,
        seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        impl: str | None = None,
    ) -> None:
        if impl is not None and impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {impl!r}: choose one of {ATTENTION_IMPLS}")
        if impl is not None and impl not in attention_impls(device):
            raise ValueError(
                f"attention impl {impl!r} runs on CPU tensors only (its kernel is "
                f"_scaled_dot_product_flash_attention_for_cpu), not on {device}: choose one of "
                f"{attention_impls(device)} or None (the device's default)"
            )
        self.impl = impl  # None: the fastest for the device
        self.recomputing = False  # a forward run again inside backward: keep the grads
        shape = (batch, n_head, seq_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.grad_k = torch.zeros(shape, dtype=dtype, device=device)
        self.grad_v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def seq_len(self) -> int:
        return self.k.shape[2]

    def begin_slice(self, start: int, end: int) -> None:
        """Check that slice ``[start, end)`` fits; the first slice of a new pass clears the
        gradients (nothing has been accumulated for this sequence yet), a recomputed one
        keeps what later slices added."""
        if end > self.seq_len:
            raise ValueError(
                f"slice [{start}, {end}) runs past the context buffer of {self.seq_len} tokens"
            )
        if start == 0 and not self.recomputing:
            self.grad_k.zero_()
            self.grad_v.zero_()


class StageContext:
    """The :class:`LayerContext` of every layer of a stage, for one batch slice."""

    def __init__(self, layers: dict[int, LayerContext]) -> None:
        self.layers = layers

    @classmethod
    def allocate(
        cls,
        layer_ids: range,
        *,
        batch: int,
        n_head: int,
        seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        impl: str | None = None,
    ) -> StageContext:
        return cls(
            {
                i: LayerContext(
                    batch, n_head, seq_len, head_dim, dtype=dtype, device=device, impl=impl
                )
                for i in layer_ids
            }
        )

    def __getitem__(self, layer: int) -> LayerContext:
        return self.layers[layer]

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Mark the forwards run inside this block as recomputation (see the module)."""
        for layer in self.layers.values():
            layer.recomputing = True
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.recomputing = False

    def buffers(self) -> list[Tensor]:
        """Every buffer it holds: keys, values and their gradients, per layer."""
        return [t for c in self.layers.values() for t in (c.k, c.v, c.grad_k, c.grad_v)]


def _alias(buffer: Tensor, end: int) -> Tensor:
    """``buffer[:, :, :end]`` as a tensor with its own version counter.

    Later slices write into ``buffer`` beyond ``end`` while this slice's graph still holds
    the alias for backward. Those writes never touch ``[0, end)``, but an ordinary view
    shares the buffer's version counter and autograd would reject the saved tensor.
    """
    out = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    shape = (buffer.shape[0], buffer.shape[1], end, buffer.shape[3])
    return out.set_(buffer.untyped_storage(), buffer.storage_offset(), shape, buffer.stride())


class _AppendKV(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        k: Tensor,
        v: Tensor,
        layer: LayerContext,
        start: int,
    ) -> tuple[Tensor, Tensor]:
        end = start + k.shape[2]
        layer.k[:, :, start:end].copy_(k)
        layer.v[:, :, start:end].copy_(v)
        ctx.layer, ctx.start, ctx.end = layer, start, end  # type: ignore[attr-defined]
        return _alias(layer.k, end), _alias(layer.v, end)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_keys: Tensor | None,
        grad_values: Tensor | None,
    ) -> tuple[Tensor | None, Tensor | None, None, None]:
        layer: LayerContext = ctx.layer  # type: ignore[attr-defined]
        start: int = ctx.start  # type: ignore[attr-defined]
        end: int = ctx.end  # type: ignore[attr-defined]
        grads = []
        for grad, acc in ((grad_keys, layer.grad_k), (grad_values, layer.grad_v)):
            own = acc[:, :, start:end]
            if grad is None:
                grads.append(own.clone())
                continue
            if start:
                acc[:, :, :start].add_(grad[:, :, :start])
            grads.append(grad[:, :, start:end] + own)
        return grads[0], grads[1], None, None


def append_kv(k: Tensor, v: Tensor, layer: LayerContext, start: int) -> tuple[Tensor, Tensor]:
    """Write a slice's keys and values into ``layer`` at ``start``; return the context's
    keys and values ``[0, end)`` as the slice's graph sees them (gradients routed as the
    module describes)."""
    keys, values = _AppendKV.apply(k, v, layer, start)
    return keys, values


def merge_partials(
    out: Tensor, lse: Tensor, out_other: Tensor, lse_other: Tensor
) -> tuple[Tensor, Tensor]:
    """Attention over two disjoint sets of keys merged into attention over both, from each
    part's output and log-sum-exp: the merged output and log-sum-exp."""
    merged = torch.logaddexp(lse, lse_other)
    out = out * torch.exp(lse - merged).unsqueeze(-1) + out_other * torch.exp(
        lse_other - merged
    ).unsqueeze(-1)
    return out, merged


def math_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    start: int,
    probs_dropout: ProbsDropout,
    seen: Tensor | None = None,
) -> Tensor:
    """Causal attention written out, with dropout on the probabilities: queries at
    positions ``start..`` over ``keys``/``values`` at positions ``0..``. The fused kernels
    draw their dropout masks from a generator in call order; this path drops by position
    (see :mod:`tplib.nn.dropout`), so a sliced run drops what the whole sequence drops.
    ``seen``, if given, is the mask of visible keys instead of the causal one (packed
    rows: :func:`tplib.nn.doc_attention.document_mask`)."""
    length, end = q.shape[2], keys.shape[2]
    qpos = torch.arange(start, start + length, device=q.device)
    kpos = torch.arange(end, device=q.device)
    scores = (q @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    hidden = kpos > qpos.unsqueeze(1) if seen is None else ~seen
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs_dropout(probs, qpos, kpos) @ values


def slice_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: LayerContext,
    start: int,
    probs_dropout: ProbsDropout | None = None,
    *,
    recompute: bool = False,
) -> Tensor:
    """Causal attention of a slice's queries over the context ``[0, start)`` and itself.

    ``q``, ``k``, ``v`` are the slice's own ``(batch, n_head, length, head_dim)``; its keys
    and values are written into ``layer`` at ``start``. With ``probs_dropout`` the
    attention is :func:`math_attention` over the context's keys and values. With
    ``recompute`` the attention core keeps only its inputs and runs again in backward
    (:mod:`tplib.nn.selective`); the gradient buffers are cleared outside it, so running
    it again never clears what later slices accumulated.
    """
    end = start + k.shape[2]
    layer.begin_slice(start, end)
    if probs_dropout is not None:
        keys, values = append_kv(k, v, layer, start)
        core: Core = partial(math_attention, start=start, probs_dropout=probs_dropout)
        return attention_core(core, q, keys, values, recompute=recompute)
    impl = layer.impl or fastest_impl(q)
    if impl == "split":
        if q.device.type != "cpu":  # a CPU context written into from another device
            raise ValueError(f"attention impl 'split' runs on CPU tensors only, not {q.device}")
        # Run again in backward it writes the same keys and values into the context.
        core = partial(_split_attention, layer=layer, start=start)
        return attention_core(core, q, k, v, recompute=recompute)
    if impl == "masked":
        keys, values = append_kv(k, v, layer, start)
        mask = None if start == 0 else _mask(q.shape[2], end, q.device)
        core = partial(_masked_attention, mask=mask)
        return attention_core(core, q, keys, values, recompute=recompute)
    raise ValueError(f"unknown attention impl {impl!r}: choose one of {ATTENTION_IMPLS}")


def fastest_impl(q: Tensor) -> str:
    """The faster implementation for queries ``q``: the fused CPU kernels ("split") take
    float32 CPU tensors; anything else is "masked"."""
    return "split" if q.device.type == "cpu" and q.dtype == torch.float32 else "masked"


def causal_attention(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """Whole sequences' causal attention, the fused kernel."""
    return F.scaled_dot_product_attention(q, keys, values, is_causal=True)


def _masked_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return causal_attention(q, keys, values)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def _split_attention(q: Tensor, k: Tensor, v: Tensor, layer: LayerContext, start: int) -> Tensor:
    out: Tensor = _SplitAttention.apply(q, k, v, layer, start)
    return out


@lru_cache(maxsize=64)
def _mask(length: int, end: int, device: torch.device) -> Tensor:
    """Bottom-right aligned causal mask: query i sees keys ``[0, end - length + i]``."""
    if device.type == "cuda":
        return causal_lower_right(length, end)
    return torch.ones(length, end, dtype=torch.bool, device=device).tril(end - length)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: LayerContext,
        start: int,
    ) -> Tensor:
        end = start + k.shape[2]
        layer.k[:, :, start:end].copy_(k)
        layer.v[:, :, start:end].copy_(v)
        out, lse = _flash(q, k, v, is_causal=True)[:2]
        if start:
            out_ctx, lse_ctx = _flash(q, layer.k[:, :, :start], layer.v[:, :, :start])[:2]
            out, lse = merge_partials(out, lse, out_ctx, lse_ctx)
        ctx.save_for_backward(q, out, lse)
        ctx.layer, ctx.start, ctx.end = layer, start, end  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        layer: LayerContext = ctx.layer  # type: ignore[attr-defined]
        start: int = ctx.start  # type: ignore[attr-defined]
        end: int = ctx.end  # type: ignore[attr-defined]
        grad_out = grad_out.contiguous()
        k, v = layer.k[:, :, start:end], layer.v[:, :, start:end]
        dq, dk, dv = _flash_backward(grad_out, q, k, v, out, lse, 0.0, True)
        if start:
            dq_ctx, dk_ctx, dv_ctx = _flash_backward(
                grad_out, q, layer.k[:, :, :start], layer.v[:, :, :start], out, lse, 0.0, False
            )
            dq = dq + dq_ctx
            layer.grad_k[:, :, :start].add_(dk_ctx)
            layer.grad_v[:, :, :start].add_(dv_ctx)
        dk = dk + layer.grad_k[:, :, start:end]
        dv = dv + layer.grad_v[:, :, start:end]
        return dq, dk, dv, None, None
