"""tplib.util.machine: how local processes share this machine's cores."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from tplib.util import machine


def test_threads_split_the_cores_evenly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 16)
    assert [machine.threads_per_process(w) for w in (1, 2, 3, 16, 40)] == [16, 8, 5, 1, 1]
    with pytest.raises(ValueError, match="world_size=0"):
        machine.threads_per_process(0)


def test_busy_cores_sees_a_spinning_process() -> None:
    # /proc/stat exists on Linux: the answer must be a real core count, not NaN.
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start
        busy = machine.busy_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert 0.7 <= busy <= machine.cpu_count()


def test_busy_cores_is_nan_without_proc_stat(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr("builtins.open", missing)
    assert math.isnan(machine.busy_cores(0.0))
