"""Exactness of token-slice execution against whole sequences on one device (float32)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tplib.nn.configs import get_config
from tplib.nn.context import ATTENTION_IMPLS
from tplib.nn.data import synthetic_batch
from tplib.nn.model import GPTStage, build_model
from tplib.nn.slicing import SliceExecutor, full_batch_loss, run_pipeline_local
from tplib.plan import Plan, Unit

from .conftest import assert_scaled_close

CFG = get_config("tiny")


@st.composite
def compositions(draw: st.DrawFn, total: int) -> tuple[int, ...]:
    """A random composition of ``total``: positive parts in order, including all-ones and one part."""
    kind = draw(st.sampled_from(["random", "ones", "single"]))
    if kind == "ones":
        return (1,) * total
    if kind == "single":
        return (total,)
    cuts = (
        draw(st.sets(st.integers(1, total - 1), max_size=min(total - 1, 8))) if total > 1 else set()
    )
    bounds = [0, *sorted(cuts), total]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


@st.composite
def plans(draw: st.DrawFn, max_batch: int = 4, max_len: int = 40) -> Plan:
    batch = draw(st.integers(1, max_batch))
    seq_len = draw(st.integers(1, max_len))
    batch_slices = draw(compositions(batch))
    token_slices = tuple(draw(compositions(seq_len)) for _ in batch_slices)
    return Plan(batch_slices, token_slices)


def _reference(
    model: GPTStage, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = full_batch_loss(model, tokens, targets)
    loss.backward()
    return loss.detach(), _grads(model)


def _grads(model: GPTStage) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n} has no gradient"
        out[n] = p.grad.clone()
    return out


def _assert_grads_match(stages: Sequence[GPTStage], ref_grads: dict[str, torch.Tensor]) -> None:
    # A last stage's head is the first stage's embedding: run_pipeline_local gives each
    # copy the whole gradient of the shared matrix.
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            key = "wte.weight" if name == "head.weight" and stage.cfg.tie_embeddings else name
            assert p.grad is not None, f"{name} has no gradient"
            assert_scaled_close(
                p.grad, ref_grads[key], what=f"stage [{stage.lo}, {stage.hi}) {name}"
            )
            seen.add(key)
    assert seen == ref_grads.keys()


@pytest.mark.parametrize("attention", ATTENTION_IMPLS)
@settings(max_examples=40)
@given(plan=plans())
def test_sliced_whole_model_matches_the_reference(plan: Plan, attention: str) -> None:
    model = build_model(CFG, seed=1)
    tokens, targets = synthetic_batch(CFG, plan.batch, plan.seq_len, seed=2)
    ref_loss, ref_grads = _reference(model, tokens, targets)
    model.zero_grad()
    loss = run_pipeline_local([model], tokens, plan, targets=targets, attention=attention)
    assert_scaled_close(loss, ref_loss, what="loss")
    _assert_grads_match([model], ref_grads)


@settings(max_examples=40)
@given(plans(max_batch=3, max_len=32), st.sampled_from([(0, 1, 4), (0, 2, 4), (0, 1, 2, 3, 4)]))
def test_chained_stages_match_the_reference(plan: Plan, cuts: tuple[int, ...]) -> None:
    whole = build_model(CFG, seed=4)
    tokens, targets = synthetic_batch(CFG, plan.batch, plan.seq_len, seed=5)
    ref_loss, ref_grads = _reference(whole, tokens, targets)
    stages = [build_model(CFG, lo, hi, seed=4) for lo, hi in itertools.pairwise(cuts)]
    loss = run_pipeline_local(stages, tokens, plan, targets=targets)
    assert_scaled_close(loss, ref_loss, what="loss")
    _assert_grads_match(stages, ref_grads)


@pytest.mark.parametrize("attention", ATTENTION_IMPLS)
@settings(max_examples=30)
@given(plan=plans(max_batch=3, max_len=32))
def test_middle_stage_input_gradients_match(plan: Plan, attention: str) -> None:
    stage = build_model(CFG, 1, 3, seed=6)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(plan.batch, plan.seq_len, CFG.hidden, generator=g)
    grad_out = torch.randn(plan.batch, plan.seq_len, CFG.hidden, generator=g)
    x_ref = x.clone().requires_grad_()
    y_ref = stage(x_ref)
    y_ref.backward(grad_out)
    ref_grads = _grads(stage)
    stage.zero_grad()
    x_sl = x.clone().requires_grad_()
    y = run_pipeline_local([stage], x_sl, plan, grad_output=grad_out, attention=attention)
    assert_scaled_close(y, y_ref.detach(), what="output")
    assert_scaled_close(x_sl.grad, x_ref.grad, what="input grad")
    for name, p in stage.named_parameters():
        assert_scaled_close(p.grad, ref_grads[name], what=name)


def test_context_buffers_are_allocated_once() -> None:
    model = build_model(CFG)
    plan = Plan((2,), ((5, 7, 4),))
    tokens, targets = synthetic_batch(CFG, 2, 16)
    ex = SliceExecutor(model, plan)
    pointers = None
    for _ in range(2):  # two iterations reuse the same buffers
        for t, (lo, hi) in enumerate(
            zip(plan.token_bounds(0), plan.token_bounds(0)[1:], strict=False)
        ):
            ex.forward(Unit(0, t), tokens[:, lo:hi], targets[:, lo:hi])
            ptrs = [(c.k.data_ptr(), c.v.data_ptr()) for c in ex.context(0).layers.values()]
            assert pointers is None or ptrs == pointers
            pointers = ptrs
        for t in reversed(range(3)):
            ex.backward(Unit(0, t))


def test_repeated_iterations_accumulate_like_the_reference() -> None:
    model = build_model(CFG)
    plan = Plan((1, 1), ((3, 9), (6, 6)))
    tokens, targets = synthetic_batch(CFG, 2, 12)
    _, ref = _reference(model, tokens, targets)
    model.zero_grad()
    for _ in range(2):
        run_pipeline_local([model], tokens, plan, targets=targets)
    for name, p in model.named_parameters():
        assert_scaled_close(p.grad, 2 * ref[name], what=name)


def test_out_of_order_slices_are_refused() -> None:
    model = build_model(CFG)
    plan = Plan((1,), ((4, 4),))
    tokens, targets = synthetic_batch(CFG, 1, 8)
    ex = SliceExecutor(model, plan)
    with pytest.raises(RuntimeError, match=r"forward of Unit\(b=0, t=1\) out of order"):
        ex.forward(Unit(0, 1), tokens[:, 4:], targets[:, 4:])
    ex.forward(Unit(0, 0), tokens[:, :4], targets[:, :4])
    ex.forward(Unit(0, 1), tokens[:, 4:], targets[:, 4:])
    with pytest.raises(RuntimeError, match=r"backward of Unit\(b=0, t=0\) out of order"):
        ex.backward(Unit(0, 0))


def test_slices_that_do_not_cover_the_sequence_are_rejected() -> None:
    model = build_model(CFG)
    tokens, targets = synthetic_batch(CFG, 1, 10)
    with pytest.raises(
        ValueError, match=r"token slices \[4, 4\] sum to 8, not the sequence length 10"
    ):
        run_pipeline_local([model], tokens, Plan((1,), ((4, 4),)), targets=targets)


def test_plan_longer_than_the_context_is_rejected() -> None:
    model = build_model(CFG)
    with pytest.raises(
        ValueError, match=r"plan's sequence length 80 exceeds the model's context of 64"
    ):
        SliceExecutor(model, Plan((1,), ((40, 40),)))


@pytest.mark.parametrize(
    ("plan", "cut"),
    [
        (Plan((1, 2), ((3, 9, 4), (7, 1, 8))), 1),
        (Plan((2, 1), ((11, 5), (1, 2, 13))), 3),
        (Plan((3,), ((16,),)), 2),  # unsliced
    ],
)
def test_full_recomputation_matches_no_recomputation_and_the_reference(
    plan: Plan, cut: int
) -> None:
    whole = build_model(CFG, seed=12)
    tokens, targets = synthetic_batch(CFG, plan.batch, plan.seq_len, seed=13)
    ref_loss, ref_grads = _reference(whole, tokens, targets)
    runs = {}
    for recompute in ("none", "full"):
        stages = [build_model(CFG, 0, cut, seed=12), build_model(CFG, cut, 4, seed=12)]
        loss = run_pipeline_local(stages, tokens, plan, targets=targets, recompute=recompute)
        assert_scaled_close(loss, ref_loss, what=f"loss, recompute={recompute}")
        _assert_grads_match(stages, ref_grads)
        runs[recompute] = loss, stages
    assert_scaled_close(runs["full"][0], runs["none"][0], what="loss full vs none")
    for full, none in zip(runs["full"][1], runs["none"][1], strict=True):
        for (name, p), (_, q) in zip(full.named_parameters(), none.named_parameters(), strict=True):
            assert_scaled_close(p.grad, q.grad, what=f"{name} full vs none")


def test_full_recomputation_saves_nothing_until_backward() -> None:
    """recompute="full": a unit's forward records no graph (autograd saves no tensor); its
    backward runs the forward again and saves what "none" saved in the forward."""
    plan = Plan((2,), ((5, 11),))
    _, targets = synthetic_batch(CFG, 2, 16, seed=14)
    x = torch.randn(2, 16, CFG.hidden, generator=torch.Generator().manual_seed(16))
    counts = {"forward": 0, "backward": 0}
    phase = ["forward"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts[phase[0]] += 1
        return t

    saved = {}
    for recompute in ("none", "full"):
        counts.update(forward=0, backward=0)
        ex = SliceExecutor(build_model(CFG, 1, 4, seed=15), plan, recompute=recompute)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            phase[0] = "forward"
            for t, (lo, hi) in enumerate(itertools.pairwise(plan.token_bounds(0))):
                ex.forward(Unit(0, t), x[:, lo:hi], targets[:, lo:hi])
            phase[0] = "backward"
            for t in reversed(range(2)):
                grad = ex.backward(Unit(0, t))
                assert grad is not None and grad.shape == (2, plan.token_slices[0][t], CFG.hidden)
        saved[recompute] = dict(counts)
    assert saved["none"]["forward"] > 0 and saved["none"]["backward"] == 0
    assert saved["full"] == {"forward": 0, "backward": saved["none"]["forward"]}


def test_an_executor_sets_its_stores_on_the_stage_either_way() -> None:
    """A stage a split-backward executor ran keeps no deferring store once a plain one
    takes it over (its products then accumulate as they would have), and the context
    dtype a chain asks for is the one its contexts get."""
    from tplib.nn.linear import Linear

    stage = build_model(CFG, seed=1)
    plan = Plan.uniform(2, 16, n_token_slices=2)
    split = SliceExecutor(stage, plan, split_backward=True)
    products = [m for m in stage.modules() if isinstance(m, Linear)]
    assert products and all(m.deferred is split.deferred is not None for m in products)
    SliceExecutor(stage, plan, dtype=torch.float64)
    assert all(m.deferred is None for m in products)
    plain = SliceExecutor(stage, plan, dtype=torch.bfloat16)
    assert plain.context(0)[0].k.dtype == torch.bfloat16
