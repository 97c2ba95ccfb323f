"""The single-device reference every pipeline must reproduce.

:func:`train_reference` trains a run's model in one process on the whole batch with
whole sequences (no stages, no slices, no replicas), the same data, initialisation and
optimiser. The exactness tests compare every schedule, slicing and layout with it:
losses, gradients after the first iteration and parameters after the last step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tplib.data import synthetic_batch
from tplib.model import build_model
from tplib.runtime.config import RunConfig

__all__ = ["ReferenceResult", "train_reference"]


@dataclass
class ReferenceResult:
    """A single-process, whole-batch, unsliced run: what every pipeline must reproduce."""

    losses: list[float]
    grads: dict[str, Tensor]  # after the first iteration
    params: dict[str, Tensor]  # after the last step


def train_reference(run: RunConfig) -> ReferenceResult:
    """Train ``run``'s model on one device with whole sequences and the full batch."""
    model = build_model(run.cfg, seed=run.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=run.lr,
        betas=run.betas,
        weight_decay=run.weight_decay,
        eps=run.adam_eps,
    )
    losses: list[float] = []
    grads: dict[str, Tensor] = {}
    for i in range(run.warmup + run.steps):
        tokens, targets = synthetic_batch(run.cfg, run.batch, run.seq_len, seed=run.data_seed + i)
        loss = model(tokens, targets=targets) / targets.numel()
        loss.backward()
        if i >= run.warmup:
            losses.append(loss.item())
        if i == 0:
            grads = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return ReferenceResult(losses, grads, params)
