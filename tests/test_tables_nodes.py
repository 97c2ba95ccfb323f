"""Measure mode on GPU nodes, exercised on this machine: runs are started by a launch
command through torchrun (gloo on CPU), their result files read back, and a Table-1 row
built from them beside the paper's values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tplib.tables.nodes as nodes
from tplib.paper import GPIPE, TERAPIPE, PaperResult, ablation_rows, main_row
from tplib.runs.settings import Launch, run_on_nodes, setting_run
from tplib.runtime import Data, Parallelism, RunConfig, Timing, save_run_config, train_reference
from tplib.runtime.torchrun import load_result
from tplib.tables import run_table
from tplib.tables.nodes import run_settings

TINY = RunConfig(
    model="tiny",
    schedule_name="terapipe",
    parallelism=Parallelism(n_stages=2),
    data=Data(batch=2, seq_len=16),
    slicing=4,
    timing=Timing(steps=3),
)


def test_a_run_started_by_the_local_launcher_trains_exactly(tmp_path: Path) -> None:
    result = run_on_nodes(TINY, Launch("local", workdir=str(tmp_path)), "tiny")
    assert (tmp_path / "tiny.json").exists() and (tmp_path / "tiny.pt").exists()
    assert result.config == TINY
    assert len(result.ranks) == 2 and len(result.iteration_s) == 3
    ref = train_reference(TINY)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses))


def test_a_failing_launch_reports_its_output(tmp_path: Path) -> None:
    launch = Launch(command="echo starting {config} {out}; exit 3", workdir=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"(?s)failed \(exit 3\).*starting"):
        run_on_nodes(TINY, launch, "broken")


def test_setting_rows_come_from_the_runs_results(tmp_path: Path) -> None:
    # A stand-in for the nodes: every launch trains the tiny run (setting (9) needs 384
    # GPUs), so the row must carry exactly those results' latencies.
    stand_in = tmp_path / "stand_in.json"
    save_run_config(TINY, stand_in)
    command = (
        "{python} -m torch.distributed.run --standalone --nproc-per-node 2 "
        f"-m tplib.runtime.torchrun --config {stand_in} --out {{out}}  # for {{config}}"
    )
    df = run_settings([9], {"command": command, "workdir": str(tmp_path)}, steps=3)
    gpipe = load_result(tmp_path / "setting9-gpipe.pt")
    tera = load_result(tmp_path / "setting9-terapipe.pt")
    (row,) = df.to_dict("records")
    assert row["latency_gpipe"] == gpipe.median_latency_s
    assert row["latency_terapipe"] == tera.median_latency_s
    assert row["speedup"] == pytest.approx(gpipe.median_latency_s / tera.median_latency_s)
    assert row["paper_latency_gpipe"] == main_row(9, GPIPE).latency
    assert row["paper_latency_terapipe"] == main_row(9, TERAPIPE).latency
    assert row["model"] == "GPT3-175B" and row["n_op"] == 4
    # The configs it wrote are setting (9)'s, as a cluster job would run them.
    written = setting_run(9, plan="gpipe", steps=3)
    assert (tmp_path / "setting9-gpipe.json").read_text().count('"n_op": 4') == 1
    assert written.parallelism.world_size == 384


def test_measure_mode_needs_settings_and_launch_together() -> None:
    with pytest.raises(ValueError, match=r"needs both the settings and how to launch them"):
        run_table("main_results", "measure", settings=[9])


def test_launch_rejects_bad_descriptions() -> None:
    with pytest.raises(ValueError, match=r"launcher='mpirun'"):
        Launch("mpirun")
    with pytest.raises(ValueError, match=r"must contain \{config\} and \{out\}"):
        Launch(command="torchrun train.py")


@pytest.mark.system  # run_table's measure mode launches the command below
def test_ablation_rows_come_from_the_runs_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two of setting (8)'s five rows, one slice and the DP's plan, are the two kinds of
    # row there are (the findings need the one-slice row); each more would only launch
    # torchrun again.
    def two_rows(n: int) -> list[PaperResult]:
        return [r for r in ablation_rows(n) if r.algorithm in ("#Slices=1", "DP")]

    monkeypatch.setattr(nodes, "ablation_rows", two_rows)
    stand_in = tmp_path / "stand_in.json"
    save_run_config(TINY, stand_in)
    command = (
        "{python} -m torch.distributed.run --standalone --nproc-per-node 2 "
        f"-m tplib.runtime.torchrun --config {stand_in} --out {{out}}  # for {{config}}"
    )
    result = run_table(
        "dp_ablation",
        "measure",
        settings=[8],
        launch={"command": command, "workdir": str(tmp_path)},
        iters=3,
    )
    df = result.df
    refs = two_rows(8)
    assert len(refs) == 2
    assert list(df.algorithm) == [r.algorithm for r in refs]
    assert list(df.paper_latency) == [r.latency for r in refs]
    for name, latency in zip(df.algorithm, df.latency, strict=True):
        tag = "setting8-" + name.replace("#Slices=", "slices")
        assert latency == load_result(tmp_path / f"{tag}.pt").median_latency_s
        written = (tmp_path / f"{tag}.json").read_text()
        assert '"n_op": 8' in written and '"schedule_name": "terapipe"' in written
    # The uniform row's config carries the paper's uniform plan for setting (8).
    assert '"slicing": "[(1, [2048])] * 8"' in (tmp_path / "setting8-slices1.json").read_text()
    assert sorted(df["rank"]) == sorted(df.latency.rank(method="min").astype(int))
