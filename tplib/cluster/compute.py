"""What one transformer layer costs on one V100: the compute half of the cluster model.

Per layer and slice of b sequences, s tokens after c tokens of context, on one GPU of
an #Op group (the paper's implementation, appendix B: PyTorch + Megatron-LM, fp16):

* matrix products: forward 24 b s H^2 / #Op FLOPs in four products (QKV 6, output
  projection 2, MLP 16), backward twice that (dX and dW); attention 4 b s (c + s) H / #Op
  (QK^T and AV over all c + s keys: the implementation computes masked entries too). Each
  product runs at ``gemm_efficiency`` x the 125 TFLOPS fp16 peak, slowed by tile and wave
  quantization (whole 128 x 128 output tiles, in waves of one tile per each of the 80
  SMs; this is why small slices and small per-GPU matrices run below peak), and never
  faster than moving its operands through HBM (so a tiny slice still streams the weights);
* ``w.grad += dW`` on every slice (read two, write one fp16 copy of the weights) and the
  K/V-context gradient accumulation;
* memory-bound kernels at ``hbm_efficiency`` x 900 GB/s: LayerNorms, residuals, dropout,
  biases, activation (:data:`TOKEN_BYTES_FWD`) and the score matrix (scale, mask, fp32
  softmax, dropout: :data:`~tplib.cluster.implementation.ATTENTION_SCORE_BYTES` per score);
  dropout's share only when the model trains with dropout (``GPTConfig.dropout``; the
  paper's GPT-3 configs, as GPT-3 trained with 0.1);
* Megatron (#Op > 1): 2 forward and 2 backward all-reduces of b s H fp16 values per layer
  over NVLink, a ring (:func:`~tplib.sim.costs.ring_allreduce`) plus ``collective_latency``.

With context parallelism (``n_cp``, :mod:`tplib.cluster.context_parallel`) a GPU runs all
of this on 1 / #CP of the slice's tokens and context, and 1 / #CP of its causal attention.

:func:`embedding_times` and :func:`head_times` price the two ends of the model the
same way, for the planners that partition the whole chain (:mod:`tplib.partition`).

The host floor (paper Fig. 3) and everything about stages and links is applied on top
by :class:`~tplib.cluster.cost.ClusterCostModel`.
"""

from __future__ import annotations

import numpy as np

from tplib.cluster.calibration import Calibration
from tplib.cluster.hardware import FP16, FP32, Hardware
from tplib.cluster.implementation import (
    ATTENTION_SCORE_BYTES,
    PAPER,
    Implementation,
    check_context_parallel,
)
from tplib.nn.configs import GPTConfig, n_params_per_layer
from tplib.sim.costs import ring_allreduce

__all__ = [
    "attention_core_time",
    "embedding_times",
    "flash_times",
    "gemm_time",
    "hbm_rate",
    "head_times",
    "layer_times",
    "layer_wgrad_time",
    "nvlink_bus",
]

# Memory traffic of the memory-bound kernels, bytes per element (counted from the reads
# and writes of a plain PyTorch layer; the backward does about twice the forward).
TOKEN_BYTES_FWD = (15.0, 16.0)  # per (token, hidden) element: (replicated, per #Op share)
# replicated over the #Op group: 2 LayerNorms (r+w), 2 residual adds (2r+w), 2 dropouts;
# per #Op share: QKV and FC1 biases, the activation over 4H.
# Dropout's share of the above, charged only when the model trains with dropout
# (GPTConfig.dropout > 0, as GPT-3 did): forward, each of the 2 residual-branch dropouts
# reads and writes fp16 and writes a 1-byte mask (2.5 elements); on the scores the same
# 5 bytes; the backward reads the gradient and the mask and writes (also 5 bytes).
DROPOUT_TOKEN_ELEMS = 2 * 2.5
DROPOUT_SCORE_BYTES = 5.0
# The loss per logit: write the fp16 logit, read it into an fp32 softmax (write 4), read
# that for the loss.
LOGIT_BYTES = FP16 + FP16 + FP32 + FP32


def hbm_rate(cal: Calibration, hw: Hardware) -> float:
    """Bytes/s the memory-bound kernels reach."""
    return cal.hbm_efficiency * hw.hbm_bandwidth


def nvlink_bus(cal: Calibration, hw: Hardware) -> float:
    """Bytes/s of a collective inside a node: NCCL's rings use all of a GPU's NVLinks."""
    return cal.nvlink_efficiency * hw.nvlink_link * hw.nvlink_links


def gemm_time(
    m: float | np.ndarray,
    n: float | np.ndarray,
    k: float | np.ndarray,
    batch: float | np.ndarray = 1.0,
    *,
    cal: Calibration,
    hw: Hardware,
) -> np.ndarray:
    """Seconds of ``batch`` products (m x k) @ (k x n) in fp16."""
    if cal.quantization:
        t, sms = hw.gemm_tile, hw.sms
        tiles = batch * np.ceil(m / t) * np.ceil(n / t)
        slots = np.ceil(tiles / sms) * sms * t * t  # whole waves of whole tiles
        used = batch * m * n / slots
    else:
        used = 1.0
    flops = cal.gemm_efficiency * hw.peak_fp16
    compute = 2 * batch * m * n * k / (flops * used)
    traffic = FP16 * batch * (m * k + k * n + m * n) / hbm_rate(cal, hw)
    return np.maximum(compute, traffic)


def layer_times(
    cfg: GPTConfig,
    n_op: int,
    batch_slice_size: int,
    length: np.ndarray,
    context: np.ndarray,
    *,
    cal: Calibration,
    hw: Hardware,
    impl: Implementation = PAPER,
    n_cp: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """GPU seconds of one layer's (forward, backward) for a slice, on one GPU of an
    ``n_op`` group, in implementation ``impl`` (its attention and sequence parallelism:
    :mod:`tplib.cluster.implementation`). With ``n_cp`` context-parallel ranks the GPU
    holds 1 / #CP of the slice's tokens and of its context and does 1 / #CP of its
    causal attention (:mod:`tplib.cluster.context_parallel`; the ring's exchanges are
    the cost model's)."""
    check_context_parallel(n_cp, impl.attention)
    h, heads, hbm = cfg.hidden, cfg.n_head // n_op, hbm_rate(cal, hw)
    s, c = np.asarray(length, dtype=float), np.asarray(context, dtype=float)
    b = batch_slice_size
    tokens, keys = b * s / n_cp, c + s

    def gemm(
        m: float | np.ndarray, n: float | np.ndarray, k: float | np.ndarray, batch: float = 1.0
    ) -> np.ndarray:
        return gemm_time(m, n, k, batch, cal=cal, hw=hw)

    shapes = _layer_products(h, n_op)
    fwd_gemm = sum(gemm(tokens, n, k) for n, k in shapes)
    # Backward: dX = dY W^T (tokens x k) and dW = X^T dY (k x n, reducing over tokens).
    bwd_gemm = sum(gemm(tokens, k, n) + gemm(k, n, tokens) for n, k in shapes)
    pairs, dh = b * heads, cfg.head_dim
    rep, part = TOKEN_BYTES_FWD
    if cfg.dropout == 0:  # nothing to drop: the model does not pay for dropout
        rep -= DROPOUT_TOKEN_ELEMS
    score_seconds: tuple[float | np.ndarray, float | np.ndarray] = (0.0, 0.0)
    if impl.attention == "flash":
        attn, attn_bwd = flash_times(pairs, dh, s, c, cal=cal, hw=hw)
        attn, attn_bwd = attn / n_cp, attn_bwd / n_cp  # balanced: see context_parallel
    else:
        attn, *scored = _written_attention(cfg, pairs, s, keys, impl, cal=cal, hw=hw)
        attn_bwd, score_seconds = 2 * attn, (scored[0], scored[1])
    # Sequence parallelism splits the replicated regions over the group.
    rep_share = rep / n_op if impl.sequence_parallel else rep
    elementwise = tokens * h * FP16 * (rep_share + part / n_op) / hbm
    megatron: float | np.ndarray = 0.0
    if n_op > 1:
        ring = ring_allreduce(FP16 * tokens * h, n_op, nvlink_bus(cal, hw))
        megatron = 2 * (ring + cal.collective_latency)
    fwd = fwd_gemm + attn + score_seconds[0] + elementwise + megatron
    params = n_params_per_layer(cfg) / n_op
    accumulate = 3 * FP16 * params / hbm  # w.grad += dW per slice
    kv_grad = 3 * 2 * FP16 * b * c / n_cp * h / n_op / hbm  # context grads += update
    bwd = bwd_gemm + attn_bwd + score_seconds[1] + 2 * elementwise + megatron + accumulate + kv_grad
    return fwd, bwd


def flash_times(
    pairs: float,
    head_dim: int,
    length: np.ndarray,
    context: np.ndarray,
    *,
    cal: Calibration,
    hw: Hardware,
) -> tuple[np.ndarray, np.ndarray]:
    """GPU seconds of FlashAttention-2's (forward, backward) over ``pairs`` (sequence,
    head) pairs of a slice of ``length`` queries after ``context`` keys: the forward's
    two products over every context key and the causal half of the slice's own, at
    ``flash_efficiency`` of the peak; the backward 2.5 times the forward's work (it
    recomputes the scores: five products to the forward's two)."""
    if cal.flash_efficiency is None:
        raise ValueError(
            f"attention='flash' on {hw.gpu}: its calibration has no flash_efficiency "
            "(FlashAttention-2 runs on A100 and newer GPUs)"
        )
    s, c = np.asarray(length, dtype=float), np.asarray(context, dtype=float)
    flops = 4 * pairs * head_dim * s * (c + (s + 1) / 2)
    fwd = flops / (cal.flash_efficiency * hw.peak_fp16)
    return fwd, 2.5 * fwd


def attention_core_time(
    cfg: GPTConfig,
    n_op: int,
    batch_slice_size: int,
    length: np.ndarray,
    context: np.ndarray,
    *,
    cal: Calibration,
    hw: Hardware,
    impl: Implementation = PAPER,
) -> np.ndarray:
    """GPU seconds of one layer's attention core forward (scores, softmax, dropout, the
    product with V): what selective recomputation runs again in the backward. Nothing
    with FlashAttention-2, whose backward already recomputes the scores (and keeps no
    more than the core's inputs and output)."""
    s = np.asarray(length, dtype=float)
    if impl.attention == "flash":
        return np.zeros_like(s)
    keys = np.asarray(context, dtype=float) + s
    pairs = batch_slice_size * (cfg.n_head // n_op)
    attn, score_fwd, _ = _written_attention(cfg, pairs, s, keys, impl, cal=cal, hw=hw)
    return np.asarray(attn + score_fwd, dtype=float)


def _layer_products(h: int, n_op: int) -> list[tuple[float, float]]:
    """A layer's four products on one GPU as (n, k) of (tokens x k) @ (k x n): Megatron
    splits QKV and FC1 by columns, the output projection and FC2 by rows."""
    return [(3 * h / n_op, h), (h, h / n_op), (4 * h / n_op, h), (h, 4 * h / n_op)]


def _written_attention(
    cfg: GPTConfig,
    pairs: int,
    length: np.ndarray,
    keys: np.ndarray,
    impl: Implementation,
    *,
    cal: Calibration,
    hw: Hardware,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seconds of the written-out attention core's forward over ``pairs`` (sequence,
    head) pairs: its two products, QK^T (s x dh) @ (dh x keys) and AV (s x keys) @
    (keys x dh), and the memory traffic of its scores forward and backward
    (:data:`~tplib.cluster.implementation.ATTENTION_SCORE_BYTES`, less dropout's share
    when the model has none)."""
    dh = cfg.head_dim
    attn = gemm_time(length, keys, dh, pairs, cal=cal, hw=hw) + gemm_time(
        length, dh, keys, pairs, cal=cal, hw=hw
    )
    score_fwd, score_bwd = ATTENTION_SCORE_BYTES[impl.attention]
    if cfg.dropout == 0:
        score_fwd, score_bwd = score_fwd - DROPOUT_SCORE_BYTES, score_bwd - DROPOUT_SCORE_BYTES
    scores, hbm = pairs * length * keys, hbm_rate(cal, hw)
    return attn, scores * score_fwd / hbm, scores * score_bwd / hbm


def layer_wgrad_time(
    cfg: GPTConfig, n_op: int, tokens: float | np.ndarray, *, cal: Calibration, hw: Hardware
) -> np.ndarray:
    """GPU seconds of one layer's weight gradients over ``tokens`` tokens on one GPU of an
    ``n_op`` group, computed at once: the four dW = X^T dY products (each reducing over
    all the tokens) and one ``w.grad += dW``. This is the part of :func:`layer_times`'s
    backward a split backward defers to ``W``; over a whole sequence's tokens it is the
    fused ``W``."""
    dw = sum(gemm_time(k, n, tokens, cal=cal, hw=hw) for n, k in _layer_products(cfg.hidden, n_op))
    accumulate = 3 * FP16 * n_params_per_layer(cfg) / n_op / hbm_rate(cal, hw)
    return np.asarray(dw + accumulate, dtype=float)


def embedding_times(
    cfg: GPTConfig, n_op: int, tokens: float, *, cal: Calibration, hw: Hardware
) -> tuple[float, float]:
    """GPU seconds of the embeddings' (forward, backward) for ``tokens`` tokens on one GPU
    of an ``n_op`` group: memory-bound. Forward reads a word row and a position row and
    writes their sum per token (dropout reads and writes it again and writes a mask);
    with #Op > 1 the vocabulary-parallel lookup all-reduces the output. Backward adds the
    output gradient into the word and position gradient rows (read, read, write)."""
    hbm, elems = hbm_rate(cal, hw), tokens * cfg.hidden
    fwd = elems * FP16 * (3 + (DROPOUT_TOKEN_ELEMS / 2 if cfg.dropout else 0)) / hbm
    bwd = elems * FP16 * 2 * 3 / hbm
    if n_op > 1:
        ring = ring_allreduce(FP16 * elems, n_op, nvlink_bus(cal, hw))
        fwd += float(ring) + cal.collective_latency
    return float(fwd), float(bwd)


def head_times(
    cfg: GPTConfig, n_op: int, tokens: float, *, cal: Calibration, hw: Hardware
) -> tuple[float, float]:
    """GPU seconds of the final LayerNorm, LM head and cross-entropy's (forward,
    backward) for ``tokens`` tokens on one GPU of an ``n_op`` group. The head is a
    (tokens x H) @ (H x V / #Op) product (vocabulary-parallel); the loss writes the fp16
    logits, then an fp32 softmax (read 2, write 4, read 4 for the loss: :data:`LOGIT_BYTES`
    per logit), with two small all-reduces per token over #Op. Backward: the two products
    of the head and the softmax gradient (read 4, write 2), and the LayerNorm's."""
    hbm, h = hbm_rate(cal, hw), cfg.hidden
    vocab = -(-cfg.vocab_size // n_op)
    logits = tokens * vocab
    norm = tokens * h * FP16 * 3 / hbm  # LayerNorm: read, write, and the residual read
    fwd = gemm_time(tokens, vocab, h, cal=cal, hw=hw) + logits * LOGIT_BYTES / hbm + norm
    bwd = (
        gemm_time(tokens, h, vocab, cal=cal, hw=hw)
        + gemm_time(h, vocab, tokens, cal=cal, hw=hw)
        + logits * (FP32 + FP16) / hbm
        + 2 * norm
    )
    if n_op > 1:
        small = ring_allreduce(FP32 * tokens, n_op, nvlink_bus(cal, hw))
        fwd = fwd + 2 * (small + cal.collective_latency)
    return float(fwd), float(bwd)
