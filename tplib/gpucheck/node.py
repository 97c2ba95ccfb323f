"""What a node offers the GPU check: its Python and torch, the GPUs it shows, and whether
torch can use them.

A GPU node often runs a Python of its own, with a CUDA build of torch and no network;
a login node's virtual environment copied there, or a pip that picked the CPU wheel,
leaves torch unable to see a GPU that ``nvidia-smi`` and ``/dev/nvidia*`` show. The
check must then fail and say why, not report "no GPU" and pass: :func:`inspect_node`
gathers what the node has, :meth:`Node.refusal` says what stops the check.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

import torch

__all__ = [
    "Node",
    "device_slug",
    "inspect_node",
    "version_tuple",
]

_MIN_PYTHON = (3, 11)
_MIN_TORCH = (2, 4)
# What the check imports beside torch: no notebook, widget or test-property packages.
_NEEDS = ("numpy", "pandas", "matplotlib", "seaborn", "pytest")
# The device files the NVIDIA driver makes, one per GPU (a test points this elsewhere).
DEVICE_FILES = os.environ.get("GPU_CHECK_DEVICE_FILES", "/dev/nvidia[0-9]*")


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.11.0+cu130"`` as ``(2, 11, 0)``."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def device_slug(name: str) -> str:
    """A folder name for a GPU: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


@dataclass(frozen=True)
class Node:
    """What :func:`inspect_node` found."""

    python: str
    torch: str
    torch_cuda: str | None  # the CUDA torch was built for; None: a CPU-only build
    cuda_available: bool
    cuda_error: str  # why torch cannot use CUDA, when it says
    gpus: tuple[str, ...]  # what torch sees
    smi_gpus: tuple[str, ...]  # what nvidia-smi lists
    device_files: tuple[str, ...]
    driver: str | None
    missing: tuple[str, ...]  # of _NEEDS

    @property
    def gpu_visible(self) -> bool:
        """Whether the node shows a GPU, whatever torch makes of it."""
        return bool(self.smi_gpus or self.device_files)

    def describe(self) -> str:
        """One line: the software found and the GPUs."""
        cuda = f"CUDA {self.torch_cuda}" if self.torch_cuda else "a CPU-only build"
        gpus = ", ".join(self.gpus or self.smi_gpus) or "no GPU"
        return (
            f"python {self.python}, torch {self.torch} ({cuda}), "
            f"driver {self.driver or 'not found'}, {gpus}"
        )

    def refusal(self, dry: bool) -> str | None:
        """Why the check cannot run here (None: it can). A rehearsal needs only the
        software; a real check also needs torch to see the GPU the node shows."""
        if version_tuple(self.python) < _MIN_PYTHON:
            return f"python {self.python} is older than {'.'.join(map(str, _MIN_PYTHON))}"
        if version_tuple(self.torch) < _MIN_TORCH:
            return f"torch {self.torch} is older than {'.'.join(map(str, _MIN_TORCH))}"
        if self.missing:
            return (
                f"python {sys.executable} lacks {', '.join(self.missing)}: the check needs "
                f"torch and {', '.join(_NEEDS)}"
            )
        if dry or self.cuda_available or not self.gpu_visible:
            return None
        shown = "; ".join(self.smi_gpus) or ", ".join(self.device_files)
        if self.torch_cuda is None:
            why = (
                f"torch {self.torch} is a CPU-only build: install a CUDA build (README: "
                "TORCH_INDEX) or run the node's own: make gpu-check PYTHON=python3"
            )
        elif os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
            why = f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
        else:
            why = (
                f"torch {self.torch} (CUDA {self.torch_cuda}) cannot use it with driver "
                f"{self.driver or 'unknown'}: {self.cuda_error or 'torch.cuda.is_available() is False'}"
            )
        return f"a GPU is visible ({shown}) but torch cannot use it: {why}"


def _nvidia_smi() -> tuple[tuple[str, ...], str | None]:
    """(the GPUs nvidia-smi lists, the driver version); nothing where it is missing or
    fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return (), None
    query = "--query-gpu=name,memory.total,driver_version"
    try:
        out = subprocess.run(
            [smi, query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return (), None
    if out.returncode:
        return (), None
    rows = [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line]
    gpus = tuple(f"{r[0]} ({r[1]})" if len(r) > 1 else r[0] for r in rows)
    driver = rows[0][2] if rows and len(rows[0]) > 2 else None
    return gpus, driver


def _cuda_error() -> str:
    """What torch says when it tries CUDA (empty when it works or stays silent)."""
    try:
        torch.cuda.init()
    except Exception as exc:  # the message is the diagnosis
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return ""


def inspect_node() -> Node:
    """What this node has (a few seconds: nvidia-smi and, without CUDA, torch's error)."""
    available = torch.cuda.is_available()
    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    smi_gpus, driver = _nvidia_smi()
    return Node(
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=available,
        cuda_error="" if available or torch.version.cuda is None else _cuda_error(),
        gpus=gpus if available else (),
        smi_gpus=smi_gpus,
        device_files=tuple(sorted(glob.glob(DEVICE_FILES))),
        driver=driver,
        missing=tuple(m for m in _NEEDS if importlib.util.find_spec(m) is None),
    )
