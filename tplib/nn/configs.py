"""Model configurations: the paper's GPT-3 family (Table 1) and small CPU configs.

A :class:`GPTConfig` is a frozen dataclass; named configs live in :data:`MODELS` and are
looked up with :func:`get_config`. :func:`n_params` counts parameters from the config
alone, so the 175B model can be sized without allocating anything.

The rules of the options a run adds to a model (#Op, recomputation, precision) and of a
run's numbers (their types and ranges) are checked here too, without torch, so a run's
configuration is checked before torch loads.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = [
    "GELUS",
    "MODELS",
    "PRECISIONS",
    "RECOMPUTE_MODES",
    "GPTConfig",
    "check_op",
    "check_precision",
    "check_recompute",
    "check_run_numbers",
    "get_config",
    "n_params",
    "n_params_per_layer",
    "padded_vocab",
    "stage_params",
]

GPT2_VOCAB = 50257
GELUS = ("tanh", "erf")


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _int_pair(p: object) -> bool:
    return isinstance(p, tuple | list) and len(p) == 2 and all(_integer(x) for x in p)


def _integer(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-style decoder-only language model."""

    name: str
    n_layer: int
    hidden: int
    n_head: int
    seq_len: int = 2048  # longest sequence (the model's context); position table size
    vocab_size: int = GPT2_VOCAB
    # GPT-2/3 share the token embedding with the LM head; the paper's parameter counts
    # (1.3B for GPT3-1B) only add up with sharing.
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    # GPT-2 and GPT-3 use GELU's tanh approximation ("gelu_new" in Hugging Face's
    # configs); "erf" is the exact GELU.
    gelu: str = "tanh"
    # Dropout on the embeddings, the attention probabilities and the residual branches
    # (GPT-2 and GPT-3 trained with 0.1), applied only when training (tplib.nn.dropout).
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"GPTConfig.name={self.name!r}: must be a string")
        if not (_finite(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: must be in [0, 1)")
        if self.gelu not in GELUS:
            raise ValueError(f"GPTConfig.gelu={self.gelu!r}: choose one of {GELUS}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"GPTConfig.tie_embeddings={self.tie_embeddings!r}: must be a bool")
        for field in ("n_layer", "hidden", "n_head", "seq_len", "vocab_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{field}={value!r}: must be a positive integer")
        for field in ("layer_norm_eps", "init_std"):
            value = getattr(self, field)
            if not (_finite(value) and value > 0):
                raise ValueError(f"GPTConfig.{field}={value!r}: must be a finite number > 0")
        if self.hidden % self.n_head:
            raise ValueError(
                f"GPTConfig.hidden={self.hidden} is not divisible by n_head={self.n_head}: "
                "attention heads must split the hidden size evenly"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    def with_(self, **changes: object) -> GPTConfig:
        """A copy with some fields changed (e.g. a longer ``seq_len``)."""
        return replace(self, **changes)  # type: ignore[arg-type]


def _paper(name: str, n_layer: int, hidden: int) -> GPTConfig:
    # Table 1: every paper model uses head dimension 128, L = 2048 and GPT-2's vocabulary.
    # GPT-3 trained with dropout 0.1 (the cluster model charges its memory traffic).
    return GPTConfig(name=name, n_layer=n_layer, hidden=hidden, n_head=hidden // 128, dropout=0.1)


MODELS: dict[str, GPTConfig] = {
    c.name: c
    for c in (
        _paper("GPT3-1B", 24, 2048),
        _paper("GPT3-13B", 40, 5120),
        _paper("GPT3-44B", 96, 6144),
        _paper("GPT3-175B", 96, 12288),
        # GPT-2 small (124M), the checkpoint size a CPU can load and run.
        GPTConfig("gpt2", n_layer=12, hidden=768, n_head=12, seq_len=1024, dropout=0.1),
        # Small configs for a 2-core CPU. "tiny" runs a training step in milliseconds
        # (exactness tests); "small" is the benchmark model (8 layers, hidden 512).
        GPTConfig("tiny", n_layer=4, hidden=32, n_head=4, seq_len=64, vocab_size=96),
        GPTConfig("mini", n_layer=4, hidden=128, n_head=4, seq_len=512, vocab_size=512),
        GPTConfig("small", n_layer=8, hidden=512, n_head=8, seq_len=4096, vocab_size=2048),
    )
}


def get_config(name: str, overrides: Iterable[tuple[str, object]] = ()) -> GPTConfig:
    """Look a named config up, ignoring case, with some fields changed by ``overrides``
    ((field, value) pairs, e.g. a smaller ``hidden`` for a CPU-scale table)."""
    by_lower = {k.lower(): v for k, v in MODELS.items()}
    cfg = by_lower.get(name.lower()) if isinstance(name, str) else None
    if cfg is None:
        raise ValueError(f"unknown model {name!r}: known models are {sorted(MODELS)}")
    try:
        changes = dict(overrides)
    except (TypeError, ValueError):
        raise ValueError(
            f"model overrides {overrides!r} are not (field, value) pairs, e.g. (('hidden', 64),)"
        ) from None
    known = {f.name for f in fields(GPTConfig)} - {"name"}
    unknown = [k for k in changes if k not in known]
    if unknown:
        raise ValueError(
            f"model overrides name unknown fields {unknown}: GPTConfig's fields are {sorted(known)}"
        )
    return cfg.with_(**changes) if changes else cfg


def n_params_per_layer(cfg: GPTConfig) -> int:
    """Parameters of one transformer block: QKV and output projections, the MLP
    (4x expansion), their biases, and two LayerNorms."""
    h = cfg.hidden
    attn = 3 * h * h + 3 * h + h * h + h
    mlp = 4 * h * h + 4 * h + 4 * h * h + h
    norms = 2 * 2 * h
    return attn + mlp + norms


def n_params(cfg: GPTConfig) -> int:
    """Total parameters, counted from the config without allocating the model."""
    return stage_params(cfg, 0, cfg.n_layer)


def stage_params(cfg: GPTConfig, lo: int, hi: int, n_op: int = 1) -> int:
    """Parameters a pipeline stage of layers ``[lo, hi)`` holds: its blocks, the
    embeddings on the first stage, the final LayerNorm and LM head on the last. With tied
    embeddings a last stage that is not also the first holds its own copy of the shared
    matrix (the runtime sums the two copies' gradients), so it counts here.

    With ``n_op`` > 1: what ONE rank of the stage's #Op group holds. The products and
    the vocabulary (padded to a multiple of #Op) are split; LayerNorms, the position
    table and the biases added after row-parallel products are whole on every rank."""
    h = cfg.hidden
    vocab_rows = -(-cfg.vocab_size // n_op)  # the padded vocabulary's rows per rank
    split = 12 * h * h + 7 * h  # QKV, projection, FC1, FC2 and the column biases
    layer = n_params_per_layer(cfg) if n_op == 1 else split // n_op + 6 * h
    embed = vocab_rows * h + cfg.seq_len * h if lo == 0 else 0
    last = hi == cfg.n_layer
    head_copy = vocab_rows * h if last and not (cfg.tie_embeddings and lo == 0) else 0
    final_norm = 2 * h if last else 0
    return embed + (hi - lo) * layer + final_norm + head_copy


# ---- the options a run adds to a model ------------------------------------------------

PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE_MODES = ("none", "full")


def padded_vocab(vocab_size: int, n_op: int) -> int:
    """The vocabulary rounded up to a multiple of #Op, so each rank holds equal rows."""
    return -(-vocab_size // n_op) * n_op


def check_op(cfg: GPTConfig, n_op: int) -> None:
    """Raise ``ValueError`` unless #Op = ``n_op`` can partition ``cfg``'s operations."""
    if isinstance(n_op, bool) or not isinstance(n_op, int) or n_op < 1:
        raise ValueError(f"n_op={n_op!r} must be a positive integer")
    if cfg.n_head % n_op or (4 * cfg.hidden) % n_op:
        raise ValueError(
            f"n_op={n_op} must divide {cfg.name}'s {cfg.n_head} attention heads and its "
            f"MLP width 4 x {cfg.hidden}: operation partitioning splits heads and MLP "
            "features evenly over the #Op ranks"
        )


def check_recompute(mode: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is a recomputation mode."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute={mode!r} is not a recompute mode: choose one of {RECOMPUTE_MODES}"
        )


def check_precision(precision: str, device: str | None = None) -> None:
    """Raise ``ValueError`` unless ``precision`` is known (and can run on ``device``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: choose one of {PRECISIONS}")
    if device is not None and precision == "fp16" and device.split(":")[0] != "cuda":
        raise ValueError(
            f"precision 'fp16' needs device='cuda', got device={device!r}: fp16 weights are "
            "for GPUs without bf16 (V100); use bf16 on CPU"
        )


# ---- the numbers of a run --------------------------------------------------------------

# Each number's type and range, checked before anything uses it, so that a wrong type is
# named rather than failing in a comparison further on. Integers: (least, most)...
RUN_INTEGERS = {
    **dict.fromkeys(("n_stages", "n_data", "n_op", "batch", "seq_len", "steps"), (1, None)),
    **dict.fromkeys(("warmup", "threads", "ranks_per_node", "lr_warmup_steps"), (0, None)),
    **dict.fromkeys(("seed", "data_seed"), (0, 2**63 - 1)),  # what torch's generators take
}
# ...and finite reals: what must hold of one, and the rule a message says.
RUN_REALS: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda x: x > 0, "be a finite positive learning rate"),
    "weight_decay": (lambda x: x >= 0, "be a finite weight decay >= 0"),
    "adam_eps": (lambda x: x > 0, "be a finite AdamW eps > 0"),
    "grad_clip": (lambda x: x >= 0, "be a finite norm >= 0 (0: no clipping)"),
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "lie in [0, 1]: the cosine's floor, a share of lr"),
    "timeout_s": (lambda x: x > 0, "be positive seconds, finite"),
}


def check_run_numbers(run: Any) -> None:
    """Raise ``ValueError`` naming the first number of ``run`` (a
    :class:`~tplib.runtime.RunConfig`) of the wrong type or out of its range."""
    for name, (least, most) in RUN_INTEGERS.items():
        n = getattr(run, name)
        if not _integer(n) or n < least or (most and n > most):
            rule = f"an integer in [{least}, {most}]" if most else f"an integer >= {least}"
            rule = "a positive integer" if least == 1 else rule
            raise ValueError(f"RunConfig.{name}={n!r} must be {rule}")
    for name, (holds, rule) in RUN_REALS.items():
        if not _finite(x := getattr(run, name)) or not holds(x):
            raise ValueError(f"RunConfig.{name}={x!r} must {rule}")
    b = run.betas
    if not (
        isinstance(b, tuple | list) and len(b) == 2 and all(_finite(x) and 0 <= x < 1 for x in b)
    ):
        raise ValueError(f"RunConfig.betas={b!r} must be AdamW's two betas, each in [0, 1)")
    if not isinstance(run.vertical_sync, bool):
        raise ValueError(f"RunConfig.vertical_sync={run.vertical_sync!r} must be True or False")
    r = run.stage_ranges
    if r is not None and not (isinstance(r, tuple | list) and all(map(_int_pair, r))):
        raise ValueError(
            f"RunConfig.stage_ranges={r!r} must be (lo, hi) integer pairs, one per stage"
        )
