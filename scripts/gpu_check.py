"""The GPU check, ``make gpu-check``: device info, CUDA exactness tests, a multi-rank run
and the paper's Figure 3 on this machine's NVIDIA GPU (see :mod:`tplib.gpucheck`).

Without a CUDA GPU it says so, writes nothing and exits 0. Usage::

    python scripts/gpu_check.py [--out results/gpu]
"""

from __future__ import annotations

from tplib.gpucheck import main

if __name__ == "__main__":
    raise SystemExit(main())
