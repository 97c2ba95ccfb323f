"""The learning-rate schedule of a run: GPT-3's linear warm-up then cosine decay.

GPT-3 (Brown et al., 2020, appendix B) warms the learning rate up linearly, then decays it
with a cosine down to 10% of its peak and trains on at that floor. :class:`LRSchedule`
says which learning rate optimizer step ``s`` (0-based) uses; it is a pure function of
``s``, so every rank of a run computes it alone, with no state to keep in step.

Precisely, with peak ``lr``, ``W = warmup_steps``, ``D = decay_steps`` and
``lr_min = min_ratio * lr``:

- warm-up, ``s < W``: ``lr * (s + 1) / (W + 1)``, a straight line that reaches ``lr`` at
  step ``W``. It starts at ``lr / (W + 1)``, not at zero: a step taken with a learning
  rate of zero would be a wasted iteration;
- ``"cosine"``: for ``W <= s < D``,
  ``lr_min + (lr - lr_min) * (1 + cos(pi * (s - W) / (D - W))) / 2`` (``lr`` at ``s = W``),
  and ``lr_min`` from step ``D`` on (``D`` counts from step 0, warm-up included);
- ``"constant"``: ``lr`` from step ``W`` on.

This is, to rounding, what torch's own schedulers compute when chained by
``torch.optim.lr_scheduler.SequentialLR`` with milestones ``[W, D]``:
``LinearLR(start_factor=1 / (W + 1), total_iters=W)``, then
``CosineAnnealingLR(T_max=D - W, eta_min=lr_min)``, then ``ConstantLR(factor=min_ratio)``
for the floor (``CosineAnnealingLR`` alone would climb back up after ``T_max``);
``tests/test_nn_lr.py`` checks the two against each other to 1e-12. It is also nanoGPT's
``get_lr``. No torch here: a run's config checks its schedule on a login node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LR_SCHEDULES", "LRSchedule"]

LR_SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of every optimizer step: ``LRSchedule(...).lr_at(step)``.

    ``peak``: the learning rate after warm-up. ``warmup_steps``: steps of linear warm-up
    (0: none). ``decay_steps``: with ``"cosine"``, the step from which the rate stays at
    ``min_ratio * peak`` (at least ``warmup_steps``; equal to it, the rate drops to the
    floor right after warm-up); ``"constant"`` has no decay and takes None.
    """

    peak: float
    kind: str = "cosine"
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(
                f"LRSchedule.kind={self.kind!r} is not a learning-rate schedule: choose one of "
                f"{LR_SCHEDULES}"
            )
        if not (math.isfinite(self.peak) and self.peak > 0):
            raise ValueError(f"LRSchedule.peak={self.peak} must be a finite positive learning rate")
        if not _count(self.warmup_steps):
            raise ValueError(
                f"LRSchedule.warmup_steps={self.warmup_steps!r} must be an integer >= 0 "
                "(0: no warm-up)"
            )
        if self.kind == "constant":
            if self.decay_steps is not None:
                raise ValueError(
                    f"LRSchedule.decay_steps={self.decay_steps} with kind='constant': a constant "
                    "schedule has no decay; leave it None or choose 'cosine'"
                )
            return
        if self.decay_steps is None:
            raise ValueError(
                "LRSchedule.decay_steps=None with kind='cosine': give the step its decay ends"
            )
        if not _count(self.decay_steps) or self.decay_steps < self.warmup_steps:
            raise ValueError(
                f"LRSchedule.decay_steps={self.decay_steps!r} must be an integer >= "
                f"warmup_steps={self.warmup_steps}: the decay ends at that step, counted "
                "from the first step, warm-up included"
            )
        if not 0 <= self.min_ratio <= 1:
            raise ValueError(
                f"LRSchedule.min_ratio={self.min_ratio} must lie in [0, 1]: the floor is "
                "that fraction of the peak learning rate"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"step {step} is negative: steps count from 0")
        w = self.warmup_steps
        if step < w:
            return self.peak * (step + 1) / (w + 1)
        if self.kind == "constant":
            return self.peak
        assert self.decay_steps is not None  # checked when made
        floor = self.min_ratio * self.peak
        if step >= self.decay_steps:
            return floor
        progress = (step - w) / (self.decay_steps - w)
        return floor + (self.peak - floor) * (1 + math.cos(math.pi * progress)) / 2


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
