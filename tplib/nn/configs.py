"""Model configurations: the paper's GPT-3 family (Table 1) and small CPU configs.

A :class:`GPTConfig` is a frozen dataclass; named configs live in :data:`MODELS` and are
looked up with :func:`get_config`. :func:`n_params` counts parameters from the config
alone, so the 175B model can be sized without allocating anything.

The rules of the options a run adds to a model (#Op, #CP, recomputation, precision) and of a
run's numbers (their types and ranges) are checked here too, without torch, so a run's
configuration is checked before torch loads.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace

__all__ = [
    "MODELS",
    "PRECISIONS",
    "RECOMPUTE_MODES",
    "GPTConfig",
    "check_cp_length",
    "check_numbers",
    "check_op",
    "check_precision",
    "check_recompute",
    "get_config",
    "is_finite",
    "is_int_pair",
    "n_params",
    "n_params_per_layer",
    "padded_vocab",
    "stage_params",
]

GPT2_VOCAB = 50257
_GELUS = ("tanh", "erf")


def is_finite(x: object) -> bool:
    """A real number, neither a bool nor inf nor nan."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def is_int_pair(p: object) -> bool:
    """Two integers, as a tuple or a list (a layer range)."""
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
        if not (is_finite(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: must be in [0, 1)")
        if self.gelu not in _GELUS:
            raise ValueError(f"GPTConfig.gelu={self.gelu!r}: choose one of {_GELUS}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"GPTConfig.tie_embeddings={self.tie_embeddings!r}: must be a bool")
        for field in ("n_layer", "hidden", "n_head", "seq_len", "vocab_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{field}={value!r}: must be a positive integer")
        for field in ("layer_norm_eps", "init_std"):
            value = getattr(self, field)
            if not (is_finite(value) and value > 0):
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
        # The "small" family at L = 8192, narrow enough for a 2-core CPU: where attention
        # dominates, for context parallelism (#CP) against a pipeline on local processes.
        GPTConfig("long", n_layer=4, hidden=256, n_head=4, seq_len=8192, vocab_size=2048),
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
RECOMPUTE_MODES = ("none", "selective", "full")


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


def check_cp_length(length: int, n_cp: int, what: str = "a token slice") -> None:
    """Raise ``ValueError`` unless ``length`` tokens cut into 2 x #CP equal chunks, as
    context parallelism cuts every token slice (:mod:`tplib.nn.ring`)."""
    if length % (2 * n_cp):
        raise ValueError(
            f"{what} of {length} tokens is not divisible by 2*#CP = {2 * n_cp} (L not "
            "divisible by 2*#CP): context parallelism cuts every slice into 2 x #CP equal "
            "chunks, two per CP rank"
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


# ---- the numbers of a run ------------------------------------------------------------


def check_numbers(
    owner: object,
    integers: Mapping[str, tuple[int, int | None]],
    reals: Mapping[str, tuple[Callable[[float], bool], str]],
) -> None:
    """Raise ``ValueError`` naming the first number of ``owner`` (a part of a
    :class:`~tplib.runtime.RunConfig`) of the wrong type or out of its range, so that a
    wrong type is named rather than failing in a comparison further on. ``integers`` give
    each integer field's (least, most), most None for no bound; ``reals`` each finite
    real's test and the rule its message says."""
    what = type(owner).__name__
    for name, (least, most) in integers.items():
        n = getattr(owner, name)
        if not _integer(n) or n < least or (most and n > most):
            rule = f"an integer in [{least}, {most}]" if most else f"an integer >= {least}"
            rule = "a positive integer" if least == 1 else rule
            raise ValueError(f"{what}.{name}={n!r} must be {rule}")
    for name, (holds, rule) in reals.items():
        if not is_finite(x := getattr(owner, name)) or not holds(x):
            raise ValueError(f"{what}.{name}={x!r} must {rule}")
