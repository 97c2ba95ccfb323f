"""Dropout keyed by position: the masks are a function of where an element is, so a
sliced, pipelined or recomputed forward drops exactly what the whole batch drops."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.conftest import assert_scaled_close
from tplib.nn.configs import get_config
from tplib.nn.data import synthetic_batch
from tplib.nn.dropout import DropoutKey, keep
from tplib.nn.model import build_model
from tplib.nn.slicing import full_batch_loss, run_pipeline_local
from tplib.plan import Plan

CFG = get_config("tiny").with_(dropout=0.1)
KEY = DropoutKey.for_iteration(seed=3, iteration=5)


def _grid(b: int, s: int, h: int, first_row: int = 0, start: int = 0) -> torch.Tensor:
    rows = torch.arange(first_row, first_row + b)[:, None, None]
    pos = torch.arange(start, start + s)[:, None]
    return keep(0.1, DropoutKey(KEY.seed, 0), 7, rows, pos, torch.arange(h))


def test_the_rate_is_p_and_masks_are_not_periodic() -> None:
    mask = _grid(8, 256, 512)
    dropped = 1.0 - mask.float().mean().item()
    # 1M Bernoulli(0.1) draws: the standard deviation of the rate is 3e-4.
    assert abs(dropped - 0.1) < 2e-3, dropped
    # Neighbouring rows, positions and features are not copies of each other.
    assert not torch.equal(mask[0], mask[1])
    assert not torch.equal(mask[:, 0], mask[:, 1])
    assert not torch.equal(mask[..., 0], mask[..., 1])
    # Masks of neighbouring elements are uncorrelated (|r| ~ 1/sqrt(n) for independent ones).
    a, b = mask[..., :-1].float().flatten(), mask[..., 1:].float().flatten()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.01


def test_a_block_of_the_mask_is_the_mask_of_the_block() -> None:
    whole = _grid(4, 64, 32)
    part = _grid(2, 16, 32, first_row=1, start=40)
    assert torch.equal(part, whole[1:3, 40:56])


def _keep_before_python_key(p: float, key: DropoutKey, site: int, *coords: Tensor) -> Tensor:
    """keep() as it was before the key's hash moved to Python integers: the independent
    reference the masks must still equal bit for bit (it made the key on the host and
    copied it to the coordinates' device for every coordinate)."""

    def mix(x: Tensor) -> Tensor:
        x = x & 0xFFFFFFFF
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    h = mix(torch.tensor(key.seed & 0xFFFFFFFF) ^ (torch.tensor(key.seed >> 32) * 0x9E3779B9))
    h = mix(h ^ site)
    for c in coords:
        h = mix(h.to(c.device) ^ c.to(torch.int64))
    return h >= int(p * 2**32)


def test_masks_equal_the_host_keyed_formula_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)

    def ints(shape: tuple[int, ...], high: int) -> Tensor:
        return torch.randint(-high, high, shape, generator=g, dtype=torch.int64)

    for i in range(40):
        # Seeds anywhere in int64 (negative ones too: the old formula took them), sites
        # and coordinates beyond 32 bits, int32 coordinates, and the attention's shapes.
        seed = int(ints((), 2**63 - 1)) if i % 2 else int(ints((), 2**20)) + 2**32 * (i % 5)
        site, p = int(ints((), 2**40).abs()), float(torch.rand((), generator=g))
        rows, heads = ints((3, 1, 1, 1), 2**34), ints((4, 1, 1), 50).to(torch.int32)
        qpos, kpos = ints((5, 1), 2**40), ints((6,), 2**12)
        for coords in ((rows, heads, qpos, kpos), (rows[..., 0], qpos, kpos), (kpos,)):
            key = DropoutKey(seed)
            want = _keep_before_python_key(p, key, site, *coords)
            got = keep(p, key, site, *coords)
            assert got.shape == want.shape and torch.equal(got, want), (seed, site, p)


class _Tensors(TorchDispatchMode):
    """Every op dispatched, with the devices and sizes of its tensors in and out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[torch.device], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        size = max((t.numel() for t in outs), default=0)
        self.ops.append((str(func), [t.device for t in ins + outs], size))
        return out


def test_a_mask_makes_no_host_tensor_and_copies_nothing_between_devices() -> None:
    # On the "meta" device any tensor made on the host, or any copy to the coordinates'
    # device, shows as a CPU tensor among an op's inputs or outputs.
    meta = torch.device("meta")
    rows = torch.arange(2, device=meta)[:, None, None, None]
    heads = torch.arange(3, device=meta)[:, None, None]
    qpos, kpos = torch.arange(4, 9, device=meta)[:, None], torch.arange(9, device=meta)
    with _Tensors() as seen:
        mask = keep(0.1, KEY, 5, rows, heads, qpos, kpos)
    assert mask.device == meta and mask.shape == (2, 3, 5, 9)
    elsewhere = [(op, devices) for op, devices, _ in seen.ops if set(devices) != {meta}]
    assert not elsewhere, elsewhere
    assert not [op for op, _, _ in seen.ops if "copy" in op], seen.ops


def test_only_the_last_coordinate_is_mixed_at_the_masks_full_size() -> None:
    rows, heads = torch.arange(2)[:, None, None, None], torch.arange(3)[:, None, None]
    qpos, kpos = torch.arange(4, 9)[:, None], torch.arange(9)
    with _Tensors() as seen:
        keep(0.1, KEY, 5, rows, heads, qpos, kpos)
    full = 2 * 3 * 5 * 9
    sizes = [size for _, _, size in seen.ops]
    # At full size: the XOR that broadcasts the last coordinate, the 10 operations of
    # one lowbias32 (its first 32-bit mask folded into the small coordinate) and the
    # comparison with the threshold. The earlier coordinates' mixes run on their own
    # broadcast shapes, at most (2, 3, 5, 1).
    assert sizes.count(full) == 1 + 10 + 1, seen.ops
    assert max(s for s in sizes if s != full) <= math.prod((2, 3, 5, 1))


def test_seeds_and_sites_give_different_masks() -> None:
    rows, pos, feats = torch.arange(4)[:, None, None], torch.arange(32)[:, None], torch.arange(32)
    base = keep(0.5, DropoutKey(1), 4, rows, pos, feats)
    assert torch.equal(base, keep(0.5, DropoutKey(1), 4, rows, pos, feats))
    assert not torch.equal(base, keep(0.5, DropoutKey(2), 4, rows, pos, feats))
    assert not torch.equal(base, keep(0.5, DropoutKey(1), 5, rows, pos, feats))
    assert not torch.equal(base, keep(0.5, DropoutKey(1 + 2**32), 4, rows, pos, feats))


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize(
    ("plan", "cuts"),
    [
        (Plan((1, 2), ((5, 11), (2, 6, 8))), (0, 4)),
        (Plan((3,), ((1, 7, 8),)), (0, 1, 4)),
        (Plan((2, 1), ((16,), (4, 12))), (0, 2, 3, 4)),
    ],
)
def test_sliced_training_with_dropout_matches_the_whole_batch(
    plan: Plan, cuts: tuple[int, ...], recompute: str
) -> None:
    tokens, targets = synthetic_batch(CFG, plan.batch, plan.seq_len, seed=2)
    whole = build_model(CFG, seed=1)
    ref = full_batch_loss(whole, tokens, targets, dropout=KEY)
    ref.backward()
    plain = full_batch_loss(build_model(CFG, seed=1), tokens, targets)
    assert abs(ref.item() - plain.item()) > 1e-3, "dropout changed nothing"
    stages = [build_model(CFG, lo, hi, seed=1) for lo, hi in itertools.pairwise(cuts)]
    loss = run_pipeline_local(
        stages, tokens, plan, targets=targets, recompute=recompute, dropout=KEY
    )
    assert_scaled_close(loss, ref.detach(), what="loss")
    grads = {n: p.grad for n, p in whole.named_parameters()}
    for stage in stages:
        for name, p in stage.named_parameters():
            key = "wte.weight" if name == "head.weight" else name
            assert_scaled_close(p.grad, grads[key], what=name)


def test_without_a_key_the_model_does_not_drop() -> None:
    tokens, targets = synthetic_batch(CFG, 2, 16, seed=2)
    a = build_model(CFG, seed=1)(tokens, targets=targets)
    b = build_model(CFG.with_(dropout=0.0), seed=1)(tokens, targets=targets, dropout=KEY)
    assert torch.equal(a, b)


def test_dropout_rate_is_checked() -> None:
    with pytest.raises(ValueError, match=r"GPTConfig.dropout=1.0: must be in \[0, 1\)"):
        CFG.with_(dropout=1.0)
