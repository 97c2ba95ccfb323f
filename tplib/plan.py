"""Slicing plans: how one iteration's batch is cut into pipeline units.

A plan splits a batch of ``batch`` sequences, each ``seq_len`` tokens long, into
*batch slices* (groups of consecutive sequences) and cuts each batch slice into
*token slices* (contiguous token ranges, in order). One (batch slice b, token slice t)
pair is a *unit*: the thing a pipeline stage runs forward and backward.

The DP planner produces plans, every schedule generator consumes them, and the
paper's appendix tables are written in the paper's own notation, which
:meth:`Plan.from_paper` parses::

    [(1, [776, 640, 632])] * 16     # 16 batch slices of 1 sequence, each cut 776+640+632

GPipe's microbatching is the special case of one token slice per batch slice.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TypeVar

__all__ = ["Plan", "Unit", "grid_size"]

T = TypeVar("T")


def grid_size(seq_len: int, granularity: int) -> int:
    """``n = L / g``: the number of grid steps when slice lengths are multiples of ``g``
    tokens (the planner's and the profiler's grid). Raises ``ValueError`` unless ``g``
    divides ``L``."""
    if granularity < 1 or seq_len < granularity or seq_len % granularity:
        raise ValueError(
            f"seq_len L={seq_len} is not a positive multiple of granularity g={granularity}: "
            "slice lengths lie on a grid of g tokens, so pick a g that divides L"
        )
    return seq_len // granularity


@dataclass(frozen=True, order=True)
class Unit:
    """One pipeline unit: token slice ``t`` of batch slice ``b``."""

    b: int
    t: int


@dataclass(frozen=True)
class Plan:
    """Batch slices and the token slices of each batch slice.

    ``batch_slices[b]`` is the number of sequences in batch slice ``b``;
    ``token_slices[b]`` lists the token-slice lengths of batch slice ``b``, first to last.
    ``latency``, ``t_max`` and ``eps`` record what a planner predicted and used; they are
    ``None`` for hand-written plans, and not part of a plan's identity: two plans with the
    same slices are equal (a plan read back from its paper notation equals the original).
    """

    batch_slices: tuple[int, ...]
    token_slices: tuple[tuple[int, ...], ...]
    latency: float | None = field(default=None, compare=False)
    t_max: float | None = field(default=None, compare=False)
    eps: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_slices", tuple(int(b) for b in self.batch_slices))
        object.__setattr__(
            self, "token_slices", tuple(tuple(int(s) for s in ts) for ts in self.token_slices)
        )
        if not self.batch_slices:
            raise ValueError("plan has no batch slices: a plan needs at least one")
        if len(self.batch_slices) != len(self.token_slices):
            raise ValueError(
                f"plan has {len(self.batch_slices)} batch slices but token slicings for "
                f"{len(self.token_slices)}: each batch slice needs exactly one token slicing"
            )
        for b, size in enumerate(self.batch_slices):
            if size <= 0:
                raise ValueError(f"batch slice {b} has size {size}: sizes must be positive")
        lengths = {sum(ts) for ts in self.token_slices}
        for b, ts in enumerate(self.token_slices):
            if not ts:
                raise ValueError(f"batch slice {b} has no token slices: it needs at least one")
            for t, s in enumerate(ts):
                if s <= 0:
                    raise ValueError(
                        f"token slice {t} of batch slice {b} has length {s}: lengths must be positive"
                    )
        if len(lengths) != 1:
            raise ValueError(
                f"token slicings cover different sequence lengths {sorted(lengths)}: "
                "every batch slice must cover the same sequence length"
            )

    # ---- shape -----------------------------------------------------------------------

    @property
    def batch(self) -> int:
        """Number of sequences the plan covers."""
        return sum(self.batch_slices)

    @property
    def seq_len(self) -> int:
        """Sequence length every batch slice covers."""
        return sum(self.token_slices[0])

    @property
    def n_batch_slices(self) -> int:
        return len(self.batch_slices)

    def n_token_slices(self, b: int) -> int:
        return len(self.token_slices[b])

    @property
    def n_units(self) -> int:
        return sum(len(ts) for ts in self.token_slices)

    def units(self) -> Iterator[Unit]:
        """All units in forward order: batch slice by batch slice, token slices in order."""
        for b, ts in enumerate(self.token_slices):
            for t in range(len(ts)):
                yield Unit(b, t)

    def batch_offset(self, b: int) -> int:
        """Index of the first sequence of batch slice ``b``."""
        return sum(self.batch_slices[:b])

    def token_offset(self, b: int, t: int) -> int:
        """Position of the first token of token slice ``t`` of batch slice ``b``."""
        return sum(self.token_slices[b][:t])

    def token_bounds(self, b: int) -> list[int]:
        """Cut points ``[0, l1, l1+l2, ..., L]`` of batch slice ``b``."""
        return [0, *accumulate(self.token_slices[b])]

    def check_covers(self, batch: int, seq_len: int) -> None:
        """Raise ``ValueError`` unless the plan covers exactly ``batch`` x ``seq_len``."""
        if self.batch != batch:
            raise ValueError(
                f"plan's batch slices {list(self.batch_slices)} sum to {self.batch}, "
                f"not the batch size {batch}: they must cover the batch exactly"
            )
        if self.seq_len != seq_len:
            raise ValueError(
                f"plan's token slices {list(self.token_slices[0])} sum to {self.seq_len}, "
                f"not the sequence length {seq_len}: they must cover the sequence exactly"
            )

    # ---- constructors ------------------------------------------------------------------

    @classmethod
    def uniform(
        cls, batch: int, seq_len: int, *, batch_slice_size: int = 1, n_token_slices: int = 1
    ) -> Plan:
        """Equal batch slices of ``batch_slice_size`` sequences, each cut into
        ``n_token_slices`` token slices as equal as integers allow (longer ones first)."""
        if batch_slice_size <= 0 or batch % batch_slice_size:
            raise ValueError(
                f"batch_slice_size={batch_slice_size} does not divide batch={batch}: "
                "uniform batch slices must split the batch evenly"
            )
        if not 1 <= n_token_slices <= seq_len:
            raise ValueError(f"n_token_slices={n_token_slices} is outside [1, seq_len={seq_len}]")
        q, r = divmod(seq_len, n_token_slices)
        tokens = tuple(q + 1 if i < r else q for i in range(n_token_slices))
        n_b = batch // batch_slice_size
        return cls((batch_slice_size,) * n_b, (tokens,) * n_b)

    @classmethod
    def gpipe(cls, batch: int, seq_len: int, microbatch: int = 1) -> Plan:
        """GPipe microbatching: batch slices of ``microbatch`` sequences, no token slicing."""
        return cls.uniform(batch, seq_len, batch_slice_size=microbatch, n_token_slices=1)

    @classmethod
    def from_paper(cls, text: str) -> Plan:
        """Parse the paper's notation, e.g. ``[(1, [64] * 26 + [56] * 6 + [48])] * 2``."""
        try:
            value = _eval_literal(ast.parse(text.strip(), mode="eval").body)
        except (SyntaxError, ValueError, TypeError) as exc:
            raise ValueError(f"cannot parse slicing scheme {text!r}: {exc}") from exc
        if not isinstance(value, list) or not all(
            isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], list) for x in value
        ):
            raise ValueError(
                f"slicing scheme {text!r} is not a list of (batch size, [token lengths]) pairs"
            )
        return cls(tuple(x[0] for x in value), tuple(tuple(x[1]) for x in value))

    # ---- rendering ---------------------------------------------------------------------

    def to_paper(self) -> str:
        """Render in the paper's notation, run-length compressing repeats."""
        groups = _runs(list(zip(self.batch_slices, self.token_slices, strict=True)))
        parts = []
        for (size, tokens), count in groups:
            token_runs = _runs(list(tokens))
            if all(n == 1 for _, n in token_runs):
                inner = "[" + ", ".join(str(s) for s in tokens) + "]"
            else:
                inner = " + ".join(f"[{s}]" if n == 1 else f"[{s}] * {n}" for s, n in token_runs)
            item = f"[({size}, {inner})]"
            parts.append(item if count == 1 else f"{item} * {count}")
        return " + ".join(parts)

    def __str__(self) -> str:
        return self.to_paper()


def _runs(items: Sequence[T]) -> list[tuple[T, int]]:
    out: list[tuple[T, int]] = []
    for x in items:
        if out and out[-1][0] == x:
            out[-1] = (x, out[-1][1] + 1)
        else:
            out.append((x, 1))
    return out


def _eval_literal(node: ast.AST) -> object:
    """Evaluate the tiny expression language of the paper's slicing schemes:
    int literals, lists, tuples, list ``+`` list and list ``*`` int. Nothing else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_eval_literal(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_eval_literal(e) for e in node.elts)
    if isinstance(node, ast.BinOp):
        left, right = _eval_literal(node.left), _eval_literal(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
            return left * right
    raise ValueError(f"unsupported element {ast.dump(node)!r}")
