"""Runs made from what the paper and the planners chose, for the runtime to execute:

- :mod:`~tplib.runs.settings`: Table 1's settings as runs (:func:`setting_run`), their
  torchrun launch commands, their results beside the paper's;
- :mod:`~tplib.runs.partitioned`: the layout search's, PipeDream's and 2BW's choices as
  runs.

Above the runtime, the planners and the layout search; below the tables. Importing it
loads no torch.
"""

from __future__ import annotations

from tplib.runs.settings import setting_run

__all__ = ["setting_run"]
