"""Packed rows through token slices: exact against each document run alone, unpacked."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import Tensor

from tplib.documents import IGNORE, Documents
from tplib.nn.configs import get_config
from tplib.nn.doc_attention import document_attention
from tplib.nn.model import GPTStage, build_model
from tplib.nn.slicing import SliceExecutor, run_pipeline_local
from tplib.plan import Plan

L = 32
LENGTHS = [[5, 11, 9, 7], [32], [3, 3, 20, 6]]  # row 1: one document; others cut anywhere
CFG = get_config("tiny")  # 4 layers, seq_len 32


def _packed(seed: int = 0) -> tuple[Tensor, Tensor, Documents]:
    g = torch.Generator().manual_seed(seed)
    docs = Documents.from_lengths(LENGTHS, L)
    tokens = torch.randint(0, CFG.vocab_size, (len(LENGTHS), L), generator=g)
    targets = torch.roll(tokens, -1, 1)
    for r, bounds in enumerate(docs.bounds):
        for end in bounds[1:]:
            targets[r, end - 1] = IGNORE  # a document's last token predicts nothing
    return tokens, targets, docs


def _unpacked_reference() -> tuple[float, dict[str, Tensor]]:
    """Each document alone, whole and unpacked, through the whole model; summed."""
    tokens, targets, docs = _packed()
    model = build_model(CFG, seed=3)
    total = torch.zeros(())
    for r, bounds in enumerate(docs.bounds):
        for lo, hi in itertools.pairwise(bounds):
            total = total + model(tokens[r : r + 1, lo:hi], targets=targets[r : r + 1, lo:hi])
    total.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return total.item(), grads


REFERENCE = _unpacked_reference()


def _check(stages: list[GPTStage], loss: Tensor) -> None:
    ref_loss, ref_grads = REFERENCE
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    for stage in stages:
        for name, p in stage.named_parameters():
            whole = "wte.weight" if name == "head.weight" else name
            assert p.grad is not None
            torch.testing.assert_close(p.grad, ref_grads[whole], rtol=1e-5, atol=1e-5)


# Slices that cut documents, slices that stop at every boundary of row 0, one slice.
SLICINGS = [(32,), (8, 8, 8, 8), (5, 11, 9, 7), (4, 12, 10, 6)]


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("attention", ["split", "masked"])
def test_sliced_packed_rows_match_documents_run_alone(recompute: str, attention: str) -> None:
    tokens, targets, docs = _packed()
    for slicing in SLICINGS:
        stages = [build_model(CFG, 0, 1, seed=3), build_model(CFG, 1, CFG.n_layer, seed=3)]
        plan = Plan((2, 1), (slicing, slicing))
        loss = run_pipeline_local(
            stages, tokens, plan, targets=targets, loss_scale=1.0, documents=docs,
            recompute=recompute, attention=attention,
        )  # fmt: skip
        _check(stages, loss)


def test_whole_packed_rows_match_documents_run_alone() -> None:
    tokens, targets, docs = _packed()
    model = build_model(CFG, seed=3)
    loss = model(tokens, targets=targets, documents=docs)
    loss.backward()
    _check([model], loss)


def test_without_document_masking_the_loss_differs() -> None:
    """The reference can tell: rows attending across documents give another loss."""
    tokens, targets, _ = _packed()
    model = build_model(CFG, seed=3)
    assert model(tokens, targets=targets).item() != pytest.approx(REFERENCE[0], rel=1e-4)


def test_document_attention_equals_masked_softmax_with_context() -> None:
    """Both kernels against attention written out with the block mask, slice by slice."""
    torch.manual_seed(1)
    docs = Documents.from_lengths([[3, 9, 4], [10, 6]], 16)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    doc = torch.tensor([[0] * 3 + [1] * 9 + [2] * 4, [0] * 10 + [1] * 6])
    seen = (doc[:, :, None] == doc[:, None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) / 8**0.5
    expected = torch.softmax(scores.masked_fill(~seen[:, None], float("-inf")), -1) @ v
    model = build_model(CFG, 0, 1)
    for impl in ("split", "masked"):
        if impl == "split":  # the CPU flash kernel runs float32
            q32, k32, v32 = q.float(), k.float(), v.float()
        else:
            q32, k32, v32 = q, k, v
        context = model.new_context(2, 16, dtype=q32.dtype, attention=impl)[0]
        out = [
            document_attention(q32[:, :, a:b], k32[:, :, a:b], v32[:, :, a:b], context, a, docs)
            for a, b in ((0, 5), (5, 12), (12, 16))
        ]
        torch.testing.assert_close(torch.cat(out, 2).double(), expected, rtol=1e-5, atol=1e-5)


def test_documents_must_describe_the_rows() -> None:
    stage = build_model(CFG)
    plan = Plan((3,), ((16, 16),))
    ex = SliceExecutor(stage, plan)
    with pytest.raises(ValueError, match="must describe its batch"):
        ex.documents = Documents.whole(2, 32)
    tokens, targets, docs = _packed()
    with pytest.raises(ValueError, match="must describe the rows"):
        stage(tokens[:2], targets=targets[:2], documents=docs)


def test_sliced_packed_rows_with_dropout_match_the_whole_rows() -> None:
    """Dropout masks are keyed by the rows' positions: slicing drops what the whole packed
    rows drop (the reference here is the packed batch in one forward)."""
    from tplib.nn.dropout import DropoutKey

    cfg = dataclasses.replace(CFG, dropout=0.1)
    tokens, targets, docs = _packed()
    key = DropoutKey(7, 0)
    whole = build_model(cfg, seed=3)
    expected = whole(tokens, targets=targets, documents=docs, dropout=key)
    expected.backward()
    assert expected.item() != pytest.approx(REFERENCE[0], rel=1e-4)  # dropout did drop
    stages = [build_model(cfg, 0, 2, seed=3), build_model(cfg, 2, cfg.n_layer, seed=3)]
    plan = Plan((1, 2), ((7, 9, 16), (5, 27)))
    loss = run_pipeline_local(
        stages, tokens, plan, targets=targets, loss_scale=1.0, documents=docs, dropout=key,
        recompute="selective",
    )  # fmt: skip
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    grads = dict(whole.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            ref = grads["wte.weight" if name == "head.weight" else name].grad
            assert p.grad is not None and ref is not None
            torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-5)
