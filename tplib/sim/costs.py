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

Also here, written once for every cost model: :func:`memo`, the cache of per-unit costs,
and :func:`ring_allreduce`, the time of a ring all-reduce.

Everything here is plain Python and numpy: planning and simulating never import torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from tplib.plan import Plan
    from tplib.schedule import Action

__all__ = [
    "ActionCosts",
    "Link",
    "SliceCostModel",
    "SplitBackwardCosts",
    "memo",
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
        key = tuple(_key(a) for a in args)
        if key not in cache:
            cache[key] = method(self, *args)
        return cache[key]

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
