"""Every table notebook executes under papermill with small parameters and writes its
table and figure; a broken notebook fails here."""

from __future__ import annotations

import pandas as pd
import pytest

from tplib.reproduce import Job, default_jobs, run_job

SMALL = {
    "main_results": {"settings": [9, 10]},
    "dp_ablation": {"settings": [9]},
    "seqlen_sweep": {"seq_lens": [2048, 8192]},
}


@pytest.mark.parametrize("notebook", sorted(SMALL))
def test_notebook_runs_and_writes_results(tmp_path, notebook: str) -> None:
    job = Job(notebook, "test", {"mode": "simulate", **SMALL[notebook]},
              (f"{notebook}-test.csv", f"{notebook}-test.png"), str(tmp_path))  # fmt: skip
    assert run_job(job)
    assert job.done()
    df = pd.read_csv(job.out_dir / f"{notebook}-test.csv")
    assert len(df) > 0
    if notebook == "main_results":
        assert {"setting", "speedup", "paper_speedup"} <= set(df.columns)
    assert not list(job.out_dir.glob(".*")), "no temporary files are left behind"
    assert not run_job(job), "existing results are skipped"


def test_default_jobs_cover_the_three_tables() -> None:
    names = {j.notebook for j in default_jobs("all")}
    assert names == {*SMALL, "simulator_validation"}
    with pytest.raises(ValueError, match=r"mode='fast'"):
        default_jobs("fast")
