"""Tests for tplib.nn.ring: context parallelism's ring attention, in one process.

Each CP rank runs in a thread of its own, and the ring's ``shift`` is a queue per rank,
so the ranks meet exactly as processes would, without any process. The reference is the
whole model on the whole batch in one call (causal attention, plain autograd): the ranks'
losses must sum to its loss and their gradients to its gradients, for #CP = 2 and 4,
whole sequences and token slices, with and without recomputation, through the fused CPU
kernels and through the written-out blocks other devices take.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from torch import Tensor

from tplib.nn import ring
from tplib.nn.configs import check_cp_length, get_config
from tplib.nn.data import synthetic_batch
from tplib.nn.model import GPTStage, build_model
from tplib.nn.ring import CPGroup, cp_positions, cp_shard, ring_context
from tplib.nn.slicing import full_batch_loss, run_pipeline_local
from tplib.plan import Plan

from .conftest import assert_scaled_close

CFG = get_config("tiny")
T = TypeVar("T")
BATCH, SEQ_LEN = 2, 32


def _ring(n_cp: int) -> list[CPGroup]:
    """One CPGroup per rank, passing tensors through queues (inbox r: what rank r gets)."""
    inboxes: list[queue.Queue[Tensor]] = [queue.Queue() for _ in range(n_cp)]

    def shift(rank: int) -> Callable[[Tensor], Tensor]:
        def send_and_receive(tensor: Tensor) -> Tensor:
            inboxes[(rank + 1) % n_cp].put(tensor.clone())
            return inboxes[rank].get(timeout=60)

        return send_and_receive

    return [CPGroup(r, n_cp, shift(r)) for r in range(n_cp)]


def _on_ranks(n_cp: int, work: Callable[[CPGroup], T]) -> list[T]:
    """``work(group)`` on every rank of a ring, each in a thread; their results in rank
    order (an exception in any is raised here)."""
    results: list[T | BaseException | None] = [None] * n_cp

    def run(group: CPGroup) -> None:
        try:
            results[group.rank] = work(group)
        except BaseException as exc:  # handed to the test below
            results[group.rank] = exc

    threads = [threading.Thread(target=run, args=(g,)) for g in _ring(n_cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done = []
    for r in results:
        if isinstance(r, BaseException):
            raise r
        assert r is not None, "a rank did not finish"
        done.append(r)
    return done


def _reference() -> tuple[float, dict[str, Tensor]]:
    model = build_model(CFG)
    tokens, targets = synthetic_batch(CFG, BATCH, SEQ_LEN, seed=3)
    loss = full_batch_loss(model, tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("n_cp", "plan", "recompute", "split"),
    [
        pytest.param(2, Plan.uniform(BATCH, SEQ_LEN), "none", 1, id="cp2-whole"),
        pytest.param(2, Plan((1, 1), ((12, 4, 16), (8, 24))), "full", 2, id="cp2-sliced-full"),
        pytest.param(4, Plan((2,), ((8, 16, 8),)), "selective", 1, id="cp4-sliced-selective"),
        pytest.param(4, Plan((1, 1), ((SEQ_LEN,), (24, 8))), "none", 2, id="cp4-two-stages"),
    ],
)
def test_ring_ranks_sum_to_the_whole_model(
    n_cp: int, plan: Plan, recompute: str, split: int
) -> None:
    """Every rank runs its chunks of every unit through ``split`` stages; the ranks'
    losses and gradients summed are the whole model's."""
    tokens, targets = synthetic_batch(CFG, BATCH, SEQ_LEN, seed=3)

    def rank(group: CPGroup) -> tuple[float, dict[str, Tensor]]:
        cuts = [0, CFG.n_layer // 2, CFG.n_layer] if split == 2 else [0, CFG.n_layer]
        stages = [build_model(CFG, lo, hi, cp=group) for lo, hi in itertools.pairwise(cuts)]
        loss = run_pipeline_local(stages, tokens, plan, targets=targets, recompute=recompute)
        grads = {n: p.grad for s in stages for n, p in s.named_parameters() if p.grad is not None}
        return loss.item(), grads

    ranks = _on_ranks(n_cp, rank)
    want_loss, want_grads = _reference()
    assert sum(loss for loss, _ in ranks) == pytest.approx(want_loss, rel=1e-5)
    for name, want in want_grads.items():
        got = torch.stack([grads[name] for _, grads in ranks]).sum(0)
        assert_scaled_close(got, want, 1e-5, f"grad {name}")


def test_the_written_out_ring_other_devices_take_is_exact_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The masked float32 blocks (off CPU, or not float32) on CPU, with recomputation."""
    monkeypatch.setattr(ring, "_fused", lambda q: False)
    test_ring_ranks_sum_to_the_whole_model(2, Plan((1, 1), ((12, 4, 16), (8, 24))), "full", 1)


def test_ranks_hold_every_position_once_in_balanced_pairs() -> None:
    for n_cp, length in ((2, 8), (4, 16), (3, 12)):
        held = [cp_positions(5, length, r, n_cp) for r in range(n_cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(5, 5 + length))
        c = length // (2 * n_cp)
        for r, pos in enumerate(held):  # chunk r and its mirror 2 #CP - 1 - r
            assert pos[:c].tolist() == list(range(5 + r * c, 5 + (r + 1) * c))
            assert pos[c:].tolist() == list(range(5 + length - (r + 1) * c, 5 + length - r * c))
            # Causal work balanced: every rank's queries see the same number of keys.
            assert int((pos - 5 + 1).sum()) == int((held[0] - 5 + 1).sum())
        x = torch.arange(5, 5 + length).repeat(2, 1)
        for r in range(n_cp):
            assert torch.equal(cp_shard(x, CPGroup(r, n_cp))[0], held[r])


def test_lengths_not_divisible_by_two_cp_are_refused() -> None:
    with pytest.raises(ValueError, match=r"12 tokens is not divisible by 2\*#CP = 8"):
        check_cp_length(12, 4)
    with pytest.raises(ValueError, match="L not divisible by 2"):
        cp_positions(0, 6, 0, 2)
    with pytest.raises(ValueError, match="not divisible by 2"):
        cp_shard(torch.zeros(1, 6), CPGroup(0, 2))
    with pytest.raises(ValueError, match="cp rank 2 is outside the #CP group of 2"):
        CPGroup(2, 2)


def test_a_cp_stage_refuses_another_attention_and_what_the_ring_lacks() -> None:
    stage = GPTStage(CFG, cp=CPGroup(0, 2))
    with pytest.raises(ValueError, match="attention impl 'split' with #CP=2"):
        stage.new_context(1, SEQ_LEN, attention="split")
    with pytest.raises(ValueError, match="a sequence of 30 tokens is not divisible"):
        ring_context(range(1), batch=1, n_head=1, seq_len=30, head_dim=4,
                     dtype=torch.float32, device="cpu", n_cp=2)  # fmt: skip
    dropping = get_config("tiny", (("dropout", 0.1),))
    with pytest.raises(ValueError, match=r"dropout=0\.1: the ring attention supports neither"):
        GPTStage(dropping, cp=CPGroup(0, 2))
    context = stage.new_context(1, SEQ_LEN)
    assert context[0].k.shape[2] == SEQ_LEN // 2  # its own slots only
