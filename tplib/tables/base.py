"""What a paper table is in tplib, and what running one gives.

A :class:`Table` is one of the paper's tables as data: for each mode it runs in
(``"simulate"``: the V100-cluster model; ``"measure"``: real processes on this machine
beside the simulator), a :class:`TableMode` says how to build its rows, how to draw
them, what its findings are, which columns to show, and which numbers
:mod:`tplib.reproduce`'s summary compares. :func:`run` builds it
and returns a :class:`TableResult`: the DataFrame, the figure and the findings' text.
The notebooks, ``python -m tplib table`` and ``make reproduce`` all go through here.
"""

from __future__ import annotations

import collections.abc
import inspect
import numbers
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pandas as pd

from tplib.util.files import save_figure, write_csv

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "MODES",
    "TIMING_COLUMNS",
    "Comparison",
    "Mode",
    "Rows",
    "Table",
    "TableMode",
    "TableResult",
    "is_timing",
    "run",
]

Mode = Literal["simulate", "measure"]
MODES: tuple[Mode, ...] = ("simulate", "measure")
# Wall times of tplib's own code (planning, profiling; ``plan_pct``: planning's share of
# a simulated iteration): they vary from run to run, so
# comparisons with a reference leave them out. Everything else in a simulated table is
# deterministic.
TIMING_COLUMNS = frozenset(
    {"plan_seconds", "profile_seconds", "search_seconds", "plan_ms", "plan_pct"}
)


def is_timing(column: str) -> bool:
    """A wall-time column: one of :data:`TIMING_COLUMNS` or a per-method ``plan_seconds_*``."""
    return column in TIMING_COLUMNS or column.startswith("plan_seconds_")


@dataclass(frozen=True, eq=False)
class Rows:
    """What a table's builder returns: the table, and what its figure and notebook need
    beyond it (``extras``: further tables to show; ``traces``: anything the figure draws,
    such as measured runs)."""

    df: pd.DataFrame
    extras: Mapping[str, pd.DataFrame] = field(default_factory=dict)
    traces: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Comparison:
    """The numbers a summary compares for one table in one mode: rows are identified by
    ``key``, described by ``label``, and ``value`` is compared with the paper's column
    ``paper`` (None: the paper has no such rows, as in measure mode) and with the
    committed reference's ``value``."""

    key: tuple[str, ...]
    value: str
    paper: str | None = None
    label: tuple[str, ...] = ()


@dataclass(frozen=True)
class TableMode:
    """How a table is built, drawn and read in one mode: its builder (keyword parameters
    only, each with a default), its figure and findings, the columns a reader looks at
    first (space-separated) and what the summary compares."""

    build: Callable[..., Rows]
    figure: Callable[[Rows], Figure]
    findings: Callable[[pd.DataFrame], str]
    columns: str
    compare: Comparison

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(self.columns.split())

    @property
    def parameters(self) -> list[str]:
        return list(inspect.signature(self.build).parameters)

    def problem(self, name: str, value: object) -> str | None:
        """What is wrong with ``value`` for the builder's parameter ``name``, judged by its
        annotation and default (None: nothing found; the builder checks the rest)."""
        param = inspect.signature(self.build).parameters[name]
        hint = _resolve(self.build, param.annotation)
        if not _fits(value, hint):
            return f"is not {_describe(hint)} (the default is {param.default!r})"
        default = param.default
        if _scalar_list(hint) and _empty(value) and isinstance(default, Sized) and len(default):
            return f"is empty: a table needs at least one, as in the default {default!r}"
        return None


@dataclass(frozen=True)
class Table:
    """One of the paper's tables (see the module docstring)."""

    name: str  # the notebook and results folder: results/<name>/
    paper: str  # where it is in the paper, e.g. "Figure 5 / Table 2"
    title: str
    modes: Mapping[Mode, TableMode]

    def check(self, mode: str, params: Mapping[str, Any]) -> Mode:
        """Raise ``ValueError`` unless ``mode`` and ``params`` suit this table: the mode,
        the parameters' names, and their values' types (by the builder's annotations)."""
        if not isinstance(mode, str) or mode not in self.modes:
            raise ValueError(
                f"mode={mode!r}: table {self.name!r} runs in mode {' or '.join(self.modes)}"
            )
        m: Mode = "simulate" if mode == "simulate" else "measure"
        accepted = self.modes[m].parameters
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            elsewhere = [
                f"{p!r} is a {other}-mode parameter"
                for p in unknown
                for other, spec in self.modes.items()
                if other != m and p in spec.parameters
            ]
            hint = f" ({'; '.join(elsewhere)})" if elsewhere else ""
            raise ValueError(
                f"table {self.name!r} in {m} mode has no parameter {', '.join(unknown)}"
                f"{hint}: it takes {', '.join(accepted)}"
            )
        for name, value in params.items():
            if problem := self.modes[m].problem(name, value):
                shown = repr(value) if len(repr(value)) <= 200 else f"{repr(value)[:200]}..."
                raise ValueError(f"table {self.name!r} in {m} mode: {name}={shown} {problem}")
        return m


@dataclass(frozen=True, eq=False)
class TableResult:
    """A table built: its rows, figure and findings (markdown), in ``mode``."""

    table: Table
    mode: Mode
    params: Mapping[str, Any]
    rows: Rows
    figure: Figure
    findings: str

    @property
    def df(self) -> pd.DataFrame:
        return self.rows.df

    @property
    def extras(self) -> Mapping[str, pd.DataFrame]:
        return self.rows.extras

    def show(self, digits: int = 3) -> pd.DataFrame:
        """The columns a reader looks at first, rounded."""
        cols = [c for c in self.table.modes[self.mode].column_names if c in self.df.columns]
        return self.df[cols].round(digits)

    def paths(self, out_dir: str | os.PathLike[str], tag: str | None = None) -> tuple[Path, Path]:
        """The CSV and PNG this result saves to: ``<out_dir>/<name>-<tag>.csv|png``."""
        stem = f"{self.table.name}-{tag or self.mode}"
        return Path(out_dir) / f"{stem}.csv", Path(out_dir) / f"{stem}.png"

    def csv_frame(self) -> pd.DataFrame:
        """What :meth:`save` writes to the CSV: the rows, without the wall times of a
        simulated table."""
        if self.mode != "simulate":
            return self.df
        return self.df.drop(columns=[c for c in self.df.columns if is_timing(c)])

    def save(self, out_dir: str | os.PathLike[str], tag: str | None = None) -> tuple[Path, Path]:
        """Write the CSV and the figure, each atomically; return their paths. A simulated
        table's CSV leaves out the wall times (:meth:`csv_frame`): everything else in it
        is deterministic, so rerunning it leaves a committed CSV as it was. The executed
        notebook still shows them."""
        csv, png = self.paths(out_dir, tag)
        write_csv(self.csv_frame(), csv)
        save_figure(self.figure, png)
        return csv, png


def run(table: Table, mode: str, params: Mapping[str, Any]) -> TableResult:
    """Build ``table`` in ``mode`` with ``params``; every parameter is checked first."""
    m = table.check(mode, params)
    spec = table.modes[m]
    rows = spec.build(**params)
    return TableResult(table, m, dict(params), rows, spec.figure(rows), spec.findings(rows.df))


# ---- parameter values against the builders' annotations ---------------------------------
# Notebooks and ``--params`` pass JSON, so a wrong type (``settings: 5``, ``eps: "x"``) is
# common; caught here, it is named before the builder runs rather than raising TypeError
# or AttributeError inside it.

_SEQUENCES = (collections.abc.Sequence, collections.abc.Iterable)


def _resolve(build: Callable[..., Rows], annotation: object) -> object:
    """The annotation as a type; Any for a name imported only for type checkers."""
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, build.__globals__)  # the module's own annotation text
    except NameError:
        return Any


def _fits(value: object, hint: object) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (Any, object, inspect.Parameter.empty):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        kind = numbers.Integral if hint is int else numbers.Real
        return isinstance(value, kind) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in _SEQUENCES:
        if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
            return False
        # Only lists, tuples and ranges are looked into: an iterator would be used up.
        return not (args and isinstance(value, list | tuple | range)) or all(
            _fits(v, args[0]) for v in value
        )
    if origin is tuple:
        if not isinstance(value, tuple | list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(_fits, value, args))
    if origin in (collections.abc.Mapping, dict):
        return isinstance(value, Mapping) and (
            not args or all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
        )
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # anything else is the builder's to check


def _describe(hint: object) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    return "of type " + text.replace("collections.abc.", "").replace("typing.", "")


def _scalar_list(hint: object) -> bool:
    """A list of numbers or names, such as ``settings: Iterable[int]``."""
    args = typing.get_args(hint)
    return typing.get_origin(hint) in _SEQUENCES and bool(args) and args[0] in (int, float, str)


def _empty(value: object) -> bool:
    return isinstance(value, Sized) and len(value) == 0
