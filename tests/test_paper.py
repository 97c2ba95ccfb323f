"""Tests for tplib.paper: Tables 1-4 as transcribed, against the rows of the paper's text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tplib.nn.configs import get_config, n_params
from tplib.paper import (
    GPIPE,
    MAIN_SPEEDUPS,
    SEQLEN_BATCH,
    SEQLEN_SPEEDUPS,
    SETTINGS,
    TABLE2,
    TABLE3,
    TABLE4,
    TERAPIPE,
    PaperResult,
    ablation_rows,
    main_row,
    seqlen_row,
    setting,
)

ROOT = Path(__file__).resolve().parents[1]
# The rows of the paper's text these tests read, committed: a clone has them. The whole text
# lives beside the checkout where it was made, not in it.
EXCERPT = ROOT / "tests/data/terapipe-paper-rows.txt"
PAPER = ROOT.parent / "shared/paper/terapipe-icml2021.txt"
TABLE1_RE = re.compile(r"^\(\d+\)\t")
ROW_RE = re.compile(r"(\[\(.*\)\]\s*\*\s*\d+)\s+([\d.]+) ± ([\d.]+)\s+([\d.]+)")


def _rows(text: str) -> list[str]:
    """Table 1's rows and the appendix tables' rows, in the text's order."""
    return [ln for ln in text.splitlines() if TABLE1_RE.match(ln) or ROW_RE.search(ln)]


@pytest.fixture(scope="module")
def text() -> str:
    return EXCERPT.read_text(encoding="utf-8")


def test_the_excerpt_is_the_papers_own_rows(text: str) -> None:
    if not PAPER.exists():
        pytest.skip(
            f"the paper's text is not beside this checkout ({PAPER}): the committed excerpt "
            f"{EXCERPT.relative_to(ROOT)} stands for it"
        )
    body = [ln for ln in text.splitlines() if not ln.startswith("# ")]
    assert body == _rows(PAPER.read_text(encoding="utf-8"))


def test_table1_matches_the_text(text: str) -> None:
    # Each printed row ends in "B, #Data, #Pipe, #Op"; the first row of a model also
    # carries N, H, #Params, L, #GPUs.
    for s in SETTINGS.values():
        tail = rf"\t{s.batch}\t{s.n_data}\t{s.n_stages}\t{s.n_op}\s*$"
        head = rf"^\({s.index}\)\t"
        lines = [ln for ln in text.splitlines() if re.match(head, ln)]
        assert len(lines) == 1 and re.search(tail, lines[0]), (s, lines)
        if s.model in lines[0]:
            cols = lines[0].split("\t")
            assert cols[1:7] == [
                s.model, str(s.n_layer), str(s.hidden), s.params_text, str(s.seq_len),
                str(s.n_gpus),
            ]  # fmt: skip


def test_settings_are_consistent_with_the_configs() -> None:
    for s in SETTINGS.values():
        cfg = get_config(s.model)
        assert (cfg.n_layer, cfg.hidden) == (s.n_layer, s.hidden)
        billions = n_params(cfg) / 1e9
        assert billions == pytest.approx(float(s.params_text.rstrip("B")), rel=0.35)
    assert SETTINGS[6].pipeline_batch == 2 and SETTINGS[1].pipeline_batch == 16
    assert SETTINGS[10].layers_per_stage == 2


def test_appendix_tables_match_the_text_row_by_row(text: str) -> None:
    """Every printed (scheme, latency ± std, TFLOPS) row, in order, equals ours."""
    printed = [m.groups() for m in map(ROW_RE.search, text.splitlines()) if m]
    ours = [*TABLE2, *TABLE3, *TABLE4]
    assert len(printed) == len(ours)
    for row, (scheme, lat, std, tf) in zip(ours, printed, strict=True):
        assert row.scheme == scheme.strip(), row
        assert (row.latency, row.latency_std, row.tflops) == (float(lat), float(std), float(tf))


def test_spot_check_latency_strings(text: str) -> None:
    for needle in ("1.254 ± 0.160", "13.319 ± 0.067", "1.481 ± 0.002", "0.636 ± 0.001"):
        assert needle in text
    assert main_row(1, TERAPIPE).latency == 1.254
    assert main_row(6, GPIPE).latency == 13.319
    assert main_row(9, TERAPIPE).latency == 1.481
    assert seqlen_row(8192, TERAPIPE).latency == 0.636


@pytest.mark.parametrize(
    "row",
    [*TABLE2, *TABLE3, *TABLE4],
    ids=lambda r: f"T{r.table}-{r.setting}-{r.seq_len}-{r.algorithm}",
)
def test_each_scheme_covers_its_setting(row: PaperResult) -> None:
    s = setting(row.setting, row.seq_len)
    row.plan.check_covers(s.pipeline_batch, s.seq_len)
    if row.algorithm == GPIPE:
        assert row.plan == s.gpipe_plan()
    if row.n_slices is not None:
        assert all(len(ts) == row.n_slices for ts in row.plan.token_slices)


def test_tables_agree_with_the_prose() -> None:
    for i, claimed in MAIN_SPEEDUPS.items():
        ratio = main_row(i, GPIPE).latency / main_row(i, TERAPIPE).latency
        assert ratio == pytest.approx(claimed, abs=0.01), i  # the prose rounds or truncates
    for seq_len, claimed in SEQLEN_SPEEDUPS.items():
        ratio = seqlen_row(seq_len, GPIPE).latency / seqlen_row(seq_len, TERAPIPE).latency
        assert ratio == pytest.approx(claimed, abs=0.01), seq_len
    # Table 3's "#Slices=1" and "DP" rows repeat Table 2's GPipe and TeraPipe rows.
    for i in (8, 9):
        rows = ablation_rows(i)
        assert rows[0].latency == main_row(i, GPIPE).latency
        assert rows[-1].scheme == main_row(i, TERAPIPE).scheme


def test_seqlen_variants() -> None:
    for seq_len, batch in SEQLEN_BATCH.items():
        s = setting(5, seq_len)
        assert (s.seq_len, s.batch, s.pipeline_batch, s.n_stages) == (seq_len, batch, batch, 40)
        assert s.config.seq_len == seq_len
    with pytest.raises(ValueError, match="only for setting"):
        setting(4, 4096)
    with pytest.raises(ValueError, match=r"settings are 1\.\.10"):
        setting(11)
