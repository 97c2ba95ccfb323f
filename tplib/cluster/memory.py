"""Peak memory per GPU of a plan on a cluster layout: will it fit in 16 GB?

GPipe and TeraPipe keep the activations of the WHOLE minibatch until the backward (paper
§3.4), beside the weights and the mixed-precision optimizer state. Token slicing changes
only the attention scores kept: a slice of s tokens after c keeps s (c + s) scores per
head, so a sequence sliced s_1..s_M keeps (L^2 + sum s_i^2) / 2 of them, not L^2.
:func:`memory_per_gpu` prices the paper's implementation that way (Megatron, fp16,
attention scores materialised), for the cluster model.

:func:`stage_memory` applies the same accounting to tplib's own runtime, stage by stage:
what each of its layers keeps for backward (:class:`Inventory`: fused attention keeps
no scores, only a log-sum-exp per head), which units are alive at once under the
schedule (replayed from its actions, so 1F1B's bounded in-flight units show), full
recomputation (each unit keeps only its input; one unit's activations are rebuilt at a
time inside its backward), the precision's bytes per parameter, and the K/V context
buffers. The runtime measures the same quantities (:mod:`tplib.runtime.memory`); the
test suite holds the two within 10%.

:func:`schedule_memory_per_gpu` prices any schedule on the cluster, synchronous or not
(PipeDream, PipeDream-2BW; PipeDream-2BW paper §3.1 and §4.2.2): a stage holds
``held_versions`` weight versions (:func:`tplib.schedule.asynchronous.held_versions`),
each an extra fp16 copy of its weights while the master weights, gradients and Adam
state stay single; and it keeps the activations of the units in flight at its peak, a
maximum over the schedule (:func:`peak_in_flight`) rather than the whole minibatch. For
a fill-drain schedule that is :func:`memory_per_gpu` again.

Virtual stages. With v chunks per stage a unit is in flight on each chunk separately,
from the chunk's forward to its backward, and keeps that chunk's N / (vK) layers'
activations. Interleaved 1F1B holds more chunk-units than 1F1B holds units (stage 0:
vK + K - 1 at its peak against K) but each is 1/v of a stage: 1 + (K - 1) / (vK) times
1F1B's activations, Megatron's figure, read off the schedule rather than assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tplib.cluster.calibration import CALIBRATION, Calibration
from tplib.cluster.hardware import FP16, FP32, P3_16XLARGE, Hardware
from tplib.nn.configs import (
    GPTConfig,
    check_recompute,
    get_config,
    n_params_per_layer,
    stage_params,
)
from tplib.plan import Plan, Unit
from tplib.schedule import Action, Kind, Schedule
from tplib.schedule.asynchronous import held_versions

__all__ = [
    "STATE_BYTES",
    "Inventory",
    "MemoryEstimate",
    "activation_rates",
    "memory_per_gpu",
    "peak_in_flight",
    "schedule_memory_per_gpu",
    "stage_memory",
    "stage_memory_on_cluster",
]

# Weights and optimizer state per parameter in mixed precision: fp16 weights and grads,
# fp32 master weights and grads, Adam's m and v.
STATE_BYTES = FP16 + FP16 + FP32 + FP32 + FP32 + FP32
# Activations kept for the backward per token and hidden element, fp16: (replicated, per
# #Op share). Replicated: LN1 in/out, attention output, LN2 in/out. Shared: Q, K, V, the
# attention context, FC1 out (4H), activation out (4H).
_ACT_ELEMS = (5.0, 12.0)
_ACT_SCORE_BYTES = FP16 + FP32  # attention scores (fp16) and probabilities (fp32)


# tplib's runtime, bytes per parameter: weight, gradient (kept allocated between steps),
# Adam's m and v. fp16: an fp16 weight, its gradient accumulated in an fp32 main grad that
# is also the master gradient (tplib.nn.optimizer), the fp32 master weight, Adam's m and v.
_RUNTIME_STATE_BYTES = {
    "fp32": FP32 + FP32 + FP32 + FP32,
    "bf16": FP32 + FP32 + FP32 + FP32,  # autocast: parameters stay fp32
    "fp16": FP16 + FP32 + FP32 + FP32 + FP32,
}
ADAM_STEP_BYTES = FP32  # torch's AdamW keeps a float32 step counter per parameter tensor
PARAM_TENSORS_PER_LAYER = 12  # 2 LayerNorms, QKV, projection, FC1, FC2: weight and bias each


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU: weights and optimizer state, stored activations, K/V context
    buffers, reserve."""

    states: float
    activations: float
    reserve: float
    capacity: float
    contexts: float = 0.0

    @property
    def total(self) -> float:
        return self.states + self.activations + self.contexts + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def __str__(self) -> str:
        gib = 2**30
        return (
            f"{self.total / gib:.1f} GiB of {self.capacity / gib:.0f} GiB "
            f"(states {self.states / gib:.1f}, activations {self.activations / gib:.1f}, "
            f"reserve {self.reserve / gib:.1f}): {'fits' if self.fits else 'does NOT fit'}"
        )


def activation_rates(cfg: GPTConfig, n_op: int) -> tuple[float, float]:
    """Bytes one layer keeps per token (the hidden-size activations, the partitioned ones
    split over #Op) and per attention score (token x context position), on one GPU."""
    rep, part = _ACT_ELEMS
    return cfg.hidden * FP16 * (rep + part / n_op), cfg.n_head / n_op * _ACT_SCORE_BYTES


def memory_per_gpu(
    model: GPTConfig | str,
    *,
    n_stages: int,
    n_op: int,
    plan: Plan,
    calibration: Calibration = CALIBRATION,
    hardware: Hardware = P3_16XLARGE,
    recompute: str = "none",
) -> MemoryEstimate:
    """Memory of one GPU of a stage: mixed-precision states (:data:`STATE_BYTES` per
    parameter) and the activations of the whole minibatch (see the module docstring).
    With ``recompute="full"`` a stage keeps only each unit's input (fp16 hidden states)
    and rebuilds one unit's activations at a time inside its backward."""
    cfg = get_config(model) if isinstance(model, str) else model
    layers_per_stage = cfg.n_layer // n_stages
    states = STATE_BYTES * layers_per_stage * n_params_per_layer(cfg) / n_op
    per_token, score_bytes = activation_rates(cfg, n_op)
    units = []  # (tokens, attention scores) of each unit
    for size, slices in zip(plan.batch_slices, plan.token_slices, strict=True):
        s = np.asarray(slices, dtype=float)
        units += [(size * a, size * a * c) for a, c in zip(s, np.cumsum(s), strict=True)]
    if recompute == "full":
        inputs = plan.batch * plan.seq_len * cfg.hidden * FP16
        rebuilt = max(layers_per_stage * (t * per_token + sc * score_bytes) for t, sc in units)
        acts = inputs + rebuilt
    else:
        acts = layers_per_stage * sum(t * per_token + sc * score_bytes for t, sc in units)
    return MemoryEstimate(states, acts, calibration.memory_reserve, hardware.gpu_memory)


def stage_memory_on_cluster(
    model: GPTConfig | str,
    schedule: Schedule,
    stage: int,
    *,
    n_op: int,
    recompute: str = "none",
    versions: int | None = None,
    calibration: Calibration = CALIBRATION,
    hardware: Hardware = P3_16XLARGE,
) -> MemoryEstimate:
    """Memory of one GPU of ``stage`` running ``schedule`` in the paper's implementation
    (see the module docstring). ``versions``: the weight versions it holds at once
    (default: :func:`~tplib.schedule.asynchronous.held_versions` of the schedule); each
    beyond the first adds an fp16 copy of the stage's weights. Activations: the most
    bytes kept by units forwarded and not yet backwarded on the stage (with virtual
    stages, on each chunk: its N / (vK) layers); with ``recompute="full"`` a unit keeps
    only its input (fp16 hidden states, once per chunk) and its activations are
    rebuilt, one unit at a time, inside its backward."""
    check_recompute(recompute)
    cfg = get_config(model) if isinstance(model, str) else model
    plan = schedule.plan
    params = cfg.n_layer // schedule.n_stages * n_params_per_layer(cfg) / n_op
    layers = cfg.n_layer // schedule.n_parts  # what one chunk's units keep activations of
    held = held_versions(schedule)[stage] if versions is None else versions
    states = STATE_BYTES * params + (held - 1) * FP16 * params
    per_token, score_bytes = activation_rates(cfg, n_op)

    def tokens(u: Unit) -> int:
        return plan.batch_slices[u.b] * plan.token_slices[u.b][u.t]

    def full(u: Unit) -> float:  # everything the unit keeps on the stage's layers
        end = plan.token_offset(u.b, u.t) + plan.token_slices[u.b][u.t]
        return layers * (tokens(u) * per_token + tokens(u) * end * score_bytes)

    actions = schedule.actions[stage]
    if recompute == "full":
        acts = peak_in_flight(actions, kept=lambda u: tokens(u) * cfg.hidden * FP16, rebuilt=full)
    else:
        acts = peak_in_flight(actions, kept=full)
    return MemoryEstimate(states, acts, calibration.memory_reserve, hardware.gpu_memory)


def schedule_memory_per_gpu(
    model: GPTConfig | str,
    schedule: Schedule,
    *,
    n_op: int,
    recompute: str = "none",
    versions: Sequence[int] | None = None,
    calibration: Calibration = CALIBRATION,
    hardware: Hardware = P3_16XLARGE,
) -> tuple[MemoryEstimate, int]:
    """The GPU that needs the most memory running ``schedule``, and its stage: the
    largest :func:`stage_memory_on_cluster` over the stages (``versions``: each stage's
    held weight versions, when already counted)."""
    held = held_versions(schedule) if versions is None else versions
    per_stage = [
        stage_memory_on_cluster(
            model,
            schedule,
            k,
            n_op=n_op,
            recompute=recompute,
            versions=held[k],
            calibration=calibration,
            hardware=hardware,
        )
        for k in range(schedule.n_stages)
    ]
    worst = max(range(len(per_stage)), key=lambda k: per_stage[k].total)
    return per_stage[worst], worst


# ---- tplib's runtime, stage by stage -------------------------------------------------------


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


def peak_in_flight(
    actions: Sequence[Action],
    kept: Callable[[Unit], float],
    rebuilt: Callable[[Unit], float] | None = None,
    deferred: Callable[[Unit], float] | None = None,
) -> float:
    """The most bytes a stage keeps for backward at once under its ``actions``: ``kept(u)``
    from unit u's forward to its backward, plus, with recomputation, ``rebuilt(u)``
    while u's backward runs, and under split backwards ``deferred(u)`` from u's ``B`` to
    the ``W`` that computes its weight gradients. With virtual stages a unit is held on
    each chunk apart, each time ``kept(u)``: the bytes of one chunk's layers."""
    alive: dict[tuple[Unit, int], float] = {}
    waiting: dict[tuple[Unit, int], float] = {}
    peak = 0.0
    for action in actions:
        key = (action.unit, action.chunk)
        if action.kind is Kind.F:
            alive[key] = kept(action.unit)
            peak = max(peak, sum(alive.values()) + sum(waiting.values()))
        elif action.kind is Kind.B:
            held = sum(alive.values()) + sum(waiting.values())
            if rebuilt is not None:
                peak = max(peak, held + rebuilt(action.unit))
            alive.pop(key, None)
            if deferred is not None:
                waiting[key] = deferred(action.unit)
                peak = max(peak, sum(alive.values()) + sum(waiting.values()))
        elif action.kind is Kind.W:
            for u, c in [k for k in waiting if k[0].b == action.b and k[1] == action.chunk]:
                if action.whole_sequence or u.t == action.t:
                    del waiting[u, c]
    return peak


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
) -> MemoryEstimate:
    """Peak memory of one rank of stage ``[lo, hi)`` in tplib's runtime, running ``plan``
    in the order of its ``actions`` (see the module docstring)."""
    inv = _runtime_inventory(precision)
    h, e = cfg.hidden, inv.hidden
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
        inv.replicated * h + inv.partitioned * h / n_op + inv.norm_stats + per_head * heads
    ) + (2 * h if dropout else 0)
    # Beyond the layers: a middle stage's output waits for its backward; the last keeps
    # ln_f's input, the head's input (its copy under autocast), ln_f's statistics and the
    # cross-entropy's fp32 softmax.
    head_input = FP16 if precision == "bf16" else e
    extra = (e + head_input) * h + 2 * FP32 + vocab_rows * FP32 if last else h * e
    extra += h if dropout and first else 0
    per_token = (hi - lo) * per_token_layer + extra
    own_input = 0.0 if first else h * e  # counted in the layers: LN1 keeps it

    def tokens(u: Unit) -> int:
        return plan.batch_slices[u.b] * plan.token_slices[u.b][u.t]

    def scores(u: Unit) -> float:  # the unit's kept attention scores, all its layers
        length, end = plan.token_slices[u.b][u.t], plan.token_offset(u.b, u.t)
        end += length
        return (hi - lo) * heads * plan.batch_slices[u.b] * length * end * score_bytes

    def kept(u: Unit) -> float:
        return tokens(u) * per_token + scores(u)

    # Split backwards keep each product's input and output gradient from B to W: per
    # layer the inputs of QKV, FC1 (h each), the projection (h / #Op) and FC2 (4h / #Op),
    # and the gradients of their outputs (3h / #Op, 4h / #Op, h, h); the head's too.
    wgrad = e if precision == "fp32" else FP16
    per_token_deferred = (hi - lo) * (4 * h + 12 * h / n_op) * wgrad
    per_token_deferred += (h + vocab_rows) * wgrad if last else 0
    deferred = None
    if any(a.kind is Kind.W for a in actions):
        deferred = lambda u: tokens(u) * per_token_deferred  # noqa: E731
    if recompute == "full":
        acts = peak_in_flight(
            actions,
            kept=lambda u: tokens(u) * own_input,
            rebuilt=lambda u: kept(u) - tokens(u) * (own_input + (0 if last else h * e)),
            deferred=deferred,
        )
    else:
        acts = peak_in_flight(actions, kept=kept, deferred=deferred)
    # The products' weights (and the head, which may be the tied embedding).
    products = (hi - lo) * 12 * h * h // n_op + (vocab_rows * h if last else 0)
    acts += inv.weight_copy * products
    params = stage_params(cfg, lo, hi, n_op=n_op)
    tensors = (hi - lo) * PARAM_TENSORS_PER_LAYER + 2 * first + 3 * last
    tensors -= int(first and last and cfg.tie_embeddings)  # one shared embedding
    states = params * _RUNTIME_STATE_BYTES[precision] + tensors * ADAM_STEP_BYTES
    context_element = FP32 if precision == "fp32" else FP16
    contexts = 4 * (hi - lo) * plan.batch * plan.seq_len * h / n_op * context_element
    return MemoryEstimate(states, acts, 0.0, capacity, contexts)
