"""Loading a Hugging Face GPT-2 checkpoint into tplib's model, one pipeline stage at a time.

A checkpoint is a local directory written by ``save_pretrained`` (``config.json`` and
the weights: ``model.safetensors``, ``pytorch_model.bin``, or either sharded with an
``.index.json``). :func:`load_gpt2` builds the stage ``[lo, hi)`` with the checkpoint's
configuration (:func:`config_from_hf`) and copies into it exactly the stage's
parameters, this rank's shard of them with an ``op`` group. Only the tensors the stage
needs are read, so a stage of a large model never holds the whole model. Nothing is
downloaded: the directory must exist (save it with ``save_pretrained`` on a machine with
internet access).

The names map one to one. Hugging Face's ``Conv1D`` (``attn.c_attn``, ``attn.c_proj``,
``mlp.c_fc``, ``mlp.c_proj``) stores its weight as in x out, ``nn.Linear`` as out x in,
so those weights are transposed; ``c_attn``'s output columns are [q; k; v], heads
contiguous within each, which is the row order of tplib's ``attn.qkv``. The LM head is
the token embedding when ``tie_word_embeddings`` is set (a saved ``lm_head.weight`` is
then ignored, as Hugging Face ignores it). The attention ``bias``/``masked_bias``
buffers older checkpoints carry are causal masks, not parameters, and are skipped.
Loading is strict: a key the stage needs and the file lacks, a key no GPT-2 of this
configuration has, or a tensor of the wrong shape raises ``ValueError`` naming it.

Dropout: the checkpoint's rate becomes ``GPTConfig.dropout``, but the model drops only
when it is given a :class:`~tplib.nn.dropout.DropoutKey`. Without one it computes what
Hugging Face computes in ``eval()`` mode (or with every ``*_pdrop`` = 0); with one it
drops at the same rate, but other elements: its masks are keyed by position, Hugging
Face's drawn from torch's generator.

Loss positions. The two models score different positions by default:

- tplib draws L + 1 tokens per sequence and scores B·L positions: with ``tokens`` of
  shape (B, L + 1), ``stage(tokens[:, :-1], targets=tokens[:, 1:])`` is the SUM of the
  next-token cross-entropy over all B·L positions (``targets`` are given separately,
  already shifted; :func:`tplib.nn.data.synthetic_batch` returns exactly this pair).
- Hugging Face's ``labels`` are shifted inside the model: ``HF(input_ids=x, labels=x)``
  with ``x`` of L tokens scores the B·(L − 1) positions that have a next token in ``x``
  (the last position's prediction is dropped) and returns their MEAN.

So, for the same B·L positions (needs L + 1 <= ``n_positions``; at the full context use
the second form)::

    HF(input_ids=tokens, labels=tokens).loss
        == stage(tokens[:, :-1], targets=tokens[:, 1:]) / (B * L)
        == run_pipeline_local(stages, tokens[:, :-1], plan, targets=tokens[:, 1:])

HF's extra input token (position L) is scored by nothing and, attention being causal,
changes no earlier logit, so the gradients agree too. For the same L input tokens::

    HF(input_ids=x, labels=x).loss == stage(x[:, :-1], targets=x[:, 1:]) / (B * (L - 1))

``transformers`` is an optional extra (``pip install 'tplib[hf]'``); importing this
module does not import it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tplib.nn.configs import GPTConfig
from tplib.nn.model import GPTStage
from tplib.nn.oppart import OpGroup, shard_spec, take_shard

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["config_from_hf", "load_gpt2"]

# Hugging Face's activation_function -> GPTConfig.gelu. "gelu_new", "gelu_pytorch_tanh"
# and "gelu_fast" are all GELU's tanh approximation (GPT-2's own, written three ways),
# "gelu" the exact one.
_GELU_OF_ACTIVATION = {
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "gelu_fast": "tanh",
    "gelu": "erf",
}

_INSTALL = "pip install 'tplib[hf]'"
# Causal-mask buffers of older checkpoints (GPT2Attention registered them): not weights.
_MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
# A Conv1D's weight is in x out: these need a transpose to become nn.Linear's out x in.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# tplib's name in a block -> Hugging Face's name in a block.
_BLOCK_NAMES = {
    "ln_1": "ln_1",
    "attn.qkv": "attn.c_attn",
    "attn.proj": "attn.c_proj",
    "ln_2": "ln_2",
    "mlp.fc": "mlp.c_fc",
    "mlp.proj": "mlp.c_proj",
}
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"loading Hugging Face checkpoints needs transformers: {_INSTALL}") from e
    return transformers


# ---- configuration ----------------------------------------------------------------------


def config_from_hf(hf_config: PreTrainedConfig, name: str = "gpt2-hf") -> GPTConfig:
    """tplib's :class:`GPTConfig` of a Hugging Face ``GPT2Config``.

    Raises ``ValueError`` naming the field for what tplib's model cannot compute: another
    model type, an activation other than GELU, an MLP width other than 4 x hidden
    (``n_inner``), unscaled attention (``scale_attn_weights=False``), attention scaled by
    the layer index (``scale_attn_by_inverse_layer_idx``) and cross-attention
    (``add_cross_attention``). ``reorder_and_upcast_attn`` is accepted: it computes the
    same attention, only in another order and precision under mixed precision. The
    three dropout rates (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``) must be equal:
    tplib's one rate, ``GPTConfig.dropout``, is theirs.
    """
    cfg: Any = hf_config  # GPT2Config's fields are not on PreTrainedConfig's type
    model_type = getattr(cfg, "model_type", None)
    if model_type != "gpt2":
        raise ValueError(f"model_type={model_type!r}: tplib loads GPT-2 checkpoints ('gpt2') only")
    act = cfg.activation_function
    if act not in _GELU_OF_ACTIVATION:
        raise ValueError(
            f"activation_function={act!r} is not supported: tplib's MLP computes GELU, "
            f"one of {sorted(_GELU_OF_ACTIVATION)}"
        )
    if cfg.n_inner is not None and cfg.n_inner != 4 * cfg.n_embd:
        raise ValueError(
            f"n_inner={cfg.n_inner} is not 4 x n_embd = {4 * cfg.n_embd}: tplib's MLP is 4x wide"
        )
    if not cfg.scale_attn_weights:
        raise ValueError(
            "scale_attn_weights=False is not supported: tplib scales attention by 1/sqrt(head_dim)"
        )
    if cfg.scale_attn_by_inverse_layer_idx:
        raise ValueError(
            "scale_attn_by_inverse_layer_idx=True is not supported: tplib's attention "
            "scale does not depend on the layer"
        )
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError("add_cross_attention=True is not supported: tplib is decoder-only")
    rates = {f: float(getattr(cfg, f)) for f in ("embd_pdrop", "attn_pdrop", "resid_pdrop")}
    if len(set(rates.values())) > 1:
        raise ValueError(
            f"dropout rates {rates} differ: tplib's model has one dropout rate "
            "(GPTConfig.dropout) for the embeddings, attention and residual branches"
        )
    return GPTConfig(
        name=name,
        n_layer=cfg.n_layer,
        hidden=cfg.n_embd,
        n_head=cfg.n_head,
        seq_len=cfg.n_positions,
        vocab_size=cfg.vocab_size,
        tie_embeddings=bool(cfg.tie_word_embeddings),
        layer_norm_eps=float(cfg.layer_norm_epsilon),
        init_std=float(cfg.initializer_range),
        gelu=_GELU_OF_ACTIVATION[act],
        dropout=rates["resid_pdrop"],
    )


# ---- names ------------------------------------------------------------------------------


def _hf_name(name: str, cfg: GPTConfig) -> tuple[str, bool]:
    """The Hugging Face key (without the ``transformer.`` prefix) holding tplib parameter
    ``name``, and whether it is stored transposed."""
    if name in ("wte.weight", "wpe.weight") or name.startswith("ln_f."):
        return name, False
    if name == "head.weight":
        return ("wte.weight" if cfg.tie_embeddings else "lm_head.weight"), False
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"parameter {name!r} has no Hugging Face GPT-2 counterpart")
    layer, module, leaf = match.groups()
    hf = f"h.{layer}.{_BLOCK_NAMES[module]}.{leaf}"
    return hf, hf.endswith(_CONV1D)


def _hf_keys(cfg: GPTConfig) -> set[str]:
    """Every key a GPT-2 of ``cfg`` has (normalised: no ``transformer.`` prefix)."""
    with torch.device("meta"):
        whole = GPTStage(cfg)
    return {_hf_name(name, cfg)[0] for name, _ in whole.named_parameters(remove_duplicate=False)}


def _normalise(key: str) -> str:
    # GPT2LMHeadModel saves "transformer.h.0...." and "lm_head.weight"; GPT2Model (and the
    # original hub checkpoints) save "h.0....". One namespace for both.
    return key.removeprefix("transformer.")


def _names(keys: Iterable[str], limit: int = 10) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


# ---- the weights files ------------------------------------------------------------------


class _Checkpoint:
    """The tensors of a checkpoint directory by normalised key, read on demand."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        # normalised key -> (file, key as stored)
        self.where: dict[str, tuple[Path, str]] = {}
        for file in self._files():
            for key in self._keys_of(file):
                norm = _normalise(key)
                if norm in self.where:
                    raise ValueError(
                        f"{directory}: key {key!r} appears twice (as {self.where[norm][1]!r}); "
                        "the checkpoint mixes GPT2Model and GPT2LMHeadModel names"
                    )
                self.where[norm] = (file, key)

    def _files(self) -> list[Path]:
        for candidate in _WEIGHT_FILES:
            path = self.directory / candidate
            if not path.exists():
                continue
            if candidate.endswith(".index.json"):
                weight_map: dict[str, str] = json.loads(path.read_text())["weight_map"]
                return sorted({self.directory / f for f in weight_map.values()})
            return [path]
        raise FileNotFoundError(
            f"{self.directory} holds no GPT-2 weights: expected one of {list(_WEIGHT_FILES)} "
            "(written by save_pretrained)"
        )

    @staticmethod
    def _is_safetensors(file: Path) -> bool:
        return file.suffix == ".safetensors"

    def _keys_of(self, file: Path) -> list[str]:
        if self._is_safetensors(file):
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        return list(self._load_bin(file))

    @staticmethod
    def _load_bin(file: Path) -> dict[str, Tensor]:
        # mmap: a stage reads its own tensors, not the whole file, into memory.
        state: dict[str, Tensor] = torch.load(
            file, map_location="cpu", weights_only=True, mmap=True
        )
        return state

    def keys(self) -> set[str]:
        return set(self.where)

    def read(self, keys: Iterable[str]) -> dict[str, Tensor]:
        """The tensors of normalised ``keys``, each file opened once."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.where[key][0], []).append(key)
        out: dict[str, Tensor] = {}
        for file, wanted in by_file.items():
            if self._is_safetensors(file):
                from safetensors import safe_open

                with safe_open(str(file), framework="pt") as f:
                    out.update({k: f.get_tensor(self.where[k][1]) for k in wanted})
            else:
                state = self._load_bin(file)
                out.update({k: state[self.where[k][1]] for k in wanted})
        return out


# ---- loading ------------------------------------------------------------------------------


def _checkpoint_dir(path: str | Path) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{path} is not a directory: load_gpt2 reads a checkpoint saved with "
            "save_pretrained and never downloads one; on a machine with internet access run "
            "GPT2LMHeadModel.from_pretrained('gpt2').save_pretrained(DIR), then copy DIR here"
        )
    return directory


@torch.no_grad()
def load_gpt2(
    path: str | Path,
    lo: int = 0,
    hi: int | None = None,
    *,
    op: OpGroup | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> GPTStage:
    """Layers ``[lo, hi)`` (the whole model by default) of the GPT-2 checkpoint saved in
    directory ``path``, this rank's shard of them with an ``op`` group, on ``device`` in
    ``dtype``.

    The configuration is the checkpoint's (:func:`config_from_hf`, named after the
    directory). Every parameter of the stage is filled from the checkpoint; the
    vocabulary padding rows #Op adds are zero.
    """
    directory = _checkpoint_dir(path)
    transformers = _require_transformers()
    hf_config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    cfg = config_from_hf(hf_config, name=directory.resolve().name)
    checkpoint = _Checkpoint(directory)

    # Key names first, before any tensor is read: a checkpoint that is not this GPT-2
    # fails whole, whichever stage is loading it.
    expected = _hf_keys(cfg)
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unexpected = {
        k for k in checkpoint.keys() - expected - ignored if not _MASK_BUFFER.fullmatch(k)
    }
    if unexpected:
        raise ValueError(
            f"{directory}: unexpected keys, not part of a GPT-2 with {cfg.n_layer} layers: "
            f"{_names(unexpected)}"
        )

    # Built on the meta device, then given storage: the values all come from the file.
    with torch.device("meta"):
        stage = GPTStage(cfg, lo, hi, op)
        whole = {n: p.shape for n, p in GPTStage(cfg, lo, stage.hi).named_parameters()}
    stage = stage.to(dtype=dtype).to_empty(device=device)
    if stage.is_first and stage.is_last and cfg.tie_embeddings:
        stage.head.weight = stage.wte.weight  # to_empty gave the tied pair separate storage

    params = dict(stage.named_parameters())
    sources = {name: _hf_name(name, cfg) for name in params}
    missing = {hf for hf, _ in sources.values()} - checkpoint.keys()
    if missing:
        raise ValueError(
            f"{directory}: missing keys that layers [{lo}, {stage.hi}) need: {_names(missing)}"
        )
    tensors = checkpoint.read({hf for hf, _ in sources.values()})
    for name, param in params.items():
        hf, transposed = sources[name]
        value = tensors[hf].t() if transposed else tensors[hf]
        if value.shape != whole[name]:
            stored = tuple(tensors[hf].shape)
            want = tuple(whole[name])[::-1] if transposed else tuple(whole[name])
            raise ValueError(
                f"{directory}: {hf} has shape {stored}, expected {want} for {cfg.n_layer} "
                f"layers, hidden {cfg.hidden}, vocabulary {cfg.vocab_size}"
            )
        if op is not None:
            value = take_shard(value, shard_spec(name), op.rank, op.size)
        param.copy_(value)
    return stage
