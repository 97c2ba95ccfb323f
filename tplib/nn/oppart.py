"""Operation partitioning (Megatron's tensor parallelism) inside a pipeline stage.

A stage partitioned over #Op ranks splits each transformer block the Megatron way:

- attention by heads: the QKV product is column-parallel (each rank computes the
  queries, keys and values of its n_head / #Op heads), the output projection is
  row-parallel (each rank multiplies its heads' part and the partial products are summed);
- the MLP the same way: FC1 column-parallel, FC2 row-parallel;
- the token embedding and the LM head by vocabulary rows, with a vocabulary-parallel
  cross-entropy that never gathers the logits;
- LayerNorms, the position embedding and the row-parallel biases replicated.

Two conjugate functions carry all the communication: :func:`copy_to_group` (identity
forward, all-reduce of the gradient backward) enters a column-parallel product, and
:func:`reduce_from_group` (all-reduce forward, identity backward) leaves a row-parallel
one. Everything between them is local to the rank, and everything outside them is
computed identically on every rank, so replicated parameters get identical gradients
without any further communication.

Sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation in
Large Transformer Models") splits what lies outside them, the LayerNorms, dropouts and
residual adds, along the tokens instead: each op rank holds its shard of the sequence
there (:func:`sequence_shard`). Two other conjugates then carry the communication, the
same volume as the all-reduce pair: :func:`gather_from_sequence` (all-gather of the
shards forward, reduce-scatter of the gradient backward) enters a column-parallel
product, and :func:`reduce_scatter_to_sequence` (reduce-scatter forward, all-gather
backward) leaves a row-parallel one. :func:`enter_tensor_parallel` and
:func:`leave_tensor_parallel` pick the pair the group's mode says. The replicated
parameters of the sharded regions then see only the rank's tokens: their gradients
must be summed over the group before the step (the runtime does).

The vocabulary is padded to a multiple of #Op (:func:`padded_vocab`). Padding rows are
zero, never looked up, and masked out of the softmax, so the partitioned model computes
exactly the unpadded one.

An :class:`OpGroup` carries the rank's position and its collectives as callables:
the model never imports torch.distributed; the runtime hands it the process group's
collectives. :func:`shard_spec`, :func:`take_shard` and :func:`merge_shards` map between
a parameter of the whole model and its shards, for initialisation and for comparing a
partitioned run with the single-process reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tplib.nn.configs import padded_vocab

__all__ = [
    "OpGroup",
    "ShardSpec",
    "copy_to_group",
    "enter_tensor_parallel",
    "gather_from_sequence",
    "leave_tensor_parallel",
    "merge_shards",
    "padded_vocab",
    "reduce_from_group",
    "reduce_scatter_to_sequence",
    "sequence_shard",
    "shard_spec",
    "take_shard",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]

Collective = Callable[[Tensor], None]  # reduces a tensor in place over the #Op group
# Every rank's tensor (all of one shape), in rank order.
Gather = Callable[[Tensor], list[Tensor]]
# One tensor per rank (all of one shape) in; out the sum over ranks of this rank's one.
ReduceScatter = Callable[[list[Tensor]], Tensor]


def _no_collective(tensor: Tensor) -> None:
    raise RuntimeError("this OpGroup has no collectives (built for sizing only)")


def _no_gather(tensor: Tensor) -> list[Tensor]:
    raise RuntimeError("this OpGroup has no all-gather (built without sequence parallelism)")


def _no_reduce_scatter(tensors: list[Tensor]) -> Tensor:
    raise RuntimeError("this OpGroup has no reduce-scatter (built without sequence parallelism)")


@dataclass(frozen=True)
class OpGroup:
    """One rank's place in a stage's #Op group, and the group's collectives.

    ``sequence_parallel``: between the tensor-parallel products each rank holds its
    shard of the tokens (:func:`sequence_shard`), and the products are entered by an
    all-gather and left by a reduce-scatter (``all_gather``, ``reduce_scatter``)."""

    rank: int
    size: int
    all_reduce: Collective = _no_collective  # sum
    all_reduce_max: Collective = _no_collective
    sequence_parallel: bool = False
    all_gather: Gather = _no_gather
    reduce_scatter: ReduceScatter = _no_reduce_scatter  # sum

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"op rank {self.rank} is outside the #Op group of {self.size}")


# ---- the conjugate pair -----------------------------------------------------------------


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, group: OpGroup) -> Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        ctx.group.all_reduce(grad)  # type: ignore[attr-defined]
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, group: OpGroup) -> Tensor:
        out = x.contiguous().clone()
        group.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_group(x: Tensor, group: OpGroup | None) -> Tensor:
    """Enter a column-parallel region: ``x`` as is; backward sums the ranks' gradients."""
    if group is None or group.size == 1:
        return x
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: Tensor, group: OpGroup | None) -> Tensor:
    """Leave a row-parallel region: the sum of the ranks' partial products."""
    if group is None or group.size == 1:
        return x
    return _ReduceFromGroup.apply(x, group)


# ---- the sequence-parallel conjugate pair ----------------------------------------------

SEQUENCE_DIM = 1  # hidden states are (batch, tokens, hidden)


def sequence_shard(length: int, group: OpGroup | None) -> tuple[int, int]:
    """(offset, tokens) of this rank's shard of ``length`` tokens: the whole of them
    without sequence parallelism, else the rank's contiguous 1/#Op of them."""
    if group is None or group.size == 1 or not group.sequence_parallel:
        return 0, length
    if length % group.size:
        raise ValueError(
            f"a slice of {length} tokens does not split over #Op={group.size} ranks: "
            "sequence parallelism needs every slice's length divisible by #Op"
        )
    tokens = length // group.size
    return group.rank * tokens, tokens


def _gather(x: Tensor, group: OpGroup) -> Tensor:
    return torch.cat(group.all_gather(x.contiguous()), dim=SEQUENCE_DIM)


def _reduce_scatter(x: Tensor, group: OpGroup) -> Tensor:
    if x.shape[SEQUENCE_DIM] % group.size:
        sequence_shard(x.shape[SEQUENCE_DIM], group)  # raises, naming the length
    parts = [p.contiguous() for p in x.chunk(group.size, dim=SEQUENCE_DIM)]
    return group.reduce_scatter(parts)


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, group: OpGroup) -> Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return _gather(x, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _reduce_scatter(grad, ctx.group), None  # type: ignore[attr-defined]


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, group: OpGroup) -> Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _gather(grad, ctx.group), None  # type: ignore[attr-defined]


def gather_from_sequence(x: Tensor, group: OpGroup | None) -> Tensor:
    """Enter a column-parallel region from sequence shards: the ranks' shards of ``x``
    (batch, tokens / #Op, hidden) joined in rank order along the tokens; backward sums
    the ranks' gradients and hands each rank its shard of the sum (reduce-scatter)."""
    if group is None or group.size == 1:
        return x
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: Tensor, group: OpGroup | None) -> Tensor:
    """Leave a row-parallel region into sequence shards: this rank's shard (its tokens,
    :func:`sequence_shard`) of the sum of the ranks' partial products ``x``; backward
    gathers the shards' gradients (all-gather)."""
    if group is None or group.size == 1:
        return x
    return _ReduceScatterToSequence.apply(x, group)


def enter_tensor_parallel(x: Tensor, group: OpGroup | None) -> Tensor:
    """Enter a column-parallel product: :func:`gather_from_sequence` under sequence
    parallelism, else :func:`copy_to_group`."""
    if group is not None and group.sequence_parallel:
        return gather_from_sequence(x, group)
    return copy_to_group(x, group)


def leave_tensor_parallel(x: Tensor, group: OpGroup | None) -> Tensor:
    """Leave a row-parallel product: :func:`reduce_scatter_to_sequence` under sequence
    parallelism, else :func:`reduce_from_group`."""
    if group is not None and group.sequence_parallel:
        return reduce_scatter_to_sequence(x, group)
    return reduce_from_group(x, group)


# ---- vocabulary-parallel embedding and cross-entropy ------------------------------------


def vocab_parallel_embedding(
    ids: Tensor, weight: Tensor, first_row: int, group: OpGroup | None
) -> Tensor:
    """Embed token ``ids`` with this rank's rows ``[first_row, first_row + rows)`` of the
    (padded) table; ids owned by other ranks contribute zeros, and the sum over the
    group is the full lookup (under sequence parallelism, this rank's tokens of it)."""
    if group is None or group.size == 1:
        return torch.nn.functional.embedding(ids, weight)
    local = ids - first_row
    outside = (local < 0) | (local >= weight.shape[0])
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return leave_tensor_parallel(out, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy over logits split by vocabulary rows across the group;
    tokens whose target is negative (``IGNORE``) add nothing, as in ``F.cross_entropy``.

    Saves the local softmax (tokens x rows / #Op, float32) for backward, as Megatron's
    does; the logits themselves are not kept.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: Tensor,
        targets: Tensor,
        first_row: int,
        n_valid: int,
        group: OpGroup,
    ) -> Tensor:
        logits = logits.float()
        if n_valid < logits.shape[1]:  # padding rows are not words
            logits = logits.clone()
            logits[:, n_valid:] = float("-inf")
        peak = logits.max(dim=1).values
        group.all_reduce_max(peak)
        exp = (logits - peak.unsqueeze(1)).exp_()
        total = exp.sum(dim=1)
        group.all_reduce(total)
        counted = targets >= 0  # a negative target (IGNORE) adds no loss
        local = targets - first_row
        mine = (local >= 0) & (local < logits.shape[1])
        local = local.masked_fill(~mine, 0)
        rows = torch.arange(logits.shape[0], device=logits.device)
        picked = torch.where(mine, logits[rows, local], 0.0)
        group.all_reduce(picked)
        loss = torch.where(counted, total.log() + peak - picked, 0.0).sum()
        softmax = exp.div_(total.unsqueeze(1)).mul_(counted.unsqueeze(1))
        ctx.save_for_backward(softmax, local, mine)
        return loss

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: Tensor
    ) -> tuple[Tensor, None, None, None, None]:
        softmax, local, mine = ctx.saved_tensors  # type: ignore[attr-defined]
        out = softmax.clone()
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows[mine], local[mine]] -= 1.0
        return out.mul_(grad), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, targets: Tensor, first_row: int, n_valid: int, group: OpGroup | None
) -> Tensor:
    """Summed next-token cross-entropy of ``logits`` (tokens x this rank's rows) against
    ``targets`` (tokens); ``n_valid`` of the local rows are real words, the rest padding."""
    if group is None or group.size == 1:
        return torch.nn.functional.cross_entropy(
            logits[:, :n_valid].float(), targets, reduction="sum"
        )
    return _VocabParallelCrossEntropy.apply(logits, targets, first_row, n_valid, group)


# ---- shards of the whole model's parameters ---------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter splits over #Op: along ``dim``, which is ``blocks`` equal blocks
    (the QKV product stacks queries, keys and values), each split into #Op contiguous
    parts; rank r holds part r of every block. ``vocab``: rows are the vocabulary,
    padded to a multiple of #Op."""

    dim: int
    blocks: int = 1
    vocab: bool = False


_SPECS: dict[str, ShardSpec] = {
    "attn.qkv.weight": ShardSpec(0, blocks=3),
    "attn.qkv.bias": ShardSpec(0, blocks=3),
    "attn.proj.weight": ShardSpec(1),
    "mlp.fc.weight": ShardSpec(0),
    "mlp.fc.bias": ShardSpec(0),
    "mlp.proj.weight": ShardSpec(1),
    "wte.weight": ShardSpec(0, vocab=True),
    "head.weight": ShardSpec(0, vocab=True),
}


def shard_spec(name: str) -> ShardSpec | None:
    """The split of parameter ``name`` (a stage's parameter name), None if replicated."""
    for suffix, spec in _SPECS.items():
        if name == suffix or name.endswith("." + suffix):
            return spec
    return None


def take_shard(full: Tensor, spec: ShardSpec | None, rank: int, n_op: int) -> Tensor:
    """Rank ``rank``'s part of the whole parameter ``full``."""
    if spec is None or n_op == 1:
        return full
    if spec.vocab:
        pad = padded_vocab(full.shape[spec.dim], n_op) - full.shape[spec.dim]
        if pad:
            shape = list(full.shape)
            shape[spec.dim] = pad
            full = torch.cat([full, full.new_zeros(shape)], dim=spec.dim)
    parts = [block.chunk(n_op, dim=spec.dim)[rank] for block in full.chunk(spec.blocks, spec.dim)]
    return torch.cat(parts, dim=spec.dim)


def merge_shards(shards: Sequence[Tensor], spec: ShardSpec | None, full_size: int) -> Tensor:
    """The whole parameter from every rank's shard (rank order); ``full_size`` is the
    unpadded length of the split dimension."""
    if spec is None or len(shards) == 1:
        return shards[0]
    per_rank = [s.chunk(spec.blocks, dim=spec.dim) for s in shards]
    blocks = [torch.cat([parts[i] for parts in per_rank], dim=spec.dim) for i in range(spec.blocks)]
    return torch.cat(blocks, dim=spec.dim).narrow(spec.dim, 0, full_size)
