"""The stage memory meter: saved-tensor storages counted once, released with their graph.

Expected sizes are worked out by hand from shapes (float32: 4 bytes, int64: 8 bytes).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tplib.nn.bytecount import (
    context_tensors,
    gradient_bytes,
    optimizer_bytes,
    parameter_bytes,
    static_bytes,
    storage_bytes,
)
from tplib.nn.configs import get_config
from tplib.nn.model import build_model
from tplib.runtime.memory import MemoryMeter, StageMemory, cuda_peak, reset_cuda_peak

F32, I64 = 4, 8
CFG = get_config("tiny")


def test_linear_counts_its_input_only_and_backward_releases_it() -> None:
    lin = nn.Linear(8, 4)
    meter = MemoryMeter()
    meter.exclude(lin.parameters())
    x = torch.randn(5, 8, requires_grad=True)
    with meter:
        loss = lin(x).sum()
    # addmm saves its input (5 x 8) and weight.t(), a view of an excluded parameter.
    assert meter.current == 5 * 8 * F32
    assert meter.n_storages == 1
    loss.backward()
    assert meter.current == 0
    assert meter.peak == 5 * 8 * F32
    meter.reset_peak()
    assert meter.peak == 0


def test_unexcluded_weight_counts_once_through_its_transposed_view() -> None:
    lin = nn.Linear(8, 4, bias=False)
    meter = MemoryMeter()
    x = torch.randn(5, 8, requires_grad=True)
    with meter:
        loss = lin(x).sum()
    assert meter.current == 5 * 8 * F32 + 4 * 8 * F32
    del loss
    assert meter.current == 0


def test_views_of_one_storage_count_once() -> None:
    meter = MemoryMeter()
    x = torch.randn(4, 6, requires_grad=True)
    with meter:
        y = x * 2  # multiplying by a number saves nothing
        # sin and cos each save their input, a view of y: y's whole storage (4 x 6), once.
        # Counting tensors would give 2 x (4 x 2); counting per saved tensor 2 x (4 x 6).
        loss = (y[:, :2].sin() + y[:, 2:4].cos()).sum()
    assert meter.current == 4 * 6 * F32
    assert meter.n_storages == 1
    del y
    loss.backward()
    assert meter.current == 0


def test_dropping_a_graph_unrun_releases_its_count() -> None:
    meter = MemoryMeter()
    x = torch.randn(3, 5, requires_grad=True)
    with meter:
        h = x.exp()  # saves its own output (3 x 5)
        loss = (h * h).sum()  # saves h twice: the same storage
    assert meter.current == 3 * 5 * F32
    del h, loss
    # Freed by reference counting alone: the handles hold no cycle through the graph.
    assert meter.current == 0
    gc.collect()
    assert meter.current == 0
    assert meter.peak == 3 * 5 * F32


def test_retained_graph_stays_counted_until_dropped() -> None:
    meter = MemoryMeter()
    x = torch.randn(7, requires_grad=True)
    with meter:
        loss = x.sin().sum()
    loss.backward(retain_graph=True)
    assert meter.current == 7 * F32
    loss.backward()  # the saved tensor unpacks again, then the graph is freed
    assert meter.current == 0
    assert torch.allclose(x.grad, 2 * x.detach().cos())  # type: ignore[arg-type]


def test_hold_and_release() -> None:
    meter = MemoryMeter()
    t = torch.randn(10)
    first = meter.hold(t)
    second = meter.hold(t[2:5])  # a view: the same storage
    assert (meter.current, meter.n_storages) == (10 * F32, 1)
    first.release()
    first.release()  # idempotent
    assert meter.current == 10 * F32
    del second
    assert meter.current == 0
    assert meter.hold(torch.empty(0)) is not None and meter.current == 0
    assert meter.peak == 10 * F32


def test_held_and_saved_storage_counts_once() -> None:
    meter = MemoryMeter()
    x = torch.randn(6, 2, requires_grad=True)
    held = meter.hold(x)
    with meter:
        loss = x.sin().sum()
    assert meter.current == 6 * 2 * F32
    loss.backward()
    assert meter.current == 6 * 2 * F32  # still held
    del held
    assert meter.current == 0


def test_parameter_views_are_excluded() -> None:
    w = nn.Parameter(torch.randn(4, 8))
    emb = nn.Embedding(10, 8)
    meter = MemoryMeter()
    meter.exclude([w, *emb.parameters()])
    x = torch.randn(3, 8, requires_grad=True)
    idx = torch.tensor([1, 2, 3, 4, 5])
    with meter:
        a = F.linear(x, w).sum()  # saves x and w
        b = (x @ w.t()).sum()  # saves x and w.t(), a view of w
        c = F.linear(emb(idx), emb.weight).sum()  # a tied head: saves indices, h, the weight
    assert meter.current == 3 * 8 * F32 + 5 * I64 + 5 * 8 * F32
    assert meter.n_storages == 3
    del a, b, c
    assert meter.current == 0


def test_hooks_are_active_only_inside_and_blocks_accumulate() -> None:
    meter = MemoryMeter()
    x = torch.randn(8, requires_grad=True)
    active = [meter.active]
    with meter:
        active.append(meter.active)
        first = x.sin()  # saves x
    outside = (x * 3).exp()  # saves a new 8-element output, not counted
    assert meter.current == 8 * F32
    with meter:
        second = outside.cos()  # saves outside
        with meter:
            third = torch.randn(2, 3, requires_grad=True).tanh()  # saves its output
        active.append(meter.active)
    active.append(meter.active)
    assert active == [False, True, True, False]
    assert meter.current == 8 * F32 + 8 * F32 + 2 * 3 * F32
    del first, second, third
    assert meter.current == 0
    del outside


def _stage_forward_bytes(lo: int, hi: int, batch: int) -> int:
    stage = build_model(CFG, lo, hi)
    meter = MemoryMeter()
    meter.exclude(stage.parameters())
    length = 16
    if lo == 0:
        x = torch.randint(0, CFG.vocab_size, (batch, length))
    else:
        x = torch.randn(batch, length, CFG.hidden, requires_grad=True)
    with meter:
        out = stage(x)
    counted = meter.current
    out.backward(torch.ones_like(out))
    assert meter.current == 0
    assert meter.peak == counted
    return counted


def test_tiny_stage_activations_grow_linearly_with_batch() -> None:
    length = 16
    first = [_stage_forward_bytes(0, 2, b) for b in (1, 2, 4)]
    assert first[0] > 0
    # Every saved tensor scales with the batch but one: the first stage's position ids
    # (16 int64), saved by the position embedding, are shared by all sequences.
    positions = length * I64
    assert first[1] == 2 * first[0] - positions
    assert first[2] == 2 * first[1] - positions
    middle = [_stage_forward_bytes(1, 3, b) for b in (1, 2)]
    assert middle[0] > 0
    assert middle[1] == 2 * middle[0]


def test_context_buffers_saved_by_attention_are_excluded() -> None:
    stage = build_model(CFG, 1, 3)
    batch, seq = 2, 16
    x = torch.randn(batch, seq, CFG.hidden, requires_grad=True)
    counts = []
    for exclude_contexts in (True, False):
        ctx = stage.new_context(batch, seq, attention="masked")
        meter = MemoryMeter()
        meter.exclude(stage.parameters())
        if exclude_contexts:
            meter.exclude(context_tensors([ctx]))
        with meter:
            out = stage(x, 0, ctx)
        counts.append(meter.current)
        del out
        assert meter.current == 0
    # Masked attention saves its keys and values: aliases of the whole K and V buffers.
    buffer = batch * CFG.n_head * seq * CFG.head_dim * F32
    assert counts[1] - counts[0] == 2 * 2 * buffer


def test_static_bytes_count_a_tied_weight_once() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    lin = nn.Linear(4, 3)
    model = nn.ModuleDict({"emb": emb, "head": head, "lin": lin})
    params = 10 * 4 * F32 + (3 * 4 + 3) * F32
    assert parameter_bytes(model) == params
    assert gradient_bytes(model) == 0
    opt = torch.optim.AdamW(model.parameters())
    assert optimizer_bytes(opt) == 0
    (head(emb(torch.tensor([1, 2]))).sum() + lin(emb.weight).sum()).backward()
    assert gradient_bytes(model) == params
    opt.step()
    # Two moments per parameter and a float32 step counter for each of the 3 parameters.
    assert optimizer_bytes(opt) == 2 * params + 3 * F32
    ctx = build_model(CFG, 1, 3).new_context(2, 16)
    buffers = context_tensors([ctx])
    per_buffer = 2 * CFG.n_head * 16 * CFG.head_dim * F32
    assert storage_bytes(buffers) == 2 * 4 * per_buffer
    assert static_bytes(model, 100, buffers) == 2 * params + 100 + 8 * per_buffer


def test_stage_memory_counted_total() -> None:
    lin = nn.Linear(8, 4)
    meter = MemoryMeter()
    meter.exclude(lin.parameters())
    with meter:
        lin(torch.randn(5, 8)).sum().backward()
    mem = StageMemory.counted(lin, meter, optimizer_state_bytes=7, contexts=[torch.zeros(3)])
    params = (4 * 8 + 4) * F32
    assert mem == StageMemory(params, params, 7, 3 * F32, 5 * 8 * F32, "counted")
    assert mem.total == 2 * params + 7 + 3 * F32 + 5 * 8 * F32


def test_cuda_peak_refuses_other_devices() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        cuda_peak("cpu")
    with pytest.raises(ValueError, match="CUDA"):
        reset_cuda_peak(torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA"):
        StageMemory.allocator(nn.Linear(2, 2), "cpu")
