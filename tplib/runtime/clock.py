"""When each action of a pass starts and ends, in seconds from the pass's start.

On CPU the wall clock. On a GPU, CUDA events recorded on the current stream and read
once the pass is over: a device-wide synchronisation per action would expose every
kernel launch's latency, which costs short token slices most.
"""

from __future__ import annotations

import time

import torch

__all__ = ["Mark", "PassClock"]

Mark = float | torch.cuda.Event


class PassClock:
    """The clock of one pass, started when it is made."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.base: torch.cuda.Event | None = None
        if self.cuda:
            self.base = torch.cuda.Event(enable_timing=True)
            self.base.record()

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter() - self.t0
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self) -> None:
        """End the pass: wait for the GPU's work, so that the pass's time is its own."""
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed(self) -> float:
        """Wall seconds since the pass started."""
        return time.perf_counter() - self.t0

    def seconds(self, mark: Mark) -> float:
        """A mark as seconds from the start (a GPU's only after :meth:`finish`)."""
        if isinstance(mark, float):
            return mark
        assert self.base is not None
        return self.base.elapsed_time(mark) / 1e3
