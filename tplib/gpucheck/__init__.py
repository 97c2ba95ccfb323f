"""The GPU check (``make gpu-check``): what a user runs once on a GPU node, in one short
run, to prove tplib's CUDA path and measure what the paper's premises become there.

================  ====================================================================
module            what it holds
================  ====================================================================
``node``          what the node offers: Python, torch, CUDA, driver, the GPUs; why a
                  visible GPU that torch cannot use fails the check
``sizes``         what the steps measure at: a GPU's sizes, the rehearsal's; the targets
``result``        a step's outcome, as its process prints it
``proofs``        the steps that prove the path runs: device, exactness tests, multi-rank
``measures``      the steps that measure: Figure 3, slicing, dropout, efficiency, memory
``kernels``       timings on one device: Figure 3, slicing's cost, keyed dropout's cost
``training``      a training step's MFU; measured memory against the memory model
``steps``         the steps by name with their budgets; one step's process (``-m``)
``driver``        the steps under their budgets, the summary, the folder and archive
================  ====================================================================

``make gpu-check PYTHON=python3`` runs it with a node's own interpreter as it is (no
virtual environment, no install, no network: torch 2.4 or newer, numpy, pandas,
matplotlib, seaborn and pytest, on Python 3.11 or newer); everything goes to
``results/gpu/<device>/``. ``GPU_CHECK_DRY=1`` (``make gpu-check-rehearsal``) runs every
step on the CPU at small sizes, through the same code, so that a mistake shows before a
GPU is leased.
"""

from tplib.gpucheck.driver import main

__all__ = ["main"]
