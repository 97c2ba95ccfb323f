"""The ring attention's per-block kernels: one rank's queries against one rank's block.

:mod:`tplib.nn.ring` walks the ring; at each step a CP rank holds its queries of slice t
(chunks ``rank`` and ``2 x #CP - 1 - rank``, c tokens each, local rows ``[0, c)`` and
``[c, 2c)``) and the *block* of CP rank ``owner``: its keys and values of positions
``[0, end)``, local slots ``[0, hi)``. This module computes the block's part of the
attention, merged into a running output and log-sum-exp, and in backward the block's
share of the gradients, given the merged output and log-sum-exp (which makes each
block's share exact, as :mod:`tplib.nn.context`'s split attention does for its parts).

Two ways, the same numbers:

- fused (CPU, float32): because chunks are cut along slices, a query chunk and a block
  need no mask. The block's slots ``[0, lo)``, earlier slices, all precede the slice;
  each of its two chunks of slice t is, relative to a query chunk, wholly before it
  (seen whole), the same chunk (plain causal: the same positions), or wholly after it
  (skipped). Laid out in slot order this gives at most two contiguous key ranges per
  query chunk, an unmasked one and a causal one (:func:`pieces`), each one call of
  ``_scaled_dot_product_flash_attention_for_cpu`` and of its backward.
- written out (any device): scores in float32 over the whole block, masked by global
  position (query position >= key position).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "Piece",
    "fused_backward",
    "fused_forward",
    "masked_backward",
    "masked_forward",
    "pieces",
]

# (first query row, end query row, first key slot, end key slot, causal): one kernel call.
Piece = tuple[int, int, int, int, bool]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def pieces(rank: int, owner: int, lo: int, chunk: int) -> list[Piece]:
    """The kernel calls of CP ``rank``'s queries over CP ``owner``'s block of a slice whose
    first local slot is ``lo``, chunks of ``chunk`` tokens.

    With n = #CP, query chunk r (rows ``[0, c)``) and 2n - 1 - r (rows ``[c, 2c)``); the
    block's chunks of the slice are r' and 2n - 1 - r' (slots ``[lo, lo + c)`` and
    ``[lo + c, lo + 2c)``), and a chunk sees a lower-numbered chunk whole:

    - r' = r: rows ``[0, c)`` see ``[0, lo)`` and their own chunk causally; rows
      ``[c, 2c)`` see ``[0, lo + c)`` and their own chunk causally;
    - r' < r: every row sees ``[0, lo + c)`` (chunk r' precedes both, 2n - 1 - r' follows
      both);
    - r' > r: rows ``[0, c)`` see ``[0, lo)`` only, rows ``[c, 2c)`` the whole block.
    """
    c = chunk
    early = [(0, c, 0, lo, False)] if lo else []
    if owner == rank:
        return [*early, (0, c, lo, lo + c, True), (c, 2 * c, 0, lo + c, False),
                (c, 2 * c, lo + c, lo + 2 * c, True)]  # fmt: skip
    if owner < rank:
        return [(0, 2 * c, 0, lo + c, False)]
    return [*early, (c, 2 * c, 0, lo + 2 * c, False)]


def _merge(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Merge one part's output and log-sum-exp into ``out`` and ``lse`` (views, in place).
    ``lse`` -inf (no keys yet) takes the part as it is."""
    merged = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.addcmul_(part, torch.exp(part_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def fused_forward(
    q: Tensor, k: Tensor, v: Tensor, calls: list[Piece], out: Tensor, lse: Tensor
) -> None:
    """Merge the attention of ``q`` over the block ``k``, ``v`` into ``out`` and ``lse``,
    one fused call per piece."""
    for q0, q1, k0, k1, causal in calls:
        part, part_lse = _flash(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], is_causal=causal)[
            :2
        ]
        _merge(out[:, :, q0:q1], lse[:, :, q0:q1], part, part_lse)


def fused_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    calls: list[Piece],
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    grads: tuple[Tensor, Tensor, Tensor],
) -> None:
    """Add the block's share of the gradients into ``grads`` (of q, of the block's keys
    and values), given the merged ``out`` and ``lse``: one kernel backward per piece."""
    grad_q, grad_k, grad_v = grads
    for q0, q1, k0, k1, causal in calls:
        rows = slice(q0, q1)
        dq, dk, dv = _flash_backward(
            grad_out[:, :, rows],
            q[:, :, rows],
            k[:, :, k0:k1],
            v[:, :, k0:k1],
            out[:, :, rows],
            lse[:, :, rows],
            0.0,
            causal,
        )
        grad_q[:, :, rows] += dq
        grad_k[:, :, k0:k1] += dk
        grad_v[:, :, k0:k1] += dv


def masked_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, out: Tensor, lse: Tensor) -> None:
    """Merge the written-out float32 attention of ``q`` over the block, keys hidden where
    ``mask`` (queries x keys) is False, into ``out`` and ``lse``. A row whose every key is
    hidden adds nothing (its part's log-sum-exp is -inf)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    part_lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - part_lse.masked_fill(part_lse.isinf(), 0.0).unsqueeze(-1))
    _merge(out, lse, probs @ v.float(), part_lse)


def masked_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    grads: tuple[Tensor, Tensor, Tensor],
) -> None:
    """:func:`fused_backward` written out in float32, over the masked block."""
    q, k, v, grad_out = q.float(), k.float(), v.float(), grad_out.float()
    scale = q.shape[-1] ** -0.5
    scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    grad_probs = grad_out @ v.transpose(-1, -2)
    grad_scores = probs * (grad_probs - (grad_out * out).sum(-1, keepdim=True))
    grads[0].add_(grad_scores @ k * scale)
    grads[1].add_(grad_scores.transpose(-1, -2) @ q * scale)
    grads[2].add_(probs.transpose(-1, -2) @ grad_out)
