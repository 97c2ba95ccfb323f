"""A partition's closed form against the simulator: the planners' arithmetic, checked by
running the schedule they assume.

PipeDream-2BW's planner rates a configuration by a closed form (§4.2.1): the slowest of
each stage's compute, its boundary traffic and its share of the weight all-reduce, as if
all three overlapped perfectly. :class:`ChainCosts` prices the actions of tplib's own
schedules from the same :class:`~tplib.partition.chain.LayerChain` (a stage's forward
and backward, a boundary's bytes at the topology's bandwidth, the stage's ring
all-reduce over its replicas; sends do not block, as the closed form assumes), so
:func:`twobw_simulated` can replay the ``2bw`` schedule of a configuration and read its
steady state (:func:`tplib.sim.throughput.steady_state`). Where the two differ, the closed
form has assumed an overlap the schedule does not give: an all-reduce on a stage's own
stream holds its next forward, and a slower stage starves its neighbours.
"""

from __future__ import annotations

from tplib.partition.chain import LayerChain
from tplib.partition.topology import Topology
from tplib.partition.twobw import TwoBWConfig, placement
from tplib.plan import Plan
from tplib.schedule import Action, Kind
from tplib.sim.costs import ring_allreduce
from tplib.sim.throughput import steady_state

__all__ = ["ChainCosts", "twobw_simulated"]


class ChainCosts:
    """:class:`~tplib.sim.costs.ActionCosts` of one replica of a pipeline of ``stage_ranges``
    over ``chain``, its stages replicated ``width`` times on ``topology`` (rank = stage x
    width + replica, as the 2BW planner places them). Units are whole microbatches of
    ``chain.microbatch`` sequences."""

    blocking_sends = False

    def __init__(
        self,
        chain: LayerChain,
        stage_ranges: tuple[tuple[int, int], ...],
        topology: Topology,
        *,
        width: int = 1,
        recompute: bool = False,
        optimizer_seconds: float = 0.0,
    ) -> None:
        self.chain, self.ranges, self.width = chain, stage_ranges, width
        self.recompute, self.optimizer_seconds = recompute, optimizer_seconds
        self._link, self._reduce = placement(topology, width, len(stage_ranges))

    def _check(self, plan: Plan, action: Action) -> None:
        size, tokens = plan.batch_slices[action.b], plan.token_slices[action.b]
        if size != self.chain.microbatch or tokens != (self.chain.seq_len,):
            raise ValueError(
                f"unit {action.b} holds {size} sequences of {tokens} tokens: ChainCosts prices "
                f"whole microbatches of {self.chain.microbatch} x {self.chain.seq_len}"
            )

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        self._check(plan, action)
        lo, hi = self.ranges[stage]
        fwd = self.chain.total("forward", lo, hi)
        if action.kind is Kind.F:
            return fwd
        return self.chain.total("backward", lo, hi) + (fwd if self.recompute else 0.0)

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        if action.kind in (Kind.RA, Kind.RG):  # a posted receive costs its stage nothing
            return 0.0
        forward = action.kind is Kind.SA
        cut = stage if forward else stage - 1  # boundary between stages cut and cut + 1
        return self.chain.boundary(*self.ranges[cut]) / self._link[cut]

    def allreduce(self, stage: int) -> float:
        lo, hi = self.ranges[stage]
        nbytes = self.chain.grad_bytes * self.chain.total("params", lo, hi)
        return float(ring_allreduce(nbytes, self.width, self._reduce[stage]))

    def optimizer(self, stage: int) -> float:
        return self.optimizer_seconds


def twobw_simulated(chain: LayerChain, topology: Topology, config: TwoBWConfig) -> float:
    """Seconds per microbatch of ``config``'s ``2bw`` schedule in its steady state,
    simulated with :class:`ChainCosts`; compare ``config.seconds_per_microbatch``."""
    if chain.microbatch != config.microbatch:
        raise ValueError(
            f"chain of microbatch {chain.microbatch} for a configuration of b="
            f"{config.microbatch}: build the chain with the configuration's microbatch"
        )
    g = config.accumulation
    plan = Plan((config.microbatch,) * g, ((chain.seq_len,),) * g)
    costs = ChainCosts(
        chain, config.stage_ranges, topology, width=config.width, recompute=config.recompute
    )
    return steady_state("2bw", config.depth, plan, costs).iteration_time / g
