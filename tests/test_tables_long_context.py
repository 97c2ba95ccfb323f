"""The long-context study (tplib.tables.long_context): its committed rows regenerate, the
winners are the fastest fitting rows, and TeraPipe's DP never loses to Seq1F1B's slicing."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from tplib.search.long_context import METHODS, best_layout
from tplib.tables import TableResult, run_table
from tplib.tables.long_context import STUDIES, findings, winners

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results/long_context"
STUDY, L = "GPT3-13B/dgx-h100", 131072


@pytest.fixture(scope="module")
def built() -> TableResult:
    """Every method of the GPT3-13B H100 study at 128K, as the table builds it."""
    result = run_table("long_context", studies=[STUDY], seq_lens=[L])
    assert set(result.extras) == {"winners", "dp_vs_seq1f1b"}
    return result


@pytest.fixture
def one_length(built: TableResult) -> pd.DataFrame:
    return built.df


def test_the_committed_rows_regenerate(one_length: pd.DataFrame) -> None:
    committed = pd.read_csv(RESULTS / "long_context-simulate.csv")
    theirs = committed[(committed.study == STUDY) & (committed.seq_len == L)]
    assert len(theirs) == len(METHODS) == len(one_length)
    for column in ("method", "schedule", "recompute", "slicing"):
        assert list(one_length[column].fillna("")) == list(theirs[column].fillna("")), column
    for column in ("tp", "cp", "pp", "dp", "iteration_s", "memory_gib"):
        ours, want = one_length[column].astype(float), theirs[column].astype(float)
        assert list(ours.fillna(-1)) == pytest.approx(list(want.fillna(-1))), column


def test_each_row_is_the_methods_best_layout(one_length: pd.DataFrame) -> None:
    # The table's row for a method is best_layout's answer for it, made independently.
    study = STUDIES[STUDY]
    row = one_length.set_index("method").loc["seq1f1b"]
    alone = best_layout(study.model, study.n_gpus, L, "seq1f1b", batch=study.batch(L))
    assert alone.iteration_s == row.iteration_s and alone.slicing == row.slicing
    assert row.tokens_per_s_per_gpu == pytest.approx(
        study.batch(L) * L / row.iteration_s / study.n_gpus
    )


def test_the_winner_is_the_fastest_fitting_method(one_length: pd.DataFrame) -> None:
    w = winners(one_length).iloc[0]
    fitting = one_length[one_length.fits]
    assert w.iteration_s == fitting.iteration_s.min()
    slower = fitting[fitting.iteration_s > w.iteration_s * (1 + 1e-9)].iteration_s
    assert w.margin == pytest.approx(slower.min() / w.iteration_s)
    assert w.runner_up in set(fitting.method) and w.why
    text = findings(one_length)
    assert f"L={L}: `{w.winner}`" in text and "over 1F1B" in text


def test_the_dp_never_loses_to_seq1f1b(built: TableResult) -> None:
    dp = built.extras["dp_vs_seq1f1b"]
    assert len(dp) == 1 and (dp.margin >= 0).all()
    assert (dp.dp_latency <= dp.seq1f1b_latency).all()


def test_nothing_fitting_and_bad_input_are_said() -> None:
    with pytest.raises(ValueError, match=r"studies=\['GPT3-13B/tpu'\]: choose among"):
        run_table("long_context", studies=["GPT3-13B/tpu"])
    with pytest.raises(ValueError, match=r"seq_lens=\[1000\]: each L must be"):
        run_table("long_context", seq_lens=[1000])
    with pytest.raises(ValueError, match=r"methods=\['ring'\]: choose among"):
        run_table("long_context", methods=["ring"])
    rows = pd.DataFrame(
        [{"study": "s", "seq_len": 8192, "method": "1f1b", "fits": False, "iteration_s": 1.0}]
    )
    assert winners(rows).winner.iloc[0] == "nothing fits"
    assert "L=8192: no method fits." in findings(rows)


def test_the_measured_comparison_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"methods=\['ring'\]: choose among"):
        run_table("long_context", "measure", methods=["ring"])
    with pytest.raises(ValueError, match=r"need rounds >= 1 and #CP = #Pipe >= 2"):
        run_table("long_context", "measure", n_cp=4)
    committed = pd.read_csv(RESULTS / "long_context-measure.csv")
    assert list(committed.method) == ["terapipe", "seq1f1b", "uniform", "cp"]
    # Each row's error is its simulated latency against its measured median.
    err = committed.simulated_latency / committed.latency - 1
    assert list(committed.err_simulated_latency) == pytest.approx(list(err))
    assert (committed.latency_round_min <= committed.latency_round_max).all()
