"""Tests for tplib.nn.wgrad (and the split backward of tplib.nn.linear and tplib.nn.slicing):
a backward split into B (input gradients) and W (weight gradients) gives the gradients
of one whole-batch backward, whichever W covers which units, in float32 exactly and
under bf16 autocast within bf16's rounding."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from tplib.nn.configs import get_config
from tplib.nn.data import synthetic_batch
from tplib.nn.linear import Linear
from tplib.nn.model import GPTStage, build_model
from tplib.nn.slicing import SliceExecutor, full_batch_loss, run_pipeline_local, unit_rows
from tplib.nn.wgrad import DeferredWeightGrads
from tplib.plan import Plan, Unit
from tplib.schedule import WHOLE_SEQUENCE

from .conftest import assert_scaled_close

CFG = get_config("tiny")
REL = 1e-6  # float32: measured worst 6e-7 of each gradient's largest magnitude

PLANS = [
    Plan((1, 1), ((7, 1, 8), (3, 13))),  # uneven, a different slice count per batch slice
    Plan.uniform(4, 16, n_token_slices=4),
    Plan((2, 1), ((11, 5), (1, 2, 13))),
    Plan.gpipe(3, 16),  # microbatches: W of one slice each
]
CUTS = [(0, 4), (0, 2, 4)]  # one stage, two stages


def _reference(
    cut_seed: int, plan: Plan, data_seed: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The whole model's mean loss and gradients over the whole batch, unsliced."""
    model = build_model(CFG, seed=cut_seed)
    tokens, targets = synthetic_batch(CFG, plan.batch, plan.seq_len, seed=data_seed)
    loss = full_batch_loss(model, tokens, targets)
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        grads[n] = p.grad.clone()
    return loss.detach(), grads, tokens, targets


def _stages(cuts: Sequence[int], seed: int) -> list[GPTStage]:
    return [build_model(CFG, lo, hi, seed=seed) for lo, hi in itertools.pairwise(cuts)]


def _assert_grads(
    stages: Sequence[GPTStage], ref: dict[str, torch.Tensor], tied_summed: bool = True
) -> None:
    """Every parameter's gradient against the reference's. A last stage's head is the
    tied embedding: with ``tied_summed`` it holds the whole gradient (run_pipeline_local
    sums the two copies), otherwise the first stage's ``wte`` and the last stage's head
    are summed here."""
    seen = set()
    head_plus_wte = None
    if not tied_summed and len(stages) > 1:
        g0, g1 = stages[0].wte.weight.grad, stages[-1].head.weight.grad
        assert g0 is not None and g1 is not None
        head_plus_wte = g0 + g1
    for stage in stages:
        for name, p in stage.named_parameters():
            key = "wte.weight" if name == "head.weight" else name
            grad = p.grad
            if head_plus_wte is not None and key == "wte.weight":
                grad = head_plus_wte
            assert_scaled_close(grad, ref[key], rel=REL, what=f"[{stage.lo}, {stage.hi}) {name}")
            seen.add(key)
    assert seen == ref.keys()


def _block_linears(stages: Sequence[GPTStage]) -> list[Linear]:
    """The products whose weights get gradients from W only (the head's weight is the
    tied embedding's, which B's embedding lookup also writes on a single stage)."""
    return [
        m
        for s in stages
        for name, m in s.named_modules()
        if isinstance(m, Linear) and name.startswith("blocks.")
    ]


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("cuts", CUTS, ids=lambda c: f"{len(c) - 1}stages")
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_split_backward_matches_the_whole_batch_reference(
    plan: Plan, cuts: tuple[int, ...], recompute: str
) -> None:
    ref_loss, ref_grads, tokens, targets = _reference(21, plan, 22)
    split = _stages(cuts, 21)
    loss = run_pipeline_local(
        split, tokens, plan, targets=targets, recompute=recompute, split_backward=True
    )
    assert_scaled_close(loss, ref_loss, rel=REL, what="loss")
    _assert_grads(split, ref_grads)
    # B changes nothing forward: the loss is the unsplit pipeline's, bit for bit.
    unsplit = _stages(cuts, 21)
    plain = run_pipeline_local(unsplit, tokens, plan, targets=targets, recompute=recompute)
    assert torch.equal(loss, plain)


def _run_f_and_b(
    executors: Sequence[SliceExecutor], plan: Plan, tokens: torch.Tensor, targets: torch.Tensor
) -> None:
    """Every unit forward through the executors' stages, then every unit backward (B)."""
    for unit in plan.units():
        h = unit_rows(plan, unit, tokens)
        for ex in executors:
            y = unit_rows(plan, unit, targets) if ex.stage.is_last else None
            h = ex.forward(unit, h, y)
    for unit in reversed(list(plan.units())):
        grad = None
        for ex in reversed(executors):
            grad = ex.backward(unit, grad)


def _executors(plan: Plan, seed: int) -> list[SliceExecutor]:
    """Two split-backward stages with the mean loss's scale."""
    scale = 1.0 / (plan.batch * plan.seq_len)
    return [
        SliceExecutor(s, plan, loss_scale=scale, split_backward=True)
        for s in _stages((0, 2, 4), seed)
    ]


def test_per_unit_w_equals_fused_w_and_the_reference() -> None:
    plan = Plan((1, 2), ((5, 11), (3, 6, 7)))
    _, ref_grads, tokens, targets = _reference(23, plan, 24)
    runs = {}
    for how in ("per unit", "fused"):
        executors = _executors(plan, 23)
        _run_f_and_b(executors, plan, tokens, targets)
        stages = [ex.stage for ex in executors]
        # B left every block product's weight gradient to W, and computed the rest.
        for m in _block_linears(stages):
            assert m.weight.grad is None and m.bias is not None and m.bias.grad is None
        assert all(p.grad is not None for s in stages for n, p in s.named_parameters() if "ln" in n)
        for ex in executors:
            assert ex.deferred is not None and ex.deferred.pending == list(plan.units())
            if how == "fused":
                ex.weight_grad(1)
                ex.weight_grad(0, WHOLE_SEQUENCE)
            else:
                # Units in any order, a sequence's slices apart or some together.
                ex.weight_grad(0, 1)
                ex.weight_grad(1, 0)
                assert ex.deferred.pending == [Unit(0, 0), Unit(1, 1), Unit(1, 2)]
                ex.deferred.compute([Unit(1, 2), Unit(0, 0)])
                ex.weight_grad(1, 1)
            assert ex.deferred.pending == []
        _assert_grads(stages, ref_grads, tied_summed=False)
        runs[how] = stages
    for a, b in zip(runs["per unit"], runs["fused"], strict=True):
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert_scaled_close(p.grad, q.grad, rel=REL, what=f"{name}: per unit vs fused")


def test_pending_empties_sequence_by_sequence() -> None:
    plan = Plan((1, 1), ((4, 12), (8, 8)))
    tokens, targets = synthetic_batch(CFG, 2, 16, seed=25)
    ex = SliceExecutor(build_model(CFG, seed=26), plan, split_backward=True)
    _run_f_and_b([ex], plan, tokens, targets)
    assert ex.deferred is not None
    assert ex.deferred.pending == list(plan.units())
    ex.weight_grad(1)
    assert ex.deferred.pending == [Unit(0, 0), Unit(0, 1)]
    ex.weight_grad(0)
    assert ex.deferred.pending == []


def test_w_before_its_b_or_twice_is_refused() -> None:
    plan = Plan((1,), ((6, 10),))
    tokens, targets = synthetic_batch(CFG, 1, 16, seed=27)
    ex = SliceExecutor(build_model(CFG, seed=28), plan, split_backward=True)
    for t, (lo, hi) in enumerate(itertools.pairwise(plan.token_bounds(0))):
        ex.forward(Unit(0, t), tokens[:, lo:hi], targets[:, lo:hi])
    with pytest.raises(RuntimeError, match="before their B"):
        ex.weight_grad(0, 1)
    ex.backward(Unit(0, 1))
    # The whole sequence's W needs every slice's B: refused whole, nothing computed.
    with pytest.raises(RuntimeError, match=r"W of \[Unit\(b=0, t=0\)\] before their B"):
        ex.weight_grad(0)
    assert all(m.weight.grad is None for m in _block_linears([ex.stage]))
    ex.weight_grad(0, 1)
    with pytest.raises(RuntimeError, match="before their B"):
        ex.weight_grad(0, 1)  # computed once: it is gone
    ex.backward(Unit(0, 0))
    ex.weight_grad(0, 0)
    assert ex.deferred is not None and ex.deferred.pending == []


def test_a_second_b_before_its_w_is_refused() -> None:
    store = DeferredWeightGrads()
    with store.collecting(Unit(0, 0)):
        pass
    with pytest.raises(RuntimeError, match="deferred twice"), store.collecting(Unit(0, 0)):
        pass


def test_weight_grad_needs_split_backward() -> None:
    plan = Plan((1,), ((16,),))
    tokens, targets = synthetic_batch(CFG, 1, 16, seed=29)
    ex = SliceExecutor(build_model(CFG, seed=30), plan)
    assert ex.deferred is None
    ex.forward(Unit(0, 0), tokens, targets)
    ex.backward(Unit(0, 0))
    with pytest.raises(RuntimeError, match="without split_backward"):
        ex.weight_grad(0)


@pytest.mark.parametrize("bias", [True, False])
def test_deferred_linear_against_autograd(bias: bool) -> None:
    """One Linear, two units: B gives autograd's input gradient and leaves the weight
    gradients; W over both units gives autograd's sum, in one product."""
    g = torch.Generator().manual_seed(31)
    lin = Linear(6, 5, bias=bias)
    ref = torch.nn.Linear(6, 5, bias=bias)
    ref.load_state_dict(lin.state_dict())
    held: list[torch.Tensor] = []
    store = DeferredWeightGrads(hold=lambda t: held.append(t))
    lin.deferred = store
    xs = [torch.randn(2, n, 6, generator=g) for n in (3, 4)]
    dys = [torch.randn(2, n, 5, generator=g) for n in (3, 4)]
    for t, (x, dy) in enumerate(zip(xs, dys, strict=True)):
        x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
        F.linear(x_ref, ref.weight, ref.bias).backward(dy)
        with store.collecting(Unit(0, t)):
            lin(x_new).backward(dy)
        assert x_new.grad is not None and x_ref.grad is not None
        torch.testing.assert_close(x_new.grad, x_ref.grad, rtol=0, atol=1e-6)
        assert lin.weight.grad is None and (lin.bias is None or lin.bias.grad is None)
    assert len(held) == 4  # x and dy of each unit
    assert store.pending == [Unit(0, 0), Unit(0, 1)]
    store.compute([Unit(0, 0), Unit(0, 1)])
    assert ref.weight.grad is not None
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    if bias:
        assert lin.bias is not None and ref.bias is not None
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)
    assert store.pending == []
    # Outside a collecting block a deferring Linear computes its weight gradient at once.
    lin.zero_grad(set_to_none=True)
    x = xs[0].clone().requires_grad_()
    lin(x).backward(dys[0])
    want = torch.einsum("bto,bti->oi", dys[0], xs[0])
    torch.testing.assert_close(lin.weight.grad, want, rtol=1e-6, atol=1e-6)


# bf16 autocast: split and unsplit round differently (W's one product over a whole
# sequence is rounded to bf16 once; unsplit, each slice's product is). Measured on these
# plans: split vs unsplit needs atol 4.0e-4 at rtol 2e-2 (gradients up to ~0.25), the
# same size as unsplit bf16 against float32 (5.1e-4); with one slice per sequence split
# and unsplit are identical.
RTOL_BF16, ATOL_BF16 = 2e-2, 1e-3


@pytest.mark.parametrize("plan", PLANS[:3], ids=str)
def test_split_backward_under_bf16_autocast(plan: Plan) -> None:
    tokens, targets = synthetic_batch(CFG, plan.batch, plan.seq_len, seed=32)
    runs = {}
    for split in (True, False):
        stages = _stages((0, 2, 4), 33)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run_pipeline_local(stages, tokens, plan, targets=targets, split_backward=split)
        runs[split] = loss, stages
    exact = _stages((0, 2, 4), 33)
    run_pipeline_local(exact, tokens, plan, targets=targets)
    assert torch.equal(runs[True][0], runs[False][0])
    for a, b, c in zip(runs[True][1], runs[False][1], exact, strict=True):
        params = zip(a.named_parameters(), b.named_parameters(), c.parameters(), strict=True)
        for (name, p), (_, q), r in params:
            assert p.grad is not None and q.grad is not None and r.grad is not None
            assert p.grad.dtype == torch.float32, name
            for other, what in ((q.grad, "unsplit"), (r.grad, "float32")):
                torch.testing.assert_close(
                    p.grad, other, rtol=RTOL_BF16, atol=ATOL_BF16, msg=f"{name}: split vs {what}"
                )


def test_bf16_autocast_defers_too() -> None:
    plan = Plan((1,), ((8, 8),))
    tokens, targets = synthetic_batch(CFG, 1, 16, seed=34)
    executors = _executors(plan, 35)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _run_f_and_b(executors, plan, tokens, targets)
        assert all(m.weight.grad is None for m in _block_linears([e.stage for e in executors]))
        for ex in executors:
            ex.weight_grad(0)
    for m in _block_linears([e.stage for e in executors]):
        assert m.weight.grad is not None and m.weight.grad.dtype == torch.float32
        assert m.weight.grad.abs().max() > 0
