"""Peak memory per GPU of a plan on a cluster layout: will it fit in 16 GB?

GPipe and TeraPipe keep the activations of the WHOLE minibatch until the backward (paper
§3.4), beside the weights and the mixed-precision optimizer state. Token slicing changes
only the attention scores kept: a slice of s tokens after c keeps s (c + s) scores per
head, so a sequence sliced s_1..s_M keeps (L^2 + sum s_i^2) / 2 of them, not L^2.
:func:`memory_per_gpu` prices the paper's implementation that way (Megatron, fp16,
attention scores materialised), for the cluster model.

:mod:`tplib.cluster.runtime_memory` applies the same accounting to tplib's own runtime,
with :func:`peak_in_flight`, written here once for both.

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

Context parallelism (``n_cp``, #CP; :mod:`tplib.cluster.context_parallel`): a GPU keeps
1 / #CP of every unit's activations (its K/V share among them) and, while a layer's
backward runs, the ring's blocks in flight (``contexts``); the distributed optimizer
shards over #Data x #CP. With ``n_cp=1`` every estimate is what it was without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tplib.cluster.calibration import CALIBRATION, Calibration
from tplib.cluster.context_parallel import ring_buffer_bytes
from tplib.cluster.hardware import FP16, FP32, P3_16XLARGE, Hardware
from tplib.cluster.implementation import PAPER, Implementation, check_recompute
from tplib.nn.configs import (
    GPTConfig,
    get_config,
    n_params_per_layer,
    padded_vocab,
)
from tplib.plan import Plan, Unit
from tplib.schedule import Action, Kind, Schedule
from tplib.schedule.asynchronous import held_versions
from tplib.schedule.chunks import identity

__all__ = [
    "STATE_BYTES",
    "MemoryEstimate",
    "activation_rates",
    "end_params",
    "logit_bytes",
    "memory_per_gpu",
    "peak_in_flight",
    "schedule_memory_per_gpu",
    "stage_memory_on_cluster",
    "state_bytes",
]

# Weights and optimizer state per parameter in mixed precision: fp16 weights and grads,
# fp32 master weights and grads, Adam's m and v.
STATE_BYTES = FP16 + FP16 + FP32 + FP32 + FP32 + FP32
# Activations kept for the backward per token and hidden element, fp16: (replicated, per
# #Op share). Replicated: LN1 in/out, attention output, LN2 in/out. Shared: Q, K, V, the
# attention context, FC1 out (4H), activation out (4H).
_ACT_ELEMS = (5.0, 12.0)
# Bytes kept per attention score: the paper's fp16 scores and fp32 probabilities;
# Megatron's fused softmax keeps its fp16 output, the dropout mask and the dropped
# probabilities (5, Korthikanti et al. 2022); FlashAttention-2 none (a row statistic).
_SCORE_KEPT = {"unfused": FP16 + FP32, "fused-softmax": 5.0, "flash": 0.0}
_ACT_SCORE_BYTES = _SCORE_KEPT["unfused"]
# What the loss keeps per logit on the last stage with the model's ends: the fp16
# logits and their fp32 softmax.
_LOGIT_KEPT = FP16 + FP32


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU: weights and optimizer state, stored activations, K/V context
    buffers (the ring attention's blocks in flight), reserve."""

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


def activation_rates(
    cfg: GPTConfig, n_op: int, impl: Implementation = PAPER, recompute: str = "none"
) -> tuple[float, float]:
    """Bytes one layer keeps per token (the hidden-size activations, the partitioned ones
    split over #Op, all of them under sequence parallelism) and per attention score
    (token x context position), on one GPU; selective recomputation keeps no score."""
    rep, part = _ACT_ELEMS
    if impl.sequence_parallel:
        rep /= n_op
    kept = 0.0 if recompute == "selective" else _SCORE_KEPT[impl.attention]
    return cfg.hidden * FP16 * (rep + part / n_op), cfg.n_head / n_op * kept


def logit_bytes(cfg: GPTConfig, n_op: int) -> float:
    """Bytes the loss keeps per token on one GPU of the last stage, with the model's ends:
    its vocabulary-parallel share of the fp16 logits and their fp32 softmax."""
    return padded_vocab(cfg.vocab_size, n_op) / n_op * _LOGIT_KEPT


def state_bytes(params: float, impl: Implementation = PAPER, n_data: int = 1) -> float:
    """Bytes of weights and optimizer state for ``params`` parameters: :data:`STATE_BYTES`
    each, or with the distributed optimizer the fp16 weights and gradients and the fp32
    gradients whole and the fp32 master weights and Adam moments over #Data."""
    if not impl.distributed_optimizer:
        return STATE_BYTES * params
    return (FP16 + FP16 + FP32) * params + 3 * FP32 * params / n_data


def memory_per_gpu(
    model: GPTConfig | str,
    *,
    n_stages: int,
    n_op: int,
    plan: Plan,
    calibration: Calibration = CALIBRATION,
    hardware: Hardware = P3_16XLARGE,
    recompute: str = "none",
    implementation: Implementation = PAPER,
    n_data: int = 1,
    n_cp: int = 1,
) -> MemoryEstimate:
    """Memory of one GPU of a stage: mixed-precision states (:func:`state_bytes`) and the
    activations of the whole minibatch (see the module docstring), of the N layers only.
    With ``recompute="full"`` a stage keeps only each unit's input (fp16 hidden states)
    and rebuilds one unit's activations at a time inside its backward. With the
    implementation's ``ends`` the busier of the first stage (the embedding) and the
    last (a copy of it and every unit's logits); with ``layer_checkpoints`` full
    recomputation keeps each layer's input and rebuilds one layer at a time."""
    check_recompute(recompute)
    impl = implementation
    cfg = get_config(model) if isinstance(model, str) else model
    layers_per_stage = cfg.n_layer // n_stages
    params = layers_per_stage * n_params_per_layer(cfg) / n_op
    per_token, score_bytes = activation_rates(cfg, n_op, impl, recompute)
    units = []  # (tokens, attention scores) of each unit on one GPU
    ring = 0.0
    for size, slices in zip(plan.batch_slices, plan.token_slices, strict=True):
        s = np.asarray(slices, dtype=float)
        ends = np.cumsum(s)
        units += [(size * a / n_cp, size * a * c / n_cp) for a, c in zip(s, ends, strict=True)]
        ring = max(ring, ring_buffer_bytes(cfg, n_op, n_cp, size, float(ends[-1])))
    if recompute == "full":
        span = layers_per_stage if impl.layer_checkpoints else 1
        inputs = plan.batch * plan.seq_len * cfg.hidden * FP16 / n_cp * span
        inputs /= n_op if impl.sequence_parallel else 1
        rebuilt = max(layers_per_stage * (t * per_token + sc * score_bytes) for t, sc in units)
        acts = inputs + rebuilt / span
    else:
        acts = layers_per_stage * sum(t * per_token + sc * score_bytes for t, sc in units)
    if not impl.ends:
        states = state_bytes(params, impl, n_data * n_cp)
        return MemoryEstimate(states, acts, calibration.memory_reserve, hardware.gpu_memory, ring)
    logits = plan.batch * plan.seq_len / n_cp * padded_vocab(cfg.vocab_size, n_op) / n_op
    ends_of = identity(n_stages)
    estimates = [
        MemoryEstimate(
            state_bytes(params + end_params(cfg, n_op, k, ends_of), impl, n_data * n_cp),
            acts + (logits * _LOGIT_KEPT if k == n_stages - 1 else 0.0),
            calibration.memory_reserve,
            hardware.gpu_memory,
            ring,
        )
        for k in sorted({0, n_stages - 1})
    ]
    return max(estimates, key=lambda m: m.total)


def end_params(cfg: GPTConfig, n_op: int, stage: int, placement: Sequence[int]) -> float:
    """Parameters the model's ends add to one GPU of ``stage`` (with
    :attr:`~tplib.cluster.implementation.Implementation.ends`): the word embedding on the
    stages of the first and the last part (the head shares it, so the last holds a
    copy), and the positions on the first."""
    words = padded_vocab(cfg.vocab_size, n_op) * cfg.hidden / n_op
    first, last = placement[0], placement[-1]
    return words * ((stage == first) + (stage == last)) + cfg.seq_len * cfg.hidden * (
        stage == first
    )


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
    implementation: Implementation = PAPER,
    n_data: int = 1,
    n_cp: int = 1,
) -> MemoryEstimate:
    """Memory of one GPU of ``stage`` running ``schedule`` in the paper's implementation
    (see the module docstring). ``versions``: the weight versions it holds at once
    (default: :func:`~tplib.schedule.asynchronous.held_versions` of the schedule); each
    beyond the first adds an fp16 copy of the stage's weights. Activations: the most
    bytes kept by units forwarded and not yet backwarded on the stage (with virtual
    stages, on each chunk: its N / (vK) layers); with ``recompute="full"`` a unit keeps
    only its input (fp16 hidden states, once per chunk, or once per layer with the
    implementation's ``layer_checkpoints``) and its activations are rebuilt, one unit
    at a time, inside its backward. With the model's ``ends`` the first and last stages
    also hold the word embedding (the first the positions too) and the last keeps each
    unit's logits until its backward. With ``n_cp`` context-parallel ranks every unit's
    bytes are 1 / #CP and the ring's blocks in flight are added."""
    check_recompute(recompute)
    impl = implementation
    cfg = get_config(model) if isinstance(model, str) else model
    plan = schedule.plan
    params = cfg.n_layer // schedule.n_stages * n_params_per_layer(cfg) / n_op
    last_part = schedule.n_parts - 1
    if impl.ends:
        params += end_params(cfg, n_op, stage, schedule.placement)
    layers = cfg.n_layer // schedule.n_parts  # what one chunk's units keep activations of
    held = held_versions(schedule)[stage] if versions is None else versions
    states = state_bytes(params, impl, n_data * n_cp) + (held - 1) * FP16 * params
    per_token, score_bytes = activation_rates(cfg, n_op, impl, recompute)
    kept_per_logit_token = logit_bytes(cfg, n_op) if impl.ends else 0.0

    def tokens(u: Unit) -> float:  # on one GPU: 1 / #CP of the unit's
        return plan.batch_slices[u.b] * plan.token_slices[u.b][u.t] / n_cp

    def full(u: Unit) -> float:  # everything the unit keeps on the stage's layers
        end = plan.token_offset(u.b, u.t) + plan.token_slices[u.b][u.t]
        return layers * (tokens(u) * per_token + tokens(u) * end * score_bytes)

    def logits(a: Action) -> float:
        return tokens(a.unit) * kept_per_logit_token if schedule.part(a) == last_part else 0.0

    def checkpoint(a: Action) -> float:
        kept = float(tokens(a.unit) * cfg.hidden * FP16)
        kept /= n_op if impl.sequence_parallel else 1
        return kept * (layers if impl.layer_checkpoints else 1) + logits(a)

    actions = schedule.actions[stage]
    if recompute == "full":
        # The backward rebuilds one checkpoint's span at a time: a layer, or the chunk.
        span = layers if impl.layer_checkpoints else 1
        acts = peak_in_flight(actions, kept=checkpoint, rebuilt=lambda a: full(a.unit) / span)
    elif impl.ends:
        acts = peak_in_flight(actions, kept=lambda a: full(a.unit) + logits(a))
    else:
        acts = peak_in_flight(actions, kept=lambda a: full(a.unit))
    ring = max(ring_buffer_bytes(cfg, n_op, n_cp, size, plan.seq_len) for size in plan.batch_slices)
    return MemoryEstimate(states, acts, calibration.memory_reserve, hardware.gpu_memory, ring)


def schedule_memory_per_gpu(
    model: GPTConfig | str,
    schedule: Schedule,
    *,
    n_op: int,
    recompute: str = "none",
    versions: Sequence[int] | None = None,
    calibration: Calibration = CALIBRATION,
    hardware: Hardware = P3_16XLARGE,
    implementation: Implementation = PAPER,
    n_data: int = 1,
    stages: Sequence[int] | None = None,
    n_cp: int = 1,
) -> tuple[MemoryEstimate, int]:
    """The GPU that needs the most memory running ``schedule``, and its stage: the
    largest :func:`stage_memory_on_cluster` over the stages (or over ``stages`` only;
    ``versions``: each stage's held weight versions, when already counted)."""
    held = held_versions(schedule) if versions is None else versions
    which = range(schedule.n_stages) if stages is None else stages
    per_stage = {
        k: stage_memory_on_cluster(
            model,
            schedule,
            k,
            n_op=n_op,
            recompute=recompute,
            versions=held[k],
            calibration=calibration,
            hardware=hardware,
            implementation=implementation,
            n_data=n_data,
            n_cp=n_cp,
        )
        for k in which
    }
    worst = max(per_stage, key=lambda k: per_stage[k].total)
    return per_stage[worst], worst


def peak_in_flight(
    actions: Sequence[Action],
    kept: Callable[[Action], float],
    rebuilt: Callable[[Action], float] | None = None,
    deferred: Callable[[Action], float] | None = None,
) -> float:
    """The most bytes a stage keeps for backward at once under its ``actions``:
    ``kept(f)`` from a unit's forward ``f`` to its backward, plus, with recomputation,
    ``rebuilt(b)`` while its backward ``b`` runs, and under split backwards
    ``deferred(b)`` from its ``B`` to the ``W`` that computes its weight gradients. Each
    is asked of the action, which names the unit and, with virtual stages, the chunk:
    a unit is held on each chunk apart, each time the bytes of that chunk's layers."""
    alive: dict[tuple[Unit, int], float] = {}
    waiting: dict[tuple[Unit, int], float] = {}
    peak = 0.0
    for action in actions:
        key = (action.unit, action.chunk)
        if action.kind is Kind.F:
            alive[key] = kept(action)
            peak = max(peak, sum(alive.values()) + sum(waiting.values()))
        elif action.kind is Kind.B:
            held = sum(alive.values()) + sum(waiting.values())
            if rebuilt is not None:
                peak = max(peak, held + rebuilt(action))
            alive.pop(key, None)
            if deferred is not None:
                waiting[key] = deferred(action)
                peak = max(peak, sum(alive.values()) + sum(waiting.values()))
        elif action.kind is Kind.W:
            for u, c in [k for k in waiting if k[0].b == action.b and k[1] == action.chunk]:
                if action.whole_sequence or u.t == action.t:
                    del waiting[u, c]
    return peak
