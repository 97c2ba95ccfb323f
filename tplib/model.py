"""A GPT-style decoder-only language model whose stages run over token slices.

The model reads top to bottom: :class:`CausalSelfAttention`, :class:`MLP`,
:class:`Block`, and :class:`GPTStage`. A pipeline stage (the paper's cell c_k) is simply
a contiguous range of blocks; the first stage also owns the embeddings and the last the
final LayerNorm, LM head and loss. The whole model is the stage that covers every layer,
so a stage's parameters have the same names as in the whole model and
:func:`init_parameters` gives them the same values without building the whole model.

The only idea beyond a plain GPT: attention can take a :class:`~tplib.context.StageContext`
and a ``start`` position, and then attends to the keys and values of earlier token slices
of the same sequences (see :mod:`tplib.context`).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tplib.config import GPTConfig
from tplib.context import LayerContext, StageContext, slice_attention

__all__ = ["GPTStage", "build_model", "check_stage_range", "init_parameters"]


class _LinearAccumulate(torch.autograd.Function):
    """``x @ W.T + b`` whose backward adds the weight and bias gradients straight into
    ``.grad`` inside the GEMM (``addmm_`` with beta=1).

    A stage runs backward once per token slice, so each weight receives one gradient per
    slice; letting autograd allocate each and add it to ``.grad`` costs a full pass over
    every weight per slice. Autograd never sees these gradients (``None`` is returned), so
    parameter hooks do not fire; tplib reduces gradients itself after backward.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor
    ) -> Tensor:
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[Tensor | None, None, None]:
        x, weight, bias = ctx.saved_tensors  # type: ignore[attr-defined]
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if weight.requires_grad:
            if weight.grad is None:
                weight.grad = g2.t() @ x2
            else:
                weight.grad.addmm_(g2.t(), x2)
        if bias.requires_grad:
            if bias.grad is None:
                bias.grad = g2.sum(0)
            else:
                bias.grad.add_(g2.sum(0))
        grad_in = grad_out @ weight if ctx.needs_input_grad[0] else None  # type: ignore[attr-defined]
        return grad_in, None, None


class Linear(nn.Linear):
    """``nn.Linear`` that accumulates its parameter gradients in place (float32 path).

    Under autocast, or for other dtypes, it is a plain ``nn.Linear``.
    """

    def forward(self, x: Tensor) -> Tensor:
        fused = (
            self.bias is not None
            and torch.is_grad_enabled()
            and self.weight.requires_grad
            and x.dtype == self.weight.dtype == torch.float32
            and not torch.is_autocast_enabled(x.device.type)
        )
        if fused:
            return _LinearAccumulate.apply(x, self.weight, self.bias)
        return super().forward(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: Tensor, start: int = 0, context: LayerContext | None = None) -> Tensor:
        b, length, hidden = x.shape
        q, k, v = (
            t.view(b, length, self.n_head, hidden // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(hidden, dim=2)
        )
        if context is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = slice_attention(q, k, v, context, start)
        return self.proj(y.transpose(1, 2).reshape(b, length, hidden))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = Linear(cfg.hidden, 4 * cfg.hidden)
        self.proj = Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, start: int = 0, context: LayerContext | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), start, context)
        return x + self.mlp(self.ln_2(x))


def check_stage_range(cfg: GPTConfig, lo: int, hi: int) -> None:
    """Raise ``ValueError`` unless ``[lo, hi)`` is a non-empty range of the model's layers."""
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi <= cfg.n_layer):
        raise ValueError(
            f"stage layer range [{lo}, {hi}) is outside the model's layers [0, {cfg.n_layer}): "
            "a stage needs 0 <= lo < hi <= n_layer"
        )


class GPTStage(nn.Module):
    """Layers ``[lo, hi)`` of a GPT; the first stage embeds tokens, the last computes the loss.

    ``forward(x, start=0, context=None, targets=None)``:

    - ``x`` is token ids ``(batch, length)`` on the first stage and hidden states
      ``(batch, length, hidden)`` elsewhere; ``start`` is the position of its first token.
    - With a ``context``, attention also sees the keys and values that earlier slices of
      the same sequences wrote there; without one, ``x`` must be whole sequences.
    - The last stage returns the summed next-token cross-entropy when given ``targets``
      ``(batch, length)``, and the logits otherwise. Other stages return hidden states.
    """

    def __init__(self, cfg: GPTConfig, lo: int = 0, hi: int | None = None) -> None:
        super().__init__()
        hi = cfg.n_layer if hi is None else hi
        check_stage_range(cfg, lo, hi)
        self.cfg, self.lo, self.hi = cfg, lo, hi
        if self.is_first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        # Keys are absolute layer indices so that stage and whole-model names agree.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(lo, hi)})
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
            self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings and self.is_first:
                self.head.weight = self.wte.weight

    @property
    def is_first(self) -> bool:
        return self.lo == 0

    @property
    def is_last(self) -> bool:
        return self.hi == self.cfg.n_layer

    @property
    def layer_ids(self) -> range:
        return range(self.lo, self.hi)

    def new_context(
        self,
        batch: int,
        seq_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        attention: str | None = None,
    ) -> StageContext:
        """Allocate the K/V context for ``batch`` sequences of ``seq_len`` tokens.

        ``attention`` picks a slice-attention implementation (see :mod:`tplib.context`)."""
        seq_len = self.cfg.seq_len if seq_len is None else seq_len
        self._check_length(0, seq_len)
        param = next(self.parameters())
        return StageContext.allocate(
            self.layer_ids,
            batch=batch,
            n_head=self.cfg.n_head,
            seq_len=seq_len,
            head_dim=self.cfg.head_dim,
            dtype=dtype or param.dtype,
            device=param.device,
            impl=attention,
        )

    def _check_length(self, start: int, length: int) -> None:
        if start + length > self.cfg.seq_len:
            raise ValueError(
                f"tokens [{start}, {start + length}) exceed the model's context of "
                f"{self.cfg.seq_len} tokens (GPTConfig.seq_len): sequences must fit it"
            )

    def forward(
        self,
        x: Tensor,
        start: int = 0,
        context: StageContext | None = None,
        targets: Tensor | None = None,
    ) -> Tensor:
        length = x.shape[1]
        self._check_length(start, length)
        if context is None and start != 0:
            raise ValueError(f"start={start} without a context: a slice needs its K/V context")
        if self.is_first:
            positions = torch.arange(start, start + length, device=x.device)
            x = self.wte(x) + self.wpe(positions)
        for i, block in self.blocks.items():
            x = block(x, start, None if context is None else context[int(i)])
        if not self.is_last:
            return x
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum"
        )


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_parameters(stage: GPTStage, seed: int = 0) -> None:
    """GPT-2 initialisation, drawn per parameter from a generator seeded by its name.

    Any stage therefore holds exactly the values the same layers have in the whole model.
    Residual projections get std / sqrt(2 * n_layer), as in GPT-2.
    """
    cfg = stage.cfg
    for name, param in stage.named_parameters():
        if param.device.type == "meta":
            return
        if name == "head.weight" and cfg.tie_embeddings:
            name = "wte.weight"  # a last stage's copy of the shared embedding
        leaf = name.rsplit(".", 1)[-1]
        if (name.startswith("blocks.") and ".ln_" in name) or name.startswith("ln_f."):
            param.fill_(1.0 if leaf == "weight" else 0.0)
        elif leaf == "bias":
            param.zero_()
        else:
            std = cfg.init_std
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                std /= math.sqrt(2 * cfg.n_layer)
            g = torch.Generator().manual_seed(_seed_for(seed, name))
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
            param.copy_(values)


def build_model(
    cfg: GPTConfig,
    lo: int = 0,
    hi: int | None = None,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> GPTStage:
    """Build and initialise layers ``[lo, hi)`` (the whole model by default).

    On the ``meta`` device nothing is allocated, which is how the 175B model is built.
    """
    with torch.device(device):
        stage = GPTStage(cfg, lo, hi)
    stage.to(dtype=dtype)
    init_parameters(stage, seed)
    return stage
