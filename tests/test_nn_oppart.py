"""Operation partitioning (tplib.nn.oppart) against the unpartitioned model.

Shards are checked against slicing written out by hand, and a whole #Op group is
simulated in one process: one thread per op rank, each with an :class:`OpGroup` whose
all-reduces meet at a barrier and reduce a shared list. The threads' loss and merged
gradients must equal the unpartitioned model's (float32, 1e-5).

The comparisons run on perturbed weights (:func:`_perturb`), not the initial ones: at
initialisation every bias is zero and every LayerNorm the identity, so a replicated bias
added once per op rank instead of once in total would compute the same numbers.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tplib.nn.configs import GPTConfig, get_config
from tplib.nn.data import synthetic_batch
from tplib.nn.dropout import DropoutKey
from tplib.nn.model import GPTStage, build_model
from tplib.nn.oppart import (
    OpGroup,
    ShardSpec,
    enter_tensor_parallel,
    gather_from_sequence,
    leave_tensor_parallel,
    merge_shards,
    padded_vocab,
    reduce_scatter_to_sequence,
    sequence_shard,
    shard_spec,
    take_shard,
    vocab_parallel_cross_entropy,
)
from tplib.nn.slicing import run_pipeline_local
from tplib.plan import Plan

from .conftest import assert_scaled_close

TINY = get_config("tiny")  # 4 layers, hidden 32, 4 heads of 8, vocabulary 96, context 64
T = TypeVar("T")


# ---- shards ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab", "n_op", "expected"),
    [(96, 1, 96), (96, 2, 96), (96, 4, 96), (95, 2, 96), (95, 4, 96), (97, 4, 100), (1, 8, 8)],
)
def test_padded_vocab(vocab: int, n_op: int, expected: int) -> None:
    assert padded_vocab(vocab, n_op) == expected
    assert padded_vocab(50257, 8) == 50264  # GPT-2's vocabulary over 8 ranks: 6283 rows each


def test_shard_specs_of_the_model_parameters() -> None:
    assert shard_spec("blocks.3.attn.qkv.weight") == ShardSpec(0, blocks=3)
    assert shard_spec("blocks.0.attn.qkv.bias") == ShardSpec(0, blocks=3)
    assert shard_spec("blocks.0.attn.proj.weight") == ShardSpec(1)
    assert shard_spec("blocks.0.mlp.fc.weight") == ShardSpec(0)
    assert shard_spec("blocks.0.mlp.fc.bias") == ShardSpec(0)
    assert shard_spec("blocks.0.mlp.proj.weight") == ShardSpec(1)
    assert shard_spec("wte.weight") == ShardSpec(0, vocab=True)
    assert shard_spec("head.weight") == ShardSpec(0, vocab=True)
    for replicated in (
        "wpe.weight",
        "ln_f.weight",
        "blocks.0.ln_1.bias",
        "blocks.0.attn.proj.bias",  # added once, after the row-parallel sum
        "blocks.0.mlp.proj.bias",
    ):
        assert shard_spec(replicated) is None, replicated


def test_qkv_shard_holds_its_heads_queries_keys_and_values() -> None:
    hidden, n_head, head_dim = 32, 4, 8
    full = torch.arange(3 * hidden * 5, dtype=torch.float32).reshape(3 * hidden, 5)
    spec = ShardSpec(0, blocks=3)
    for n_op in (2, 4):
        heads = n_head // n_op
        rows = heads * head_dim  # this rank's share of q (and of k, and of v)
        for r in range(n_op):
            shard = take_shard(full, spec, r, n_op)
            q = full[r * rows : (r + 1) * rows]
            k = full[hidden + r * rows : hidden + (r + 1) * rows]
            v = full[2 * hidden + r * rows : 2 * hidden + (r + 1) * rows]
            assert torch.equal(shard, torch.cat([q, k, v]))
            # Head by head: head j of rank r is head r * heads + j of the whole model.
            for j in range(heads):
                whole_head = r * heads + j
                for block in range(3):
                    mine = shard[
                        (block * heads + j) * head_dim : (block * heads + j + 1) * head_dim
                    ]
                    ref = full[
                        block * hidden + whole_head * head_dim : block * hidden
                        + (whole_head + 1) * head_dim
                    ]
                    assert torch.equal(mine, ref), (n_op, r, j, block)
    # The bias splits the same way.
    bias = torch.arange(3 * hidden, dtype=torch.float32)
    assert take_shard(bias, spec, 1, 2).tolist() == (
        list(range(16, 32)) + list(range(48, 64)) + list(range(80, 96))
    )


def test_column_and_row_shards_by_hand() -> None:
    w = torch.arange(16 * 6, dtype=torch.float32).reshape(16, 6)
    assert torch.equal(take_shard(w, ShardSpec(0), 1, 4), w[4:8])
    assert torch.equal(take_shard(w, ShardSpec(1), 2, 3), w[:, 4:6])
    assert take_shard(w, None, 1, 4) is w  # replicated
    assert take_shard(w, ShardSpec(0), 0, 1) is w  # #Op = 1


def test_vocab_shard_pads_the_last_ranks_with_zero_rows() -> None:
    w = torch.arange(1, 95 * 3 + 1, dtype=torch.float32).reshape(95, 3)
    spec = ShardSpec(0, vocab=True)
    # 95 words over 4 ranks: 24 rows each, the last rank's final row is padding.
    shards = [take_shard(w, spec, r, 4) for r in range(4)]
    assert [s.shape[0] for s in shards] == [24] * 4
    for r in range(3):
        assert torch.equal(shards[r], w[24 * r : 24 * (r + 1)])
    assert torch.equal(shards[3][:23], w[72:95])
    assert torch.equal(shards[3][23], torch.zeros(3))
    # 95 over 2: 48 rows each, one padding row on rank 1.
    two = [take_shard(w, spec, r, 2) for r in range(2)]
    assert torch.equal(two[0], w[:48])
    assert torch.equal(two[1][:47], w[48:])
    assert torch.equal(two[1][47], torch.zeros(3))


@pytest.mark.parametrize("n_op", [2, 4])
@pytest.mark.parametrize(
    ("spec", "shape"),
    [
        (ShardSpec(0, blocks=3), (96, 5)),  # QKV weight
        (ShardSpec(0, blocks=3), (96,)),  # QKV bias
        (ShardSpec(0), (128, 32)),  # FC1 (column-parallel)
        (ShardSpec(0), (128,)),
        (ShardSpec(1), (32, 128)),  # FC2 / output projection (row-parallel)
        (ShardSpec(0, vocab=True), (95, 32)),  # padded vocabulary
        (ShardSpec(0, vocab=True), (96, 32)),
        (ShardSpec(0, vocab=True), (93, 7)),
        (None, (7, 3)),
    ],
)
def test_take_then_merge_is_the_whole(
    spec: ShardSpec | None, shape: tuple[int, ...], n_op: int
) -> None:
    full = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape) + n_op))
    shards = [take_shard(full, spec, r, n_op) for r in range(n_op)]
    if spec is not None:
        split = padded_vocab(shape[spec.dim], n_op) if spec.vocab else shape[spec.dim]
        assert all(s.shape[spec.dim] == split // n_op for s in shards)
    size = full.shape[0 if spec is None else spec.dim]
    assert torch.equal(merge_shards(shards, spec, size), full)


# ---- vocabulary-parallel cross-entropy without a group -----------------------------------


def test_vocab_parallel_cross_entropy_without_a_group_is_cross_entropy() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 96, generator=g)
    targets = torch.randint(0, 95, (10,), generator=g)
    ref = F.cross_entropy(logits[:, :95], targets, reduction="sum")
    got = vocab_parallel_cross_entropy(logits, targets, 0, 95, None)
    assert_scaled_close(got, ref, what="loss")
    # By hand: sum over tokens of log(sum_j exp(z_j)) - z_target, padding column excluded.
    by_hand = sum(
        torch.logsumexp(logits[i, :95], 0) - logits[i, int(targets[i])] for i in range(10)
    )
    assert isinstance(by_hand, Tensor)
    assert_scaled_close(got, by_hand, what="loss by hand")
    # A group of one is the same as none.
    one = vocab_parallel_cross_entropy(logits, targets, 0, 95, OpGroup(0, 1))
    assert_scaled_close(one, ref, what="group of one")


# ---- an #Op group simulated with threads ----------------------------------------------------


class ThreadGroup:
    """In-place all-reduces of ``n`` threads: each writes its tensor into a shared list,
    all meet at a barrier, each writes back the reduction over ranks (in rank order, so
    every rank gets bit-identical results), and all meet again before the list is reused."""

    def __init__(self, n: int, timeout_s: float = 30.0) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=timeout_s)
        self.slots: list[Tensor | None] = [None] * n
        self.exchanged: list[Any] = [None] * n
        self.calls = [0] * n

    def _exchange(self, rank: int, value: T) -> list[T]:
        """Every rank's ``value`` in rank order (values are not copied: callers pass
        fresh tensors), both barriers passed."""
        self.calls[rank] += 1
        self.exchanged[rank] = value
        self.barrier.wait()
        got: list[T] = list(self.exchanged)
        self.barrier.wait()
        return got

    def _all_gather(self, rank: int, tensor: Tensor) -> list[Tensor]:
        parts = self._exchange(rank, tensor.detach().clone())
        assert all(p.shape == tensor.shape for p in parts)
        return [p.clone() for p in parts]

    def _reduce_scatter(self, rank: int, tensors: list[Tensor]) -> Tensor:
        assert len(tensors) == self.n
        lists = self._exchange(rank, [t.detach().clone() for t in tensors])
        return torch.stack([parts[rank] for parts in lists]).sum(0)

    def _reduce(self, rank: int, tensor: Tensor, how: str) -> None:
        self.calls[rank] += 1
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        parts = [s for s in self.slots if s is not None]
        assert len(parts) == self.n and all(p.shape == tensor.shape for p in parts)
        stacked = torch.stack(parts)
        result = stacked.sum(0) if how == "sum" else stacked.amax(0)
        self.barrier.wait()  # everyone has read the list before anyone writes it again
        tensor.copy_(result)

    def group(self, rank: int, sequence_parallel: bool = False) -> OpGroup:
        return OpGroup(
            rank,
            self.n,
            all_reduce=lambda t: self._reduce(rank, t, "sum"),
            all_reduce_max=lambda t: self._reduce(rank, t, "max"),
            sequence_parallel=sequence_parallel,
            all_gather=lambda t: self._all_gather(rank, t),
            reduce_scatter=lambda ts: self._reduce_scatter(rank, ts),
        )


def run_threads(
    n: int,
    body: Callable[[OpGroup], T],
    timeout_s: float = 60.0,
    sequence_parallel: bool = False,
) -> list[T]:
    """Run ``body(op)`` in ``n`` threads, one per op rank; their results in rank order.
    A thread that raises breaks the barrier, so the others fail instead of hanging."""
    tg = ThreadGroup(n)
    results: list[T | None] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def target(rank: int) -> None:
        try:
            results[rank] = body(tg.group(rank, sequence_parallel))
        except BaseException as exc:
            errors[rank] = exc
            tg.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "an op-rank thread hung"
    for rank, err in enumerate(errors):
        if err is not None and not isinstance(err, threading.BrokenBarrierError):
            raise AssertionError(f"op rank {rank} failed") from err
    for rank, err in enumerate(errors):
        if err is not None:
            raise AssertionError(f"op rank {rank} failed") from err
    assert len(set(tg.calls)) == 1 and tg.calls[0] > 0, f"collective counts {tg.calls}"
    return [r for r in results if r is not None]


@contextmanager
def one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _grads(stage: GPTStage) -> dict[str, Tensor]:
    out = {}
    for name, p in stage.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        out[name] = p.grad.detach().clone()
    return out


def _perturb(whole: GPTStage, seed: int) -> None:
    """Move every parameter of the whole model off its initial value (std 0.05 noise):
    biases and LayerNorm shifts start at zero, where adding one too often goes unseen."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.05)


def _load_shards(stage: GPTStage, whole: GPTStage, op: OpGroup) -> None:
    """Give ``stage`` (a partitioned stage of ``whole``'s model) this rank's shards of
    ``whole``'s current parameters."""
    source = dict(whole.named_parameters())
    with torch.no_grad():
        for name, p in stage.named_parameters():
            # A last stage's head is the embedding of a tied model (one parameter there).
            full = source.get(name, source["wte.weight"] if name == "head.weight" else None)
            assert full is not None, name
            p.copy_(take_shard(full.detach(), shard_spec(name), op.rank, op.size))


def _merge(per_rank: list[dict[str, Tensor]], cfg: GPTConfig) -> dict[str, Tensor]:
    """The whole model's tensors from every rank's shards; replicated tensors must be
    identical on every rank."""
    n = len(per_rank)
    out = {}
    for name in per_rank[0]:
        parts = [d[name] for d in per_rank]
        spec = shard_spec(name)
        if spec is None:
            for r, p in enumerate(parts[1:], 1):
                assert torch.equal(p, parts[0]), f"{name} differs on op rank {r}"
            out[name] = parts[0]
        else:
            size = cfg.vocab_size if spec.vocab else parts[0].shape[spec.dim] * n
            out[name] = merge_shards(parts, spec, size)
    return out


CONFIGS = {
    "tiny": TINY,
    "vocab95": TINY.with_(vocab_size=95),  # padding: 1 row over 2 or 4 ranks
    "vocab93-untied": TINY.with_(vocab_size=93, tie_embeddings=False),  # 3 rows over 4 ranks
    # 5 words over 4 ranks of 2 rows: rank 2 holds one word, rank 3 none (all padding).
    "vocab5": TINY.with_(vocab_size=5),
}


@pytest.mark.parametrize("n_op", [2, 4])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_partitioned_model_equals_the_whole(n_op: int, cfg_name: str) -> None:
    cfg = CONFIGS[cfg_name]
    tokens, targets = synthetic_batch(cfg, 3, 20, seed=11)
    whole = build_model(cfg, seed=5)
    initial = {n: p.detach().clone() for n, p in whole.named_parameters()}
    _perturb(whole, seed=6)
    ref_logits = whole(tokens).detach()
    ref_loss = whole(tokens, targets=targets)
    ref_loss.backward()
    ref_grads = _grads(whole)

    def body(op: OpGroup) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]]:
        with one_thread():
            stage = build_model(cfg, seed=5, op=op)
            params = {n: p.detach().clone() for n, p in stage.named_parameters()}
            _load_shards(stage, whole, op)
            logits = stage(tokens).detach()
            loss = stage(tokens, targets=targets)
            loss.backward()
            return loss.detach(), logits, params, _grads(stage)

    results = run_threads(n_op, body)
    # Every rank holds its shard of the whole model's initial values (padding zero).
    params = _merge([r[2] for r in results], cfg)
    assert params.keys() == initial.keys()
    for name, p in initial.items():
        assert torch.equal(params[name], p), name
    # Every rank computes the whole loss.
    for rank, (loss, *_) in enumerate(results):
        assert_scaled_close(loss, ref_loss.detach(), what=f"loss on op rank {rank}")
    # Each rank's logits are its vocabulary rows; padding logits are zero (padding head
    # rows are zero, perturbed or not: take_shard pads).
    rows = padded_vocab(cfg.vocab_size, n_op) // n_op
    assert all(r[1].shape == (3, 20, rows) for r in results)
    logits = merge_shards([r[1] for r in results], ShardSpec(2, vocab=True), cfg.vocab_size)
    assert_scaled_close(logits, ref_logits, what="logits")
    # The padded table, rank after rank: the columns past the vocabulary are padding.
    padded = torch.cat([r[1] for r in results], dim=2)
    pad = padded_vocab(cfg.vocab_size, n_op) - cfg.vocab_size
    assert torch.equal(padded[..., cfg.vocab_size :], torch.zeros(3, 20, pad))
    grads = _merge([r[3] for r in results], cfg)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert_scaled_close(grads[name], ref, what=f"grad {name}")


@pytest.mark.parametrize("n_op", [2, 4])
def test_partitioned_stages_with_kv_context_equal_the_whole_sequence(n_op: int) -> None:
    """Two partitioned stages [0, 2) and [2, 4), token slice by token slice with K/V
    contexts of this rank's heads, against whole sequences through the whole model."""
    cfg = TINY.with_(vocab_size=95)
    batch, cuts = 2, (0, 5, 6, 17, 24)
    length = cuts[-1]
    tokens, targets = synthetic_batch(cfg, batch, length, seed=21)
    whole = build_model(cfg, seed=8)
    _perturb(whole, seed=22)
    ref_logits = whole(tokens).detach()
    ref_loss = whole(tokens, targets=targets).detach()

    def body(op: OpGroup) -> tuple[Tensor, Tensor, Tensor]:
        with one_thread(), torch.no_grad():
            first = build_model(cfg, 0, 2, seed=8, op=op)
            last = build_model(cfg, 2, 4, seed=8, op=op)
            _load_shards(first, whole, op)
            _load_shards(last, whole, op)
            ctx_first, ctx_last = first.new_context(batch, length), last.new_context(batch, length)
            assert ctx_first[0].k.shape[1] == cfg.n_head // n_op  # this rank's heads only
            logits, losses = [], []
            for lo, hi in itertools.pairwise(cuts):
                h = first(tokens[:, lo:hi], start=lo, context=ctx_first)
                logits.append(last(h, start=lo, context=ctx_last))
            # The loss, slice by slice, on fresh contexts.
            ctx_first, ctx_last = first.new_context(batch, length), last.new_context(batch, length)
            for lo, hi in itertools.pairwise(cuts):
                h = first(tokens[:, lo:hi], start=lo, context=ctx_first)
                losses.append(last(h, start=lo, context=ctx_last, targets=targets[:, lo:hi]))
            return torch.cat(logits, dim=1), torch.stack(losses).sum(), h

    results = run_threads(n_op, body)
    logits = merge_shards([r[0] for r in results], ShardSpec(2, vocab=True), cfg.vocab_size)
    assert_scaled_close(logits, ref_logits, what="sliced logits")
    for rank, (_, loss, h) in enumerate(results):
        assert_scaled_close(loss, ref_loss, what=f"sliced loss on op rank {rank}")
        # Hidden states between stages are whole and equal on every rank.
        assert torch.equal(h, results[0][2]), rank


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("n_op", [2, 4])
def test_partitioned_token_slices_backward_equals_the_whole(n_op: int, recompute: str) -> None:
    """The slice executor on partitioned stages: loss and gradients of uneven token slices
    (forward first to last, backward last to first) equal the whole model's."""
    cfg = TINY.with_(vocab_size=95)
    plan = Plan((1, 2), ((3, 9, 4), (7, 9)))
    tokens, targets = synthetic_batch(cfg, plan.batch, plan.seq_len, seed=31)
    whole = build_model(cfg, seed=9)
    _perturb(whole, seed=32)
    ref_loss = whole(tokens, targets=targets) / targets.numel()
    ref_loss.backward()
    ref_grads = _grads(whole)

    def body(op: OpGroup) -> tuple[Tensor, dict[str, Tensor]]:
        with one_thread():
            stages = [build_model(cfg, lo, hi, seed=9, op=op) for lo, hi in ((0, 1), (1, 4))]
            for stage in stages:
                _load_shards(stage, whole, op)
            loss = run_pipeline_local(stages, tokens, plan, targets=targets, recompute=recompute)
            grads: dict[str, Tensor] = {}
            for stage in stages:
                for name, g in _grads(stage).items():
                    # run_pipeline_local gives each tied copy the whole gradient.
                    key = "wte.weight" if name == "head.weight" else name
                    if key in grads:
                        torch.testing.assert_close(g, grads[key], rtol=0, atol=0)
                    grads[key] = g
            return loss.detach(), grads

    results = run_threads(n_op, body)
    for rank, (loss, _) in enumerate(results):
        assert_scaled_close(loss, ref_loss.detach(), what=f"loss on op rank {rank}")
    grads = _merge([r[1] for r in results], cfg)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert_scaled_close(grads[name], ref, what=f"grad {name}")


# ---- sequence parallelism -------------------------------------------------------------


def test_sequence_shard_by_hand() -> None:
    assert sequence_shard(12, OpGroup(2, 4, sequence_parallel=True)) == (6, 3)
    assert sequence_shard(12, OpGroup(0, 4, sequence_parallel=True)) == (0, 3)
    assert sequence_shard(12, OpGroup(2, 4)) == (0, 12)  # not sequence-parallel: all tokens
    assert sequence_shard(12, None) == (0, 12)
    with pytest.raises(ValueError, match="10 tokens does not split over #Op=4"):
        sequence_shard(10, OpGroup(1, 4, sequence_parallel=True))
    x = torch.ones(2, 3, 4)
    one = OpGroup(0, 1, sequence_parallel=True)
    for f in (gather_from_sequence, reduce_scatter_to_sequence):
        assert f(x, None) is x and f(x, one) is x  # nothing to communicate


@pytest.mark.parametrize("n_op", [2, 3])
def test_sequence_parallel_conjugates_against_the_unsplit_tensors(n_op: int) -> None:
    """Forward, gather_from_sequence joins the ranks' shards into the whole sequence and
    reduce_scatter_to_sequence gives each rank its tokens of the ranks' sum; backward,
    each is the other (the first's gradient is the rank's tokens of the ranks' summed
    gradients, the second's the ranks' shards' gradients joined)."""
    b, tokens, h = 2, 3, 4  # tokens per rank
    length = tokens * n_op
    g = torch.Generator().manual_seed(41)
    whole = torch.randn(b, length, h, generator=g)
    partials = torch.randn(n_op, b, length, h, generator=g)  # rank r's partial product
    up = torch.randn(n_op, b, length, h, generator=g)  # rank r's gradient of the gathered
    down = torch.randn(b, length, h, generator=g)  # rank r's tokens: its shard's gradient

    def body(op: OpGroup) -> tuple[Tensor, ...]:
        mine = slice(op.rank * tokens, (op.rank + 1) * tokens)
        shard = whole[:, mine].clone().requires_grad_()
        gathered = enter_tensor_parallel(shard, op)
        gathered.backward(up[op.rank])
        partial = partials[op.rank].clone().requires_grad_()
        scattered = leave_tensor_parallel(partial, op)
        scattered.backward(down[:, mine])
        assert shard.grad is not None and partial.grad is not None
        return gathered.detach(), shard.grad, scattered.detach(), partial.grad

    results = run_threads(n_op, body, sequence_parallel=True)
    for rank, (gathered, shard_grad, scattered, partial_grad) in enumerate(results):
        mine = slice(rank * tokens, (rank + 1) * tokens)
        assert torch.equal(gathered, whole), rank
        summed_up = up[0, :, mine] + up[1, :, mine] + (up[2, :, mine] if n_op == 3 else 0)
        assert_scaled_close(shard_grad, summed_up, what=f"gather's backward on rank {rank}")
        expected = partials[0, :, mine] + partials[1, :, mine]
        expected += partials[2, :, mine] if n_op == 3 else 0
        assert_scaled_close(scattered, expected, what=f"reduce-scatter on rank {rank}")
        assert torch.equal(partial_grad, down), rank


@pytest.mark.parametrize("n_op", [2, 4])
def test_sequence_parallel_token_slices_with_dropout_equal_the_whole(n_op: int) -> None:
    """Sequence-parallel stages [0, 1) and [1, 4) over token slices, with dropout: each
    rank's hidden states are its shard of each slice, its dropout masks the shard's rows
    of the whole batch's, and its replicated parameters' gradients (LayerNorms, position
    embedding, row-parallel biases) its tokens' part: summed over the ranks, with the
    partitioned ones merged, they are the whole model's gradients."""
    cfg = TINY.with_(vocab_size=95, dropout=0.1)
    plan = Plan((1, 2), ((4, 12, 8), (8, 16)))
    tokens, targets = synthetic_batch(cfg, plan.batch, plan.seq_len, seed=51)
    key = DropoutKey(seed=7)
    whole = build_model(cfg, seed=9)
    _perturb(whole, seed=52)
    ref_loss = whole(tokens, targets=targets, dropout=key) / targets.numel()
    ref_loss.backward()
    ref_grads = _grads(whole)

    def body(op: OpGroup) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        with one_thread():
            stages = [build_model(cfg, lo, hi, seed=9, op=op) for lo, hi in ((0, 1), (1, 4))]
            for stage in stages:
                _load_shards(stage, whole, op)
            with torch.no_grad():  # what the first stage hands on: the rank's shard
                hidden = stages[0](tokens[:1, :4], context=stages[0].new_context(1, 4))
            loss = run_pipeline_local(stages, tokens, plan, targets=targets, dropout=key)
            grads: dict[str, Tensor] = {}
            for stage in stages:
                for name, g in _grads(stage).items():
                    grads["wte.weight" if name == "head.weight" else name] = g
            return loss.detach(), grads, hidden

    results = run_threads(n_op, body, sequence_parallel=True)
    for rank, (loss, _, hidden) in enumerate(results):
        assert_scaled_close(loss, ref_loss.detach(), what=f"loss on op rank {rank}")
        assert hidden.shape == (1, 4 // n_op, cfg.hidden)
    replicated = [n for n in ref_grads if shard_spec(n) is None]
    summed = {n: torch.stack([r[1][n] for r in results]).sum(0) for n in replicated}
    for _, grads, _ in results:
        assert not torch.equal(grads["ln_f.weight"], summed["ln_f.weight"])  # a part only
        grads.update(summed)
    grads = _merge([r[1] for r in results], cfg)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert_scaled_close(grads[name], ref, what=f"grad {name}")


def test_thread_group_reduces_like_a_sum_and_a_max() -> None:
    """The simulated collectives themselves, against values written out by hand."""

    def body(op: OpGroup) -> tuple[Tensor, Tensor]:
        s = torch.tensor([1.0, 2.0]) * (op.rank + 1)
        m = torch.tensor([float(op.rank), -float(op.rank)])
        op.all_reduce(s)
        op.all_reduce_max(m)
        return s, m

    for s, m in run_threads(3, body):
        assert s.tolist() == [6.0, 12.0] and m.tolist() == [2.0, 0.0]


def test_op_group_rank_must_lie_in_the_group() -> None:
    with pytest.raises(ValueError, match="op rank 2 is outside the #Op group of 2"):
        OpGroup(2, 2)
    with pytest.raises(RuntimeError, match="no collectives"):
        OpGroup(0, 2).all_reduce(torch.zeros(1))
