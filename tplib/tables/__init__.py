"""The paper's tables, one function each, in simulate or measure mode.

=========================  =====================  ======================================
table                      paper                  module
=========================  =====================  ======================================
``main_results``           Figure 5 / Table 2     :mod:`tplib.tables.main_results`
``dp_ablation``            Figure 6 / Table 3     :mod:`tplib.tables.dp_ablation`
``seqlen_sweep``           Figure 7 / Table 4     :mod:`tplib.tables.seqlen_sweep`
``simulator_validation``   (method)               :mod:`tplib.tables.validation`
``pipeline_systems``       PipeDream-2BW §5       :mod:`tplib.tables.pipeline_systems`
``layout_search``          Table 1 (layouts)      :mod:`tplib.tables.layout_search`
``modern_clusters``        (beyond: DGX nodes)    :mod:`tplib.tables.modern_clusters`
``long_context``           (beyond: Table 4)      :mod:`tplib.tables.long_context`
``packed_sequences``       (beyond: documents)    :mod:`tplib.tables.packed_sequences`
=========================  =====================  ======================================

:func:`run_table` builds one and returns a :class:`~tplib.tables.base.TableResult` (its
DataFrame, figure and findings). The notebooks call it, ``python -m tplib table NAME``
calls it, and ``make reproduce`` runs the notebooks. Column names mean the same thing in
every table and mode (the README's glossary lists them); a simulated table's
``err_<column>`` is <column> / the paper's - 1, a measured table's
``err_simulated_<column>`` is the simulator's prediction / the measurement - 1.
"""

from __future__ import annotations

import importlib
from typing import Any

from tplib.tables.base import (
    MODES,
    TIMING_COLUMNS,
    Comparison,
    Mode,
    Rows,
    Table,
    TableMode,
    TableResult,
    run,
)

__all__ = [
    "MODES",
    "TABLE_NAMES",
    "TIMING_COLUMNS",
    "Comparison",
    "Mode",
    "Rows",
    "Table",
    "TableMode",
    "TableResult",
    "get_table",
    "run_table",
]

# Table name -> its module. Loaded on first use: the per-setting helpers of
# tplib.search.setting serve the numpy-only commands, which should not pay for plotting.
_MODULES = {
    "main_results": "main_results",
    "dp_ablation": "dp_ablation",
    "seqlen_sweep": "seqlen_sweep",
    "simulator_validation": "validation",
    "pipeline_systems": "pipeline_systems",
    "layout_search": "layout_search",
    "modern_clusters": "modern_clusters",
    "long_context": "long_context",
    "packed_sequences": "packed_sequences",
}
TABLE_NAMES = tuple(_MODULES)


def get_table(name: str) -> Table:
    """The table called ``name``."""
    if not isinstance(name, str) or name not in _MODULES:
        raise ValueError(f"unknown table {name!r}: known tables are {list(TABLE_NAMES)}")
    table: Table = importlib.import_module(f"tplib.tables.{_MODULES[name]}").TABLE
    return table


def run_table(name: str, mode: str = "simulate", **params: Any) -> TableResult:
    """Build table ``name`` in ``mode`` ("simulate" or "measure") with the parameters of
    that mode's builder (see each table module); bad names, modes and parameters raise
    ``ValueError`` before anything runs."""
    return run(get_table(name), mode, params)
