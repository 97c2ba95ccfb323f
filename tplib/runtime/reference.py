"""The single-device reference every pipeline must reproduce.

:func:`train_reference` trains a run's model in one process on the whole batch with
whole sequences (no stages, no slices, no replicas), the same data, initialisation and
optimiser. The exactness tests compare every schedule, slicing and layout with it:
losses, gradients after the first iteration and parameters after the last step.

The optimiser recipe is applied here with torch's own tools, independently of the
runtime's code: parameter groups chosen by ``ndim`` right here,
``torch.nn.utils.clip_grad_norm_`` on the whole model (whose tied embedding is one
parameter, counted once: the definition of the global norm the runtime's ranks must
agree on), and the learning rate driven by ``torch.optim.lr_scheduler`` schedulers
(:func:`torch_lr_scheduler`), not by :mod:`tplib.nn.lr`.

Asynchronous schedules compute gradients on older weights, and the reference applies
their defining recurrences directly (:func:`_stage_delays`): iteration t's gradient is
taken with stage k's weights as they were ``d_k`` updates ago,
W(t+1) = W(t) - lr * grad f_t(W_0(t - d_0), ..., W_{K-1}(t - d_{K-1})), clamped at
W(0), and AdamW's moments are taken over these delayed gradients. It keeps the history
of the whole model's weights and evaluates each iteration's gradient on a chain of K
stage copies loaded from it (the tied embedding's two uses may then see different
versions: PipeDream's first stage reads an older one than its last).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    SequentialLR,
)

from tplib.documents import IGNORE
from tplib.nn.data import document_batch, training_batch
from tplib.nn.dropout import DropoutKey
from tplib.nn.model import GPTStage, build_model
from tplib.runtime.runconfig import RunConfig

__all__ = ["ReferenceResult", "torch_lr_scheduler", "train_reference"]


def _stage_delays(run: RunConfig) -> tuple[int, ...]:
    """The updates by which each stage's weights lag in ``run``'s update rule, from the
    papers: 2BW 1 on every stage; PipeDream K-1-k on stage k (weight stashing), K-1 on
    every stage with vertical sync; synchronous schedules 0."""
    k = run.parallelism.n_stages
    if run.schedule_name == "2bw":
        return (1,) * k
    if run.schedule_name == "pipedream":
        return (k - 1,) * k if run.vertical_sync else tuple(k - 1 - s for s in range(k))
    return (0,) * k


@dataclass
class ReferenceResult:
    """A single-process, whole-batch, unsliced run: what every pipeline must reproduce."""

    losses: list[float]
    grads: dict[str, Tensor]  # after the first iteration, before clipping
    params: dict[str, Tensor]  # after the last step
    # Per timed iteration: the global gradient norm before clipping (empty without
    # clipping) and the learning rate of the step.
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)


def torch_lr_scheduler(optimizer: torch.optim.Optimizer, run: RunConfig) -> LRScheduler:
    """``run``'s learning-rate schedule as torch schedulers on ``optimizer`` (whose
    groups hold the peak rate): linear warm-up from ``lr / (W + 1)``, then a cosine to
    ``min_lr_ratio * lr`` and that floor, or the peak held ("constant"). Call ``step()``
    after each optimizer step."""
    total = run.timing.iterations
    optim = run.optim
    w = optim.lr_warmup_steps
    phases: list[tuple[int, LRScheduler]] = []  # (first step, scheduler)
    if w > 0:
        phases.append((0, LinearLR(optimizer, start_factor=1 / (w + 1), total_iters=w)))
    if optim.lr_schedule_name == "cosine":
        end = optim.lr_decay_steps if optim.lr_decay_steps is not None else max(total, w)
        if end > w:
            floor = optim.min_lr_ratio * optim.lr
            phases.append((w, CosineAnnealingLR(optimizer, T_max=end - w, eta_min=floor)))
        # The floor; total_iters past the run's end, where ConstantLR would restore the peak.
        phases.append(
            (end, ConstantLR(optimizer, factor=optim.min_lr_ratio, total_iters=total + 1))
        )
    else:
        phases.append((w, ConstantLR(optimizer, factor=1.0, total_iters=total + 1)))
    return SequentialLR(
        optimizer, schedulers=[s for _, s in phases], milestones=[start for start, _ in phases[1:]]
    )


def _documents_loss(model: GPTStage, run: RunConfig, i: int, key: DropoutKey | None) -> Tensor:
    """Iteration ``i``'s mean loss over packed rows as the sum over its documents run one
    at a time, unpacked, through the whole model (the rows themselves, attending across
    documents, when ``document_masking`` is off): what packing must not change. With
    dropout, whose masks are keyed by the rows' positions, the packed rows whole."""
    data = run.data
    packed = document_batch(
        run.cfg, data.source, data.batch, data.seq_len, data.seed + i, data.packing
    )
    counted = int((packed.targets != IGNORE).sum())
    if not data.document_masking:
        return model(packed.tokens, targets=packed.targets, dropout=key) / counted
    if key is not None:
        loss = model(packed.tokens, targets=packed.targets, dropout=key, documents=packed.documents)
        return loss / counted
    total = torch.zeros(())
    for tokens, targets in packed.unpacked():
        total = total + model(tokens, targets=targets)
    return total / counted


def train_reference(run: RunConfig) -> ReferenceResult:
    """Train ``run``'s model on one device with whole sequences and the full batch."""
    model = build_model(run.cfg, seed=run.seed)
    params = list(model.parameters())  # the tied embedding once
    groups: list[dict[str, Any]]
    optim = run.optim
    if optim.weight_decay_params == "all":
        groups = [{"params": params}]
    else:  # GPT-3: no decay for biases and LayerNorm gains and biases (1-d tensors)
        groups = [
            {"params": [p for p in params if p.dim() > 1]},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
        ]
    optimizer = torch.optim.AdamW(
        groups, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, eps=optim.adam_eps
    )
    scheduler = torch_lr_scheduler(optimizer, run)
    result = ReferenceResult([], {}, {})
    delays = _stage_delays(run)
    delayed = _Delayed(run, model) if any(delays) else None
    data = run.data
    for i in range(run.timing.iterations):
        key = DropoutKey.for_iteration(run.seed, i) if run.cfg.dropout > 0 else None
        if data.packed:  # every document alone, whole and unpacked
            loss = _documents_loss(model, run, i, key)
            loss.backward()
        else:
            tokens, targets = training_batch(
                run.cfg, data.source, data.batch, data.seq_len, seed=data.seed + i
            )
            if delayed is None:
                loss = model(tokens, targets=targets, dropout=key) / targets.numel()
                loss.backward()
            else:
                loss = delayed.gradient(i, delays, tokens, targets)
        timed = i >= run.timing.warmup
        if timed:
            result.losses.append(loss.item())
            result.lrs.append(optimizer.param_groups[0]["lr"])
        if i == 0:
            result.grads = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        if optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
            if timed:
                result.grad_norms.append(norm.item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    result.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result


class _Delayed:
    """Gradients on delayed weights: the whole model's weights after every update, and
    a chain of stage copies to evaluate a gradient on a mix of them."""

    def __init__(self, run: RunConfig, model: GPTStage) -> None:
        self.model = model
        self.tied = run.cfg.tie_embeddings
        self.history = [self._snapshot()]  # weights after 0, 1, ... updates
        self.stages = [build_model(run.cfg, lo, hi, seed=run.seed) for lo, hi in run.ranges]

    def _snapshot(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def _whole(self, stage: GPTStage, name: str) -> str:
        # A last stage's head is the whole model's (tied) embedding.
        tied = self.tied and stage.is_last and not stage.is_first and name == "head.weight"
        return "wte.weight" if tied else name

    def gradient(self, i: int, delays: tuple[int, ...], tokens: Tensor, targets: Tensor) -> Tensor:
        """Iteration ``i``'s mean loss with each stage on its delayed weights; its
        gradient, summed over every use of each whole-model parameter, is left in the
        model's ``.grad``. Call after each update: it records the weights."""
        if len(self.history) < i + 1:
            self.history.append(self._snapshot())
        with torch.no_grad():
            for stage, delay in zip(self.stages, delays, strict=True):
                weights = self.history[max(i - delay, 0)]
                for name, p in stage.named_parameters():
                    p.copy_(weights[self._whole(stage, name)])
                    p.grad = None
        x = tokens
        for stage in self.stages[:-1]:
            x = stage(x)
        loss = self.stages[-1](x, targets=targets) / targets.numel()
        loss.backward()
        whole = dict(self.model.named_parameters())
        for stage in self.stages:
            for name, p in stage.named_parameters():
                target = whole[self._whole(stage, name)]
                assert p.grad is not None
                target.grad = p.grad.clone() if target.grad is None else target.grad + p.grad
        return loss.detach()
