"""Costs of a pipeline on this machine, from measurements: the simulator's
:class:`LocalCosts` and the planner's :class:`BottleneckCost`.

Both are built from one :class:`~tplib.perfmodel.Profile` per pipeline stage (timed as
that stage, embeddings on the first and LM head and loss on the last, with the threads
each local process gets) and the :class:`~tplib.sim.costs.Link` between two local processes
measured by ping-pong. Nothing here imports torch: the costs are plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tplib.nn.configs import stage_params
from tplib.perfmodel import Profile
from tplib.plan import Plan
from tplib.schedule import SENDS, Action, Kind, covered_slices
from tplib.schedule.chunks import Placement
from tplib.sim.costs import Link, Parts, memo, ring_allreduce, unit_shape

__all__ = ["BYTES_PER_ACTIVATION", "BottleneckCost", "LocalCosts", "local_costs"]

BYTES_PER_ACTIVATION = 4  # the runtime sends float32 activations and gradients


@dataclass(frozen=True)
class LocalCosts:
    """:class:`~tplib.sim.costs.ActionCosts` of a pipeline on this machine.

    ``compute``: stage k's profile, t(b, l, c) without communication, split into forward
    and backward by the stage's measured forward share; ``weight_grad`` (the ``W`` of a
    split backward), the stage's measured weight-gradient share. ``transfer``: a send
    occupies the link for its one-way time; a posted receive costs its stage nothing
    beyond waiting, since the copy out of the socket is part of that one-way time.
    ``allreduce`` / ``optimizer``: per stage, see :func:`local_costs`.

    With virtual stages (:meth:`placed`, ``n_chunks`` v) a chunk's forward, backward and
    ``W`` take 1/v of its stage's profile: the profiles were timed on whole stages, so a
    stage's embeddings or head are spread over its chunks, an approximation until chunks
    are profiled on their own. Every pair of local processes shares the one measured
    link, so a message costs the same whichever rank it goes to (across the wrap too).
    """

    profiles: tuple[Profile, ...]
    link: Link
    t_allreduce: tuple[float, ...]
    t_optimizer: tuple[float, ...]
    blocking_sends: bool = False
    n_chunks: int = 1

    def placed(self, placement: Placement) -> LocalCosts:
        """These costs for a schedule of ``placement`` on the profiled stages."""
        parts = Parts(placement)
        if parts.n_stages != len(self.profiles):
            raise ValueError(
                f"placement {parts.placement} spreads the model over {parts.n_stages} "
                f"stages, but these costs have profiles of {len(self.profiles)}"
            )
        return replace(self, n_chunks=parts.n_chunks)

    @memo
    def _slice(self, stage: int, size: int, length: int, context: int) -> float:
        value = self.profiles[stage].compute_time(size, np.array([length]), np.array([context]))
        return float(np.asarray(value).reshape(-1)[0])

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        share = self.profiles[stage].fwd_fraction
        share = share if action.kind is Kind.F else 1.0 - share
        return share * self._slice(stage, *unit_shape(plan, action)) / self.n_chunks

    def weight_grad(self, stage: int, action: Action, plan: Plan) -> float:
        """A ``W``: the profile's measured weight-gradient share of the unit's tokens, or
        of the whole sequence's at once."""
        ts = plan.token_slices[action.b]
        length = sum(ts[t] for t in covered_slices(plan, action.b, action.t))
        return self._wgrad(stage, plan.batch_slices[action.b], length) / self.n_chunks

    @memo
    def _wgrad(self, stage: int, size: int, length: int) -> float:
        value = self.profiles[stage].wgrad_time(size, np.array([length]))
        return float(np.asarray(value).reshape(-1)[0])

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        if action.kind not in SENDS:
            return 0.0
        hidden = self.profiles[stage].config.hidden
        size, length, _ = unit_shape(plan, action)
        return self.link.time(size * length * hidden * BYTES_PER_ACTIVATION)

    def allreduce(self, stage: int) -> float:
        return self.t_allreduce[stage]

    def optimizer(self, stage: int) -> float:
        return self.t_optimizer[stage]


def local_costs(profiles: Sequence[Profile], link: Link, n_data: int = 1) -> LocalCosts:
    """The simulator's costs for the pipeline whose stages ``profiles`` describe (one per
    stage, from :func:`~tplib.perfmodel.profile_pipeline`), over ``link``.

    The all-reduce of stage k is what the runtime's ``AR`` does: the tied embedding's
    gradient between the first and the last stage (when they differ), plus, with
    ``n_data`` > 1, the stage's whole gradient across replicas, both as ring
    all-reduces over the link. The optimizer step is the profile's measured AdamW step."""
    if not profiles:
        raise ValueError("local_costs needs one profile per stage, got none")
    if not (link.bandwidth > 0 and link.latency >= 0 and np.isfinite(link).all()):
        raise ValueError(f"link={link}: need a positive bandwidth and a non-negative latency")
    if n_data < 1:
        raise ValueError(f"n_data={n_data} must be at least 1")
    n_stages, allreduce = len(profiles), []
    for k, prof in enumerate(profiles):
        if prof.stage is None:
            raise ValueError(
                f"profile {k} is of a middle stage, not of pipeline stage {k}: profile the "
                "pipeline's own stages with tplib.perfmodel.profile_pipeline"
            )
        cfg, (lo, hi) = prof.config, prof.stage
        total = stage_params(cfg, lo, hi) * BYTES_PER_ACTIVATION
        t = float(ring_allreduce(total, n_data, link.bandwidth, link.latency))
        holds_copy = cfg.tie_embeddings and (lo == 0 or hi == cfg.n_layer)
        if n_stages > 1 and holds_copy:
            tied = cfg.vocab_size * cfg.hidden * BYTES_PER_ACTIVATION
            t += float(ring_allreduce(tied, 2, link.bandwidth, link.latency))
        allreduce.append(t)
    return LocalCosts(
        tuple(profiles), link, tuple(allreduce), tuple(p.optimizer_time for p in profiles)
    )


class BottleneckCost:
    """The planner's cost model of a pipeline of unequal stages: a slice costs what it
    costs on its slowest stage, plus its communication. (The planner's Eq. 5 assumes
    equal stages; the slowest one sets the pace of the steady state.)"""

    def __init__(self, profiles: Sequence[Profile]) -> None:
        self.profiles = list(profiles)
        self.max_batch_slice_size: int | None = min(p.max_batch_slice_size for p in self.profiles)

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        times = [p.compute_time(batch_slice_size, length, context) for p in self.profiles]
        return np.maximum.reduce(times) + self.profiles[0].comm_time(batch_slice_size, length)
