"""Tests for tplib.runtime.update: the gradient buffers a rank reduces and steps with.

fp16 accumulates in fp32 main grads (tplib.nn.precision): the buffers the all-reduces sum
and the step zeroes are those, and no fp16 gradient stays allocated. On CPU, with a
one-rank stand-in for the process groups (every reduction over one rank is the identity);
a RunConfig names device "cuda" to take fp16, which builds nothing on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tplib.nn.data import synthetic_batch
from tplib.nn.model import build_model
from tplib.nn.wgrad import main_grad
from tplib.runtime.parts import Data, Parallelism
from tplib.runtime.runconfig import RunConfig
from tplib.runtime.update import Update


class _OneRank:
    """What Update asks of RankGroups, for a run of one rank."""

    replica = op_rank = reduce_index = 0

    def all_reduce(
        self, tensor: Tensor, group: object, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> None:
        pass


def _update(precision: str, lo: int, hi: int) -> Update:
    run = RunConfig(
        model="tiny",
        parallelism=Parallelism(n_stages=2),
        precision=precision,
        device="cuda",
        data=Data(seq_len=16),
    )
    dtype = torch.float16 if precision == "fp16" else torch.float32
    stage = build_model(run.cfg, lo, hi, seed=3, dtype=dtype)
    return Update(run, stage, _OneRank())  # type: ignore[arg-type]


def test_fp16_buffers_are_the_main_grads_and_no_fp16_grad_is_kept() -> None:
    upd = _update("fp16", 0, 2)
    buffers = upd.grad_buffers()
    assert [b is main_grad(p) for b, p in zip(buffers, upd.params, strict=True)] == [True] * len(
        upd.params
    )
    assert all(b.dtype == torch.float32 for b in buffers)
    assert all(p.grad is None for p in upd.params)
    # The first of two stages holds the tied embedding's first copy: its buffer is wte's.
    (tied,) = upd.tied_grad_buffers()
    assert tied is main_grad(upd.stages[0].wte.weight)
    fp32 = _update("fp32", 0, 2)
    assert [b is p.grad for b, p in zip(fp32.grad_buffers(), fp32.params, strict=True)] == [
        True
    ] * len(fp32.params)
    (tied,) = fp32.tied_grad_buffers()
    assert tied is fp32.stages[0].wte.weight.grad


def test_fp16_step_uses_the_main_grads_then_zeroes_them() -> None:
    upd = _update("fp16", 2, 4)
    ref = build_model(upd.stages[0].cfg, 2, 4, seed=3)  # the same weights in fp32
    _, targets = synthetic_batch(upd.stages[0].cfg, 2, 16, seed=5)
    x = torch.randn(2, 16, upd.stages[0].cfg.hidden, generator=torch.Generator().manual_seed(6))
    # The mean loss, as the executor scales it, times fp16's loss scale.
    scale = upd.optimizer.loss_scale / targets.numel()
    (upd.stages[0](x.half(), targets=targets).float() * scale).backward()
    (ref(x, targets=targets) / targets.numel()).backward()
    assert all(p.grad is None for p in upd.params)  # moved into the main grads
    # The head is the tied embedding's second copy: the first stage counts it in the norm.
    norms = [p.grad.norm() for n, p in ref.named_parameters() if n != "head.weight"]  # type: ignore[union-attr]
    want = torch.linalg.vector_norm(torch.stack(norms))
    before = [p.detach().clone() for p in upd.params]
    upd.step(0)
    assert upd.steps_skipped == 0 and len(upd.grad_norms) == 1
    # The norm of the unscaled main grads is the fp32 model's, within fp16's rounding.
    torch.testing.assert_close(upd.grad_norms[0], want, rtol=1e-2, atol=0)
    assert all(not torch.equal(p, b) for p, b in zip(upd.params, before, strict=True))
    assert all(torch.count_nonzero(b) == 0 for b in upd.grad_buffers())
