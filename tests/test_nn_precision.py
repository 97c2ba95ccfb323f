"""Tests for tplib.nn.precision and tplib.nn.optimizer (the optimizers of its precisions): the loss scaler's rules, fp16 master-weight AdamW against torch's
AdamW on an independent fp32 copy, overflow skipping, and loss scaling rescuing a gradient
that fp16 would flush to zero, fp16 gradients summed over many units in fp32 main grads;
GPT-3's weight-decay groups, the learning rate set per step
and clipping of the gradients the step uses (fp16: the unscaled master grads) against torch's
own tools. Everything runs on CPU with float16 tensors."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, TypedDict, cast

import pytest
import torch
from torch import Tensor

from tplib.nn.bytecount import storage_bytes
from tplib.nn.linear import Linear
from tplib.nn.optimizer import (
    DECAY_RULES,
    DynamicLossScaler,
    MixedPrecisionOptimizer,
    PlainOptimizer,
    is_matrix,
    make_optimizer,
)
from tplib.nn.precision import PRECISIONS, attach_main_grads, autocast, check_precision, param_dtype
from tplib.nn.wgrad import DeferredWeightGrads, main_grad
from tplib.plan import Unit


class Hyper(TypedDict):
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    eps: float


HYPER = Hyper(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
SHAPES = [(4, 3), (3,), (2, 2, 2)]


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _true_grads(seed: int) -> list[Tensor]:
    """Small fp32 gradients, like a mean loss's; times 2**16 they stay well inside fp16."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 1e-3 for s in SHAPES]


def _snapshot(t: list[Tensor]) -> list[Tensor]:
    return [x.detach().clone() for x in t]


def _assert_equal(actual: list[Tensor], expected: list[Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=0, atol=0)


# -- DynamicLossScaler ---------------------------------------------------------------------


def test_scaler_backs_off_on_overflow() -> None:
    s = DynamicLossScaler(scale=1024.0, growth_interval=10)
    assert s.update(False) and s.update(False)
    assert s.good_steps == 2
    assert s.update(True) is False
    assert (s.scale, s.good_steps) == (512.0, 0)


def test_scaler_never_goes_below_min_scale() -> None:
    s = DynamicLossScaler(scale=4.0, min_scale=2.0, backoff_factor=0.25)
    assert s.update(True) is False
    assert s.scale == 2.0
    assert s.update(True) is False
    assert s.scale == 2.0


def test_scaler_grows_after_exactly_growth_interval_good_steps() -> None:
    s = DynamicLossScaler(scale=8.0, growth_factor=3.0, growth_interval=4)
    for _ in range(3):
        assert s.update(False)
        assert s.scale == 8.0
    assert s.update(False)
    assert (s.scale, s.good_steps) == (24.0, 0)
    # An overflow restarts the count: 3 more good steps are not enough again.
    for _ in range(3):
        s.update(False)
    s.update(True)
    for _ in range(3):
        s.update(False)
    assert s.scale == 12.0
    s.update(False)
    assert s.scale == 36.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale": 0.5}, "scale must be"),
        ({"scale": float("inf")}, "scale must be"),
        ({"min_scale": 0.0}, "min_scale must be"),
        ({"growth_factor": 1.0}, "growth_factor must be"),
        ({"backoff_factor": 1.0}, "backoff_factor must be"),
        ({"backoff_factor": 0.0}, "backoff_factor must be"),
        ({"growth_interval": 0}, "growth_interval must be"),
        ({"good_steps": -1}, "good_steps must be"),
        ({"good_steps": 1000}, "good_steps must be"),
    ],
)
def test_scaler_rejects_bad_fields(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


# -- MixedPrecisionOptimizer ---------------------------------------------------------------


def _set_scaled_grads(params: list[torch.nn.Parameter], grads: list[Tensor], scale: float) -> None:
    """What backward of ``loss * scale`` leaves in fp16 parameters."""
    for p, g in zip(params, grads, strict=True):
        p.grad = (g * scale).to(torch.float16)


def test_masters_follow_torch_adamw_exactly() -> None:
    params = _params(torch.float16)
    ref = [p.detach().float().clone().requires_grad_(True) for p in params]
    ref_opt = torch.optim.AdamW(ref, **HYPER)
    # growth_interval=2: the scale changes between steps, so each must use the current one.
    opt = MixedPrecisionOptimizer(params, **HYPER, scaler=DynamicLossScaler(growth_interval=2))
    scales = []
    for i in range(5):
        scale = opt.loss_scale
        scales.append(scale)
        _set_scaled_grads(params, _true_grads(i), scale)
        for r, p in zip(ref, params, strict=True):
            assert p.grad is not None
            r.grad = p.grad.float() / scale
        assert opt.unscale_grads().item() == 0.0
        assert opt.step(False)
        opt.zero_grad()
        ref_opt.step()
    assert scales == [2.0**16, 2.0**16, 2.0**17, 2.0**17, 2.0**18]
    _assert_equal(opt.master_params, ref)
    _assert_equal(list(params), [r.half() for r in ref])
    assert all(p.dtype == torch.float16 for p in params)
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    assert opt.steps_skipped == 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_grad_skips_the_step(bad: float) -> None:
    params = _params(torch.float16)
    opt = MixedPrecisionOptimizer(params, **HYPER)
    for i in range(2):  # Adam state exists and must survive the skip unchanged
        _set_scaled_grads(params, _true_grads(i), opt.loss_scale)
        opt.unscale_grads()
        assert opt.step(False)
        opt.zero_grad()
    before_params = _snapshot(list(params))
    before_masters = _snapshot(opt.master_params)
    before_state = copy.deepcopy(opt.inner.state_dict())
    scale = opt.loss_scale

    _set_scaled_grads(params, _true_grads(2), scale)
    assert params[1].grad is not None
    params[1].grad[0] = bad
    found = opt.unscale_grads()
    assert found.shape == () and found.dtype == torch.float32
    assert found.item() == 1.0
    assert opt.step(bool(found.item())) is False
    assert opt.loss_scale == scale / 2
    assert opt.steps_skipped == 1
    _assert_equal(list(params), before_params)
    _assert_equal(opt.master_params, before_masters)
    after_state = opt.inner.state_dict()
    for k, v in before_state["state"].items():
        for name, t in v.items():
            torch.testing.assert_close(after_state["state"][k][name], t, rtol=0, atol=0)
    opt.zero_grad()

    _set_scaled_grads(params, _true_grads(3), opt.loss_scale)
    found = opt.unscale_grads()
    assert found.item() == 0.0
    assert opt.step(bool(found.item()))
    assert all(not torch.equal(p, b) for p, b in zip(params, before_params, strict=True))
    assert opt.steps_skipped == 1


def test_none_grad_counts_as_zero_and_master_grads_persist() -> None:
    params = _params(torch.float16)
    opt = MixedPrecisionOptimizer(params, **HYPER)
    buffers = [m.grad for m in opt.master_params]
    ptrs = [b.data_ptr() for b in buffers if b is not None]
    _set_scaled_grads(params, _true_grads(0), opt.loss_scale)
    opt.unscale_grads()
    opt.step(False)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    _set_scaled_grads(params, _true_grads(1), opt.loss_scale)
    params[0].grad = None
    assert opt.unscale_grads().item() == 0.0
    grads = [m.grad for m in opt.master_params]
    assert grads[0] is not None and torch.count_nonzero(grads[0]) == 0
    assert grads[1] is not None and torch.count_nonzero(grads[1]) == grads[1].numel()
    assert [g is b for g, b in zip(grads, buffers, strict=True)] == [True] * len(SHAPES)
    assert [g.data_ptr() for g in grads if g is not None] == ptrs


def test_state_bytes_is_12_per_parameter_beyond_the_model_and_its_main_grads() -> None:
    params = _params(torch.float16)
    n = sum(p.numel() for p in params)
    opt = MixedPrecisionOptimizer(params, **HYPER)
    # The gradients live in the fp32 main grads, 4 bytes each, counted as the model's.
    mains = [main_grad(p) for p in params]
    assert all(m is not None and m.dtype == torch.float32 for m in mains)
    assert storage_bytes([m for m in mains if m is not None]) == 4 * n
    assert opt.state_bytes() == 4 * n  # the masters; Adam's m, v come with step 1
    _set_scaled_grads(params, _true_grads(0), opt.loss_scale)
    opt.unscale_grads()
    opt.step(False)
    # + m and v, 4 bytes each, and a float32 step counter per tensor.
    assert opt.state_bytes() == 12 * n + 4 * len(params)


# -- fp16 gradients accumulated in fp32 (main_grad) ---------------------------------------

# A first unit's gradient of 1.0, then UNITS gradients of 2**-12 each: fp16's spacing at 1.0
# is 2**-10, so in fp16 each small one rounds away and the sum stays 1.0; in fp32 the sum
# is exactly 1 + 2**-5. Scaled by 2**10, as a loss scale does, nothing changes but the exponent.
UNITS, SMALL, SCALE = 128, 2.0**-12, 2.0**10


def _accumulate_units(path: str) -> tuple[list[Tensor], list[Tensor | None]]:
    """Run 1 + UNITS backwards through fp16 parameters the way a stage's units do, each
    giving every parameter a gradient of 1.0 (the first) or SMALL (the others); return
    the unscaled gradients the optimizer steps with, and each .grad after the backwards."""
    torch.manual_seed(0)
    lin, ln = Linear(4, 1).half(), torch.nn.LayerNorm(4).half()
    emb = torch.nn.Embedding(3, 4).half()
    params = [cast(torch.nn.Parameter, p) for p in (lin.weight, lin.bias, ln.bias, emb.weight)]
    opt = MixedPrecisionOptimizer(params, **HYPER, scaler=DynamicLossScaler(scale=SCALE))
    store = DeferredWeightGrads()
    if path == "deferred":
        lin.deferred = store
    x = torch.ones(1, 4, dtype=torch.float16)
    for u in range(1 + UNITS):
        g = (1.0 if u == 0 else SMALL) * opt.loss_scale
        seed = torch.full((1, 1), g, dtype=torch.float16)
        unit = Unit(0, u)
        with store.collecting(unit) if path == "deferred" else contextlib.nullcontext():
            # dW = seed^T x = g, db = g; the LayerNorm's bias and the embedding row get
            # the output gradient g itself, through autograd.
            lin(x).backward(seed)
            ln(x).backward(torch.full((1, 4), g, dtype=torch.float16))
            emb(torch.tensor([1])).backward(torch.full((1, 4), g, dtype=torch.float16))
        if path == "deferred":
            store.compute([unit])  # one W per unit: the accumulation is across Ws
    left = [p.grad for p in params]
    assert opt.unscale_grads().item() == 0.0
    grads = [g for g in opt.grads() if g is not None]
    return [grads[0], grads[1], grads[2], grads[3][1]], left


@pytest.mark.parametrize("path", ["fused", "deferred"])
def test_fp16_gradients_keep_their_fp32_sum_over_units(path: str) -> None:
    """The model's products (fused into the GEMM, or deferred to W) and the parameters
    autograd accumulates (a LayerNorm's bias, an embedding) sum their units' gradients
    in fp32: fp16 accumulation would give 1.0."""
    grads, left = _accumulate_units(path)
    exact = 1.0 + UNITS * SMALL
    assert exact == 1 + 2**-5 and torch.tensor(exact, dtype=torch.float16).item() == exact
    names = ["product weight", "product bias", "LayerNorm bias", "embedding"]
    for name, g in zip(names, grads, strict=True):
        assert g.dtype == torch.float32, name
        assert torch.equal(g, torch.full_like(g, exact)), (name, g)
    # The fp16 .grad lives only until the hook moves it: none is left behind.
    assert left == [None] * 4


def test_main_grads_are_attached_once() -> None:
    """A second optimizer on the same parameters shares their main grads: the hook that
    moves autograd's gradient into them is not registered twice (which would add each
    gradient twice)."""
    params = _params(torch.float16)
    first = attach_main_grads(params)
    opt = MixedPrecisionOptimizer(params, **HYPER, scaler=DynamicLossScaler(scale=1.0))
    assert [g is m for g, m in zip(opt.grads(), first, strict=True)] == [True] * len(SHAPES)
    (params[0].float().sum() * 0.5).backward()
    assert params[0].grad is None
    assert torch.equal(first[0], torch.full_like(first[0], 0.5))
    assert opt.unscale_grads().item() == 0.0
    opt.zero_grad()
    assert all(torch.count_nonzero(m) == 0 for m in first)


def test_loss_scaling_keeps_a_gradient_fp16_flushes_to_zero() -> None:
    """d loss / d w = x * 1e-4 = 1e-8, below fp16's smallest subnormal (~6e-8)."""
    x = torch.tensor([1e-4], dtype=torch.float16)
    true_grad = x.double().item() * 1e-4
    grads = {}
    for scale in (1.0, 2.0**16):
        w = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
        opt = MixedPrecisionOptimizer([w], **HYPER, scaler=DynamicLossScaler(scale=scale))
        loss = (w * x).float().sum() * 1e-4  # fp32 loss, as a mean cross-entropy is
        (loss * opt.loss_scale).backward()
        assert opt.unscale_grads().item() == 0.0
        grad = opt.master_params[0].grad
        assert grad is not None
        grads[scale] = grad.item()
    assert grads[1.0] == 0.0
    assert grads[2.0**16] == pytest.approx(true_grad, rel=1e-3)


def test_rejects_non_fp16_parameters() -> None:
    params = [*_params(torch.float16)[:1], torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"parameter 1 .*torch\.float32.*float16"):
        MixedPrecisionOptimizer(params, **HYPER)


# -- PlainOptimizer, make_optimizer, precision helpers ------------------------------------


def test_plain_optimizer_steps_like_torch_adamw() -> None:
    params = _params(torch.float32)
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    ref_opt = torch.optim.AdamW(ref, **HYPER)
    opt = PlainOptimizer(params, **HYPER)
    assert opt.loss_scale == 1.0
    for i in range(3):
        for p, r, g in zip(params, ref, _true_grads(i), strict=True):
            p.grad, r.grad = g.clone(), g.clone()
        found = opt.unscale_grads()
        assert found.shape == () and found.dtype == torch.float32 and found.item() == 0.0
        assert opt.step(False)
        opt.zero_grad()
        ref_opt.step()
    assert all(p.grad is None for p in params)
    _assert_equal(list(params), ref)
    n = sum(p.numel() for p in params)
    assert opt.state_bytes() == 8 * n + 4 * len(params)
    assert opt.steps_skipped == 0


@pytest.mark.parametrize(
    ("precision", "dtype", "cls"),
    [
        ("fp32", torch.float32, PlainOptimizer),
        ("bf16", torch.float32, PlainOptimizer),
        ("fp16", torch.float16, MixedPrecisionOptimizer),
    ],
)
def test_make_optimizer_and_param_dtype(precision: str, dtype: torch.dtype, cls: type) -> None:
    assert param_dtype(precision) == dtype
    opt = make_optimizer(_params(dtype), precision, **HYPER)
    assert type(opt) is cls


def test_check_precision() -> None:
    assert PRECISIONS == ("fp32", "bf16", "fp16")
    for precision in ("fp32", "bf16"):
        check_precision(precision, "cpu")
    for precision in PRECISIONS:
        check_precision(precision, "cuda")
    check_precision("fp16", "cuda:1")
    with pytest.raises(ValueError, match=r"fp16.*device='cuda'.*'cpu'.*bf16 on CPU"):
        check_precision("fp16", "cpu")
    with pytest.raises(ValueError, match=r"'fp8'.*fp32.*bf16.*fp16"):
        check_precision("fp8", "cuda")
    for fn in (param_dtype, lambda p: make_optimizer(_params(torch.float32), p, **HYPER)):
        with pytest.raises(ValueError, match="unknown precision 'fp8'"):
            fn("fp8")


def test_autocast() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast("bf16", "cpu"):
        assert (a @ b).dtype == torch.bfloat16
    for precision in ("fp32", "fp16"):
        with autocast(precision, "cpu"):
            assert (a @ b).dtype == torch.float32


# -- weight-decay groups, the learning rate per step, clipping ---------------------------


def _decay_split(params: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """GPT-3's split, written out: matrices (and the 3-d tensor) decay, vectors do not."""
    return [p for p in params if len(p.shape) > 1], [p for p in params if len(p.shape) == 1]


def test_decay_rules() -> None:
    assert set(DECAY_RULES) == {"matrices", "all"}
    vector, matrix, cube = torch.zeros(3), torch.zeros(2, 3), torch.zeros(2, 2, 2)
    assert [is_matrix(t) for t in (vector, matrix, cube)] == [False, True, True]
    assert [DECAY_RULES["all"](t) for t in (vector, matrix, cube)] == [True, True, True]


@pytest.mark.parametrize("fp16", [False, True])
def test_exempt_parameters_are_not_decayed(fp16: bool) -> None:
    """With zero gradients AdamW's only move is the decay, p *= 1 - lr * wd: the exempt
    vector must not move at all, the others by exactly that factor per step."""
    dtype = torch.float16 if fp16 else torch.float32
    params = _params(dtype)
    cls = MixedPrecisionOptimizer if fp16 else PlainOptimizer
    opt = cls(params, **HYPER, decay=is_matrix)
    start = _snapshot(opt.master_params)
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.unscale_grads()
        assert opt.step(False)
    shrink = (1 - HYPER["lr"] * HYPER["weight_decay"]) ** 3
    moved = opt.master_params
    torch.testing.assert_close(moved[0], start[0] * shrink, rtol=1e-6, atol=0)
    assert torch.equal(moved[1], start[1])  # the vector: exempt
    torch.testing.assert_close(moved[2], start[2] * shrink, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fp16", [False, True])
def test_decay_groups_and_lr_per_step_follow_torch_adamw(fp16: bool) -> None:
    dtype = torch.float16 if fp16 else torch.float32
    params = _params(dtype)
    ref = [p.detach().float().clone().requires_grad_(True) for p in params]
    decayed, exempt = _decay_split(ref)
    groups: list[dict[str, Any]] = [
        {"params": decayed},
        {"params": exempt, "weight_decay": 0.0},
    ]
    ref_opt = torch.optim.AdamW(groups, **HYPER)
    cls = MixedPrecisionOptimizer if fp16 else PlainOptimizer
    opt = cls(params, **HYPER, decay=is_matrix)
    for i, lr in enumerate([1e-3, 5e-3, 2e-3]):
        scale = opt.loss_scale
        if fp16:
            _set_scaled_grads(params, _true_grads(i), scale)
        else:
            for p, g in zip(params, _true_grads(i), strict=True):
                p.grad = g.clone()
        for r, p in zip(ref, params, strict=True):
            assert p.grad is not None
            r.grad = p.grad.float() / scale
        for group in ref_opt.param_groups:
            group["lr"] = lr
        opt.unscale_grads()
        opt.set_lr(lr)
        assert opt.step(False)
        opt.zero_grad()
        ref_opt.step()
    _assert_equal(opt.master_params, ref)


def test_make_optimizer_passes_the_decay_rule() -> None:
    opt = make_optimizer(_params(torch.float32), "fp32", **HYPER, decay=is_matrix)
    decays = sorted((len(g["params"]), g["weight_decay"]) for g in opt.inner.param_groups)
    assert decays == [(1, 0.0), (2, HYPER["weight_decay"])]
    (group,) = make_optimizer(_params(torch.float32), "fp32", **HYPER).inner.param_groups
    assert group["weight_decay"] == HYPER["weight_decay"]  # default: every parameter


def test_clipping_the_master_grads_is_clipping_the_true_grads() -> None:
    """fp16: grads() are the unscaled fp32 master grads the step uses; clipping them in
    place is torch's clip_grad_norm_ on an fp32 model given the true gradients."""
    params = _params(torch.float16)
    ref = [p.detach().float().clone().requires_grad_(True) for p in params]
    ref_opt = torch.optim.AdamW(ref, **HYPER)
    opt = MixedPrecisionOptimizer(params, **HYPER)
    max_norm = 1e-3  # the true gradients' norm is ~3e-3: clipping binds
    for i in range(3):
        _set_scaled_grads(params, _true_grads(i), opt.loss_scale)
        for r, p in zip(ref, params, strict=True):
            assert p.grad is not None
            r.grad = p.grad.float() / opt.loss_scale
        assert opt.unscale_grads().item() == 0.0
        grads = opt.grads()
        assert [g is m.grad for g, m in zip(grads, opt.master_params, strict=True)] == [True] * 3
        assert all(g is not None and g.dtype == torch.float32 for g in grads)
        norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        assert norm > 2 * max_norm
        got = torch.nn.utils.get_total_norm([g for g in grads if g is not None])
        torch.testing.assert_close(got, norm, rtol=0, atol=0)  # the same fp32 values
        torch.nn.utils.clip_grads_with_norm_(opt.master_params, max_norm, got)
        opt.step(False)
        opt.zero_grad()
        ref_opt.step()
    _assert_equal(opt.master_params, ref)


def test_plain_grads_are_the_parameters_own() -> None:
    params = _params(torch.float32)
    opt = PlainOptimizer(params, **HYPER)
    params[0].grad = torch.ones_like(params[0])
    grads = opt.grads()
    assert grads[0] is params[0].grad and grads[1] is None and grads[2] is None
