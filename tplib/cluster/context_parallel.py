"""Context parallelism (#CP): what ring attention costs, for the cluster model.

Megatron-LM's context parallelism with causal load balancing. A slice of l tokens (a
whole sequence, or a token slice after c tokens of context) is cut into 2 #CP chunks
and CP rank r holds chunks r and 2 #CP - 1 - r. A layer's products, element-wise kernels
and #Op collectives then run on l / #CP tokens per rank
(:func:`~tplib.cluster.compute.layer_times` with ``n_cp``); attention needs every
earlier key, so it runs as a ring:

- #CP steps per layer; at each, a rank runs FlashAttention of its queries against the
  K/V block it holds while it sends that block to the next rank of the ring and receives
  the next one (Megatron and TransformerEngine post the exchange before the kernel), so
  #CP - 1 exchanges each hide behind one step's compute. A block is the K and V of a
  rank's share of the context and the slice, 2 x b (c + l) / #CP x H / #Op fp16 values
  (:func:`ring_block_bytes`): earlier slices' keys stay with the rank that computed them.
- The backward passes the K/V blocks round again and the dK/dV blocks with them: twice
  the forward's bytes per exchange, hidden behind the backward's steps.
- Exposed per layer (:func:`ring_exposed`): one exchange's latency to start, then per
  exchange ``max(0, exchange - step)``, forward and backward apart.

Balance. With the mirrored chunks every rank does exactly 1 / #CP of the causal work of
the slice, diagonal included (chunks r and 2 #CP - 1 - r see r m + (2 #CP - 1 - r) m
earlier keys per query, m = l / (2 #CP): the same sum for every r), and every rank sees
all the context. The steps differ only by where the diagonal falls (l / #CP pairs of the
own-block step), which is spread evenly here: each step is 1 / #CP^2 of the slice's
attention on one GPU (:func:`ring_steps`). There is no residual imbalance to model.

Where the ring runs: Megatron's rank order puts a stage's #Op x #CP GPUs together (op
innermost, :func:`~tplib.cluster.layout.gpu_rank`), so the ring's hops are NVLink when
#Op x #CP fits in a node, else some hops cross nodes, each on its GPU's own rail (a
DGX; the p3.16xlarge's one port is shared by the #Op rings): the slowest hop sets the
pace (:meth:`~tplib.cluster.links.LayoutLinks.cp_ring`).

Memory. A rank keeps 1 / #CP of every activation, its own K/V share among them; during a
layer's backward the ring also holds two K/V blocks and two dK/dV blocks in flight
(:func:`ring_buffer_bytes`), once per GPU (one layer at a time).

Only FlashAttention kernels are priced here (``Implementation.attention == "flash"``):
Megatron's context parallelism runs TransformerEngine's fused attention.
"""

from __future__ import annotations

import numpy as np

from tplib.cluster.calibration import Calibration
from tplib.cluster.compute import flash_times
from tplib.cluster.hardware import FP16, Hardware
from tplib.nn.configs import GPTConfig
from tplib.sim.costs import Link

__all__ = [
    "RING_BLOCKS_IN_FLIGHT",
    "ring_block_bytes",
    "ring_buffer_bytes",
    "ring_exposed",
    "ring_steps",
    "ring_times",
]

# Blocks a rank holds besides its own share while a layer's backward runs: the K/V block
# it computes against and the one arriving, and as many dK/dV blocks.
RING_BLOCKS_IN_FLIGHT = 4


def ring_block_bytes(
    cfg: GPTConfig,
    n_op: int,
    n_cp: int,
    batch_slice_size: int,
    length: np.ndarray,
    context: np.ndarray,
) -> np.ndarray:
    """Bytes of one K/V block of one layer a rank passes on: the K and V of its 1 / #CP
    share of the context and the slice, its #Op share of the hidden size, fp16."""
    keys = np.asarray(context, dtype=float) + np.asarray(length, dtype=float)
    return 2 * FP16 * batch_slice_size * keys / n_cp * cfg.hidden / n_op


def ring_buffer_bytes(
    cfg: GPTConfig, n_op: int, n_cp: int, batch_slice_size: int, keys: float
) -> float:
    """Bytes the ring holds in flight during a layer's backward for a unit whose slice ends
    ``keys`` tokens into its sequence; nothing without context parallelism."""
    if n_cp == 1:
        return 0.0
    block = ring_block_bytes(cfg, n_op, n_cp, batch_slice_size, np.array(keys), np.array(0.0))
    return RING_BLOCKS_IN_FLIGHT * float(block)


def ring_steps(
    n_cp: int, attention: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of one ring step's attention, (forward, backward), given the slice's whole
    attention on one GPU of the #Op group without context parallelism: each rank does
    1 / #CP of it, in #CP equal steps."""
    fwd, bwd = attention
    return fwd / n_cp**2, bwd / n_cp**2


def ring_exposed(
    link: Link, n_cp: int, block: np.ndarray, steps: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of one layer's ring exchanges not hidden behind its attention, (forward,
    backward): the first exchange's latency, then each of the #CP - 1 exchanges beyond
    the step it overlaps; the backward's exchanges carry K/V and dK/dV (twice the bytes).
    Nothing with one rank."""
    block = np.asarray(block, dtype=float)
    if n_cp == 1:
        return np.zeros_like(block), np.zeros_like(block)
    fwd_step, bwd_step = steps
    hops = n_cp - 1
    fwd = link.latency + hops * np.maximum(0.0, link.time(block) - fwd_step)
    bwd = link.latency + hops * np.maximum(0.0, link.time(2 * block) - bwd_step)
    return fwd, bwd


def ring_times(
    cfg: GPTConfig,
    n_op: int,
    n_cp: int,
    batch_slice_size: int,
    length: np.ndarray,
    context: np.ndarray,
    link: Link,
    *,
    cal: Calibration,
    hw: Hardware,
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of one layer's ring exchanges its FlashAttention steps do not hide,
    (forward, backward), for a slice of ``length`` tokens after ``context`` on one GPU
    of an ``n_op`` group, over ``link`` (:func:`ring_exposed`)."""
    pairs = batch_slice_size * (cfg.n_head // n_op)
    whole = flash_times(pairs, cfg.head_dim, length, context, cal=cal, hw=hw)
    block = ring_block_bytes(cfg, n_op, n_cp, batch_slice_size, length, context)
    return ring_exposed(link, n_cp, block, ring_steps(n_cp, whole))
