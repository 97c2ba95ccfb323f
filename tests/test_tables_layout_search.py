"""The layout-search table: the search never loses to the paper's own layout, the
committed results regenerate, and bad settings are refused."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from tplib.paper import SETTINGS
from tplib.tables import TIMING_COLUMNS, run_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    return run_table("layout_search", "simulate", settings=[9, 10]).df


def test_search_never_loses_to_the_papers_layout(table: pd.DataFrame) -> None:
    """The paper's layout is one of the candidates, so where it fits the search's best
    is at least as fast; where it is the best itself the two latencies agree."""
    for _, r in table.iterrows():
        s = SETTINGS[int(r.setting)]
        assert r.paper_layout == f"#Data={s.n_data} x #Pipe={s.n_stages} x #Op={s.n_op}"
        if r.paper_layout_fits:
            assert r.latency_best <= r.latency_paper_layout * (1 + 1e-9)
            assert r.paper_layout_rank >= 1
        if r.paper_layout_rank == 1:
            assert r.latency_best == pytest.approx(r.latency_paper_layout)
            assert r.paper_layout_reason == "best"
        assert r.candidates == r.fitting + r.pruned + r.out_of_memory
        assert r.fitting <= r.planned <= r.candidates - r.pruned
        assert r.memory_gib_best <= 16


def test_committed_results_regenerate(table: pd.DataFrame) -> None:
    committed = pd.read_csv(ROOT / "results/layout_search/layout_search-simulate.csv")
    committed = committed[committed.setting.isin([9, 10])].reset_index(drop=True)
    cols = [c for c in committed.columns if c not in TIMING_COLUMNS]
    pd.testing.assert_frame_equal(
        table[cols].reset_index(drop=True), committed[cols], check_dtype=False
    )


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"settings \[11\] are not in Table 1"):
        run_table("layout_search", "simulate", settings=[11])
    with pytest.raises(ValueError, match="no parameter settngs"):
        run_table("layout_search", "simulate", settngs=[9])
    with pytest.raises(ValueError, match="runs in mode simulate"):
        run_table("layout_search", "measure")
