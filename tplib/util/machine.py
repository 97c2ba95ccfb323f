"""This machine's cores, as local pipeline processes share them.

A local pipeline runs one process per rank on this machine. :func:`threads_per_process`
is how many torch threads each gets (the launcher sets it, the profiler times stages
with it, the simulator's shared-cores model assumes it); :func:`busy_cores` measures how
many cores other jobs keep busy, which the measured tables record beside each run.
"""

from __future__ import annotations

import os
import time

__all__ = ["busy_cores", "cpu_count", "threads_per_process"]


def cpu_count() -> int:
    return os.cpu_count() or 1


def threads_per_process(world_size: int) -> int:
    """Torch threads for each of ``world_size`` local processes: the cores split evenly,
    at least one. More threads than cores make spin-waiting threads fight for them."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    return max(1, cpu_count() // world_size)


def busy_cores(window_s: float = 0.25) -> float:
    """Cores this machine spent busy (or stolen by its hypervisor) over the next
    ``window_s`` seconds, from Linux's ``/proc/stat``; NaN where there is no such file.
    Called while a pool's processes wait for work, it measures the other jobs' demand."""

    def snapshot() -> tuple[float, float]:
        with open("/proc/stat") as f:
            ticks = [float(x) for x in f.readline().split()[1:9]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

    try:
        total0, idle0 = snapshot()
        time.sleep(window_s)
        total1, idle1 = snapshot()
    except (OSError, ValueError, IndexError):
        return float("nan")
    if total1 <= total0:
        return float("nan")
    busy = 1.0 - (idle1 - idle0) / (total1 - total0)
    return busy * cpu_count()
