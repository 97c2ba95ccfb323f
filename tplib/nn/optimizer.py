"""The optimizers of the three precisions (:mod:`tplib.nn.precision`): AdamW on the model's
own parameters (fp32, bf16), or on fp32 master copies of fp16 parameters with dynamic loss
scaling (fp16), both with GPT-3's weight-decay groups.

An fp16 step, on every rank::

    (loss * opt.loss_scale).backward()      # the last stage scales; gradients flow back
                                            # scaled, into the fp32 main grads
    found = opt.unscale_grads()             # 0-d tensor: 1.0 if any gradient is inf/NaN
    all_reduce(found, MAX)                  # over every rank of the run
    if not found: clip(opt.grads())         # the unscaled main grads, never a skip's
    opt.set_lr(lr); opt.step(bool(found.item())); opt.zero_grad()

Every rank must take the same decision: data-parallel replicas must stay identical, and
earlier stages divide gradients scaled by the last stage's loss scale by their own scaler's
scale, which is only right while all scalers see the same overflow history.

Both optimizers take a ``decay`` predicate choosing the parameters AdamW decays
(:data:`DECAY_RULES`): GPT-3, like GPT-2 and Megatron, exempts biases and LayerNorm gains
and biases, the parameters with fewer than two dimensions, since decaying a gain or an
offset towards zero only fights the normalisation. The others get ``weight_decay``, the
exempt ones 0, in two AdamW parameter groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tplib.nn.bytecount import optimizer_bytes, storage_bytes
from tplib.nn.configs import check_precision
from tplib.nn.precision import attach_main_grads

__all__ = [
    "DECAY_RULES",
    "DynamicLossScaler",
    "MixedPrecisionOptimizer",
    "PlainOptimizer",
    "is_matrix",
    "make_optimizer",
    "set_groups_lr",
]


@dataclass
class DynamicLossScaler:
    """The loss scale of fp16 training, adjusted to the largest value that does not overflow.

    - On overflow (any inf/NaN gradient) the step is skipped, since its gradients are
      garbage, and the scale is multiplied by ``backoff_factor``: the scale was too large.
      It never falls below ``min_scale``: gradients that overflow at every scale mean a
      diverged run, and shrinking the scale further would only flush them all to zero.
    - After ``growth_interval`` consecutive good steps the scale is multiplied by
      ``growth_factor``: gradients shrink as training goes on, and a larger scale keeps more
      of their low bits. The interval is long because each probe that overflows costs a
      skipped step.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_scale) and self.min_scale > 0):
            raise ValueError(f"min_scale must be finite and > 0, got {self.min_scale}")
        if not (math.isfinite(self.scale) and self.scale >= self.min_scale):
            raise ValueError(
                f"scale must be finite and >= min_scale={self.min_scale}, got {self.scale}"
            )
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            raise ValueError(f"growth_factor must be finite and > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")
        if not 0 <= self.good_steps < self.growth_interval:
            raise ValueError(
                f"good_steps must be in [0, growth_interval={self.growth_interval}), "
                f"got {self.good_steps}"
            )

    def update(self, found_inf: bool) -> bool:
        """Record one step's outcome; return whether the optimizer should step."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True


Decay = Callable[[Tensor], bool]  # whether AdamW decays a parameter


def is_matrix(param: Tensor) -> bool:
    """GPT-3's rule: decay product weights and embeddings (ndim >= 2), not biases or
    LayerNorm gains and biases."""
    return param.ndim >= 2


def _decay_all(param: Tensor) -> bool:
    return True


# Optim.weight_decay_params names these (tplib.runtime.runconfig.WEIGHT_DECAY_PARAMS).
DECAY_RULES: dict[str, Decay] = {"matrices": is_matrix, "all": _decay_all}


def _decay_groups(
    params: Sequence[Tensor], tensors: Sequence[Tensor], weight_decay: float, decay: Decay | None
) -> list[dict[str, Any]]:
    """AdamW parameter groups over ``tensors`` (the model's ``params`` themselves, or their
    master copies, in the same order): ``weight_decay`` where ``decay(param)``, 0 elsewhere.
    ``decay`` None decays every parameter, as torch's AdamW does; empty groups are left out.
    """
    rule = _decay_all if decay is None else decay
    keep = [rule(p) for p in params]
    groups = [
        {
            "params": [t for t, k in zip(tensors, keep, strict=True) if k],
            "weight_decay": weight_decay,
        },
        {"params": [t for t, k in zip(tensors, keep, strict=True) if not k], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def set_groups_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set ``lr`` on every parameter group of ``optimizer``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class MixedPrecisionOptimizer:
    """AdamW on fp32 master copies of float16 model parameters, with dynamic loss scaling.

    Each model parameter's gradient accumulates in its fp32 ``main_grad``
    (:func:`attach_main_grads`), which is also its master's ``.grad``. A parameter whose
    gradient is zero still receives weight decay and momentum, unlike torch AdamW, which
    skips a parameter whose gradient is None.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float,
        scaler: DynamicLossScaler | None = None,
        decay: Decay | None = None,
    ) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("MixedPrecisionOptimizer got an empty parameter list")
        for i, p in enumerate(self.params):
            if p.dtype != torch.float16:
                raise ValueError(
                    f"parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}: "
                    "MixedPrecisionOptimizer needs float16 model parameters"
                )
        self.scaler = scaler if scaler is not None else DynamicLossScaler()
        self.steps_skipped = 0
        self._device = self.params[0].device
        self._masters: list[Tensor] = []
        for p, main in zip(self.params, attach_main_grads(self.params), strict=True):
            master = p.detach().to(torch.float32, copy=True).requires_grad_(True)
            # The main grad itself: the inner AdamW reads the gradients where they were
            # accumulated, and never zeroes or frees them.
            master.grad = main
            self._masters.append(master)
        self.inner = torch.optim.AdamW(
            _decay_groups(self.params, self._masters, weight_decay, decay),
            lr=lr,
            betas=betas,
            eps=eps,
        )

    @property
    def loss_scale(self) -> float:
        """What the caller multiplies the loss by before backward."""
        return self.scaler.scale

    @property
    def master_params(self) -> list[Tensor]:
        return self._masters

    def unscale_grads(self) -> Tensor:
        """Divide the main grads by the loss scale, in place (call it once per step).

        A gradient left in a parameter's fp16 ``.grad`` (set there directly, not by a
        backward, whose hook moves it) is added to its main grad first.

        Returns a 0-d float32 tensor on the parameters' device, 1.0 if any main grad is
        inf or NaN, else 0.0. It stays a tensor (no host sync here) so that the caller can
        all-reduce it with MAX before calling :meth:`step`.
        """
        finite = []
        for p, m in zip(self.params, self._masters, strict=True):
            assert m.grad is not None  # the main grad, attached for good
            if p.grad is not None:
                m.grad.add_(p.grad)
                p.grad = None
            m.grad.div_(self.scaler.scale)
            finite.append(torch.isfinite(m.grad).all())
        return torch.stack(finite).all().logical_not().to(torch.float32)

    def grads(self) -> list[Tensor | None]:
        """The gradients :meth:`step` will use, one per parameter in order: the main
        grads, unscaled fp32 after :meth:`unscale_grads`, which gradient clipping scales
        in place."""
        return [m.grad for m in self._masters]

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next :meth:`step` (every parameter group)."""
        set_groups_lr(self.inner, lr)

    @torch.no_grad()
    def step(self, found_inf: bool) -> bool:
        """Step unless ``found_inf``; either way update the scaler. Return whether it stepped.

        A skipped step leaves the masters, the model parameters and Adam's state untouched.
        """
        if not self.scaler.update(found_inf):
            self.steps_skipped += 1
            return False
        self.inner.step()
        for p, m in zip(self.params, self._masters, strict=True):
            p.copy_(m)  # rounds to nearest fp16, as m.half() does
        return True

    def zero_grad(self) -> None:
        # The main grads are kept and zeroed; an fp16 .grad is only ever transient.
        for p, m in zip(self.params, self._masters, strict=True):
            p.grad = None
            assert m.grad is not None
            m.grad.zero_()

    def state_bytes(self) -> int:
        """Bytes held beyond the model parameters and their gradient buffers (the main
        grads, :func:`tplib.runtime.memory.gradient_bytes`): the masters and Adam's state
        (allocated by the first step that is not skipped)."""
        return storage_bytes(self._masters) + optimizer_bytes(self.inner)


class PlainOptimizer:
    """AdamW directly on the model's parameters (fp32, bf16): the interface of
    :class:`MixedPrecisionOptimizer` without loss scaling or master copies."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float,
        decay: Decay | None = None,
    ) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("PlainOptimizer got an empty parameter list")
        self.steps_skipped = 0  # never skips: there is no loss scale to back off
        self._device = self.params[0].device
        self.inner = torch.optim.AdamW(
            _decay_groups(self.params, self.params, weight_decay, decay),
            lr=lr,
            betas=betas,
            eps=eps,
        )

    @property
    def loss_scale(self) -> float:
        return 1.0

    @property
    def master_params(self) -> list[Tensor]:
        """The tensors AdamW updates: here the model parameters themselves."""
        return list(self.params)

    def unscale_grads(self) -> Tensor:
        """Always 0.0, without scanning the gradients: nothing is scaled, so an inf or NaN
        here is a diverged run, which skipping would not cure."""
        return torch.zeros((), dtype=torch.float32, device=self._device)

    def grads(self) -> list[Tensor | None]:
        """The gradients :meth:`step` will use, one per parameter in order (None where a
        parameter has none): the model's own."""
        return [p.grad for p in self.params]

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next :meth:`step` (every parameter group)."""
        set_groups_lr(self.inner, lr)

    def step(self, found_inf: bool) -> bool:
        self.inner.step()
        return True

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        return optimizer_bytes(self.inner)


def make_optimizer(
    params: Iterable[torch.nn.Parameter],
    precision: str,
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
    decay: Decay | None = None,
) -> MixedPrecisionOptimizer | PlainOptimizer:
    """The optimizer for ``precision``: master weights and loss scaling for fp16 only.
    ``decay`` picks the parameters that get ``weight_decay`` (None: all of them)."""
    check_precision(precision)
    cls = MixedPrecisionOptimizer if precision == "fp16" else PlainOptimizer
    return cls(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, decay=decay)
