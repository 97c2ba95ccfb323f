"""One rank's messages to the stages that hold its neighbouring parts of the model: posting them where the schedule's
posting plan says, waiting for each receive, and completing the sends.

NCCL runs the messages between two ranks in order, on one stream, and completes a send
only once its receive is posted; gloo buffers sends. Posted as a schedule lists them,
1F1B would hang on GPUs (stage k sends ``A b1`` then waits for ``G b0``, stage k+1 sends
``G b0`` then waits for ``A b1``). :func:`tplib.schedule.nccl.posting_plan` says where
each message is posted so that both ends of a link post in one order: each group, the
sends and receives this op rank carries to one peer, goes out as one
``batch_isend_irecv`` (1F1B's crossing pair together). A receive is waited for at its own
place in the list, with the run's timeout; the sends are completed before the all-reduce
(a synchronous schedule's) or at the end of the pass.

Between stages a tensor travels once, between one op rank of each (``RankGroups.wire``);
the receiving op rank shares it with its #Op group. Under sequence parallelism each op
rank sends and receives its own shard of the tokens, to and from the same op rank of
the neighbouring stage; under context parallelism each CP rank its l / #CP tokens, to and
from the same CP rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tplib.plan import Plan, Unit
from tplib.runtime.groups import RankGroups
from tplib.schedule import RECEIVES, Action, Kind
from tplib.schedule.nccl import PostGroup

__all__ = ["Messages"]


class Messages:
    """The messages of one rank of ``stage``, posted as ``posting`` (the stage's part of
    the posting plan) says; :meth:`begin` starts a pass over its list."""

    def __init__(
        self,
        plan: Plan,
        stage: int,
        posting: tuple[PostGroup, ...],
        groups: RankGroups,
        *,
        hidden: int,
        wire_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.plan = plan
        self.stage, self.groups, self.hidden = stage, groups, hidden
        self.wire_dtype, self.device = wire_dtype, device
        self.wire = torch.device("cpu") if groups.staged else device
        # Each message holds 1/shards of a unit's tokens: 1/#Op under sequence parallelism,
        # 1/#CP under context parallelism.
        layout = groups.parallelism
        self.shards = (layout.n_op if layout.sequence_parallel else 1) * layout.n_cp
        # Where this stage posts its messages: list index -> the groups posted there.
        self.posting: dict[int, list[PostGroup]] = {}
        for group in posting:
            self.posting.setdefault(group.at, []).append(group)
        self.begin()

    def begin(self) -> None:
        """A new pass: nothing posted, nothing in flight."""
        # Receives posted ahead of their place: the buffer and, on the carrying op rank,
        # the message's Work.
        self.posted: dict[Action, tuple[Tensor, dist.Work | None]] = {}
        self.pending: list[tuple[dist.Work, Tensor, Action]] = []  # sends in flight

    def _buffer(self, action: Action) -> Tensor:
        b, t = action.b, action.t
        tokens = self.plan.token_slices[b][t] // self.shards
        shape = (self.plan.batch_slices[b], tokens, self.hidden)
        return torch.empty(shape, dtype=self.wire_dtype, device=self.wire)

    def post(self, position: int, outputs: dict[tuple[int, Unit], Tensor]) -> None:
        """Post the groups the plan puts before action ``position``; a send takes its
        (chunk, unit)'s tensor out of ``outputs``."""
        op_rank = self.groups.op_rank
        for group in self.posting.get(position, ()):
            ops: list[dist.P2POp] = []
            carried: list[tuple[Action, Tensor]] = []  # each op's action and tensor
            for action in group.actions:
                carrier, peer = self.groups.wire(action)
                if action.kind in RECEIVES:
                    tensor = self._buffer(action)
                    self.posted[action] = (tensor, None)
                    if op_rank == carrier:
                        ops.append(dist.P2POp(dist.irecv, tensor, peer))
                        carried.append((action, tensor))
                    continue
                tensor = outputs.pop((action.chunk, action.unit))
                if op_rank != carrier:
                    continue  # an op-rank peer sends the (identical) tensor
                tensor = tensor.to(self.wire_dtype).contiguous().to(self.wire)
                ops.append(dist.P2POp(dist.isend, tensor, peer))
                carried.append((action, tensor))
            if not ops:
                continue
            works = dist.batch_isend_irecv(ops)
            # Drop sends already delivered: their buffers need not live until AR.
            self.pending[:] = [p for p in self.pending if not p[0].is_completed()]
            for (action, tensor), work in zip(carried, works, strict=True):
                if action.kind in RECEIVES:
                    self.posted[action] = (tensor, work)
                else:
                    self.pending.append((work, tensor, action))

    def take(self, action: Action) -> Tensor:
        """RA / RG: wait (with the run's timeout) for the unit's activation or gradient on
        the carrying op rank, share it with the stage's #Op group, and return it on the
        device."""
        buffer, work = self.posted.pop(action)
        carrier, peer = self.groups.wire(action)
        if self.groups.op_rank == carrier:
            assert work is not None  # posted in the group the plan puts it in
            activation = action.kind is Kind.RA
            self.groups.wait(
                work,
                f"the {'activation' if activation else 'gradient'} from stage "
                f"{self.groups.peer_stage(action)} (rank {peer}) of unit "
                f"b{action.b} t{action.t} ({action})",
            )
        self.groups.broadcast_from(buffer, carrier)
        return buffer.to(self.device)

    def complete_sends(self) -> None:
        """Wait until every send in flight has been delivered."""
        for work, _, action in self.pending:
            self.groups.wait(work, f"{action} to rank {self.groups.wire(action)[1]} to complete")
        self.pending.clear()
