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
        r"^\| \((\d+)\) \| (\S+) \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+)% \| "
        r"([+-][\d.]+)%( \(held out\))? \| ([+-][\d.]+)% \|$",
        (ROOT / "README.md").read_text(),
        flags=re.MULTILINE,
    )
    assert len(rows) == len(csv) == 10
    for setting, model, paper, ours, err, err_g, held, err_p in rows:
        r = csv.loc[int(setting)]
        assert model == r.model
        assert float(paper) == round(r.paper_speedup, 2), setting
        assert float(ours) == round(r.speedup, 2), setting
        assert float(err) == round(100 * r.err_speedup, 1), setting
        assert float(err_g) == round(100 * r.err_latency_gpipe, 1), setting
        assert bool(held) == (r.gpipe_row == "held out"), setting
        assert float(err_p) == round(100 * r.err_latency_paper_plan, 1), setting


def _layout_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(tplib/[^`]+)` \| (.+) \|$", text, flags=re.MULTILINE))


def test_readme_layout_table_matches_the_package() -> None:
    """Every module and package of tplib has a row; every module a package row names
    exists, and every module of a package is named (its __init__ aside)."""
    rows = _layout_rows()
    tplib = ROOT / "tplib"
    present = {
        f"tplib/{p.name}/" if p.is_dir() else f"tplib/{p.name}"
        for p in tplib.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))
    }
    assert set(rows) == present
    for path, text in rows.items():
        if path.endswith("/"):
            named = set(re.findall(r"`(\w+)\.py`", text))
            modules = {p.stem for p in (ROOT / path).glob("*.py") if p.stem != "__init__"}
            assert named == modules, path


def test_readme_layout_search_table_matches_the_committed_results() -> None:
    csv = pd.read_csv(ROOT / "results/layout_search/layout_search-simulate.csv")
    csv = csv.set_index("setting")
    rows = re.findall(
        r"^\| \((\d+)\) \| (\S+) \| (\d+) x (\d+) x (\d+) \| ([\d.]+) \| ([\d.]+) \| "
        r"(\d+) x (\d+) x (\d+)( \+recompute)? \| ([\d.]+) \| ([\d.]+) \|$",
        (ROOT / "README.md").read_text(),
        flags=re.MULTILINE,
    )
    assert len(rows) == len(csv) == 10
    for setting, model, d, k, op, measured, theirs, bd, bk, bop, rc, ours, gain in rows:
        r = csv.loc[int(setting)]
        assert model == r.model
        assert r.paper_layout == f"#Data={d} x #Pipe={k} x #Op={op}"
        assert float(measured) == round(r.paper_latency_terapipe, 3)
        assert float(theirs) == round(r.latency_paper_layout, 3)
        assert (int(bd), int(bk), int(bop)) == (r.best_n_data, r.best_n_stages, r.best_n_op)
        assert bool(rc) == (r.best_recompute == "full")
        assert float(ours) == round(r.latency_best, 3)
        assert float(gain) == round(r.speedup_over_paper_layout, 2)
