"""Batches: synthetic ids, the stdlib text, and a replica's rows of several iterations."""

from __future__ import annotations

import pytest
import torch

from tplib.nn.configs import get_config
from tplib.nn.data import batch_rows, synthetic_batch, training_batch


def test_text_needs_a_byte_vocabulary() -> None:
    with pytest.raises(ValueError, match=r"data source 'stdlib' is bytes .* vocab_size is 128"):
        training_batch(get_config("tiny", (("vocab_size", 128),)), "stdlib", 2, 16, 0)
    with pytest.raises(ValueError, match="data source 'wiki'"):
        training_batch(get_config("tiny"), "wiki", 2, 16, 0)


def test_text_batches_are_bytes_shifted_by_one() -> None:
    cfg = get_config("tiny", (("vocab_size", 256),))
    tokens, targets = training_batch(cfg, "stdlib", 3, 32, seed=5)
    assert tokens.shape == targets.shape == (3, 32)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert int(tokens.max()) < 256
    again, _ = training_batch(cfg, "stdlib", 3, 32, seed=5)
    assert torch.equal(tokens, again)


def test_batch_rows_stacks_a_replicas_rows_iteration_after_iteration() -> None:
    cfg = get_config("tiny")
    tokens, targets = batch_rows(cfg, "synthetic", 4, 8, range(2, 5), 10, slice(2, 4))
    want = [synthetic_batch(cfg, 4, 8, seed=10 + i) for i in (2, 3, 4)]
    assert torch.equal(tokens, torch.cat([x[2:4] for x, _ in want]))
    assert torch.equal(targets, torch.cat([y[2:4] for _, y in want]))
