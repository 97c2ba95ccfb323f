"""The summary of a reproduction: each table's numbers beside the paper's and beside the
committed reference's.

For every table a run produced, :func:`section` writes one short markdown table: the
row's key, the paper's number (simulate mode), the reproduced one, the committed
reference's, and the differences. In simulate mode, which is deterministic, it also says
whether the whole table equals the committed reference, timing columns aside
(:data:`~tplib.tables.TIMING_COLUMNS`), and lists any row that does not.

A difference is relative ("+7.6%") for a quantity such as a speedup or a latency, and
absolute, in percentage points ("+1.4 pp"), for an error column (``err_<column>``,
``<column>_error``: itself a relative difference): an error that moved from 1.8% to
3.2% changed by 1.4 points, where a ratio of the two (+77%) says little.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from tplib.tables import TIMING_COLUMNS, Mode, Table

__all__ = ["equal_to_reference", "section"]


def _fmt(value: object) -> str:
    if isinstance(value, float | np.floating):
        return "—" if np.isnan(value) else f"{value:#.4g}"
    return str(value)


def _is_error_column(name: str) -> bool:
    """Whether column ``name`` holds a relative error (0.018 for 1.8%), by the tables'
    naming: ``err_<column>`` (ours / the paper's − 1, the simulator's / the measured − 1)
    or ``<column>_error``."""
    return name.startswith("err_") or name.endswith("_error")


def _fmt_value(value: float, error: bool) -> str:
    if error and np.isfinite(value):
        return f"{value:+.1%}"
    return _fmt(value)


def _delta(ours: float, theirs: float, error: bool = False) -> str:
    if ours == theirs:
        return "="
    if not (np.isfinite(ours) and np.isfinite(theirs)):
        return "—"
    if error:
        return f"{(ours - theirs) * 100:+.1f} pp"
    if theirs == 0:
        return "—"
    return f"{ours / theirs - 1:+.1%}"


def _key(row: pd.Series, key: Sequence[str]) -> tuple[object, ...]:
    return tuple(row[k] for k in key)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float | np.floating) and isinstance(b, float | np.floating):
        return bool(a == b or (np.isnan(a) and np.isnan(b)))
    return bool(a == b)


def equal_to_reference(
    df: pd.DataFrame, reference: pd.DataFrame, key: Sequence[str]
) -> tuple[list[str], list[str]]:
    """Compare ``df`` with ``reference`` row by row (rows matched by ``key``), every column
    but the timing ones, exactly. Returns (lines about columns, lines about rows that
    differ); both empty means equal on the rows ``df`` has."""
    notes: list[str] = []
    cols = [c for c in df.columns if c not in TIMING_COLUMNS]
    ref_cols = [c for c in reference.columns if c not in TIMING_COLUMNS]
    if set(cols) != set(ref_cols):
        missing, extra = sorted(set(ref_cols) - set(cols)), sorted(set(cols) - set(ref_cols))
        notes.append(f"columns differ: not reproduced {missing}, new {extra}")
    shared = [c for c in cols if c in ref_cols]
    ref_rows = {_key(r, key): r for _, r in reference.iterrows()}
    rows: list[str] = []
    for _, r in df.iterrows():
        k = _key(r, key)
        if k not in ref_rows:
            rows.append(f"{dict(zip(key, k, strict=True))}: not in the reference")
            continue
        ref = ref_rows[k]
        diff = [c for c in shared if not _same(r[c], ref[c])]
        if diff:
            shown = ", ".join(f"{c} {_fmt(r[c])} (reference {_fmt(ref[c])})" for c in diff[:4])
            more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
            rows.append(f"{dict(zip(key, k, strict=True))}: {shown}{more}")
    return notes, rows


def section(table: Table, mode: Mode, df: pd.DataFrame, reference: pd.DataFrame | None) -> str:
    """The summary of one produced table (see the module docstring), as markdown."""
    cmp = table.modes[mode].compare
    lines = [f"### {table.title} ({table.paper}), {mode} mode", ""]
    unmatched = None
    if reference is not None:
        missing = [c for c in (*cmp.key, cmp.value) if c not in reference.columns]
        if missing:
            # An older reference, from before a column was renamed: show the table alone.
            unmatched, reference = f"The committed reference has no column {missing}.", None
    head = [*cmp.key, *cmp.label]
    cols = [*head, *(["paper"] if cmp.paper else []), "reproduced"]
    cols += ["Δ paper"] if cmp.paper else []
    cols += ["reference", "Δ reference"]
    lines += ["| " + " | ".join(c.replace("_", " ") for c in cols) + " |"]
    lines += ["| " + " | ".join("---" if c in head else "---:" for c in cols) + " |"]
    ref_rows = {} if reference is None else {_key(r, cmp.key): r for _, r in reference.iterrows()}
    error = _is_error_column(cmp.value)
    for _, r in df.iterrows():
        ours = float(r[cmp.value])
        cells = [_fmt(r[c]) for c in head]
        if cmp.paper:
            paper = float(r[cmp.paper])
            cells += [_fmt_value(paper, error), _fmt_value(ours, error)]
            cells += [_delta(ours, paper, error)]
        else:
            cells += [_fmt_value(ours, error)]
        ref = ref_rows.get(_key(r, cmp.key))
        if ref is None or cmp.value not in ref:
            cells += ["—", "—"]
        else:
            theirs = float(ref[cmp.value])
            cells += [_fmt_value(theirs, error), _delta(ours, theirs, error)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"Compared: `{cmp.value}`"
        + (f" against the paper's `{cmp.paper}`" if cmp.paper else "")
        + ("; an error, so differences are in percentage points (pp)." if error else ".")
    )
    if reference is None:
        lines.append(unmatched or "No committed reference to compare with.")
    elif mode == "simulate":
        notes, rows = equal_to_reference(df, reference, cmp.key)
        left_out = len(reference) - sum(_key(r, cmp.key) in ref_rows for _, r in df.iterrows())
        if not notes and not rows:
            timing = sorted(TIMING_COLUMNS & set(df.columns))
            lines.append(
                f"**Equal to the committed reference**: all {len(df)} reproduced rows, every "
                f"column but the timing ones ({', '.join(timing) or 'none'})."
            )
        else:
            lines.append("**Differs from the committed reference:**")
            lines += [f"- {x}" for x in [*notes, *rows]]
            if not rows:
                lines.append(
                    f"- every reproduced row ({len(df)}) equals the reference on the shared columns"
                )
        if left_out > 0:
            lines.append(f"({left_out} reference rows were not part of this run's parameters.)")
    else:
        lines.append(
            "Measured on this machine: measurements vary from run to run and from machine to "
            "machine, so the reference is a comparison, not an expected value."
        )
    return "\n".join(lines) + "\n"
