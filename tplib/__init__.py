"""tplib: a reproducibility kit for TeraPipe, token-level pipeline parallelism
for training large transformer language models (Li et al., ICML 2021)."""

from tplib.config import MODELS, GPTConfig, get_config, n_params
from tplib.model import GPTStage, build_model
from tplib.plan import Plan, Unit

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
