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
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TypeVar

__all__ = ["Plan", "Unit", "grid_size"]

T = TypeVar("T")

# The most items (numbers, lists and tuples) a scheme in the paper's notation may expand
# to: far beyond any real plan (the paper's largest has a few hundred), small enough that
# ``[(1, [1] * 10**12)]`` is refused at once instead of filling memory.
_MAX_SCHEME_ITEMS = 1 << 20


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
        sizes = _whole_numbers(self.batch_slices, "batch slice sizes", "batch slice {} has size")
        tokens = tuple(
            _whole_numbers(
                ts,
                f"token slices of batch slice {b}",
                f"token slice {{}} of batch slice {b} has length",
            )
            for b, ts in enumerate(_as_tuple(self.token_slices, "token slicings"))
        )
        object.__setattr__(self, "batch_slices", sizes)
        object.__setattr__(self, "token_slices", tokens)
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
        _check_counts(batch=batch, seq_len=seq_len)
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
        _check_counts(
            batch=batch,
            seq_len=seq_len,
            batch_slice_size=batch_slice_size,
            n_token_slices=n_token_slices,
        )
        if batch % batch_slice_size:
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
        if not isinstance(text, str):
            raise ValueError(f"slicing scheme {text!r} is not a string in the paper's notation")
        try:
            value, _ = _eval_literal(ast.parse(text.strip(), mode="eval").body)
        except (SyntaxError, ValueError, TypeError) as exc:
            raise ValueError(f"cannot parse slicing scheme {_short(text)}: {exc}") from exc
        except (RecursionError, MemoryError):
            raise ValueError(
                f"cannot parse slicing scheme {_short(text)}: nested too deeply"
            ) from None
        if not isinstance(value, list) or not all(
            isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], list) for x in value
        ):
            raise ValueError(
                f"slicing scheme {_short(text)} is not a list of (batch size, [token lengths]) "
                "pairs"
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


def _as_tuple(value: object, what: str) -> tuple[object, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValueError(f"plan's {what} are {value!r}, not a sequence: give a tuple or a list")
    return tuple(value)


def _whole_numbers(values: object, what: str, each: str) -> tuple[int, ...]:
    """``values`` as ints; ``each`` names one (``{}``: its index). Integral floats pass (a
    planner's numpy arithmetic may make them); 1.5, '4', True or None do not."""
    out = []
    for i, x in enumerate(_as_tuple(values, what)):
        if (
            isinstance(x, bool)
            or not isinstance(x, numbers.Integral | float)
            or (isinstance(x, float) and not x.is_integer())
        ):
            raise ValueError(f"{each.format(i)} {x!r}: {what} must be whole numbers")
        out.append(int(x))
    return tuple(out)


def _check_counts(**counts: object) -> None:
    for name, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"{name}={n!r} must be a positive integer")


def _short(text: str, limit: int = 200) -> str:
    """``text`` quoted, cut short: an error need not repeat a megabyte of input."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _eval_literal(node: ast.AST) -> tuple[object, int]:
    """Evaluate the tiny expression language of the paper's slicing schemes: int
    literals (negative ones too, so that Plan can name them), lists, tuples, list ``+``
    list and list ``*`` a positive int. Nothing else. Returns the value and its size:
    how many numbers, lists and tuples it holds, at most :data:`_MAX_SCHEME_ITEMS`."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value, 1
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
    ):
        return -node.operand.value, 1
    if isinstance(node, ast.List | ast.Tuple):
        items = [_eval_literal(e) for e in node.elts]
        values = [v for v, _ in items]
        size = _at_most(1 + sum(n for _, n in items), node)
        return (values if isinstance(node, ast.List) else tuple(values)), size
    if isinstance(node, ast.BinOp):
        (left, n_left), (right, n_right) = _eval_literal(node.left), _eval_literal(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right, _at_most(n_left + n_right - 1, node)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and type(right) is int:
            if right < 1:
                raise ValueError(
                    f"{_short(ast.unparse(node))} repeats a list {right} times: a repeat "
                    "count must be a positive integer"
                )
            size = _at_most(1 + (n_left - 1) * right, node)  # before the product fills memory
            return left * right, size
    raise ValueError(
        f"unsupported element {_short(ast.unparse(node))}: the notation has integers, "
        "lists, (batch size, [lengths]) tuples, list + list and list * count"
    )


def _at_most(size: int, node: ast.AST) -> int:
    if size > _MAX_SCHEME_ITEMS:
        raise ValueError(
            f"{_short(ast.unparse(node))} expands to {size} numbers and lists, more than "
            f"the {_MAX_SCHEME_ITEMS} a slicing scheme may hold"
        )
    return size
