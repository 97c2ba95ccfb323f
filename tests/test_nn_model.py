import math

import pytest
import torch

from tplib.nn.configs import get_config
from tplib.nn.data import synthetic_batch
from tplib.nn.model import GPTStage, build_model

from .conftest import assert_scaled_close

CFG = get_config("tiny")


def test_stage_parameters_equal_the_whole_models() -> None:
    whole = dict(build_model(CFG, seed=3).named_parameters())
    for lo, hi in [(0, 1), (1, 3), (3, 4)]:
        for name, p in build_model(CFG, lo, hi, seed=3).named_parameters():
            ref = whole["wte.weight" if name == "head.weight" else name]
            assert torch.equal(p, ref), name


def test_seed_changes_the_weights() -> None:
    a = build_model(CFG, seed=0).get_parameter("blocks.0.attn.qkv.weight")
    b = build_model(CFG, seed=1).get_parameter("blocks.0.attn.qkv.weight")
    assert not torch.equal(a, b)


def test_chained_stages_compute_the_whole_model() -> None:
    tokens, _targets = synthetic_batch(CFG, 2, 24, seed=1)
    whole = build_model(CFG)
    h = tokens
    for lo, hi in [(0, 2), (2, 3), (3, 4)]:
        h = build_model(CFG, lo, hi)(h)
    assert_scaled_close(h, whole(tokens), what="logits")


def test_initial_loss_is_near_uniform() -> None:
    tokens, targets = synthetic_batch(CFG, 4, 32)
    model = build_model(CFG)
    loss = model(tokens, targets=targets) / targets.numel()
    assert abs(loss.item() - math.log(CFG.vocab_size)) < 0.1


def test_tied_head_shares_the_embedding() -> None:
    model = build_model(CFG)
    assert model.head.weight is model.wte.weight


def test_attention_is_causal() -> None:
    model = build_model(CFG)
    tokens, _ = synthetic_batch(CFG, 1, 16)
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % CFG.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sequence_longer_than_context_is_rejected() -> None:
    model = build_model(CFG)
    tokens = torch.zeros(1, CFG.seq_len + 1, dtype=torch.long)
    with pytest.raises(
        ValueError,
        match=rf"tokens \[0, {CFG.seq_len + 1}\) exceed the model's context of {CFG.seq_len}",
    ):
        model(tokens)
    with pytest.raises(ValueError, match=r"exceed the model's context"):
        model.new_context(1, CFG.seq_len + 8)


@pytest.mark.parametrize(("lo", "hi"), [(-1, 2), (0, 5), (2, 2), (3, 1)])
def test_stage_range_outside_the_layers_is_rejected(lo: int, hi: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"stage layer range \[{lo}, {hi}\) is outside the model's layers \[0, 4\)",
    ):
        GPTStage(CFG, lo, hi)
