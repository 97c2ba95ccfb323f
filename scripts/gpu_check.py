"""The GPU check, ``make gpu-check``: device info, the CUDA exactness tests, a multi-rank
run, the paper's Figure 3, slicing's and keyed dropout's cost, a training step's MFU and
memory against the model, on this node's GPU (see :mod:`tplib.gpucheck`).

It runs from the checkout with whatever Python starts it, tplib uninstalled. Without a
GPU it says so, writes nothing and exits 0; with a GPU that torch cannot use it fails,
saying why. Usage::

    python scripts/gpu_check.py [--out results/gpu] [--dry] [--steps device,exactness]
"""

from __future__ import annotations

import sys
from pathlib import Path

# The checkout before any installed copy: a node's own Python has no tplib installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tplib.gpucheck import main

if __name__ == "__main__":
    raise SystemExit(main())
