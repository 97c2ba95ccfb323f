"""A GPT-style decoder-only language model whose stages run over token slices.

The model reads top to bottom: :class:`CausalSelfAttention`, :class:`MLP`,
:class:`Block`, and :class:`GPTStage`. A pipeline stage (the paper's cell c_k) is simply
a contiguous range of blocks; the first stage also owns the embeddings and the last the
final LayerNorm, LM head and loss. The whole model is the stage that covers every layer,
so a stage's parameters have the same names as in the whole model and
:func:`tplib.nn.init.init_parameters` gives them the same values without building the whole
model.

The only idea beyond a plain GPT: attention can take a :class:`~tplib.nn.context.StageContext`
and a ``start`` position, and then attends to the keys and values of earlier token slices
of the same sequences (see :mod:`tplib.nn.context`).

Given an :class:`~tplib.nn.oppart.OpGroup` of #Op > 1 ranks, a stage holds only this rank's
share of each block, embedding and head, split the Megatron way (see
:mod:`tplib.nn.oppart`); :mod:`tplib.nn.init` then gives each shard exactly its part of
the whole model's values. The blocks' products are :class:`tplib.nn.linear.Linear`; dropout,
when training with it, is :mod:`tplib.nn.dropout`'s. An attention whose ``recompute_core``
an executor set keeps its core's inputs alone and runs the core again in backward
(selective recomputation, :mod:`tplib.nn.selective`). With a
:class:`~tplib.nn.ring.CPGroup` of #CP > 1 ranks a stage runs on the rank's l / #CP tokens
of each slice, and attention is :mod:`tplib.nn.ring`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tplib.documents import Documents
from tplib.nn.configs import GPTConfig, check_op, padded_vocab
from tplib.nn.context import (
    LayerContext,
    StageContext,
    causal_attention,
    math_attention,
    slice_attention,
)
from tplib.nn.doc_attention import document_attention
from tplib.nn.dropout import (
    SITE_ATTENTION,
    SITE_EMBEDDING,
    SITE_MLP,
    SITE_PROBS,
    DropoutKey,
    StageDropout,
    layer_site,
)
from tplib.nn.init import init_parameters
from tplib.nn.linear import Linear
from tplib.nn.oppart import (
    OpGroup,
    enter_tensor_parallel,
    sequence_shard,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from tplib.nn.ring import CPGroup, cp_positions, ring_attention, ring_context
from tplib.nn.selective import Core, attention_core

__all__ = ["CausalSelfAttention", "GPTStage", "build_model", "check_op", "check_stage_range"]


def _op_size(op: OpGroup | None) -> int:
    return 1 if op is None else op.size


class CausalSelfAttention(nn.Module):
    """Causal self-attention over this rank's ``n_head / #Op`` heads."""

    def __init__(
        self, cfg: GPTConfig, op: OpGroup | None = None, cp: CPGroup | None = None
    ) -> None:
        super().__init__()
        self.op, self.cp = op, cp
        self.n_head = cfg.n_head // _op_size(op)
        self.width = self.n_head * cfg.head_dim  # this rank's share of the hidden size
        self.qkv = Linear(cfg.hidden, 3 * self.width)
        self.proj = Linear(self.width, cfg.hidden, op)
        first_head = (0 if op is None else op.rank) * self.n_head
        # Global indices of this rank's heads (dropout masks are keyed by them).
        heads = torch.arange(first_head, first_head + self.n_head)
        self.heads: Tensor
        self.register_buffer("heads", heads, persistent=False)
        # Selective recomputation (tplib.nn.selective): set by the executor that runs it.
        self.recompute_core = False

    def forward(
        self,
        x: Tensor,
        start: int = 0,
        context: LayerContext | None = None,
        drop: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
        documents: Documents | None = None,
    ) -> Tensor:
        x = enter_tensor_parallel(x, self.op)  # the whole slice, if x is a sequence shard
        b, length, _ = x.shape
        q, k, v = (
            t.view(b, length, self.n_head, -1).transpose(1, 2)
            for t in self.qkv(x).split(self.width, dim=2)
        )
        if documents is not None:
            y = document_attention(
                q, k, v, context, start, documents, drop, recompute=self.recompute_core
            )
        elif self.cp is not None:
            y = ring_attention(q, k, v, context, start, self.cp, recompute=self.recompute_core)
        elif context is not None:
            y = slice_attention(q, k, v, context, start, drop, recompute=self.recompute_core)
        else:
            core: Core = causal_attention
            if drop is not None:
                core = partial(math_attention, start=0, probs_dropout=drop)
            y = attention_core(core, q, k, v, recompute=self.recompute_core)
        return self.proj(y.transpose(1, 2).reshape(b, length, self.width))


class MLP(nn.Module):
    """The 4x MLP, this rank's share of the 4H features."""

    def __init__(self, cfg: GPTConfig, op: OpGroup | None = None) -> None:
        super().__init__()
        self.op = op
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"
        width = 4 * cfg.hidden // _op_size(op)
        self.fc = Linear(cfg.hidden, width)
        self.proj = Linear(width, cfg.hidden, op)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(enter_tensor_parallel(x, self.op))
        return self.proj(F.gelu(h, approximate=self.approximate))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(
        self, cfg: GPTConfig, op: OpGroup | None = None, cp: CPGroup | None = None
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg, op, cp)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg, op)

    def forward(
        self,
        x: Tensor,
        start: int = 0,
        context: LayerContext | None = None,
        drop: tuple[StageDropout, int] | None = None,
        documents: Documents | None = None,
    ) -> Tensor:
        if drop is None:
            x = x + self.attn(self.ln_1(x), start, context, documents=documents)
            return x + self.mlp(self.ln_2(x))
        dropout, layer = drop
        probs = dropout.probs(layer_site(layer, SITE_PROBS), self.attn.heads)
        a = self.attn(self.ln_1(x), start, context, probs, documents)
        x = x + dropout.hidden(a, layer_site(layer, SITE_ATTENTION))
        return x + dropout.hidden(self.mlp(self.ln_2(x)), layer_site(layer, SITE_MLP))


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
      ``(batch, length)``, and the logits otherwise (with #Op > 1: this rank's
      vocabulary rows of them). Other stages return hidden states.

    With ``op`` (#Op > 1) the stage holds this rank's shard of every partitioned
    parameter (see :mod:`tplib.nn.oppart`); hidden states in and out are whole, and equal
    on every rank of the group. Under sequence parallelism (``op.sequence_parallel``)
    they are this rank's shard of the slice's tokens instead, ``(batch, length / #Op,
    hidden)`` (:meth:`input_tokens`), and so is everything between the tensor-parallel
    products: LayerNorms, dropouts and residual adds. With ``cp`` (#CP > 1), ``x`` and
    ``targets`` are the rank's chunks of the slice (:func:`tplib.nn.ring.cp_shard`).

    With ``documents`` (:class:`~tplib.documents.Documents` of ``x``'s rows) the rows are
    packed: position ids restart at each document and attention is
    :mod:`tplib.nn.doc_attention`'s, within documents only. A target of
    :data:`~tplib.documents.IGNORE` (a document's last token, padding) adds no loss.
    """

    def __init__(
        self, cfg: GPTConfig, lo: int = 0, hi: int | None = None, op: OpGroup | None = None,
        cp: CPGroup | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        hi = cfg.n_layer if hi is None else hi
        check_stage_range(cfg, lo, hi)
        n_op = _op_size(op)
        check_op(cfg, n_op)
        self.cfg, self.lo, self.hi = cfg, lo, hi
        self.op = op if n_op > 1 else None
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.n_cp = 1 if self.cp is None else self.cp.size
        if self.cp is not None and (self.sequence_parallel or cfg.dropout > 0):
            raise ValueError(
                f"#CP={self.cp.size} with sequence parallelism or dropout={cfg.dropout}: "
                "the ring attention supports neither"
            )
        # This rank's vocabulary rows [first_row, first_row + rows) of the padded table.
        rows = padded_vocab(cfg.vocab_size, n_op) // n_op
        self.first_row = (0 if op is None else op.rank) * rows
        self.n_valid_rows = max(0, min(rows, cfg.vocab_size - self.first_row))
        if self.is_first:
            self.wte = nn.Embedding(rows, cfg.hidden)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        # Keys are absolute layer indices so that stage and whole-model names agree.
        self.blocks = nn.ModuleDict({str(i): Block(cfg, self.op, self.cp) for i in range(lo, hi)})
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
            self.head = Linear(cfg.hidden, rows, bias=False)
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

    @property
    def n_op(self) -> int:
        return _op_size(self.op)

    @property
    def sequence_parallel(self) -> bool:
        return self.op is not None and self.op.sequence_parallel

    def input_tokens(self, length: int) -> int:
        """The tokens of a slice of ``length`` in this stage's input: all of them (token
        ids on the first stage), this rank's shard under sequence parallelism, or its
        l / #CP under context parallelism."""
        if self.cp is not None:
            return length // self.n_cp
        return length if self.is_first else sequence_shard(length, self.op)[1]

    def new_context(
        self,
        batch: int,
        seq_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        attention: str | None = None,
    ) -> StageContext:
        """Allocate the K/V context of this rank's heads for ``batch`` sequences of
        ``seq_len`` tokens.

        ``attention`` picks a slice-attention implementation (see :mod:`tplib.nn.context`)."""
        seq_len = self.cfg.seq_len if seq_len is None else seq_len
        self._check_length(0, seq_len)
        param = next(self.parameters())
        n_head, dtype, device = self.cfg.n_head // self.n_op, dtype or param.dtype, param.device
        if self.cp is not None:  # tplib.nn.ring's, which refuses another ``attention``
            return ring_context(
                self.layer_ids, batch=batch, n_head=n_head, seq_len=seq_len,
                head_dim=self.cfg.head_dim, dtype=dtype, device=device, n_cp=self.n_cp,
                impl=attention,
            )  # fmt: skip
        return StageContext.allocate(
            self.layer_ids, batch=batch, n_head=n_head, seq_len=seq_len,
            head_dim=self.cfg.head_dim, dtype=dtype, device=device, impl=attention,
        )  # fmt: skip

    def _check_documents(self, documents: Documents, rows: int, end: int) -> None:
        if documents.batch != rows or documents.seq_len < end:
            raise ValueError(
                f"documents of {documents.batch} rows x {documents.seq_len} tokens for "
                f"{rows} rows up to token {end}: they must describe the rows run"
            )
        if self.cp is not None:
            raise ValueError(
                f"packed documents with #CP={self.n_cp}: the ring attention does not mask documents"
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
        dropout: DropoutKey | None = None,
        documents: Documents | None = None,
    ) -> Tensor:
        length = x.shape[1] * self.n_cp  # x holds this CP rank's l / #CP tokens
        if not self.is_first and self.sequence_parallel:
            length *= self.n_op  # x is this rank's shard of the slice
        self._check_length(start, length)
        if context is None and start != 0:
            raise ValueError(f"start={start} without a context: a slice needs its K/V context")
        if documents is not None:
            self._check_documents(documents, x.shape[0], start + length)
        # The tokens of the residual stream on this rank: [first, first + tokens).
        offset, tokens = sequence_shard(length, self.op)
        first = start + offset
        # Dropout only in training, which the caller says by giving the iteration's key.
        drop = None
        if dropout is not None and self.cfg.dropout > 0:
            drop = StageDropout(self.cfg.dropout, dropout, x, first, length=tokens)
        if self.is_first:
            positions = torch.arange(first, first + tokens, device=x.device)
            if documents is not None:  # each document's positions count from 0
                positions = torch.from_numpy(documents.positions(first, tokens)).to(x.device)
            if self.cp is not None:  # this rank's two chunks of the slice
                positions = cp_positions(start, length, self.cp.rank, self.n_cp, x.device)
            x = vocab_parallel_embedding(x, self.wte.weight, self.first_row, self.op)
            x = x + self.wpe(positions)
            if drop is not None:
                x = drop.hidden(x, SITE_EMBEDDING)
        for i, block in self.blocks.items():
            layer = None if drop is None else (drop, int(i))
            x = block(x, start, None if context is None else context[int(i)], layer, documents)
        if not self.is_last:
            return x
        # The final LayerNorm on the shard; the vocabulary-parallel head and loss see the
        # whole slice, so the cross-entropy stays exact.
        logits = self.head(enter_tensor_parallel(self.ln_f(x), self.op))
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            self.first_row,
            self.n_valid_rows,
            self.op,
        )


def _whole_shapes(stage: GPTStage) -> dict[str, torch.Size]:
    """Shapes of the stage's parameters in the unpartitioned model (nothing allocated)."""
    with torch.device("meta"):
        whole = GPTStage(stage.cfg, stage.lo, stage.hi)
    return {name: p.shape for name, p in whole.named_parameters()}


def build_model(
    cfg: GPTConfig,
    lo: int = 0,
    hi: int | None = None,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    op: OpGroup | None = None,
    cp: CPGroup | None = None,
) -> GPTStage:
    """Build and initialise layers ``[lo, hi)`` (the whole model by default), this rank's
    shard of them with an ``op`` group (a ``cp`` group shards tokens, not parameters).

    On the ``meta`` device nothing is allocated, which is how the 175B model is built.
    """
    with torch.device(device):
        stage = GPTStage(cfg, lo, hi, op, cp)
    stage.to(dtype=dtype)
    shapes = _whole_shapes(stage) if stage.op is not None else {}
    init_parameters(stage.named_parameters(), stage.cfg, stage.op, shapes, seed)
    return stage
