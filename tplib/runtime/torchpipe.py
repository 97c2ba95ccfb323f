"""A tplib schedule run by torch.distributed.pipelining's runtime, on tplib's stages.

:func:`run_torch` exports a schedule of whole microbatches to torch's action CSV
(:mod:`tplib.schedule.torchio`), starts one local process per rank (gloo on 127.0.0.1),
and on each builds the model parts its rank holds with :func:`tplib.nn.model.build_model`
(the same initialisation as tplib's runtime), wraps each in a torch ``PipelineStage``
(torch's stage index = tplib's part), loads the CSV into ``_PipelineScheduleRuntime``
and runs one ``step()`` on the run's first batch. It returns the loss and the gradients,
keyed as :meth:`tplib.runtime.RunResult.grads` keys them, so a test holds torch's
execution of a schedule to tplib's runtime, or to the single-device reference.

Three things are done here so that torch computes what tplib computes:

- the loss: tplib's is the sum of token cross-entropies over ``batch * seq_len``; torch
  calls the loss function once per microbatch and adds nothing up, so the function given
  is each microbatch's summed cross-entropy over the whole batch's token count, with
  ``scale_grads=False`` (torch's default would divide the gradients by the microbatch
  count a second time). The iteration's loss is the sum of the microbatches';
- the tied embedding: the first part's token embedding and the last part's head are one
  parameter of the model, two of torch's stages; their gradients are summed (an
  all-reduce between the two ranks, an addition on a rank that holds both), as tplib's
  ``AR`` does;
- the products: tplib's ``Linear`` adds its weight gradients into ``.grad`` itself,
  outside autograd's graph, and torch asks autograd for them (:func:`_plain_products`):
  here they run as plain ``nn.Linear``.

What tplib's runtime adds and torch's has no action for is refused: data or operation
parallelism, recomputation, dropout (tplib's masks are keyed by position, torch's stages
draw their own), a precision other than fp32, a device other than the CPU.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from dataclasses import dataclass
from functools import partial
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from tplib.nn.data import training_batch
from tplib.nn.layer_ranges import balanced_stages
from tplib.nn.linear import Linear
from tplib.nn.model import GPTStage, build_model
from tplib.runtime.pool import free_port
from tplib.runtime.runconfig import RunConfig
from tplib.schedule import Schedule
from tplib.schedule.torchio import TorchFormat, to_torch, write_torch_csv
from tplib.util.machine import threads_per_process

__all__ = ["TorchRunResult", "check_torch_run", "run_torch"]


@dataclass
class TorchRunResult:
    """What one torch ``step()`` computed: each microbatch's loss (in microbatch order) and
    the gradients, keyed by (rank, parameter name)."""

    microbatch_losses: list[float]
    grads: dict[tuple[int, str], Tensor]

    @property
    def loss(self) -> float:
        """The iteration's loss, tplib's: the microbatches' summed."""
        return sum(self.microbatch_losses)


def check_torch_run(run: RunConfig, schedule: Schedule) -> None:
    """Refuse, naming the setting, what torch's runtime would not compute as tplib does."""
    p = run.parallelism
    unlike = {
        "n_data": (p.n_data, 1),
        "n_op": (p.n_op, 1),
        "n_cp": (p.n_cp, 1),
        "recompute": (run.recompute, "none"),
        "dropout": (run.cfg.dropout, 0.0),
        "precision": (run.precision, "fp32"),
        "device": (run.device, "cpu"),
    }
    for name, (value, want) in unlike.items():
        if value != want:
            raise ValueError(
                f"{name}={value!r}: a run on torch's pipeline runtime takes {name}={want!r} "
                "(torch's runtime runs one pipeline of whole stages, fp32 on the CPU here, "
                "without tplib's recomputation or position-keyed dropout)"
            )
    plan = schedule.plan
    if (plan.batch, plan.seq_len) != (run.data.batch, run.data.seq_len):
        raise ValueError(
            f"schedule {schedule.name!r} covers batch={plan.batch}, seq_len={plan.seq_len} "
            f"but the run trains batch={run.data.batch}, seq_len={run.data.seq_len}"
        )
    if len(set(plan.batch_slices)) != 1:
        raise ValueError(
            f"schedule {schedule.name!r} has batch slices of {sorted(set(plan.batch_slices))} "
            "sequences: torch splits the batch into equal microbatches"
        )


def _part_ranges(run: RunConfig, schedule: Schedule) -> tuple[tuple[int, int], ...]:
    ranges = tuple(run.ranges)
    if len(ranges) == schedule.n_parts:
        return ranges
    return balanced_stages(run.cfg.n_layer, schedule.n_parts)


def _loss(logits: Tensor, targets: Tensor, tokens: int) -> Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, targets.reshape(-1), reduction="sum") / tokens


def _rank_main(
    rank: int,
    run: RunConfig,
    schedule: Schedule,
    csv_path: str,
    fmt: TorchFormat,
    port: int,
    results: Any,
) -> None:
    try:
        world = schedule.n_stages
        torch.set_num_threads(run.timing.threads or threads_per_process(world))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=run.timing.timeout_s),
        )
        losses, grads = _step(rank, run, schedule, csv_path, fmt)
        dist.barrier()  # every rank's messages are in before any rank leaves
        # As numpy arrays: a tensor would cross in shared memory this process is about to free.
        results.put(("ok", rank, (losses, {n: g.numpy() for n, g in grads.items()})))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    # Leave without the interpreter's teardown (torch's of the process group takes seconds),
    # once the queue's thread has handed the result over.
    results.close()
    results.join_thread()
    os._exit(0)


def _step(
    rank: int, run: RunConfig, schedule: Schedule, csv_path: str, fmt: TorchFormat
) -> tuple[list[float], dict[str, Tensor]]:
    cfg, data, placement = run.cfg, run.data, schedule.placement
    ranges = _part_ranges(run, schedule)
    mine = [p for p, r in enumerate(placement) if r == rank]
    modules = {p: _plain_products(build_model(cfg, *ranges[p], seed=run.seed)) for p in mine}
    stages = [PipelineStage(modules[p], p, schedule.n_parts, torch.device("cpu")) for p in mine]
    runtime = _PipelineScheduleRuntime(
        stages,
        schedule.plan.n_batch_slices,
        loss_fn=partial(_loss, tokens=data.batch * data.seq_len),
        scale_grads=False,
    )
    runtime._load_csv(csv_path, format=fmt)
    tokens, targets = training_batch(cfg, data.source, data.batch, data.seq_len, seed=data.seed)
    losses: list[Tensor] = []
    runtime.step(tokens, target=targets, losses=losses)
    _sum_tied(rank, run, schedule, modules)
    grads = {
        name: p.grad.detach().clone()
        for m in modules.values()
        for name, p in m.named_parameters()
        if p.grad is not None
    }
    return [float(x.detach()) for x in losses], grads


def _plain_products(module: GPTStage) -> GPTStage:
    """``module`` with its products as plain ``nn.Linear`` (the same arithmetic). tplib's
    add their weight gradients into ``.grad`` themselves, outside autograd's graph
    (:mod:`tplib.nn.linear`), where torch counts on autograd: its split backward's ``W``
    asks autograd for them (and fails), and its first step infers the stages' shapes by a
    forward and backward that would leave gradients behind (torch clears an FSDP
    module's only)."""
    for m in module.modules():
        if isinstance(m, Linear):
            setattr(m, "forward", MethodType(nn.Linear.forward, m))  # noqa: B010
    return module


def _sum_tied(rank: int, run: RunConfig, schedule: Schedule, modules: dict[int, GPTStage]) -> None:
    first, last = 0, schedule.n_parts - 1
    if not run.cfg.tie_embeddings or first == last:
        return  # one module: its head already is its embedding
    a, b = schedule.placement[first], schedule.placement[last]
    if a == b:
        if rank == a:
            wte, head = modules[first].wte.weight, modules[last].head.weight
            assert wte.grad is not None and head.grad is not None
            wte.grad.add_(head.grad)
            head.grad.copy_(wte.grad)
        return
    group = dist.new_group([a, b])  # every rank creates it, as torch requires
    if rank in (a, b):
        p = modules[first].wte.weight if rank == a else modules[last].head.weight
        assert p.grad is not None
        dist.all_reduce(p.grad, group=group)


def run_torch(
    run: RunConfig,
    schedule: Schedule | None = None,
    *,
    fmt: TorchFormat = "compute_only",
    start_timeout_s: float = 120.0,
) -> TorchRunResult:
    """One iteration of ``schedule`` (default: the run's own) on torch's runtime, on local
    processes, with ``run``'s model, data and seed; its CSV written in format ``fmt``."""
    schedule = run.schedule if schedule is None else schedule
    check_torch_run(run, schedule)
    rows = to_torch(schedule, fmt)  # refuses token slices and asynchronous schedules
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "schedule.csv")
        write_torch_csv(rows, path)
        port = free_port()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, run, schedule, path, fmt, port, results),
                daemon=True,
            )
            for rank in range(schedule.n_stages)
        ]
        for proc in procs:
            proc.start()
        try:
            got = _gather(procs, results, start_timeout_s + run.timing.timeout_s)
        finally:
            for proc in procs:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    losses: list[float] = []
    grads: dict[tuple[int, str], Tensor] = {}
    for rank, (rank_losses, rank_grads) in sorted(got.items()):
        losses += rank_losses  # only the rank of the last part has them
        grads |= {(rank, name): torch.from_numpy(g) for name, g in rank_grads.items()}
    return TorchRunResult(losses, grads)


def _gather(procs: list[Any], results: Any, budget_s: float) -> dict[int, Any]:
    got: dict[int, Any] = {}
    waited = 0.0
    while len(got) < len(procs):
        try:
            status, rank, payload = results.get(timeout=0.5)
        except queue.Empty:
            waited += 0.5
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
            if dead or waited > budget_s:
                for p in procs:
                    p.kill()
                why = f"ranks {dead} died" if dead else f"no result within {budget_s:.0f} s"
                raise RuntimeError(f"torch's pipeline runtime failed: {why}") from None
            continue
        if status == "error":
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} of torch's pipeline runtime failed:\n{payload}")
        got[rank] = payload
    return got
