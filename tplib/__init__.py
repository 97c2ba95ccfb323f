"""tplib: a reproducibility kit for TeraPipe, token-level pipeline parallelism for
training large transformer language models (Li et al., ICML 2021).

``import tplib`` is light: the configs and plans load at once, the torch model on first
use (``tplib.GPTStage``, ``tplib.build_model``), so planning and simulating never pay
for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tplib.nn.configs import MODELS, GPTConfig, get_config, n_params
from tplib.plan import Plan, Unit

if TYPE_CHECKING:
    from tplib.nn.model import GPTStage, build_model

__all__ = [
    "MODELS",
    "GPTConfig",
    "GPTStage",
    "Plan",
    "Unit",
    "build_model",
    "get_config",
    "n_params",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("GPTStage", "build_model"):
        import tplib.nn.model

        return getattr(tplib.nn.model, name)
    raise AttributeError(f"module 'tplib' has no attribute {name!r}")
