"""Selective recomputation (tplib.nn.selective): a stage keeps no attention scores, and its
gradients are, bit for bit, those of the stage that kept everything.

A middle stage (layers 1 and 2 of tiny) runs one batch slice of two sequences in two
token slices, 5 and 11 tokens, so the second slice attends over the first's K/V context.
What its forwards keep is counted by the runtime's memory meter (parameters and the K/V
context buffers excluded, as the runtime excludes them), and the expected differences
are worked out by hand from shapes (float32: 4 bytes, bool: 1), as in
tests/test_runtime_memory.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from tplib.nn.bytecount import context_tensors
from tplib.nn.configs import get_config
from tplib.nn.data import synthetic_batch
from tplib.nn.dropout import DropoutKey
from tplib.nn.model import CausalSelfAttention, build_model
from tplib.nn.slicing import SliceExecutor
from tplib.plan import Plan, Unit
from tplib.runtime.memory import MemoryMeter

CFG = get_config("tiny")
PLAN = Plan((2,), ((5, 11),))
UNITS = ((5, 5), (11, 16))  # each unit's (queries, keys): its length and context end
LAYERS = 2
B, H, WIDTH = 2, CFG.n_head, CFG.hidden
KEY = DropoutKey(5)


def _run(
    recompute: str, *, dropout: float, attention: str | None = None, split: bool = False
) -> tuple[int, dict[str, Tensor]]:
    """The bytes the stage's forwards keep, and its gradients after the backwards: every
    parameter's and the stage input's."""
    stage = build_model(CFG.with_(dropout=dropout), 1, 1 + LAYERS, seed=3)
    ex = SliceExecutor(stage, PLAN, recompute=recompute, attention=attention, split_backward=split)
    ex.dropout = KEY
    meter = MemoryMeter()
    meter.exclude(stage.parameters())
    meter.exclude(context_tensors([ex.context(0)]))
    x = torch.randn(B, 16, CFG.hidden, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(B, 16, CFG.hidden, generator=torch.Generator().manual_seed(2))
    bounds = list(itertools.pairwise(PLAN.token_bounds(0)))
    with meter:
        for t, (lo, hi) in enumerate(bounds):
            ex.forward(Unit(0, t), x[:, lo:hi])
        kept = meter.current
        # The global generator moves on before backward: a mask drawn from it would not
        # be drawn again when the core is recomputed; keyed masks are.
        torch.rand(1000)
        grad_in = [
            ex.backward(Unit(0, t), grad_out[:, lo:hi])
            for t, (lo, hi) in reversed(list(enumerate(bounds)))
        ][::-1]
        if split:
            ex.weight_grad(0)
    grads = {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(stage.parameters()))
    return kept, grads | {"input": torch.cat([g for g in grad_in if g is not None], dim=1)}


def _assert_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_written_out_attention_keeps_no_scores_and_the_same_gradients() -> None:
    # Dropout writes attention out. Per score "none" keeps the fp32 softmax, the keep mask
    # and the fp32 dropped probabilities; per unit the causal mask (queries x keys) and the
    # queries copied contiguous for the batched product (4 b s w). Selective keeps
    # instead the QKV product that q, k and v are views of (12 b s w).
    none, reference = _run("none", dropout=0.1)
    selective, grads = _run("selective", dropout=0.1)
    scores = sum(9 * B * H * s * end + s * end for s, end in UNITS)
    queries = sum((4 - 12) * B * s * WIDTH for s, _ in UNITS)
    assert none - selective == LAYERS * (scores + queries)
    _assert_equal(grads, reference)


@pytest.mark.parametrize("attention", ["split", "masked"])
def test_fused_attention_drops_its_log_sum_exp_and_keeps_the_same_gradients(
    attention: str,
) -> None:
    # The fused kernels keep no scores: only an fp32 log-sum-exp per head and query, which
    # selective drops (masked attention on CPU also keeps its mask as floats).
    none, reference = _run("none", dropout=0.0, attention=attention)
    selective, grads = _run("selective", dropout=0.0, attention=attention)
    lse = LAYERS * sum(4 * B * H * s for s, _ in UNITS)
    if attention == "split":
        assert none - selective == lse
    else:
        assert none - selective >= lse
    _assert_equal(grads, reference)


def test_selective_composes_with_split_backwards() -> None:
    """B recomputes the cores and defers the weight gradients; W computes them: the same
    gradients as the split backward that kept everything."""
    _, reference = _run("none", dropout=0.1, split=True)
    _, grads = _run("selective", dropout=0.1, split=True)
    _assert_equal(grads, reference)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_whole_sequences_without_a_context_recompute_their_core(dropout: float) -> None:
    """A stage called on whole sequences (the reference's way): the fused causal kernel,
    or with dropout the written-out attention, recomputed as well."""
    cfg = CFG.with_(dropout=dropout)
    tokens, targets = synthetic_batch(cfg, B, 16, seed=4)
    runs = []
    for recompute in (False, True):
        model = build_model(cfg, seed=6)
        cores = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
        for m in cores:
            m.recompute_core = recompute
        meter = MemoryMeter()
        meter.exclude(model.parameters())
        with meter:
            loss = model(tokens, targets=targets, dropout=KEY)
        kept = meter.current
        loss.backward()
        runs.append((kept, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (none, reference), (selective, grads) = runs
    assert selective < none
    _assert_equal(grads, reference)


def test_an_executor_sets_selective_on_the_stage_either_way() -> None:
    stage = build_model(CFG, seed=1)
    cores = [m for m in stage.modules() if isinstance(m, CausalSelfAttention)]
    SliceExecutor(stage, PLAN, recompute="selective")
    assert len(cores) == CFG.n_layer and all(m.recompute_core for m in cores)
    SliceExecutor(stage, PLAN, recompute="full")  # recomputes whole forwards instead
    assert not any(m.recompute_core for m in cores)
