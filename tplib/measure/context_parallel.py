"""The price of a context-parallel run on this machine: one stage on #CP local processes.

With context parallelism (:mod:`tplib.nn.ring`) every CP rank holds the whole model and,
of each unit (b sequences, a token slice of l tokens after c of context), two chunks of
l / (2 #CP) tokens: chunk r after c + r l / (2 #CP) tokens and chunk 2 #CP - 1 - r after
c + (2 #CP - 1 - r) l / (2 #CP). Everything but attention is per token, and attention
over the chunk's own tokens and those before it is exactly what a slice of that length
after that context computes, so rank r's work on the unit is the whole model's profile
t(b, l / (2 #CP), ·) at the two chunks' contexts: the pipeline stages' profiles
(:func:`~tplib.perfmodel.profile_pipeline`) summed, each split into forward and backward
by its own measured forward share.

Beside the work, every layer sends messages round the ring: the forward #CP - 1 shifts
of the rank's K/V block (keys and values of positions ``[0, c + l)``, 1 / #CP of them per
rank), the backward #CP - 1 shifts of that block with its two gradient accumulators and
one more taking the accumulators home. A shift is an exchange, every rank sending and
receiving at once, priced by a :class:`~tplib.sim.costs.Link` measured that way
(:func:`tplib.runtime.measure_link` with ``exchange``): over loopback a shift of 8 MB,
fresh blocks into new memory, takes several times the one-way time of the ping-pong's
link. The ring synchronises the
ranks at every layer, so a unit costs what it costs on the slowest rank.

:class:`ContextParallelCosts` prices the actions of the one-stage schedule the runtime
runs (``Parallelism(n_cp=#CP)``, one pipeline stage) for
:func:`tplib.sim.simulate.simulate` and :func:`~tplib.measure.simulate_shared` (with
``processes_per_stage`` #CP): the gradient all-reduce over the #CP ranks and the whole
model's optimizer step beside the units. It prices fp32 runs without recomputation, what
the ring runs on CPU. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tplib.measure.pricing import BYTES_PER_ACTIVATION
from tplib.nn.configs import GPTConfig, check_cp_length, stage_params
from tplib.perfmodel import Profile
from tplib.plan import Plan
from tplib.schedule import Action, Kind
from tplib.sim.costs import Link, memo, ring_allreduce, unit_shape

__all__ = ["ContextParallelCosts", "context_parallel_costs"]


@dataclass(frozen=True)
class ContextParallelCosts:
    """:class:`~tplib.sim.costs.ActionCosts` of a one-stage run on ``n_cp`` CP ranks.

    ``profiles``: the model's pipeline stages in order, layers 0 to ``n_layer`` (summed,
    the whole model); ``link``: the ring's exchanges; ``t_allreduce``: the gradient
    all-reduce over the #CP ranks; ``t_optimizer``: the whole model's optimizer step.
    See the module docstring."""

    profiles: tuple[Profile, ...]
    link: Link
    n_cp: int
    t_allreduce: float = 0.0
    t_optimizer: float = 0.0
    blocking_sends: bool = False

    @property
    def config(self) -> GPTConfig:
        return self.profiles[0].config

    def chunks(self, length: int, context: int) -> list[tuple[int, int]]:
        """(length, context) of every CP rank's two chunks of a unit: rank r's are
        entries 2r and 2r + 1."""
        check_cp_length(length, self.n_cp, "a token slice")
        n, c = self.n_cp, length // (2 * self.n_cp)
        return [(c, context + i * c) for r in range(n) for i in (r, 2 * n - 1 - r)]

    @memo
    def rank_work(self, forward: bool, size: int, length: int, context: int) -> tuple[float, ...]:
        """Each CP rank's forward (or backward) compute on the unit: its two chunks'
        profile times, without the ring."""
        pairs = self.chunks(length, context)
        lengths = np.array([p[0] for p in pairs])
        contexts = np.array([p[1] for p in pairs])
        total = np.zeros(len(pairs))
        for prof in self.profiles:
            share = prof.fwd_fraction if forward else 1.0 - prof.fwd_fraction
            total += share * np.asarray(prof.compute_time(size, lengths, contexts), float)
        return tuple(float(a + b) for a, b in zip(total[::2], total[1::2], strict=True))

    def ring_time(self, forward: bool, size: int, length: int, context: int) -> float:
        """Seconds of the ring's messages of the unit, every layer's: forward #CP - 1
        shifts of the K/V block, backward #CP - 1 of the block with its gradient
        accumulators and one of the accumulators alone."""
        n = self.n_cp
        if n == 1:
            return 0.0
        cfg = self.config
        # Keys or values of one rank's slots of positions [0, c + l), float32.
        tensor = size * (context + length) // n * cfg.hidden * BYTES_PER_ACTIVATION
        if forward:
            per_layer = (n - 1) * self.link.time(2 * tensor)
        else:
            per_layer = (n - 1) * self.link.time(4 * tensor) + self.link.time(2 * tensor)
        return cfg.n_layer * float(per_layer)

    def unit_time(self, forward: bool, size: int, length: int, context: int) -> float:
        """The unit's forward (or backward) on the slowest CP rank, with its ring."""
        work = max(self.rank_work(forward, size, length, context))
        return work + self.ring_time(forward, size, length, context)

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        if stage != 0:
            raise ValueError(
                f"stage {stage}: ContextParallelCosts prices a one-stage run (stage 0)"
            )
        return self.unit_time(action.kind is Kind.F, *unit_shape(plan, action))

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return 0.0  # one stage: nothing to send between stages

    def allreduce(self, stage: int) -> float:
        return self.t_allreduce

    def optimizer(self, stage: int) -> float:
        return self.t_optimizer


def context_parallel_costs(
    profiles: Sequence[Profile], link: Link, n_cp: int
) -> ContextParallelCosts:
    """The costs of a one-stage run of the model that ``profiles`` (its pipeline stages,
    from :func:`~tplib.perfmodel.profile_pipeline`) describe, on ``n_cp`` CP ranks whose
    exchanges take ``link`` (``measure_link(exchange=True)``): the all-reduce is the whole
    model's gradient, float32, as a ring of such exchanges over the #CP ranks; the
    optimizer step the stages' measured steps summed."""
    if n_cp < 1:
        raise ValueError(f"n_cp={n_cp} must be at least 1")
    if not profiles:
        raise ValueError("context_parallel_costs needs the profiles of the model's stages")
    if not (link.bandwidth > 0 and link.latency >= 0 and np.isfinite(link).all()):
        raise ValueError(f"link={link}: need a positive bandwidth and a non-negative latency")
    cfg, edge = profiles[0].config, 0
    for k, prof in enumerate(profiles):
        if prof.stage is None or prof.stage[0] != edge or prof.config != cfg:
            raise ValueError(
                f"profile {k} is not the pipeline stage starting at layer {edge} of "
                f"{cfg.name}: give the stages' profiles in order (profile_pipeline)"
            )
        if prof.precision != "fp32":
            raise ValueError(
                f"profile {k} timed precision {prof.precision!r}: the ring is priced for "
                "fp32 runs, what it runs on CPU"
            )
        edge = prof.stage[1]
    if edge != cfg.n_layer:
        raise ValueError(f"the profiles cover layers [0, {edge}) of {cfg.n_layer}: give them all")
    grads = stage_params(cfg, 0, cfg.n_layer) * BYTES_PER_ACTIVATION
    t_allreduce = float(ring_allreduce(grads, n_cp, link.bandwidth, link.latency))
    return ContextParallelCosts(
        tuple(profiles),
        link,
        n_cp,
        t_allreduce,
        sum(p.optimizer_time for p in profiles),
    )
