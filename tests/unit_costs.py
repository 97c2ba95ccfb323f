"""A cost model for tests: every action of a kind costs the same, so a schedule's
latency can be worked out by hand and compared with what the simulator finds; with
virtual stages, every chunk of a stage the same share of it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tplib.plan import Plan
from tplib.schedule import SENDS, Action, Kind, covered_slices
from tplib.schedule.chunks import Placement
from tplib.sim.costs import Parts

__all__ = ["ConstantCosts", "UnsplitCosts"]


@dataclass(frozen=True)
class ConstantCosts:
    """The same cost for every unit: ``t_f`` per forward, ``t_b`` per backward, ``t_send``
    per message on the link, ``t_recv`` per receive, plus a per-stage all-reduce and
    optimizer step. The simplest
    :class:`~tplib.sim.costs.ActionCosts`: schedules priced in units, as the tests
    reason about them. The compute prices are a whole stage's: placed on a schedule of
    v chunks per stage (:class:`~tplib.sim.costs.PlacedCosts`), each chunk's forward,
    backward and ``W`` cost 1/v of them; messages and the update stay as they are."""

    t_f: float = 1.0
    t_b: float = 2.0
    t_send: float = 0.0
    t_recv: float = 0.0
    t_allreduce: float = 0.0
    t_optimizer: float = 0.0
    blocking_sends: bool = False
    t_w: float = 1.0  # the weight gradients' part of t_b, per token slice, fused or not

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        return self.t_f if action.kind is Kind.F else self.t_b

    def weight_grad(self, stage: int, action: Action, plan: Plan) -> float:
        return self.t_w * len(covered_slices(plan, action.b, action.t))

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return self.t_send if action.kind in SENDS else self.t_recv

    def allreduce(self, stage: int) -> float:
        return self.t_allreduce

    def optimizer(self, stage: int) -> float:
        return self.t_optimizer

    def placed(self, placement: Placement) -> ConstantCosts:
        v = Parts(placement).n_chunks
        return replace(self, t_f=self.t_f / v, t_b=self.t_b / v, t_w=self.t_w / v)


class UnsplitCosts:
    """The plainest :class:`~tplib.sim.costs.ActionCosts`: one second per forward and per
    backward, communication, all-reduce and update free, and no price for a weight
    gradient on its own (not :class:`~tplib.sim.costs.SplitBackwardCosts`), and no
    price for a chunk (not :class:`~tplib.sim.costs.PlacedCosts`). A test subclasses
    it to price what it is about."""

    blocking_sends = False

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        return 1.0

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        return 0.0

    def allreduce(self, stage: int) -> float:
        return 0.0

    def optimizer(self, stage: int) -> float:
        return 0.0
