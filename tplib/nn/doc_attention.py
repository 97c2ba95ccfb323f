"""Document-masked attention of a token slice: packed rows, each document on its own.

A packed row holds several documents (:class:`tplib.documents.Documents`). A token slice
``[start, end)`` cuts it into segments, one per document it touches; a segment's queries
attend causally to the segment's own keys and, without a mask, to its document's keys
before the slice, ``[document start, segment start)``, which earlier slices wrote into
the K/V context (:mod:`tplib.nn.context`). Nothing else of the row is visible to them.

Two implementations, as for unpacked slices:

- ``"split"`` (CPU, float32): per segment, the fused CPU flash kernel twice at most, the
  causal call over the segment and the unmasked call over its document's context,
  merged by their log-sum-exp; backward gives each part the merged output and
  log-sum-exp (exact, as :mod:`tplib.nn.context` argues). The work is the document's
  query-key pairs only: no ``L x L`` mask is built and no cross-document pair computed.
  Keys and values of the slice are written into the context; the context's share of
  their gradients is added into its gradient buffers, which later slices filled first.
- ``"masked"`` (any device and dtype): one attention call over ``[0, end)`` with a
  boolean block mask ``(batch, 1, length, end)`` that keeps, for each query, its own
  document's earlier keys. It materialises the mask of the slice (``length x end``),
  which the fused CUDA kernels take natively; the CPU path avoids it.

Whole rows (no context) take the same code with ``start = 0``: every segment then begins
at its document's start and needs no context.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from tplib.documents import Documents, Segment
from tplib.nn.context import (
    LayerContext,
    ProbsDropout,
    append_kv,
    fastest_impl,
    math_attention,
    merge_partials,
)
from tplib.nn.selective import Core, attention_core

__all__ = ["document_attention", "document_mask"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def document_mask(documents: Documents, start: int, end: int, device: torch.device) -> Tensor:
    """``(batch, 1, end - start, end)``: True where a query of ``[start, end)`` may see a
    key of ``[0, end)`` (its own document's, at or before it)."""
    doc_start = torch.from_numpy(documents.starts(start, end - start)).to(device)
    keys = torch.arange(end, device=device)
    queries = keys[start:end]
    seen = (keys[None, :] <= queries[:, None]) & (keys[None, None, :] >= doc_start[:, :, None])
    return seen.unsqueeze(1)


def document_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: LayerContext | None,
    start: int,
    documents: Documents,
    probs_dropout: ProbsDropout | None = None,
    *,
    recompute: bool = False,
) -> Tensor:
    """Document-masked attention of a slice's queries ``q`` at ``[start, start + l)``.

    ``q``, ``k``, ``v`` are the slice's own ``(batch, n_head, l, head_dim)``; with a
    ``layer`` context its keys and values are written there and the slice also sees its
    documents' earlier keys. Without one, ``start`` must be 0 (whole rows). With
    ``probs_dropout`` the attention is written out (:func:`~tplib.nn.context.math_attention`
    under the document mask), its dropout keyed by the row's positions."""
    end = start + q.shape[2]
    if documents.batch != q.shape[0] or documents.seq_len < end:
        raise ValueError(
            f"documents of {documents.batch} rows x {documents.seq_len} tokens for a slice "
            f"of {q.shape[0]} rows at [{start}, {end}): they must describe its rows"
        )
    if layer is None and start != 0:
        raise ValueError(f"start={start} without a context: a slice needs its K/V context")
    if layer is not None:
        layer.begin_slice(start, end)
    if probs_dropout is not None:
        seen = document_mask(documents, start, end, q.device)
        core: Core = partial(math_attention, start=start, probs_dropout=probs_dropout, seen=seen)
        if layer is not None:
            k, v = append_kv(k, v, layer, start)
        return attention_core(core, q, k, v, recompute=recompute)
    impl = layer.impl if layer is not None else None
    impl = impl or fastest_impl(q)
    if impl == "split":
        if q.device.type != "cpu":
            raise ValueError(f"attention impl 'split' runs on CPU tensors only, not {q.device}")
        segments = documents.segments(start, end)
        core = partial(_split, layer=layer, start=start, segments=segments)
        return attention_core(core, q, k, v, recompute=recompute)
    mask = document_mask(documents, start, end, q.device)
    if layer is None:
        return attention_core(partial(_masked, mask=mask), q, k, v, recompute=recompute)
    keys, values = append_kv(k, v, layer, start)
    return attention_core(partial(_masked, mask=mask), q, keys, values, recompute=recompute)


def _masked(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def _split(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: LayerContext | None,
    start: int,
    segments: list[Segment],
) -> Tensor:
    out: Tensor = _SegmentAttention.apply(q, k, v, layer, start, segments)
    return out


class _SegmentAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layer: LayerContext | None,
        start: int,
        segments: list[Segment],
    ) -> Tensor:
        if layer is not None:
            end = start + k.shape[2]
            layer.k[:, :, start:end].copy_(k)
            layer.v[:, :, start:end].copy_(v)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for s in segments:
            r, a, b = s.row, s.lo - start, s.hi - start
            o, m = _flash(q[r : r + 1, :, a:b], k[r : r + 1, :, a:b], v[r : r + 1, :, a:b],
                          is_causal=True)[:2]  # fmt: skip
            if s.context and layer is not None:
                keys = layer.k[r : r + 1, :, s.doc_start : s.lo]
                values = layer.v[r : r + 1, :, s.doc_start : s.lo]
                o_ctx, m_ctx = _flash(q[r : r + 1, :, a:b], keys, values)[:2]
                o, m = merge_partials(o, m, o_ctx, m_ctx)
            out[r : r + 1, :, a:b] = o
            lse[r : r + 1, :, a:b] = m
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layer, ctx.start, ctx.segments = layer, start, segments  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        layer: LayerContext | None = ctx.layer  # type: ignore[attr-defined]
        start: int = ctx.start  # type: ignore[attr-defined]
        segments: list[Segment] = ctx.segments  # type: ignore[attr-defined]
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for s in segments:
            r, a, b = s.row, s.lo - start, s.hi - start
            rows = (slice(r, r + 1), slice(None), slice(a, b))
            g, qs, o, m = grad_out[rows], q[rows].contiguous(), out[rows], lse[rows]
            d_q, d_k, d_v = _flash_backward(
                g, qs, k[rows].contiguous(), v[rows].contiguous(), o, m, 0.0, True
            )
            if s.context and layer is not None:
                keys = layer.k[r : r + 1, :, s.doc_start : s.lo]
                values = layer.v[r : r + 1, :, s.doc_start : s.lo]
                dq_ctx, dk_ctx, dv_ctx = _flash_backward(g, qs, keys, values, o, m, 0.0, False)
                d_q = d_q + dq_ctx
                layer.grad_k[r : r + 1, :, s.doc_start : s.lo].add_(dk_ctx)
                layer.grad_v[r : r + 1, :, s.doc_start : s.lo].add_(dv_ctx)
            dq[rows], dk[rows], dv[rows] = d_q, d_k, d_v
        if layer is not None:
            end = start + k.shape[2]
            dk += layer.grad_k[:, :, start:end]
            dv += layer.grad_v[:, :, start:end]
        return dq, dk, dv, None, None, None
