"""The distributed optimizer's pure parts: flat layouts and their shards, the per-shard
weight-decay masks, and AdamW stepped shard by shard against AdamW on whole tensors.

Layouts are worked out by hand; the sharded steps are compared with
:class:`~tplib.nn.optimizer.PlainOptimizer` and
:class:`~tplib.nn.optimizer.MixedPrecisionOptimizer` (torch's AdamW on the whole
parameters), the replicas' all-gather done here by copying each one's shard.
"""

from __future__ import annotations

from typing import TypedDict

import pytest
import torch
from torch import nn

from tplib.nn.optimizer import MixedPrecisionOptimizer, PlainOptimizer, is_matrix
from tplib.nn.sharded_optimizer import (
    FlatLayout,
    Piece,
    ShardedOptimizer,
    decay_mask,
    flat_views,
    flatten,
)
from tplib.nn.wgrad import grad_buffer

SHAPES = [(3, 4), (5,), (2, 3), (7,)]  # 12 + 5 + 6 + 7 = 30 elements


class _Adam(TypedDict):
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    eps: float


ADAM = _Adam(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def test_layout_shards_cut_through_parameters_and_pad_the_last() -> None:
    layout = FlatLayout((5, 3, 4), 3)  # 12 elements: shards of 4, no padding
    assert (layout.offsets, layout.padded, layout.shard_size) == ((0, 5, 8), 12, 4)
    assert layout.pieces(0) == [Piece(0, 0, 4)]
    assert layout.pieces(1) == [Piece(0, 4, 5), Piece(1, 5, 8)]
    assert layout.pieces(2) == [Piece(2, 8, 12)]
    padded = FlatLayout((5, 2), 4)  # 7 elements: shards of 2, one padding element
    assert (padded.padded, padded.shard(3)) == (8, (6, 8))
    assert padded.pieces(3) == [Piece(1, 6, 7)]
    assert FlatLayout((3,), 4).pieces(3) == []  # a shard of padding only
    with pytest.raises(ValueError, match=r"shard 4 of 4: choose one in \[0, 4\)"):
        padded.shard(4)
    with pytest.raises(ValueError, match="n_shards=0 must be a positive integer"):
        FlatLayout((5,), 0)
    with pytest.raises(ValueError, match=r"numels=\(5, 0\) must be one or more positive"):
        FlatLayout((5, 0), 2)


def test_flatten_and_views_round_trip() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in SHAPES]
    flat, layout = flatten(tensors, 4)
    assert flat.shape == (32,) and layout.numel == 30  # padded from 30 to 4 x 8
    assert torch.count_nonzero(flat[30:]) == 0
    back = flat_views(flat, [t.shape for t in tensors], layout)
    assert all(torch.equal(b, t) for b, t in zip(back, tensors, strict=True))
    assert all(b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for b in back)
    # The shards, joined in order, are the flat buffer; their pieces cover each tensor once.
    shards = [flat[slice(*layout.shard(i))] for i in range(4)]
    assert torch.equal(torch.cat(shards), flat)
    covered = [0] * len(SHAPES)
    for i in range(4):
        for piece in layout.pieces(i):
            covered[piece.param] += piece.end - piece.start
    assert covered == [12, 5, 6, 7]


def test_decay_masks_per_shard() -> None:
    # A 2 x 3 matrix (decayed), a bias of 4 (not), a 2 x 2 matrix: 14 elements, 3 shards
    # of 5, one padding element.
    layout = FlatLayout((6, 4, 4), 3)
    decays = [True, False, True]
    masks = [decay_mask(layout, decays, i).tolist() for i in range(3)]
    t, f = True, False
    assert masks == [[t, t, t, t, t], [t, f, f, f, f], [t, t, t, t, f]]


def _params(dtype: torch.dtype, seed: int = 1) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


@pytest.mark.parametrize("n_shards", [1, 3, 4])
def test_sharded_adamw_steps_as_adamw_on_whole_parameters(n_shards: int) -> None:
    whole = _params(torch.float32)
    plain = PlainOptimizer(whole, decay=is_matrix, **ADAM)
    replicas = [_params(torch.float32) for _ in range(n_shards)]
    sharded = [
        ShardedOptimizer(ps, "fp32", shard=i, n_shards=n_shards, decay=is_matrix, **ADAM)
        for i, ps in enumerate(replicas)
    ]
    for step, lr in enumerate([1e-2, 5e-3]):
        for p, g in zip(whole, _grads(step), strict=True):
            p.grad = g.clone()
        plain.set_lr(lr)
        plain.step(False)
        for opt in sharded:
            for buffer, g in zip(map(grad_buffer, opt.params), _grads(step), strict=True):
                assert buffer is not None
                buffer.copy_(g)
            opt.set_lr(lr)
            assert opt.step(bool(opt.unscale_grads().item()))
        # The all-gather: every replica takes each replica's updated shard.
        gathered = torch.cat([opt.param_shard for opt in sharded])
        for opt in sharded:
            opt.flat_params.copy_(gathered)
            opt.flat_grads.zero_()
    for ps in replicas:
        for p, want in zip(ps, whole, strict=True):
            torch.testing.assert_close(p.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    # Adam's m and v: each element once, over the shards.
    assert sum(opt.state_bytes() for opt in sharded) == 2 * 30 * 4 + 4 * sum(
        len(opt.pieces) for opt in sharded
    )


def test_sharded_fp16_steps_its_masters_and_skips_on_any_shards_overflow() -> None:
    whole = _params(torch.float16)
    mixed = MixedPrecisionOptimizer(whole, decay=is_matrix, **ADAM)
    replicas = [_params(torch.float16) for _ in range(2)]
    sharded = [
        ShardedOptimizer(ps, "fp16", shard=i, n_shards=2, decay=is_matrix, **ADAM)
        for i, ps in enumerate(replicas)
    ]
    scale = mixed.loss_scale
    assert [opt.loss_scale for opt in sharded] == [scale, scale]
    for opts, buffers in [([mixed], [grad_buffer(p) for p in whole])] + [
        ([opt], [grad_buffer(p) for p in opt.params]) for opt in sharded
    ]:
        for buffer, g in zip(buffers, _grads(0), strict=True):
            assert buffer is not None and buffer.dtype == torch.float32  # the main grads
            buffer.copy_(g * scale)
        (opt,) = opts
        assert opt.unscale_grads().item() == 0.0
        assert opt.step(False)
    gathered = torch.cat([opt.param_shard for opt in sharded])
    for opt in sharded:
        opt.flat_params.copy_(gathered)
    for ps in replicas:
        for p, want in zip(ps, whole, strict=True):
            assert torch.equal(p.detach(), want.detach())  # fp32 masters rounded alike
    # An overflow in the second parameter, which lies in shard 0 (elements 12..16 of 30):
    # only replica 0 sees it; the runtime's MAX over the world makes both skip.
    for opt in sharded:
        opt.flat_grads.zero_()
    sharded[0].flat_grads[13] = float("inf")
    found = [opt.unscale_grads().item() for opt in sharded]
    assert found == [1.0, 0.0]
    before = [opt.flat_params.clone() for opt in sharded]
    assert [opt.step(max(found) > 0) for opt in sharded] == [False, False]
    assert all(torch.equal(opt.flat_params, b) for opt, b in zip(sharded, before, strict=True))
    assert [opt.loss_scale for opt in sharded] == [scale / 2, scale / 2]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_parameters_and_their_gradients_live_in_the_flat_buffers(precision: str) -> None:
    dtype = torch.float16 if precision == "fp16" else torch.float32
    lin = nn.Linear(3, 2).to(dtype)
    weight, bias = lin.weight.detach().clone(), lin.bias.detach().clone()
    opt = ShardedOptimizer(
        list(lin.parameters()), precision, shard=1, n_shards=2, decay=is_matrix, **ADAM
    )
    assert torch.equal(lin.weight.detach(), weight) and torch.equal(lin.bias.detach(), bias)
    x = torch.randn(4, 3).to(dtype)
    lin(x).float().sum().backward()
    lin(x).float().sum().backward()  # accumulates into the same buffers
    assert all(p.grad is None for p in lin.parameters()) == (precision == "fp16")
    want = torch.cat([(2 * torch.ones(4, 2).t() @ x.float()).reshape(-1), torch.full((2,), 8.0)])
    torch.testing.assert_close(opt.flat_grads, want, rtol=1e-3, atol=1e-3)
    opt.flat_params.zero_()
    assert torch.count_nonzero(lin.weight) == 0  # the module reads the flat buffer
    # Shard 1 of 8 elements: the weight's last two and the bias, in two decay groups.
    assert opt.pieces == [Piece(0, 4, 6), Piece(1, 6, 8)]
    assert opt.inner is not None
    assert [g["weight_decay"] for g in opt.inner.param_groups] == [0.1, 0.0]
