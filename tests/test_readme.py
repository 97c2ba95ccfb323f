"""The README's table of reproduced numbers is the committed results CSV, not a copy that
can drift: regenerate both with `make reproduce FORCE=1`."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def test_readme_table_matches_the_committed_results() -> None:
    csv = pd.read_csv(ROOT / "results/main_results/main_results-simulate.csv").set_index("setting")
    rows = re.findall(
        r"^\| \((\d+)\) \| (\S+) \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+)% \|$",
        (ROOT / "README.md").read_text(),
        flags=re.MULTILINE,
    )
    assert len(rows) == len(csv) == 10
    for setting, model, paper, ours, err in rows:
        r = csv.loc[int(setting)]
        assert model == r.model
        assert float(paper) == round(r.paper_speedup, 2), setting
        assert float(ours) == round(r.speedup, 2), setting
        assert float(err) == round(100 * r.err_speedup, 1), setting
