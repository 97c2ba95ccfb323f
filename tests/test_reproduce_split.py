"""Splitting a table's job into one job per configuration, and gathering the table back:
which tables split over what, and that the gathered CSV is byte for byte the one a
single job writes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from tplib.reproduce import Job, default_jobs
from tplib.reproduce.split import PARTS_DIR, describe, gather, split_job
from tplib.util.files import write_csv

ROOT = Path(__file__).resolve().parents[1]


def test_each_table_splits_over_the_configurations_the_paper_names() -> None:
    parts = {job.name: split_job(job) for job in default_jobs("all", root="/r")}
    main = parts["main_results-simulate"]
    assert [p.params for p in main] == [{"settings": [n]} for n in range(1, 11)]
    assert [p.name for p in main[:2]] == ["main_results-simulate-s1", "main_results-simulate-s2"]
    assert main[0].out_dir == Path("/r") / PARTS_DIR / "main_results"
    assert [p.params["settings"] for p in parts["dp_ablation-simulate"]] == [[8], [9]]
    assert [p.tag for p in parts["seqlen_sweep-simulate"]] == [
        "simulate-L2048",
        "simulate-L4096",
        "simulate-L6144",
        "simulate-L8192",
    ]
    assert (
        len(parts["pipeline_systems-simulate"]) == 4 and len(parts["layout_search-simulate"]) == 10
    )
    # Table 4 on this machine: each L with its own batch.
    assert [p.params for p in parts["seqlen_sweep-measure"]] == [
        {"seq_lens": [512], "batches": [8]},
        {"seq_lens": [1024], "batches": [4]},
        {"seq_lens": [2048], "batches": [2]},
        {"seq_lens": [4096], "batches": [1]},
    ]
    # No configurations (an empty settings list, or none taken): one job, the table's own.
    for name in (
        "main_results-measure",
        "dp_ablation-measure",
        "simulator_validation-measure",
        "pipeline_systems-measure",
    ):
        whole = next(j for j in default_jobs("all", root="/r") if j.name == name)
        assert parts[name] == [whole], name


def test_given_parameters_are_kept_and_given_configurations_split() -> None:
    job = Job("dp_ablation", "measure", {"settings": [9, 8], "plan": "paper"}, "/r")
    parts = split_job(job)
    assert [p.params for p in parts] == [
        {"settings": [9], "plan": "paper"},
        {"settings": [8], "plan": "paper"},
    ]
    assert describe(parts[0]) == "dp_ablation (measure) settings=[9]"
    # A batch list not one per L is passed whole: the table says what is wrong with it.
    odd = split_job(Job("seqlen_sweep", "measure", {"seq_lens": [512, 1024]}, "/r"))
    assert [p.params for p in odd] == [{"seq_lens": [512]}, {"seq_lens": [1024]}]


def test_a_configuration_named_twice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"settings=\[9, 8, 9\] names \[9\] more than once"):
        split_job(Job("main_results", "simulate", {"settings": [9, 8, 9]}))


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("main_results", "setting"),
        ("dp_ablation", "setting"),
        ("seqlen_sweep", "seq_len"),
        ("pipeline_systems", "setting"),
        ("layout_search", "setting"),
    ],
)
def test_gathered_csv_is_the_committed_single_job_csv(table: str, key: str, tmp_path: Path) -> None:
    """Each configuration's rows written as its job writes them, then gathered: the bytes
    of the committed CSV (written by one job), and the table's figure redrawn."""
    committed = ROOT / "results" / table / f"{table}-simulate.csv"
    whole = pd.read_csv(committed)
    values = list(dict.fromkeys(whole[key]))
    param = "seq_lens" if key == "seq_len" else "settings"
    job = Job(table, "simulate", {param: values}, str(tmp_path))
    parts = split_job(job)
    assert [p.params[param] for p in parts] == [[v] for v in values]
    for part, value in zip(parts, values, strict=True):
        write_csv(whole[whole[key] == value], part.csv)
    gather(job, parts)
    assert job.csv.read_bytes() == committed.read_bytes()
    assert job.figure.read_bytes().startswith(b"\x89PNG")
