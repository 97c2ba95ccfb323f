"""The GPU check, ``make gpu-check``: device info, the CUDA exactness tests, a multi-rank
run, the paper's Figure 3, slicing's and keyed dropout's cost, a training step's MFU and
memory against the model, on this node's GPU (see :mod:`tplib.gpucheck`).

It runs from the checkout with whatever Python starts it, tplib uninstalled. Without a
GPU it says so, writes nothing and exits 0; with a GPU that torch cannot use it fails,
saying why. Usage::

    python scripts/gpu_check.py [--out results/gpu] [--dry] [--steps device,exactness]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _unfit() -> str | None:
    """What makes this interpreter unable to start the check at all (tplib's own modules
    need Python 3.11 and torch to be imported)."""
    if sys.version_info < (3, 11):  # noqa: UP036 (a node's Python may be older than ours)
        return f"python {sys.version.split()[0]} is older than 3.11"
    if importlib.util.find_spec("torch") is None:
        return (
            f"{sys.executable} cannot import torch: run the node's Python that has it "
            "(make gpu-check PYTHON=...), or install tplib with a CUDA build (README: TORCH_INDEX)"
        )
    return None


if __name__ == "__main__":
    if (why := _unfit()) is not None:
        print(f"gpu-check: FAILED: {why}", file=sys.stderr)
        raise SystemExit(1)
    # The checkout before any installed copy: a node's own Python has no tplib installed.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tplib.gpucheck import main

    raise SystemExit(main())
