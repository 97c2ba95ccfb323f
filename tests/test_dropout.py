"""Dropout keyed by position: the masks are a function of where an element is, so a
sliced, pipelined or recomputed forward drops exactly what the whole batch drops."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import assert_scaled_close
from tplib.config import get_config
from tplib.data import synthetic_batch
from tplib.dropout import DropoutKey, keep
from tplib.model import build_model
from tplib.plan import Plan
from tplib.slicing import full_batch_loss, run_pipeline_local

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
