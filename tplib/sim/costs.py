"""The cost interfaces: what the planner and the simulator ask of a cost model.

Two protocols, declared once with every member tplib reads:

- :class:`SliceCostModel`, the planner's t(b, l, c) (paper Eq. 4): the forward+backward
  seconds of one pipeline stage for a slice of ``b`` sequences, ``l`` tokens long, after
  ``c`` tokens of context, with the slice's share of communication. Implemented by a
  measured :class:`~tplib.perfmodel.Profile`, the V100 :class:`~tplib.cluster.ClusterCostModel`,
  :class:`~tplib.measure.BottleneckCost` and the planner's :class:`~tplib.planner.TableCost`.
- :class:`ActionCosts`, the simulator's price of every action of a schedule. Implemented
  by :class:`~tplib.cluster.ClusterCostModel`, :class:`~tplib.measure.LocalCosts` and, from
  any slice cost model, :class:`~tplib.sim.simulate.SliceModelCosts`; those that also price
  the ``W`` actions of split backwards are :class:`SplitBackwardCosts`.

Virtual stages. A schedule with ``v`` chunks per rank (:mod:`tplib.schedule.chunks`)
cuts the model into ``v * K`` parts, and ``stage`` is then a rank holding ``v`` of them.
:class:`PlacedCosts` price such a schedule once told where the parts sit
(:meth:`PlacedCosts.placed`, which :func:`place` calls for the simulator): a chunk's
forward, backward and ``W`` as its own layers, a send or receive as the link between the
ranks of the neighbouring parts (the wrap from rank K-1 back to rank 0 too), the update
as the rank's, over all its chunks. Between two chunks of one rank there is no action to
price. :class:`Parts` answers the questions of where, for every cost model alike.

Also here, written once for every cost model: :func:`memo`, the cache of per-unit costs,
and :func:`ring_allreduce`, the time of a ring all-reduce.

Everything here is plain Python and numpy: planning and simulating never import torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np

from tplib.schedule.actions import SENDS, Kind
from tplib.schedule.chunks import Placement, check_placement, identity

if TYPE_CHECKING:
    from tplib.plan import Plan
    from tplib.schedule import Action

__all__ = [
    "ActionCosts",
    "Link",
    "Parts",
    "PlacedCosts",
    "SliceCostModel",
    "SplitBackwardCosts",
    "memo",
    "place",
    "ring_allreduce",
    "unit_shape",
]


NBytes = TypeVar("NBytes", float, np.ndarray)


class Link(NamedTuple):
    """A link between two processes: a message of n bytes takes ``latency + n / bandwidth``
    seconds (bandwidth in bytes/s, latency in seconds)."""

    bandwidth: float
    latency: float

    def time(self, nbytes: NBytes) -> NBytes:
        return self.latency + nbytes / self.bandwidth


class SliceCostModel(Protocol):
    """Per-stage slice times: the planner's cost model."""

    @property
    def max_batch_slice_size(self) -> int | None:
        """The largest batch slice (in sequences) the model has times for; None: any."""
        ...

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        """Forward+backward seconds of ONE pipeline stage for a slice of
        ``batch_slice_size`` sequences, ``length`` tokens each, attending to ``context``
        earlier tokens (numpy broadcasting), including the slice's send/receive time."""
        ...


class ActionCosts(Protocol):
    """Seconds of each action of a schedule, for :func:`tplib.sim.simulate.simulate`.

    ``blocking_sends``: the sender is busy for the whole transfer, as when sends run on
    the compute stream (the paper's NCCL implementation); otherwise it goes on and the
    message arrives ``transfer`` seconds later.
    """

    @property
    def blocking_sends(self) -> bool: ...

    def compute(self, stage: int, action: Action, plan: Plan) -> float:
        """A forward (``F``) or backward (``B``) of ``action``'s unit on ``stage``."""
        ...

    def transfer(self, stage: int, action: Action, plan: Plan) -> float:
        """A send's time on the link, or a receive's own time on the receiving stage."""
        ...

    def allreduce(self, stage: int) -> float:
        """The stage's gradient all-reduce (``AR``) after its last backward."""
        ...

    def optimizer(self, stage: int) -> float:
        """The stage's optimizer step (``OPT``) after the all-reduce."""
        ...


class SplitBackwardCosts(ActionCosts, Protocol):
    """:class:`ActionCosts` that also price the ``W`` actions of a zero-bubble schedule.

    The simulator prices a ``B`` of such a schedule as ``compute`` (the whole backward)
    minus ``weight_grad`` of the same unit's ``W``: what is left is the input gradient.
    A ``W`` of a whole sequence is priced as one product over all its tokens, which is
    where fusing gains."""

    def weight_grad(self, stage: int, action: Action, plan: Plan) -> float:
        """A ``W`` on ``stage``: the weight gradients of its unit, or with
        ``action.whole_sequence`` of every token slice of its batch slice at once."""
        ...


class PlacedCosts(ActionCosts, Protocol):
    """:class:`ActionCosts` that can price a schedule with virtual stages."""

    def placed(self, placement: Placement) -> ActionCosts:
        """These costs for a schedule whose model parts sit on the ranks ``placement``
        names (see the module docstring); the identity placement prices as ``self``."""
        ...


def place(costs: ActionCosts, placement: Placement) -> ActionCosts:
    """``costs`` for a schedule of ``placement``: :meth:`PlacedCosts.placed` where the
    costs have it; costs without it price one part per rank only, and a ValueError
    names them for any other placement (they would price each chunk as a whole rank)."""
    placed = getattr(costs, "placed", None)
    if callable(placed):
        result: ActionCosts = placed(tuple(placement))
        return result
    parts = Parts(tuple(placement))
    if parts.n_chunks > 1:
        raise ValueError(
            f"{type(costs).__name__} cannot price a schedule with {parts.n_chunks} chunks "
            "per rank: it has no placed(placement) (see tplib.sim.costs.PlacedCosts), so "
            "it would price each chunk as the rank's whole stage"
        )
    return costs


class Parts:
    """Where a placement puts the model's parts, as a cost model asks it: the part of a
    rank's chunk, the rank at the other end of a message, whether a chunk's input (or
    its output's gradient) comes from another rank."""

    def __init__(self, placement: Placement) -> None:
        self.n_stages = max(placement, default=-1) + 1
        check_placement(placement, self.n_stages)
        self.placement = tuple(placement)
        self.n_chunks = len(placement) // self.n_stages
        seen = [0] * self.n_stages
        self._part: dict[tuple[int, int], int] = {}
        for p, rank in enumerate(placement):
            self._part[rank, seen[rank]] = p
            seen[rank] += 1

    @classmethod
    def of_stages(cls, n_stages: int) -> Parts:
        """One part per rank."""
        return cls(identity(n_stages))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Parts) and other.placement == self.placement

    def __hash__(self) -> int:
        return hash(self.placement)

    def __repr__(self) -> str:
        return f"Parts({self.placement})"

    def part(self, stage: int, chunk: int = 0) -> int:
        """The part chunk ``chunk`` of rank ``stage`` holds."""
        return self._part[stage, chunk]

    def neighbour(self, stage: int, chunk: int, step: int) -> int | None:
        """The rank holding the part ``step`` (+1, -1) from chunk ``chunk`` of rank
        ``stage``; None past the model's ends."""
        p = self._part[stage, chunk] + step
        return self.placement[p] if 0 <= p < len(self.placement) else None

    def receives(self, stage: int, action: Action) -> bool:
        """Whether forward ``action``'s input (a backward's output gradient) arrives on
        rank ``stage`` from another rank: not on the model's first (last) part, nor
        after a hand-off between two chunks of one rank."""
        step = -1 if action.kind is Kind.F else 1
        peer = self.neighbour(stage, action.chunk, step)
        return peer is not None and peer != stage

    def link(self, stage: int, action: Action) -> tuple[int, int]:
        """(source rank, destination rank) of send or receive ``action`` on rank
        ``stage``: an activation goes to the holder of the next part, a gradient to that
        of the previous one."""
        toward = 1 if action.kind in (Kind.SA, Kind.RG) else -1
        peer = self.neighbour(stage, action.chunk, toward)
        if peer is None:
            raise ValueError(f"{action} on stage {stage} has no peer past the model's end")
        return (stage, peer) if action.kind in SENDS else (peer, stage)


def unit_shape(plan: Plan, action: Action) -> tuple[int, int, int]:
    """(batch-slice size, token-slice length, context) of ``action``'s unit: what a
    unit's cost depends on."""
    b, t = action.b, action.t
    return plan.batch_slices[b], plan.token_slices[b][t], plan.token_offset(b, t)


R = TypeVar("R")


def _key(value: object) -> object:
    if isinstance(value, np.ndarray):
        return (value.shape, value.dtype.str, value.tobytes())
    return value


def memo(method: Callable[..., R]) -> Callable[..., R]:
    """Cache a cost method's results per instance, by its arguments (numpy arrays by
    value). A cost model is asked for the same unit many times: once per stage, per
    schedule and per candidate plan, and its answer is a pure function of the unit.

    The cache lives on the instance, so it goes when the cost model goes."""
    slot = f"_memo_{method.__name__}"

    @functools.wraps(method)
    def cached(self: Any, *args: Any) -> R:
        cache: dict[tuple[object, ...], R] = self.__dict__.setdefault(slot, {})
        try:  # scalars, the simulator's millions of calls: the arguments are the key
            return cache[args]
        except KeyError:
            key: tuple[object, ...] = args
        except TypeError:  # an array: by value
            key = tuple(_key(a) for a in args)
            if key in cache:
                return cache[key]
        cache[key] = value = method(self, *args)
        return value

    return cached


def ring_allreduce(
    nbytes: float | np.ndarray, ranks: int, bandwidth: float, step_latency: float = 0.0
) -> float | np.ndarray:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks: 2 (r - 1) steps,
    each moving 1 / r of the buffer at ``bandwidth`` bytes/s and paying ``step_latency``.
    Zero for a single rank."""
    if ranks < 2:
        return 0.0 * nbytes
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * step_latency
