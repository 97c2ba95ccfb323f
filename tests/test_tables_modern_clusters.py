"""The modern-clusters table: its rows regenerate the committed CSVs, each row's columns
follow from its latencies, the findings are computed from the table, a search where
nothing fits is recorded, the table splits over its settings, and bad requests are
refused."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd
import pytest

import tplib.tables.modern_clusters as mc
from tplib.paper import setting
from tplib.partition.chain import DoesNotFit
from tplib.reproduce import Job
from tplib.reproduce.split import gather, split_job
from tplib.search.setting import tflops_per_gpu
from tplib.tables import TableResult, run_table
from tplib.tables.base import is_timing
from tplib.util.files import write_csv

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results/modern_clusters"
COMMITTED = RESULTS / "modern_clusters-simulate.csv"
AUTOPLAN = [
    "autoplan_layout",
    "autoplan_n_stages",
    "autoplan_recompute",
    "latency_autoplan",
    "memory_gib_autoplan",
    "plan_autoplan",
    "autoplan_note",
    "speedup_over_paper_layout",
]


def _round_trip(df: pd.DataFrame) -> pd.DataFrame:
    buf = io.StringIO()
    df.to_csv(buf, index=False)
    buf.seek(0)
    return pd.read_csv(buf)


@pytest.fixture(scope="module")
def setting_1() -> TableResult:
    """Setting (1) on both clusters without the layout search (the cheapest setting)."""
    result = run_table("modern_clusters", "simulate", settings=[1], search=False)
    plt.close(result.figure)
    return result


def test_each_row_follows_from_its_latencies(setting_1: TableResult) -> None:
    df = setting_1.df
    assert list(df.cluster) == list(mc.CLUSTER_NAMES)
    assert set(setting_1.table.modes["simulate"].column_names) <= set(df.columns)
    s = setting(1)
    for _, r in df.iterrows():
        tera = {k: float(r[f"latency_{k}"]) for k in mc.TERAPIPES}
        assert r.best_terapipe == min(tera, key=tera.__getitem__)
        assert r.latency_terapipe_best == min(tera.values())
        assert r.speedup_over_interleaved == r.latency_interleaved_1f1b / min(tera.values())
        assert r.speedup_over_zb_h1 == r.latency_zb_h1 / min(tera.values())
        assert r.tflops_gpipe == tflops_per_gpu(s, r.latency_gpipe)
        # Interleaving needs as many microbatches as stages: 16 sequences, 24 stages.
        assert r.v_interleaved_1f1b == 1 and r.latency_interleaved_1f1b == r.latency_1f1b
        assert r.autoplan_note == "not searched" and pd.isna(r.latency_autoplan)
    assert not any(is_timing(c) for c in setting_1.csv_frame().columns)


def test_the_committed_rows_regenerate(setting_1: TableResult) -> None:
    """The simulator is deterministic: setting (1)'s rows, but for the search's columns
    (not searched here), equal the committed CSV's; so does the calibration table."""
    committed = pd.read_csv(COMMITTED)
    ours = _round_trip(setting_1.csv_frame())
    assert list(ours.columns) == list(committed.columns)
    cols = [c for c in committed.columns if c not in AUTOPLAN]
    # Read back alone, as ours is: a column of setting (1) may be all empty (NaN).
    part = _round_trip(committed[committed.setting == 1][cols])
    pd.testing.assert_frame_equal(ours[cols], part, check_exact=True)
    calibration = pd.read_csv(RESULTS / "modern_clusters-simulate-calibration.csv")
    ours_cal = _round_trip(setting_1.extras["calibration"])
    pd.testing.assert_frame_equal(ours_cal, calibration, check_exact=True)


def test_the_committed_search_regenerates() -> None:
    """GPT3-175B's search on DGX H100 (settings (9) and (10)), the cheapest one."""
    row = mc.search_row("GPT3-175B", 384, 2, "dgx-h100")
    df = pd.read_csv(COMMITTED)
    committed = df[(df.cluster == "dgx-h100") & (df.setting == 10)].iloc[0]
    for col in AUTOPLAN[:-2]:
        assert row[col] == committed[col], col
    assert pd.isna(committed.autoplan_note) and row["autoplan_note"] == ""
    speedup = committed.latency_terapipe / row["latency_autoplan"]
    assert committed.speedup_over_paper_layout == speedup


def test_a_search_where_nothing_fits_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    def none_fits(*args: Any, **kwargs: Any) -> Any:
        raise DoesNotFit("GPT3-175B on 8 GPUs with batch 2", "#Data=1", 2**40, 80 * 2**30)

    monkeypatch.setattr(mc, "autoplan", none_fits)
    row = mc.search_row("GPT3-175B", 8, 2, "dgx-a100")
    assert pd.isna(row["latency_autoplan"]) and row["autoplan_layout"] == ""
    assert "nothing fits in 80.0 GiB per GPU" in row["autoplan_note"]


def test_findings_are_computed_from_the_table() -> None:
    df = pd.read_csv(COMMITTED)
    text = mc.findings(df)
    for cluster in mc.CLUSTER_NAMES:
        table1 = df[(df.cluster == cluster) & (df.seq_len == 2048)]
        won = int((table1.speedup_over_interleaved >= mc.PAYS).sum())
        median = table1.speedup_over_interleaved.median()
        assert f"wins {won} of {len(table1)} settings by >= 5%" in text
        assert f"median {median:.2f}x" in text
    # A number changed in a copy changes the sentences it enters.
    copy = df.copy()
    row = copy.index[(copy.cluster == "dgx-h100") & (copy.setting == 2)][0]
    copy.loc[row, "speedup_over_interleaved"] = 50.0
    changed = mc.findings(copy)
    assert changed != text and "(2) 50.00x" in changed and "(2) 50.00x" not in text
    sweep = copy.index[(copy.cluster == "dgx-a100") & (copy.setting == 5)]
    copy.loc[sweep, "speedup_over_interleaved"] = [4.0, 3.0, 2.0, 1.0]
    assert "the gain over interleaved 1F1B does not grow steadily, L=2048 4.00x" in mc.findings(
        copy
    )


def test_the_table_splits_over_settings_and_gathers_back(tmp_path: Path) -> None:
    """Setting (5)'s part carries its Table 4 rows: the parts' rows, gathered, are the
    committed CSV byte for byte."""
    whole = pd.read_csv(COMMITTED)
    job = Job("modern_clusters", "simulate", {}, str(tmp_path))
    parts = split_job(job)
    assert [p.params["settings"] for p in parts] == [[n] for n in range(1, 11)]
    for part, n in zip(parts, range(1, 11), strict=True):
        write_csv(whole[whole.setting == n], part.csv)
    gather(job, parts)
    assert job.csv.read_bytes() == COMMITTED.read_bytes()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"clusters": ["p3.16xlarge"]}, r"clusters=\['p3.16xlarge'\]: choose among"),
        ({"settings": [11]}, r"settings \[11\] are not in Table 1"),
        ({"seq_lens": [2048]}, r"seq_lens \[2048\]: Table 4's longer L"),
    ],
)
def test_bad_requests_are_refused(params: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_table("modern_clusters", "simulate", **params)
