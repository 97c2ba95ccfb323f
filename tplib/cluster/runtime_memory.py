"""Peak memory per rank of tplib's own runtime: what its layers keep for backward.

The cluster model's accounting (:mod:`tplib.cluster.memory`) applied to tplib's runtime,
rank by rank: what each of its layers keeps for backward (:class:`Inventory`: fused
attention keeps no scores, only a log-sum-exp per head), which units are alive at once
under the schedule (replayed from its actions by
:func:`~tplib.cluster.memory.peak_in_flight`, so 1F1B's bounded in-flight units show),
full recomputation (each unit keeps only its input; one unit's activations are rebuilt
at a time inside its backward), selective recomputation (no attention scores nor
log-sum-exp kept; one layer's attention core rebuilt at a time inside a backward,
:mod:`tplib.nn.selective`), the precision's bytes per parameter, and the K/V context
buffers. The runtime measures the same quantities (:mod:`tplib.runtime.memory`); the
test suite holds the two within 10%.

Sequence parallelism (``sequence_parallel``, :mod:`tplib.nn.oppart`) keeps 1/#Op of what
lies between the tensor-parallel products on each rank: the LayerNorms' inputs and
statistics, the dropout masks of the residual stream, a stage's input and output. The
products' inputs are all-gathered and kept whole, as tplib's runtime keeps them (it does
not all-gather them again in backward, as Megatron-LM does).

With Megatron's distributed optimizer (:mod:`tplib.nn.sharded_optimizer`,
``optimizer_shards`` = #Data) a rank keeps every weight and gradient of its stage but
Adam's m and v (fp16: and the fp32 master weight) of its 1/#Data shard only, and a step
counter per piece of a parameter in its shard; the flat buffers' padding (fewer than #Data
elements) is left out.

With virtual stages a rank holds several chunks (:func:`rank_memory`): each keeps its
own layers' weights, states and K/V contexts, and a unit in flight on a chunk keeps that
chunk's activations, from the chunk's forward to its backward; the rank's peak is of
their sum over its actions. :func:`stage_memory` is the one-chunk case.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tplib.cluster.hardware import FP16, FP32
from tplib.cluster.memory import MemoryEstimate, peak_in_flight
from tplib.nn.configs import GPTConfig, check_recompute, stage_params
from tplib.plan import Plan, Unit
from tplib.schedule import Action, Kind

__all__ = ["ADAM_STEP_BYTES", "PARAM_TENSORS_PER_LAYER", "Inventory", "rank_memory", "stage_memory"]

# tplib's runtime, bytes per parameter: weight, gradient (kept allocated between steps),
# Adam's m and v. fp16: an fp16 weight, its gradient accumulated in an fp32 main grad that
# is also the master gradient (tplib.nn.optimizer), the fp32 master weight, Adam's m and v.
_RUNTIME_STATE_BYTES = {
    "fp32": FP32 + FP32 + FP32 + FP32,
    "bf16": FP32 + FP32 + FP32 + FP32,  # autocast: parameters stay fp32
    "fp16": FP16 + FP32 + FP32 + FP32 + FP32,
}
# What the distributed optimizer shards over #Data, of the above: Adam's m and v, and
# fp16's master weight.
_SHARDED_STATE_BYTES = {"fp32": FP32 + FP32, "bf16": FP32 + FP32, "fp16": FP32 + FP32 + FP32}
ADAM_STEP_BYTES = FP32  # torch's AdamW keeps a float32 step counter per parameter tensor
PARAM_TENSORS_PER_LAYER = 12  # 2 LayerNorms, QKV, projection, FC1, FC2: weight and bias each


@dataclass(frozen=True)
class Inventory:
    """What one transformer layer keeps for backward, in bytes per token.

    ``replicated``/``partitioned``: bytes per hidden element of the tensors kept whole on
    every op rank / split over #Op; ``norm_stats``: LayerNorm statistics; ``per_head``:
    per attention head of this rank; ``hidden``: bytes of a residual-stream element (what
    a stage receives and sends); ``weight_copy``: bytes per product weight of a cast
    copy kept for backward (autocast), once per iteration.
    """

    replicated: float
    partitioned: float
    norm_stats: float
    per_head: float
    hidden: int
    weight_copy: float = 0.0


def _runtime_inventory(precision: str = "fp32") -> Inventory:
    """tplib's block (:mod:`tplib.nn.model`) as autograd sees it. Replicated: LN1's input and
    output, LN2's input and output. Partitioned: the QKV product (q, k and v are views of
    it), the attention output (the output projection reads a view of it), FC1's output
    (GELU's input, 4H) and GELU's output (4H). Statistics: mean and 1/std of two
    LayerNorms in fp32; per head: the attention's fp32 log-sum-exp. Row-parallel
    products, residual adds and the #Op collectives keep nothing.

    Under bf16 autocast the residual stream and the LayerNorms stay fp32 and their
    outputs are kept as the bf16 copies the products read; the products' outputs are
    bf16; and each product weight's bf16 copy is kept (cached once per iteration)."""
    if precision == "fp32":
        return Inventory(4 * FP32, 12 * FP32, 2 * 2 * FP32, FP32, FP32)
    if precision == "fp16":
        return Inventory(4 * FP16, 12 * FP16, 2 * 2 * FP32, FP32, FP16)
    return Inventory(2 * FP32 + 2 * FP16, 12 * FP16, 2 * 2 * FP32, FP32, FP32, FP16)


@dataclass(frozen=True)
class _ChunkBytes:
    """One chunk's bytes: per unit kept to its backward (and, with recomputation, rebuilt
    in it; under split backwards, deferred to its W), and its static weights, states and
    K/V contexts."""

    kept: Callable[[Unit], float]
    rebuilt: Callable[[Unit], float] | None
    deferred: Callable[[Unit], float] | None
    weight_copies: float
    states: float
    contexts: float


def _chunk_bytes(
    cfg: GPTConfig,
    lo: int,
    hi: int,
    *,
    plan: Plan,
    n_op: int,
    recompute: str,
    precision: str,
    split_backward: bool,
    sequence_parallel: bool = False,
    optimizer_shards: int = 1,
) -> _ChunkBytes:
    """What layers ``[lo, hi)`` of one rank keep, per unit and in all."""
    inv = _runtime_inventory(precision)
    h, e = cfg.hidden, inv.hidden
    # The residual stream's share of a slice's tokens on this rank; the LayerNorms keep
    # their inputs (residual-stream elements), the products what they read.
    s = n_op if sequence_parallel else 1
    ln_inputs = 2 * e
    first, last = lo == 0, hi == cfg.n_layer
    vocab_rows = -(-cfg.vocab_size // n_op)
    heads = cfg.n_head / n_op
    # With dropout (tplib.nn.dropout) attention is written out: no log-sum-exp, but per
    # score the fp32 softmax, the 1-byte mask and the dropped probabilities; and a 1-byte
    # mask per hidden element of each residual branch (and of the embeddings).
    dropout = cfg.dropout > 0
    per_head = 0.0 if dropout else inv.per_head
    score_bytes = (FP32 + 1 + (FP32 if precision == "fp32" else FP16)) if dropout else 0.0
    per_token_layer = (
        ln_inputs * h / s
        + (inv.replicated - ln_inputs) * h
        + inv.partitioned * h / n_op
        + inv.norm_stats / s
        + per_head * heads
    ) + (2 * h / s if dropout else 0)
    # Beyond the layers: a middle chunk's output waits for its backward; the last keeps
    # ln_f's input, the head's input (its copy under autocast), ln_f's statistics and the
    # cross-entropy's fp32 softmax.
    head_input = FP16 if precision == "bf16" else e
    # (Under sequence parallelism ln_f's input and statistics are the shard's, the
    # head's input the gathered slice.)
    output = h * e / s
    extra = (e * h + 2 * FP32) / s + head_input * h + vocab_rows * FP32 if last else output
    extra += h / s if dropout and first else 0
    per_token = (hi - lo) * per_token_layer + extra
    own_input = 0.0 if first else h * e / s  # counted in the layers: LN1 keeps it

    def tokens(u: Unit) -> int:
        return plan.batch_slices[u.b] * plan.token_slices[u.b][u.t]

    def scores(u: Unit) -> float:  # the unit's kept attention scores, all its layers
        length, end = plan.token_slices[u.b][u.t], plan.token_offset(u.b, u.t)
        end += length
        return (hi - lo) * heads * plan.batch_slices[u.b] * length * end * score_bytes

    def kept(u: Unit) -> float:
        return tokens(u) * per_token + scores(u)

    # Selective recomputation keeps each core's inputs (views of the QKV product, or the
    # contexts) and nothing the core saves: no scores, no log-sum-exp. Inside a layer's
    # backward the core saves them again: its scores written out, or the fused kernel's
    # new output and log-sum-exp; one layer of one unit at a time.
    core = (hi - lo) * per_head * heads
    fused_core = 0.0 if dropout else inv.partitioned / 12 * h / n_op + inv.per_head * heads

    # Split backwards keep each product's input and output gradient from B to W: per
    # layer the inputs of QKV, FC1 (h each), the projection (h / #Op) and FC2 (4h / #Op),
    # and the gradients of their outputs (3h / #Op, 4h / #Op, h, h); the head's too.
    wgrad = e if precision == "fp32" else FP16
    per_token_deferred = (hi - lo) * (4 * h + 12 * h / n_op) * wgrad
    per_token_deferred += (h + vocab_rows) * wgrad if last else 0
    deferred = (lambda u: tokens(u) * per_token_deferred) if split_backward else None
    rebuilt = None
    if recompute == "full":
        rebuilt = lambda u: kept(u) - tokens(u) * (own_input + (0 if last else output))  # noqa: E731
        keeps: Callable[[Unit], float] = lambda u: tokens(u) * own_input  # noqa: E731
    elif recompute == "selective":
        rebuilt = lambda u: scores(u) / (hi - lo) + tokens(u) * fused_core  # noqa: E731
        keeps = lambda u: tokens(u) * (per_token - core)  # noqa: E731
    else:
        keeps = kept
    # The products' weights (and the head, which may be the tied embedding).
    products = (hi - lo) * 12 * h * h // n_op + (vocab_rows * h if last else 0)
    params = stage_params(cfg, lo, hi, n_op=n_op)
    tensors = (hi - lo) * PARAM_TENSORS_PER_LAYER + 2 * first + 3 * last
    tensors -= int(first and last and cfg.tie_embeddings)  # one shared embedding
    sharded = _SHARDED_STATE_BYTES[precision]
    states = params * (_RUNTIME_STATE_BYTES[precision] - sharded + sharded / optimizer_shards)
    states += tensors / optimizer_shards * ADAM_STEP_BYTES
    context_element = FP32 if precision == "fp32" else FP16
    contexts = 4 * (hi - lo) * plan.batch * plan.seq_len * h / n_op * context_element
    return _ChunkBytes(keeps, rebuilt, deferred, inv.weight_copy * products, states, contexts)


def rank_memory(
    cfg: GPTConfig,
    chunks: Sequence[tuple[int, int]],
    *,
    plan: Plan,
    actions: Sequence[Action],
    n_op: int = 1,
    recompute: str = "none",
    precision: str = "fp32",
    capacity: float = float("inf"),
    sequence_parallel: bool = False,
    optimizer_shards: int = 1,
) -> MemoryEstimate:
    """Peak memory of one rank holding the layer ranges ``chunks`` (chunk c's ``[lo,
    hi)``; one range without virtual stages) in tplib's runtime, running ``plan`` in the
    order of its ``actions``, its optimizer state sharded over ``optimizer_shards`` ranks
    (the distributed optimizer's #Data; 1: not sharded). See the module docstring."""
    check_recompute(recompute)
    split = any(a.kind is Kind.W for a in actions)
    parts = [
        _chunk_bytes(
            cfg, lo, hi, plan=plan, n_op=n_op, recompute=recompute, precision=precision,
            split_backward=split, sequence_parallel=sequence_parallel,
            optimizer_shards=optimizer_shards,
        )
        for lo, hi in chunks
    ]  # fmt: skip

    def kept(a: Action) -> float:
        return parts[a.chunk].kept(a.unit)

    def rebuilt(a: Action) -> float:
        of = parts[a.chunk].rebuilt
        return 0.0 if of is None else of(a.unit)

    def deferred(a: Action) -> float:
        of = parts[a.chunk].deferred
        return 0.0 if of is None else of(a.unit)

    acts = peak_in_flight(
        actions,
        kept=kept,
        rebuilt=rebuilt if recompute != "none" else None,
        deferred=deferred if split else None,
    )
    acts += sum(p.weight_copies for p in parts)
    states = sum(p.states for p in parts)
    contexts = sum(p.contexts for p in parts)
    return MemoryEstimate(states, acts, 0.0, capacity, contexts)


def stage_memory(
    cfg: GPTConfig,
    lo: int,
    hi: int,
    *,
    plan: Plan,
    actions: Sequence[Action],
    n_op: int = 1,
    recompute: str = "none",
    precision: str = "fp32",
    capacity: float = float("inf"),
    sequence_parallel: bool = False,
    optimizer_shards: int = 1,
) -> MemoryEstimate:
    """Peak memory of one rank of stage ``[lo, hi)`` (one chunk) in tplib's runtime,
    running ``plan`` in the order of its ``actions``: :func:`rank_memory` of one range."""
    return rank_memory(
        cfg, [(lo, hi)], plan=plan, actions=actions, n_op=n_op, recompute=recompute,
        precision=precision, capacity=capacity, sequence_parallel=sequence_parallel,
        optimizer_shards=optimizer_shards,
    )  # fmt: skip
