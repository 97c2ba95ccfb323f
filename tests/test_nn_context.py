"""Tests for tplib.nn.context: slice attention over a K/V context, at the mechanism's level.

The reference is always one causal attention call over the whole sequence with plain
autograd; the sliced runs feed each slice its own fresh leaves and run backward slice by
slice, last to first, as the executor does. (Whole-model slicing is in test_slicing.)
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor

from tplib.nn import context as context_module
from tplib.nn.context import (
    ATTENTION_IMPLS,
    LayerContext,
    StageContext,
    _alias,
    _AppendKV,
    _mask,
    attention_impls,
    slice_attention,
)

from .conftest import assert_scaled_close

BATCH, HEADS = 2, 2
CPU = torch.device("cpu")


@st.composite
def slicings(draw: st.DrawFn, max_len: int = 16) -> tuple[int, ...]:
    """Slice boundaries ``(0, ..., seq_len)``: random cuts, all length-1 slices, or one slice."""
    seq_len = draw(st.integers(1, max_len))
    kind = draw(st.sampled_from(["random", "ones", "single"]))
    if kind == "ones":
        return tuple(range(seq_len + 1))
    if kind == "single":
        return (0, seq_len)
    cuts = draw(st.sets(st.integers(1, seq_len - 1))) if seq_len > 1 else set()
    return (0, *sorted(cuts), seq_len)


def _inputs(seq_len: int, head_dim: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v and an output gradient for the whole sequence."""
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, seq_len, head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=g) for _ in range(4))
    return q, k, v, grad_out


def _reference(
    q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Whole-sequence causal attention: the output and the gradients of q, k, v."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad_out)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


def _context(seq_len: int, head_dim: int, impl: str | None) -> LayerContext:
    return LayerContext(BATCH, HEADS, seq_len, head_dim, dtype=torch.float32, device=CPU, impl=impl)


class _SlicedRun:
    """One pass of a sequence through ``slice_attention``, slice by slice."""

    def __init__(
        self, layer: LayerContext, bounds: tuple[int, ...], q: Tensor, k: Tensor, v: Tensor
    ) -> None:
        self.layer, self.bounds = layer, bounds
        self.leaves: list[tuple[Tensor, Tensor, Tensor]] = []
        self.outputs: list[Tensor] = []
        for lo, hi in itertools.pairwise(bounds):
            qs, ks, vs = (x[:, :, lo:hi].clone().requires_grad_() for x in (q, k, v))
            self.leaves.append((qs, ks, vs))
            self.outputs.append(slice_attention(qs, ks, vs, layer, lo))

    def output(self) -> Tensor:
        return torch.cat([o.detach() for o in self.outputs], dim=2)

    def backward(self, t: int, grad_out: Tensor) -> None:
        lo, hi = self.bounds[t], self.bounds[t + 1]
        self.outputs[t].backward(grad_out[:, :, lo:hi])

    def grads(self) -> tuple[Tensor, Tensor, Tensor]:
        parts = []
        for i in range(3):
            grads = [leaves[i].grad for leaves in self.leaves]
            assert all(g is not None for g in grads), "a slice got no gradient"
            parts.append(torch.cat([g for g in grads if g is not None], dim=2))
        return parts[0], parts[1], parts[2]


# ---- exactness of slice attention --------------------------------------------------------


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
@settings(max_examples=40)
@given(bounds=slicings(), head_dim=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
@example(bounds=tuple(range(10)), head_dim=4, seed=0)  # every slice one token long
@example(bounds=(0, 13), head_dim=8, seed=1)  # one slice: the whole sequence
@example(bounds=(0, 1, 7, 8, 16), head_dim=8, seed=2)  # short slices between long ones
def test_sliced_attention_matches_whole_sequence_attention(
    impl: str, bounds: tuple[int, ...], head_dim: int, seed: int
) -> None:
    seq_len = bounds[-1]
    q, k, v, grad_out = _inputs(seq_len, head_dim, seed)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, grad_out)
    run = _SlicedRun(_context(seq_len, head_dim, impl), bounds, q, k, v)
    assert_scaled_close(run.output(), ref_out, what="output")
    for t in reversed(range(len(bounds) - 1)):
        run.backward(t, grad_out)
    dq, dk, dv = run.grads()
    assert_scaled_close(dq, ref_dq, what="grad q")
    assert_scaled_close(dk, ref_dk, what="grad k")
    assert_scaled_close(dv, ref_dv, what="grad v")


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
@settings(max_examples=25)
@given(bounds=slicings(), seed=st.integers(0, 2**16))
@example(bounds=(0, 3, 4, 9, 12), seed=0)
def test_gradient_buffers_hold_the_later_slices_contributions(
    impl: str, bounds: tuple[int, ...], seed: int
) -> None:
    """After slice t's backward, grad_k/grad_v before slice t hold what slices >= t gave."""
    seq_len, head_dim = bounds[-1], 4
    q, k, v, grad_out = _inputs(seq_len, head_dim, seed)
    layer = _context(seq_len, head_dim, impl)
    run = _SlicedRun(layer, bounds, q, k, v)
    for t in reversed(range(len(bounds) - 1)):
        run.backward(t, grad_out)
        start = bounds[t]
        # Only the queries of slices >= t send gradient: those at positions >= start.
        later_only = grad_out.clone()
        later_only[:, :, :start] = 0.0
        _, _, ref_dk, ref_dv = _reference(q, k, v, later_only)
        if start:
            assert_scaled_close(
                layer.grad_k[:, :, :start], ref_dk[:, :, :start], what=f"grad_k {t}"
            )
            assert_scaled_close(
                layer.grad_v[:, :, :start], ref_dv[:, :, :start], what=f"grad_v {t}"
            )


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_a_new_pass_starts_from_zeroed_gradient_buffers(impl: str) -> None:
    bounds, head_dim = (0, 5, 6, 11), 8
    layer = _context(11, head_dim, impl)
    first = _inputs(11, head_dim, seed=3)
    run = _SlicedRun(layer, bounds, *first[:3])
    for t in reversed(range(3)):
        run.backward(t, first[3])
    assert layer.grad_k.abs().max() > 0  # the first pass left its sums behind

    # The second iteration reuses the buffers; its gradients are its own alone.
    q, k, v, grad_out = _inputs(11, head_dim, seed=4)
    run = _SlicedRun(layer, bounds, q, k, v)
    for t in reversed(range(3)):
        run.backward(t, grad_out)
    _, ref_dq, ref_dk, ref_dv = _reference(q, k, v, grad_out)
    dq, dk, dv = run.grads()
    assert_scaled_close(dq, ref_dq, what="grad q")
    assert_scaled_close(dk, ref_dk, what="grad k")
    assert_scaled_close(dv, ref_dv, what="grad v")


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_only_the_first_slice_zeroes_the_gradient_buffers(impl: str) -> None:
    layer = _context(8, 4, impl)
    q, k, v, _ = _inputs(8, 4, seed=5)
    layer.grad_k.fill_(3.0)
    layer.grad_v.fill_(-2.0)
    slice_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], layer, 0)
    assert torch.count_nonzero(layer.grad_k) == 0 and torch.count_nonzero(layer.grad_v) == 0
    layer.grad_k.fill_(3.0)
    layer.grad_v.fill_(-2.0)
    slice_attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], layer, 4)
    assert bool((layer.grad_k == 3.0).all()) and bool((layer.grad_v == -2.0).all())


def test_default_impl_is_split_for_cpu_float32_and_masked_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    used: list[str] = []

    class SpySplit(context_module._SplitAttention):
        @classmethod
        def apply(cls, *args: object) -> Tensor:
            used.append("split")
            return super().apply(*args)

    class SpyAppend(context_module._AppendKV):
        @classmethod
        def apply(cls, *args: object) -> tuple[Tensor, Tensor]:
            used.append("masked")
            return super().apply(*args)

    monkeypatch.setattr(context_module, "_SplitAttention", SpySplit)
    monkeypatch.setattr(context_module, "_AppendKV", SpyAppend)
    for dtype, expected in ((torch.float32, "split"), (torch.float64, "masked")):
        used.clear()
        layer = LayerContext(BATCH, HEADS, 6, 4, dtype=dtype, device=CPU)
        q, k, v, _ = (x.to(dtype) for x in _inputs(6, 4, seed=6))
        slice_attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], layer, 0)
        slice_attention(q[:, :, 2:], k[:, :, 2:], v[:, :, 2:], layer, 2)
        assert used == [expected] * 2, dtype


# ---- the pieces: _alias, _AppendKV, _mask, StageContext -----------------------------------


def test_alias_is_the_buffers_prefix_with_its_own_version_counter() -> None:
    buffer = torch.arange(2 * 3 * 8 * 4, dtype=torch.float32).reshape(2, 3, 8, 4)
    alias = _alias(buffer, 5)
    assert alias.shape == (2, 3, 5, 4)
    assert torch.equal(alias, buffer[:, :, :5])
    buffer[:, :, 2] = -1.0  # the alias reads the buffer's memory, not a copy
    assert bool((alias[:, :, 2] == -1.0).all())

    view = buffer[:, :, :5]
    alias_version, view_version = alias._version, view._version
    buffer[:, :, 5:].fill_(7.0)
    assert view._version > view_version  # an ordinary view sees every write to the buffer
    assert alias._version == alias_version
    assert torch.equal(alias, buffer[:, :, :5])


def _attend_then_write_beyond(alias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Attend over the prefix [0, 5) of a buffer, then write the buffer's [5, 8) as a later
    slice would. Returns the output, the query leaf, the prefix's values and the query."""
    g = torch.Generator().manual_seed(7)
    buffer = torch.randn(1, 2, 8, 4, generator=g)
    prefix_values = buffer[:, :, :5].clone()
    q = torch.randn(1, 2, 3, 4, generator=g, requires_grad=True)
    prefix = _alias(buffer, 5) if alias else buffer[:, :, :5]
    out = F.scaled_dot_product_attention(q, prefix, prefix)  # saves the prefix for backward
    buffer[:, :, 5:].normal_(generator=g)
    return out, q, prefix_values, q.detach().clone()


def test_writes_beyond_an_ordinary_view_break_backward() -> None:
    """The reason _alias exists: a view shares the buffer's version counter."""
    out, *_ = _attend_then_write_beyond(alias=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_writes_beyond_the_alias_do_not_break_backward() -> None:
    out, q, prefix_values, q_values = _attend_then_write_beyond(alias=True)
    out.sum().backward()
    q_ref = q_values.requires_grad_()
    F.scaled_dot_product_attention(q_ref, prefix_values, prefix_values).sum().backward()
    assert q.grad is not None and q_ref.grad is not None
    assert_scaled_close(q.grad, q_ref.grad, what="grad q")


def test_append_kv_outputs_survive_later_writes_to_the_context() -> None:
    g = torch.Generator().manual_seed(11)
    layer = LayerContext(1, 2, 8, 4, dtype=torch.float32, device=CPU)
    q = torch.randn(1, 2, 5, 4, generator=g)
    k = torch.randn(1, 2, 5, 4, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 5, 4, generator=g, requires_grad=True)
    keys, values = _AppendKV.apply(k, v, layer, 0)
    out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    layer.k[:, :, 5:].normal_(generator=g)  # the next slice's forward
    layer.v[:, :, 5:].normal_(generator=g)
    out.sum().backward()
    _, _, ref_dk, ref_dv = _reference(q, k.detach(), v.detach(), torch.ones_like(out))
    assert k.grad is not None and v.grad is not None
    assert_scaled_close(k.grad, ref_dk, what="grad k")
    assert_scaled_close(v.grad, ref_dv, what="grad v")


def test_append_kv_writes_its_range_and_routes_gradients() -> None:
    g = torch.Generator().manual_seed(8)
    layer = LayerContext(BATCH, HEADS, 9, 4, dtype=torch.float32, device=CPU)
    earlier = torch.randn(BATCH, HEADS, 9, 4, generator=g)
    layer.k.copy_(earlier)
    layer.v.copy_(-earlier)
    acc_k = torch.randn(BATCH, HEADS, 9, 4, generator=g)  # what later slices accumulated
    acc_v = torch.randn(BATCH, HEADS, 9, 4, generator=g)
    layer.grad_k.copy_(acc_k)
    layer.grad_v.copy_(acc_v)
    k = torch.randn(BATCH, HEADS, 3, 4, generator=g, requires_grad=True)
    v = torch.randn(BATCH, HEADS, 3, 4, generator=g, requires_grad=True)

    keys, values = _AppendKV.apply(k, v, layer, 4)  # the slice [4, 7)
    assert keys.shape == values.shape == (BATCH, HEADS, 7, 4)
    assert torch.equal(keys[:, :, :4], earlier[:, :, :4])
    assert torch.equal(keys[:, :, 4:], k.detach())
    assert torch.equal(values[:, :, 4:], v.detach())
    assert torch.equal(layer.k[:, :, 7:], earlier[:, :, 7:])  # nothing beyond the slice

    gk = torch.randn(BATCH, HEADS, 7, 4, generator=g)
    gv = torch.randn(BATCH, HEADS, 7, 4, generator=g)
    torch.autograd.backward((keys, values), (gk, gv))
    assert k.grad is not None and v.grad is not None
    # Own positions: this slice's gradient plus what later slices left there.
    assert torch.allclose(k.grad, gk[:, :, 4:] + acc_k[:, :, 4:7])
    assert torch.allclose(v.grad, gv[:, :, 4:] + acc_v[:, :, 4:7])
    # Earlier positions: added into the buffers for the earlier slices; the rest untouched.
    assert torch.allclose(layer.grad_k[:, :, :4], acc_k[:, :, :4] + gk[:, :, :4])
    assert torch.allclose(layer.grad_v[:, :, :4], acc_v[:, :, :4] + gv[:, :, :4])
    assert torch.equal(layer.grad_k[:, :, 4:], acc_k[:, :, 4:])
    assert torch.equal(layer.grad_v[:, :, 4:], acc_v[:, :, 4:])


@pytest.mark.parametrize(("length", "end"), [(1, 1), (3, 3), (3, 7), (1, 5), (4, 10)])
def test_mask_lets_query_i_see_keys_up_to_end_minus_length_plus_i(length: int, end: int) -> None:
    mask = _mask(length, end, CPU)
    assert isinstance(mask, Tensor)
    offset = end - length  # the slice's start: every earlier key is visible
    expected = torch.tensor(
        [[j <= offset + i for j in range(end)] for i in range(length)], dtype=torch.bool
    )
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_stage_context_allocates_one_layer_context_per_layer() -> None:
    stage = StageContext.allocate(
        range(2, 5), batch=3, n_head=2, seq_len=7, head_dim=4, dtype=torch.float64,
        device="cpu", impl="masked",
    )  # fmt: skip
    assert sorted(stage.layers) == [2, 3, 4]
    pointers = set()
    for i in (2, 3, 4):
        layer = stage[i]
        assert layer is stage.layers[i]
        assert layer.impl == "masked" and layer.seq_len == 7
        for buf in (layer.k, layer.v, layer.grad_k, layer.grad_v):
            assert buf.shape == (3, 2, 7, 4)
            assert buf.dtype == torch.float64 and buf.device.type == "cpu"
            pointers.add(buf.data_ptr())
        assert torch.count_nonzero(layer.grad_k) == 0 and torch.count_nonzero(layer.grad_v) == 0
    assert len(pointers) == 12  # no two buffers share memory
    with pytest.raises(KeyError):
        stage[1]


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
def test_slice_past_the_buffer_is_refused(impl: str) -> None:
    layer = _context(8, 4, impl)
    q, k, v, _ = _inputs(10, 4, seed=9)
    with pytest.raises(ValueError, match=r"slice \[6, 10\) runs past the context buffer of 8"):
        slice_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], layer, 6)
    layer.grad_k.fill_(1.0)
    with pytest.raises(ValueError, match=r"slice \[0, 9\) runs past the context buffer of 8"):
        slice_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], layer, 0)
    assert bool((layer.grad_k == 1.0).all())  # a refused call leaves the context alone


def test_unknown_impl_is_refused() -> None:
    listing = re.escape(str(ATTENTION_IMPLS))
    with pytest.raises(ValueError, match=rf"unknown attention impl 'flash'.*{listing}"):
        LayerContext(1, 1, 4, 4, dtype=torch.float32, device=CPU, impl="flash")
    layer = _context(4, 4, None)
    layer.impl = "flash"  # the constructor refuses it; slice_attention must as well
    q, k, v, _ = _inputs(4, 4, seed=10)
    with pytest.raises(ValueError, match=rf"unknown attention impl 'flash'.*{listing}"):
        slice_attention(q, k, v, layer, 0)


def test_split_attention_refuses_a_device_other_than_cpu() -> None:
    """Its kernel exists for CPU tensors only: a CUDA context is refused when it is made,
    naming the device and what runs there (here the meta device stands for CUDA)."""
    assert attention_impls("cpu") == ATTENTION_IMPLS
    assert attention_impls("meta") == ("masked",)
    with pytest.raises(ValueError, match=r"'split' runs on CPU tensors only.*meta.*\('masked',\)"):
        LayerContext(1, 1, 4, 4, dtype=torch.float32, device="meta", impl="split")
    LayerContext(1, 1, 4, 4, dtype=torch.float32, device="meta", impl="masked")
    # Queries from another device reaching a CPU context's split kernel are refused too.
    layer = _context(4, 4, "split")
    q, k, v, _ = _inputs(4, 4, seed=11)
    with pytest.raises(ValueError, match="'split' runs on CPU tensors only, not meta"):
        slice_attention(q.to("meta"), k.to("meta"), v.to("meta"), layer, 0)
