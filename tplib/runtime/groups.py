"""Who a rank talks to: its process groups, its peer across each stage boundary, and
collectives (all-reduce; the distributed optimizer's reduce-scatter and all-gather; the
ring of context parallelism) that work under gloo with CUDA tensors.

Ranks follow the paper's layout with Megatron's place for context parallelism
(#Data x #Pipe x #CP x #Op, op innermost):
``rank = ((replica x #Pipe + stage) x #CP + cp_rank) x #Op + op_rank``. Operation
partitioning talks over one process group per (replica, stage, CP rank); context
parallelism's ring over one per (replica, stage, op rank); the gradient reduction over one
per (stage, op rank), joining its #Data x #CP ranks (each CP rank's gradient holds only
its tokens' part, as each replica's holds only its sequences'); the tied embedding over
one per (replica, CP rank, op rank) joining the stages of the model's first and last
parts (none when one stage holds both, as in a V of virtual stages). Every rank creates
every group in the same order (``new_group`` is collective).

Between stages a tensor travels once: the last op rank of the sender sends it to the
first op rank of the receiver (forward; backward the first to the last), which broadcasts
it to its group, as the cluster cost model charges (:mod:`tplib.cluster.layout`). Under
sequence parallelism each op rank holds its own shard of the tokens instead, and sends
it to the same op rank of the neighbouring stage (as Megatron-LM does): #Op links, each
carrying 1/#Op of the tensor, and no broadcast. CP rank r of a stage talks to CP rank r
of its neighbours only: its l / #CP tokens of each slice.

Several ranks sharing one GPU run on gloo, which moves CUDA tensors only through host
memory: then every collective and message is staged there (``staged``).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch import Tensor

from tplib.nn.model import GPTStage
from tplib.nn.oppart import OpGroup
from tplib.nn.ring import CPGroup
from tplib.runtime.runconfig import RunConfig
from tplib.schedule import Action, Kind

__all__ = ["Group", "RankGroups", "shared_weight"]

Group = dist.ProcessGroup | None


class RankGroups:
    """One rank's view of the run's process groups and peers."""

    def __init__(self, run: RunConfig, rank: int, device: torch.device) -> None:
        self.run, self.rank = run, rank
        self.parallelism = parallelism = run.parallelism
        self.replica, self.stage, self.op_rank, self.cp_rank = parallelism.position(rank)
        self.staged = device.type == "cuda" and dist.get_backend() == "gloo"
        k, r, n = parallelism.n_stages, parallelism.n_data, parallelism.n_op
        n_cp, rank_of = parallelism.n_cp, parallelism.rank_of

        def make(ranks: list[int]) -> Group:
            return dist.new_group(ranks) if len(ranks) > 1 else None

        ops = {
            (rep, s, c): make([rank_of(rep, s, o, c) for o in range(n)])
            for rep in range(r)
            for s in range(k)
            for c in range(n_cp)
        }
        cps = {
            (rep, s, o): make([rank_of(rep, s, o, c) for c in range(n_cp)])
            for rep in range(r)
            for s in range(k)
            for o in range(n)
        }
        # In rank order, replica-major: rank i of the group is replica i // #CP, CP rank
        # i % #CP (the distributed optimizer's shard i).
        datas = {
            (s, o): make([rank_of(rep, s, o, c) for rep in range(r) for c in range(n_cp)])
            for s in range(k)
            for o in range(n)
        }
        # The tied embedding's two copies: on the stage of the model's first part (0) and
        # that of its last (K-1; with a V of virtual stages 0 itself, a local sum).
        self.schedule = run.schedule
        last = self.schedule.placement[-1]
        tie = run.cfg.tie_embeddings and last != 0
        tieds = {
            (rep, c, o): make([rank_of(rep, 0, o, c), rank_of(rep, last, o, c)]) if tie else None
            for rep in range(r)
            for c in range(n_cp)
            for o in range(n)
        }
        self.op = ops[self.replica, self.stage, self.cp_rank]  # this stage's #Op group
        self.cp = cps[self.replica, self.stage, self.op_rank]  # the ring of its #CP ranks
        # This (stage, op rank)'s replicas and CP ranks: the gradient reduction.
        self.data = datas[self.stage, self.op_rank]
        self.reduce_index = self.replica * n_cp + self.cp_rank  # its rank in ``data``
        self.tied = tieds[self.replica, self.cp_rank, self.op_rank]  # the embedding's copies

    def all_reduce(
        self, tensor: Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> None:
        """In-place all-reduce over ``group`` (None: every rank)."""
        if not self.staged:
            dist.all_reduce(tensor, op=op, group=group)
            return
        host = tensor.cpu()
        dist.all_reduce(host, op=op, group=group)
        tensor.copy_(host)

    def all_reduce_flat(self, tensors: list[Tensor], group: Group) -> None:
        """Sum ``tensors`` in place over ``group`` in one all-reduce of their
        concatenation (one message instead of one per tensor)."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(flat, group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def all_gather(self, tensor: Tensor, group: Group) -> list[Tensor]:
        """Every rank of ``group``'s ``tensor`` (one shape on all), in rank order."""
        sent = tensor.cpu() if self.staged else tensor
        out = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, sent, group=group)
        return [t.to(tensor.device) for t in out]

    def reduce_scatter(self, tensors: list[Tensor], group: Group) -> Tensor:
        """The sum over ``group``'s ranks of their ``tensors[i]``, on rank i of it."""
        sent = [t.cpu() for t in tensors] if self.staged else tensors
        out = torch.empty_like(sent[0])
        dist.reduce_scatter(out, sent, group=group)
        return out.to(tensors[0].device)

    def reduce_scatter_flat(self, flat: Tensor, shard: Tensor, group: Group) -> None:
        """Sum ``flat`` over ``group`` into ``shard``, this rank's equal part of it (in
        place: ``shard`` is a view of ``flat``); the rest of ``flat`` holds no sum after."""
        # *_single: newer torch's names for *_tensor, which warn there.
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        if not self.staged:
            scatter(shard, flat, group=group)
            return
        host = flat.cpu()
        out = torch.empty_like(shard, device="cpu")
        scatter(out, host, group=group)
        shard.copy_(out)

    def all_gather_flat(self, flat: Tensor, shard: Tensor, group: Group) -> None:
        """Fill ``flat`` with every rank of ``group``'s ``shard``, in rank order (in
        place: ``shard`` is this rank's view of ``flat``)."""
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        if not self.staged:
            gather(flat, shard, group=group)
            return
        host = torch.empty_like(flat, device="cpu")
        gather(host, shard.cpu(), group=group)
        flat.copy_(host)

    def op_group(self) -> OpGroup | None:
        """The model's handle on this stage's #Op group (None without partitioning)."""
        if self.parallelism.n_op == 1:
            return None
        return OpGroup(
            self.op_rank,
            self.parallelism.n_op,
            all_reduce=lambda t: self.all_reduce(t, self.op),
            all_reduce_max=lambda t: self.all_reduce(t, self.op, dist.ReduceOp.MAX),
            sequence_parallel=self.parallelism.sequence_parallel,
            all_gather=lambda t: self.all_gather(t, self.op),
            reduce_scatter=lambda ts: self.reduce_scatter(ts, self.op),
        )

    def cp_group(self) -> CPGroup | None:
        """The model's handle on this rank's #CP ring (None without context parallelism)."""
        if self.parallelism.n_cp == 1:
            return None
        return CPGroup(self.cp_rank, self.parallelism.n_cp, shift=self.ring_shift)

    def ring_shift(self, tensor: Tensor) -> Tensor:
        """Send ``tensor`` to the next CP rank of the ring and return the previous one's
        (same shape and dtype), waiting at most the run's timeout for either."""
        n_cp, at = self.parallelism.n_cp, self.parallelism.rank_of
        after = at(self.replica, self.stage, self.op_rank, (self.cp_rank + 1) % n_cp)
        before = at(self.replica, self.stage, self.op_rank, (self.cp_rank - 1) % n_cp)
        sent = tensor.contiguous().cpu() if self.staged else tensor.contiguous()
        got = torch.empty_like(sent)
        ops = [
            dist.P2POp(dist.isend, sent, after, group=self.cp),
            dist.P2POp(dist.irecv, got, before, group=self.cp),
        ]
        for work, what in zip(
            dist.batch_isend_irecv(ops),
            (f"the ring's send to CP rank {after}", f"the ring's block from CP rank {before}"),
            strict=True,
        ):
            self.wait(work, what)
        return got.to(tensor.device)

    def peer_stage(self, action: Action) -> int:
        """The stage at the other end of send or receive ``action``: the one holding the
        neighbouring part of the model (k+1 or k-1 without virtual stages)."""
        toward = 1 if action.kind in (Kind.SA, Kind.RG) else -1
        other = self.schedule.neighbour(action, toward)
        assert other is not None  # the schedule was validated
        return other[0]

    def wire(self, action: Action) -> tuple[int, int]:
        """(the op rank of this stage that carries ``action``, the rank at the other end)."""
        last = self.parallelism.n_op - 1
        peer = self.peer_stage(action)
        cp, at = self.cp_rank, self.parallelism.rank_of  # CP rank r talks to CP rank r
        if self.parallelism.sequence_parallel:  # every op rank carries its own shard
            return self.op_rank, at(self.replica, peer, self.op_rank, cp)
        if action.kind in (Kind.SA, Kind.RG):  # to or from the next part's first op rank
            return last, at(self.replica, peer, 0, cp)
        return 0, at(self.replica, peer, last, cp)  # RA, SG

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for a point-to-point message, at most the run's ``timing.timeout_s``; the
        error says ``what`` was awaited, and whether the peer was slow or gone."""
        timeout = self.run.timing.timeout_s
        start = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            waited = time.monotonic() - start
            who = f"stage {self.stage} (rank {self.rank})"
            if waited < 0.9 * timeout:  # gloo gave up early: the link broke
                raise ConnectionError(
                    f"{who} lost its peer after {waited:.1f} s of waiting for {what}: the peer "
                    f"exited or its connection broke: {exc}"
                ) from exc
            raise TimeoutError(
                f"{who} waited {timeout:g} s for {what}; the peer is stuck or has failed: {exc}"
            ) from exc

    def broadcast_from(self, tensor: Tensor, carrier: int) -> None:
        """Share what op rank ``carrier`` received with the rest of the #Op group (under
        sequence parallelism each received its own shard: nothing to share)."""
        if self.op is not None and not self.parallelism.sequence_parallel:
            src = self.parallelism.rank_of(self.replica, self.stage, carrier, self.cp_rank)
            dist.broadcast(tensor, src, group=self.op)


def shared_weight(stage: GPTStage) -> Tensor | None:
    """This stage's copy of the tied embedding, if another stage holds the other copy."""
    if not stage.cfg.tie_embeddings or (stage.is_first and stage.is_last):
        return None
    if stage.is_first:
        return stage.wte.weight
    if stage.is_last:
        return stage.head.weight
    return None
