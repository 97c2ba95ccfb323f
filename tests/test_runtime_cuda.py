"""The runtime on CUDA, against the single-process fp32 reference on CPU.

The tests marked ``cuda`` skip without a GPU; ``make gpu-check`` runs them (this file
alone, so a node without the notebooks' packages can collect it). Its CPU rehearsal
(``make gpu-check-rehearsal``) runs them on the CPU instead: ``TPLIB_TEST_DEVICE=cpu``
names the device they use, so a mistake in them shows before a GPU is leased (fp16,
which needs CUDA, then skips). With fewer GPUs than ranks the ranks share the GPU over
gloo, their tensors staged through host memory; with a GPU per rank, NCCL.

Every pipelined schedule the issue of a GPU path names runs here: ``gpipe``, ``1f1b``,
``terapipe`` and ``terapipe-zb``, in fp32, bf16 and fp16, two stages (and #Op = 2: four
ranks) sharing the GPU.

Tolerances:

- fp32 on CUDA (2-stage TeraPipe, #Op 1 and 2, with and without recomputation) against
  :func:`~tplib.runtime.train_reference` (CPU, fp32): losses and the parameters after 5
  AdamW steps within ``rtol = atol = 1e-4``, first-iteration gradients within 1e-4 of each
  tensor's largest magnitude. Only rounding differs (CUDA kernels, slices, reduction
  order), so 1e-4 is 10x the CPU suite's 1e-5, and a wrong gradient moves a parameter by
  ~lr = 1e-3 per step.
- bf16 (autocast) and fp16 (fp16 weights, fp32 masters, dynamic loss scaling) on CUDA:
  every loss within 2e-2 relative of the fp32 reference, every first-iteration gradient
  within a relative L2 error ``||g - g_ref|| / ||g_ref||`` of 5e-2. fp16 may skip its
  first step if the initial loss scale 2**16 overflows (on this model the fp32 gradients
  times 2**16 peak near 2e4, under fp16's 65504): all ranks must skip the same steps, at
  most one, and the final parameters must be finite.
- bf16 on CPU (not marked cuda, runs everywhere): losses within 1e-3 relative, every
  gradient within 2e-2 relative L2 error (measured: losses 6e-5, gradients 0.8% at most).
- One process on CUDA: token-sliced execution (:func:`~tplib.nn.slicing.run_pipeline_local`)
  against the whole-sequence model in fp32 within 1e-5 of each tensor's scale, as
  ``tests/test_nn_slicing.py`` checks on CPU.

TF32: in torch 2.x ``torch.backends.cuda.matmul.allow_tf32`` defaults to False
(``torch.get_float32_matmul_precision() == "highest"``), so fp32 matmuls are full fp32.
Setting the flag here would not reach the runs' worker processes: they are spawned fresh
and start from torch's default, which :func:`test_fresh_processes_keep_tf32_off` checks
(the environment variable ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` would turn it on).
In this process the single-process tests switch TF32 off explicitly.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from tplib.nn.configs import get_config
from tplib.nn.context import attention_impls
from tplib.nn.data import synthetic_batch
from tplib.nn.model import GPTStage, build_model
from tplib.nn.slicing import full_batch_loss, run_pipeline_local
from tplib.plan import Plan
from tplib.runtime import (
    Data,
    Hooks,
    LocalPool,
    Optim,
    Parallelism,
    ReferenceResult,
    RunConfig,
    RunResult,
    Timing,
    train_reference,
)
from tplib.schedule import registered

from .conftest import Pools, assert_scaled_close

# The device the tests marked cuda run on: "cpu" in gpu-check's rehearsal.
DEVICE = os.environ.get("TPLIB_TEST_DEVICE", "cuda")
cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

COLLECT = Hooks(collect_grads=True, collect_params=True)
SEQ_LEN = 16
UNEVEN = Plan((1, 1), ((5, 11), (2, 6, 8)))  # uneven token slices, two batch slices
# Each schedule with the slicing it runs: whole sequences as microbatches, or token slices.
SCHEDULE_PLANS = {
    "gpipe": Plan.gpipe(2, SEQ_LEN),
    "1f1b": Plan.uniform(2, SEQ_LEN, n_token_slices=3),
    "terapipe": UNEVEN,
    "terapipe-zb": UNEVEN,
    # Virtual stages on NCCL: the interleaved wrap from stage 1 back to stage 0, and the
    # V's local turn and tied embedding summed on one stage.
    "terapipe-interleaved": UNEVEN,
    "zbv": Plan.gpipe(2, SEQ_LEN),
}


def _config(
    *,
    device: str,
    precision: str = "fp32",
    n_op: int = 1,
    schedule: str = "terapipe",
    slicing: Plan | int | None = None,
    steps: int = 5,
    recompute: str = "none",
) -> RunConfig:
    if precision == "fp16" and device != "cuda":
        pytest.skip("fp16 needs CUDA (fp16 weights are for GPUs); the rehearsal skips it")
    if registered(schedule).chunked and device != "cuda":
        # What they add here is NCCL; on gloo tests/test_runtime_virtual.py runs them.
        pytest.skip("virtual stages on CPU: tests/test_runtime_virtual.py; here for NCCL")
    return RunConfig(
        model="tiny",
        schedule_name=schedule,
        parallelism=Parallelism(
            n_stages=2, n_op=n_op, n_chunks=registered(schedule).default_chunks
        ),
        data=Data(batch=2, seq_len=SEQ_LEN),
        slicing=SCHEDULE_PLANS[schedule] if slicing is None else slicing,
        timing=Timing(steps=steps, timeout_s=120),
        # The attention key bias has an exactly-zero gradient in exact arithmetic, so
        # both sides hold rounding noise there; eps=1e-6 keeps Adam from blowing that
        # noise up to steps of ~lr (as in tests/test_runtime.py).
        optim=Optim(lr=1e-3, adam_eps=1e-6),
        device=device,
        precision=precision,
        recompute=recompute,
    )


def _model_name(run: RunConfig, stage: int, name: str) -> str:
    # The last part's LM head is the model's tied token embedding, on whichever stage.
    return "wte.weight" if name == "head.weight" and run.cfg.tie_embeddings else name


def _check_coverage(run: RunConfig, result: RunResult, ref: ReferenceResult) -> None:
    assert len(result.losses) == len(ref.losses) == run.timing.steps
    covered = {_model_name(run, s, n) for s, n in result.grads()}
    assert covered == set(ref.grads), "every parameter lives on exactly one stage"
    assert {_model_name(run, s, n) for s, n in result.params()} == set(ref.params)


def _prefixed(what: str) -> Callable[[str], str]:
    return lambda message: f"{what}: {message}"


def _check_fp32(run: RunConfig, result: RunResult, tol: float) -> None:
    ref = train_reference(run)
    _check_coverage(run, result, ref)
    torch.testing.assert_close(
        torch.tensor(result.losses), torch.tensor(ref.losses), rtol=tol, atol=tol
    )
    for (stage, name), g in result.grads().items():
        assert_scaled_close(g, ref.grads[_model_name(run, stage, name)], rel=tol, what=name)
    for (stage, name), p in result.params().items():
        torch.testing.assert_close(
            p,
            ref.params[_model_name(run, stage, name)],
            rtol=tol,
            atol=tol,
            msg=_prefixed(f"param {name} after {run.timing.steps} steps"),
        )


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    norm = expected.float().norm().item()
    assert norm > 0, "a reference gradient is zero: the relative error means nothing"
    return (actual.float() - expected.float()).norm().item() / norm


def _check_mixed(
    run: RunConfig, result: RunResult, *, loss_rel: float, grad_rel: float, grads: bool = True
) -> ReferenceResult:
    ref = train_reference(run)  # fp32 on CPU, whatever run.precision says
    _check_coverage(run, result, ref)
    for i, (got, want) in enumerate(zip(result.losses, ref.losses, strict=True)):
        assert math.isfinite(got) and abs(got - want) <= loss_rel * abs(want), (i, got, want)
    for (_, name), p in result.params().items():
        assert torch.isfinite(p).all(), f"param {name} after {run.timing.steps} steps is not finite"
    if not grads:
        return ref
    errors = {
        name: _relative_error(g, ref.grads[_model_name(run, stage, name)])
        for (stage, name), g in result.grads().items()
    }
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= grad_rel, f"grad {worst}: relative L2 error {errors[worst]:.3g}"
    return ref


# ---- bf16 on CPU: runs everywhere ------------------------------------------------------


def test_bf16_on_cpu_matches_the_fp32_reference(pools: Callable[[int], LocalPool]) -> None:
    run = _config(device="cpu", precision="bf16", slicing=4, steps=3)
    assert run.plan == Plan.uniform(2, SEQ_LEN, n_token_slices=4)
    result = pools(2).run(run, COLLECT)
    assert all(r.steps_skipped == 0 for r in result.ranks)
    ref = _check_mixed(run, result, loss_rel=1e-3, grad_rel=2e-2)
    # Not the fp32 run under another name: bf16 rounding shows in the gradients.
    g = result.grads()[0, "blocks.0.mlp.fc.weight"]
    assert _relative_error(g, ref.grads["blocks.0.mlp.fc.weight"]) > 1e-4


# ---- CUDA ------------------------------------------------------------------------------


def _on_this_node(world: int) -> LocalPool:
    """NCCL with a GPU per rank, else gloo with the ranks sharing the GPU."""
    own = DEVICE == "cuda" and torch.cuda.device_count() >= world
    return LocalPool(world, backend="nccl" if own else "gloo", timeout_s=120)


@pytest.fixture(scope="module")
def shared_gpu() -> Iterator[Callable[[int], LocalPool]]:
    """``shared_gpu(world)``: ``world`` ranks on this node's GPUs, started once per module."""
    made = Pools(_on_this_node)
    yield made
    made.close()


@cuda
@needs_gpu
def test_fresh_processes_keep_tf32_off() -> None:
    """What the spawned workers start with: fp32 matmuls in full fp32."""
    if DEVICE != "cuda":
        pytest.skip("TF32 is a CUDA setting")
    code = (
        "import torch; torch.cuda.init(); "
        "print(torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "highest"], out.stdout


# (schedule, #Op, recompute): every schedule on two ranks, TeraPipe on four (#Op = 2).
FP32_CASES = [
    *((name, 1, recompute) for name in SCHEDULE_PLANS for recompute in ("none", "full")),
    *(("terapipe", 2, recompute) for recompute in ("none", "full")),
]


@cuda
@needs_gpu
@pytest.mark.parametrize(("schedule", "n_op", "recompute"), FP32_CASES)
def test_fp32_on_cuda_matches_the_cpu_reference(
    shared_gpu: Callable[[int], LocalPool], schedule: str, n_op: int, recompute: str
) -> None:
    run = _config(device=DEVICE, schedule=schedule, n_op=n_op, recompute=recompute)
    result = shared_gpu(run.parallelism.world_size).run(run, COLLECT)
    source = "allocator" if DEVICE == "cuda" else "counted"
    assert all(r.memory is not None and r.memory.source == source for r in result.ranks)
    _check_fp32(run, result, tol=1e-4)


MIXED_CASES = [
    *((precision, name, 1) for precision in ("bf16", "fp16") for name in SCHEDULE_PLANS),
    *((precision, "terapipe", 2) for precision in ("bf16", "fp16")),
]


@cuda
@needs_gpu
@pytest.mark.parametrize(("precision", "schedule", "n_op"), MIXED_CASES)
def test_mixed_precision_on_cuda_is_close_to_fp32(
    shared_gpu: Callable[[int], LocalPool], precision: str, schedule: str, n_op: int
) -> None:
    run = _config(device=DEVICE, precision=precision, schedule=schedule, n_op=n_op)
    result = shared_gpu(run.parallelism.world_size).run(run, COLLECT)
    skipped = {r.steps_skipped for r in result.ranks}
    assert len(skipped) == 1, f"ranks skipped different numbers of steps: {skipped}"
    n_skipped = skipped.pop()
    if precision == "bf16":
        assert n_skipped == 0  # no loss scale, nothing to skip
    else:
        # Only the initial 2**16 scale may overflow, once; then it is halved.
        assert n_skipped <= 1, f"fp16 skipped {n_skipped} of {run.timing.steps} steps"
    # Gradients are collected in the first iteration: if that one overflowed (and was
    # skipped) they hold inf/NaN and say nothing about precision.
    first_finite = all(torch.isfinite(g).all() for g in result.grads().values())
    assert first_finite or n_skipped == 1, "an overflowing iteration must be skipped"
    _check_mixed(run, result, loss_rel=2e-2, grad_rel=5e-2, grads=first_finite)


@cuda
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_distributed_optimizer_on_cuda(
    shared_gpu: Callable[[int], LocalPool], precision: str
) -> None:
    """#Data = 2, the optimizer state sharded: the reduce-scatter and all-gather on NCCL,
    or staged through host memory where the four ranks share a GPU; fp16's skip taken by
    every rank together, on the unscaled shards."""
    if DEVICE != "cuda":  # what it adds is NCCL; on gloo tests/test_runtime.py runs it
        pytest.skip("the distributed optimizer on CPU: tests/test_runtime.py; here for NCCL")
    run = _config(device=DEVICE, precision=precision)
    run = dataclasses.replace(
        run,
        parallelism=dataclasses.replace(run.parallelism, n_data=2, distributed_optimizer=True),
        data=dataclasses.replace(run.data, batch=4),
    )
    result = shared_gpu(run.parallelism.world_size).run(run, COLLECT)
    if precision == "fp32":
        _check_fp32(run, result, tol=1e-4)
        return
    skipped = {r.steps_skipped for r in result.ranks}
    assert len(skipped) == 1 and skipped.pop() <= 1, f"ranks skipped {skipped} steps"
    first_finite = all(torch.isfinite(g).all() for g in result.grads().values())
    _check_mixed(run, result, loss_rel=2e-2, grad_rel=5e-2, grads=first_finite)


@cuda
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_megatrons_recipe_on_cuda(shared_gpu: Callable[[int], LocalPool], precision: str) -> None:
    """Sequence parallelism, selective recomputation and the distributed optimizer together
    on (#Data, #Pipe, #Op) = (2, 2, 2), token slices with dropout: the #Op group's
    all-gathers and reduce-scatters and the sharded step on NCCL (8 ranks sharing the
    GPUs), against the CPU reference."""
    if DEVICE != "cuda":  # what it adds is NCCL; on gloo tests/test_runtime.py runs it
        pytest.skip("Megatron's recipe on CPU: tests/test_runtime.py; here for NCCL")
    even = Plan((1, 1), ((6, 10), (2, 6, 8)))  # every slice divisible by #Op
    run = _config(device=DEVICE, precision=precision, n_op=2, slicing=even, recompute="selective")
    layout = dataclasses.replace(
        run.parallelism, n_data=2, sequence_parallel=True, distributed_optimizer=True
    )
    run = dataclasses.replace(run, parallelism=layout, data=dataclasses.replace(run.data, batch=4))
    result = shared_gpu(run.parallelism.world_size).run(run, COLLECT)
    if precision == "fp32":
        _check_fp32(run, result, tol=1e-4)
    else:
        _check_mixed(run, result, loss_rel=2e-2, grad_rel=5e-2, grads=True)


# ---- one process on CUDA: sliced against whole sequences, fp32 -------------------------


CFG = get_config("tiny")
PLANS = [
    Plan.uniform(2, 16, n_token_slices=4),
    Plan((1, 1), ((7, 1, 8), (3, 13))),
    Plan((2,), ((1,) * 4 + (12,),)),
    Plan((1, 2), ((5, 11), (16,))),
    Plan((3,), ((1,) * 8 + (8,) * 7,)),  # the model's whole context, 64 tokens
    Plan((1, 1, 1), ((64,), (32, 32), (2, 30, 1, 31))),
]


@pytest.fixture()
def no_tf32() -> Iterator[None]:
    """Full fp32 matmuls in this process, whatever ran before. (Not monkeypatch: the
    cuBLAS flags are properties of a module object it cannot restore.)"""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32, cudnn.allow_tf32 = False, False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def _reference(
    model: GPTStage, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = full_batch_loss(model, tokens, targets)
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n} has no gradient"
        grads[n] = p.grad.clone()
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _check_grads(stages: list[GPTStage], ref_grads: dict[str, torch.Tensor]) -> None:
    """Every stage's gradients on the device and equal to the whole model's. A last
    stage's head is the first stage's embedding: run_pipeline_local gives each copy the
    whole gradient of the shared matrix."""
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            key = "wte.weight" if name == "head.weight" and stage.cfg.tie_embeddings else name
            assert p.grad is not None, f"{name} has no gradient"
            assert p.grad.device.type == DEVICE, f"{name}'s gradient left the GPU"
            assert_scaled_close(p.grad, ref_grads[key], what=f"[{stage.lo}, {stage.hi}) {name}")
            seen.add(key)
    assert seen == ref_grads.keys()


@cuda
@needs_gpu
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("attention", [None, *attention_impls(DEVICE)])
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_sliced_model_on_cuda_matches_whole_sequences(
    plan: Plan, attention: str | None, recompute: str
) -> None:
    model = build_model(CFG, seed=1, device=DEVICE)
    tokens, targets = (t.to(DEVICE) for t in synthetic_batch(CFG, plan.batch, plan.seq_len, seed=2))
    ref_loss, ref_grads = _reference(model, tokens, targets)
    loss = run_pipeline_local(
        [model], tokens, plan, targets=targets, attention=attention, recompute=recompute
    )
    assert loss.device.type == DEVICE
    assert_scaled_close(loss, ref_loss, what="loss")
    _check_grads([model], ref_grads)


@cuda
@needs_gpu
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("cuts", [(0, 1, 4), (0, 2, 4), (0, 1, 2, 3, 4)], ids=str)
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_chained_stages_on_cuda_match_whole_sequences(plan: Plan, cuts: tuple[int, ...]) -> None:
    whole = build_model(CFG, seed=4, device=DEVICE)
    tokens, targets = (t.to(DEVICE) for t in synthetic_batch(CFG, plan.batch, plan.seq_len, seed=5))
    ref_loss, ref_grads = _reference(whole, tokens, targets)
    stages = [
        build_model(CFG, lo, hi, seed=4, device=DEVICE) for lo, hi in itertools.pairwise(cuts)
    ]
    loss = run_pipeline_local(stages, tokens, plan, targets=targets)
    assert_scaled_close(loss, ref_loss, what="loss")
    _check_grads(stages, ref_grads)


def _middle_stage_case(
    plan: Plan,
) -> tuple[
    GPTStage, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]
]:
    """A middle stage on CUDA: (stage, input, output gradient, reference output,
    reference input gradient, reference parameter gradients)."""
    stage = build_model(CFG, 1, 3, seed=6, device=DEVICE)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(plan.batch, plan.seq_len, CFG.hidden, generator=g).to(DEVICE)
    grad_out = torch.randn(plan.batch, plan.seq_len, CFG.hidden, generator=g).to(DEVICE)
    x_ref = x.clone().requires_grad_()
    y_ref = stage(x_ref)
    y_ref.backward(grad_out)
    assert x_ref.grad is not None
    ref_grads = {}
    for n, p in stage.named_parameters():
        assert p.grad is not None, f"{n} has no gradient"
        ref_grads[n] = p.grad.clone()
    stage.zero_grad(set_to_none=True)
    return stage, x, grad_out, y_ref.detach(), x_ref.grad, ref_grads


@cuda
@needs_gpu
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("attention", [None, *attention_impls(DEVICE)])
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_middle_stage_on_cuda_matches_whole_sequences(plan: Plan, attention: str | None) -> None:
    stage, x, grad_out, y_ref, x_grad_ref, ref_grads = _middle_stage_case(plan)
    x_sl = x.clone().requires_grad_()
    y = run_pipeline_local([stage], x_sl, plan, grad_output=grad_out, attention=attention)
    # Compared where the reference lives (see the next test for where the output is).
    assert_scaled_close(y.to(y_ref.device), y_ref, what="output")
    assert x_sl.grad is not None and x_sl.grad.device.type == DEVICE
    assert_scaled_close(x_sl.grad, x_grad_ref, what="input grad")
    for name, p in stage.named_parameters():
        assert_scaled_close(p.grad, ref_grads[name], what=name)


@cuda
@needs_gpu
def test_middle_stage_output_stays_on_the_gpu() -> None:
    """A chain that ends mid-model returns its output on the device it ran on."""
    plan = PLANS[1]
    stage, x, grad_out, y_ref, _, _ = _middle_stage_case(plan)
    y = run_pipeline_local([stage], x.clone().requires_grad_(), plan, grad_output=grad_out)
    assert y.device == y_ref.device, f"output on {y.device}, input on {x.device}"
