"""The pipeline-systems table in simulate mode: each system's plan, schedule and
semantics, its rows against independently computed and committed numbers, the figure
and findings, and saving its extra tables."""

from __future__ import annotations

import io
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from tplib.cluster import ClusterCostModel
from tplib.paper import setting
from tplib.plan import Plan
from tplib.schedule import make_schedule
from tplib.sim.simulate import simulate
from tplib.tables import TIMING_COLUMNS, Rows, run_table
from tplib.tables.base import TableResult
from tplib.tables.pipeline_systems import TABLE, save_tables, simulated_systems
from tplib.tables.systems import MEASURED, SYSTEMS, delay, infeasible, system_plan
from tplib.tables.systems_figures import simulated_findings, systems_figure

ROOT = Path(__file__).resolve().parents[1]


def test_each_system_runs_its_plan() -> None:
    tera = Plan.uniform(2, 64, n_token_slices=4)
    plans = {name: system_plan(s, 4, 64, tera) for name, s in SYSTEMS.items()}
    assert plans["GPipe"] == plans["PipeDream-2BW"] == Plan((1,) * 4, ((64,),) * 4)
    assert plans["PipeDream"] == Plan((4,), ((64,),))  # the whole batch, one batch slice
    assert plans["TeraPipe+2BW"] is tera and plans["TeraPipe+1F1B"] is tera
    assert plans["TeraPipe+interleaved"] is tera and plans["TeraPipe+ZB-V"] is tera
    assert plans["Interleaved 1F1B"] == plans["ZB-V"] == plans["GPipe"]
    assert SYSTEMS["GPipe+recompute"].recompute == "full"
    assert {s.schedule: s.n_chunks for s in SYSTEMS.values()} == {
        "gpipe": 1,
        "pipedream": 1,
        "1f1b": 1,
        "2bw": 1,
        "terapipe": 1,
        "interleaved-1f1b": 2,
        "terapipe-interleaved": 2,
        "zbv": 2,
        "terapipe-zbv": 2,
    }


def test_delay_is_the_staleness_of_each_schedule() -> None:
    one, four = Plan.gpipe(1, 16), Plan.gpipe(4, 16)
    assert delay(make_schedule("1f1b", 4, four)) == 0
    assert delay(make_schedule("2bw", 2, four, n_iterations=3)) == 1  # W(t-1)
    # PipeDream on K = 4: stage 0 runs minibatch t on the weights after t - 3 updates.
    assert delay(make_schedule("pipedream", 4, one, n_iterations=8)) == 3


def test_virtual_stages_need_layers_to_cut_and_units_to_interleave() -> None:
    # Setting 9: one layer per stage cannot be cut into two chunks.
    why = infeasible(SYSTEMS["ZB-V"], 96, Plan.gpipe(2, 2048), layers_per_stage=1)
    assert why == "2 chunks per stage need layers per stage divisible by 2: a stage has 1"
    assert infeasible(SYSTEMS["ZB-V"], 48, Plan.gpipe(8, 2048), layers_per_stage=2) == ""
    # Interleaving walks the units in groups of K: 8 sequences are too few for 48 stages.
    why = infeasible(SYSTEMS["Interleaved 1F1B"], 48, Plan.gpipe(8, 2048), layers_per_stage=2)
    assert "needs >= 48 units per iteration" in why and "this plan has 8" in why
    sliced = Plan.uniform(8, 2048, n_token_slices=7)
    assert infeasible(SYSTEMS["TeraPipe+interleaved"], 48, sliced, layers_per_stage=2) == ""
    assert "ZB-V" not in MEASURED and "TeraPipe" in MEASURED  # measure mode: one chunk


def test_two_bw_without_enough_microbatches_cannot_run() -> None:
    # Two sequences on 96 stages (setting 9): 2BW needs 95 microbatches of one slice.
    why = infeasible(SYSTEMS["PipeDream-2BW"], 96, Plan.gpipe(2, 2048))
    assert "m >= 95 microbatches of 1 token slices" in why and "this batch has 2" in why
    assert infeasible(SYSTEMS["PipeDream-2BW"], 2, Plan.gpipe(2, 2048)) == ""
    assert infeasible(SYSTEMS["PipeDream-Flush"], 96, Plan.gpipe(2, 2048)) == ""


@pytest.fixture(scope="module")
def setting8() -> pd.DataFrame:
    return simulated_systems([8])


def _by_system(df: pd.DataFrame) -> dict[str, dict[Hashable, Any]]:
    return {str(r["system"]): r for r in df.to_dict("records")}


def test_rows_agree_with_the_main_results(setting8: pd.DataFrame) -> None:
    """GPipe and TeraPipe are the main results' two columns, computed there by another
    path (simulate_schedule, memory_per_gpu on the plan): the same numbers."""
    table = pd.read_csv(ROOT / "results/main_results/main_results-simulate.csv")
    main = table[table["setting"] == 8].to_dict("records")[0]
    rows = _by_system(setting8)
    gpipe, tera = rows["GPipe"], rows["TeraPipe"]
    assert gpipe["tflops_per_gpu"] == pytest.approx(main["tflops_gpipe"], rel=1e-9)
    assert tera["tflops_per_gpu"] == pytest.approx(main["tflops_per_gpu"], rel=1e-9)
    assert tera["plan"] == main["plan"]
    assert tera["memory_gib"] == pytest.approx(main["memory_gib"], rel=1e-9)
    assert tera["bubble"] == pytest.approx(main["bubble_terapipe"], rel=1e-9)
    # The paper's TFLOPS beside its two systems only.
    assert setting8["paper_tflops_per_gpu"].notna().sum() == 2


def test_rows_of_setting_8(setting8: pd.DataFrame) -> None:
    rows = _by_system(setting8)
    assert list(rows) == list(SYSTEMS)
    assert rows["GPipe"]["speedup_vs_gpipe"] == 1.0
    # K = 48 stages: PipeDream holds 48 versions on stage 0 and lags 47 updates there.
    pipedream = rows["PipeDream"]
    assert (pipedream["weight_versions"], pipedream["delay"]) == (48, 47)
    assert pipedream["fits_16gb"] is False and pipedream["memory_stage"] == 0
    assert pipedream["bubble"] < 0.05
    # Eight sequences are too few microbatches for 2BW on 48 stages; their token slices
    # are not.
    assert rows["PipeDream-2BW"]["feasible"] is False
    assert "m >= 47" in rows["PipeDream-2BW"]["note"]
    two, one = rows["TeraPipe+2BW"], rows["TeraPipe+1F1B"]
    assert two["feasible"] and (two["weight_versions"], two["delay"]) == (2, 1)
    assert two["throughput"] > one["throughput"] and two["bubble"] < one["bubble"]
    # Virtual stages, two chunks of one layer each: on 48 single-node stages every chunk
    # doubles the messages between nodes, and ZB-V cannot fill 48 stages with 8 units.
    assert rows["Interleaved 1F1B"]["feasible"] is False
    for name in ("ZB-V", "TeraPipe+ZB-V", "TeraPipe+interleaved"):
        row = rows[name]
        assert row["feasible"] and row["n_chunks"] == 2
        assert (row["weight_versions"], row["delay"]) == (1, 0)
    assert rows["TeraPipe+ZB-V"]["throughput"] > rows["ZB-V"]["throughput"]
    # Recomputation: less memory, slower.
    gp, rc = rows["GPipe"], rows["GPipe+recompute"]
    assert rc["memory_gib"] < gp["memory_gib"] and rc["throughput"] < gp["throughput"]
    for name in ("GPipe", "PipeDream-Flush", "TeraPipe", "TeraPipe+1F1B"):
        assert (rows[name]["weight_versions"], rows[name]["delay"]) == (1, 0)
    # Sequences per second count all #Data replicas: B = 8 here, one pipeline.
    assert gp["throughput"] * gp["iteration_time"] == pytest.approx(8)


def test_chunked_rows_simulate_their_schedules(setting8: pd.DataFrame) -> None:
    """A V-shape row is zbv with two chunks on the cluster model of setting 8, flushed
    every iteration: its time is the schedule's simulated latency."""
    s = setting(8)
    zbv = simulate(make_schedule("zbv", 48, s.gpipe_plan()), ClusterCostModel.for_setting(s))
    assert zbv.n_chunks == 2
    row = _by_system(setting8)["ZB-V"]
    assert row["iteration_time"] == pytest.approx(zbv.latency, rel=1e-12)
    assert row["bubble"] == pytest.approx(zbv.bubble_fraction, rel=1e-9)


def test_setting_8_equals_the_committed_table(setting8: pd.DataFrame) -> None:
    committed = pd.read_csv(ROOT / "results/pipeline_systems/pipeline_systems-simulate.csv")
    committed = committed[committed["setting"] == 8].reset_index(drop=True)
    buf = io.StringIO()
    setting8.to_csv(buf, index=False)
    buf.seek(0)
    ours = pd.read_csv(buf)
    assert list(ours.columns) == list(committed.columns)
    cols = [c for c in committed.columns if c not in TIMING_COLUMNS]
    pd.testing.assert_frame_equal(ours[cols], committed[cols], check_exact=True)


def test_findings_and_figure(setting8: pd.DataFrame) -> None:
    text = simulated_findings(setting8)
    assert text.startswith("- (8) GPT3-44B: fastest within 16 GB: TeraPipe+2BW")
    assert "over 16 GB: PipeDream" in text and "cannot run: PipeDream-2BW (2BW needs" in text
    fig = systems_figure(setting8)
    hatched = [p for p in fig.axes[0].patches if p.get_hatch()]
    assert len(hatched) == 1  # PipeDream alone is over 16 GB
    plt.close(fig)


def test_unknown_systems_and_parameters_fail_first() -> None:
    with pytest.raises(ValueError, match=r"unknown systems \['Megatron'\]"):
        simulated_systems([8], ["Megatron"])
    with pytest.raises(ValueError, match="has no parameter settngs"):
        run_table("pipeline_systems", "simulate", settngs=[8])


def test_save_tables_writes_the_extras(tmp_path: Path) -> None:
    df = pd.DataFrame({"system": ["GPipe"], "throughput": [1.0]})
    loss = pd.DataFrame({"system": ["GPipe"], "step": [0], "loss": [5.5]})
    fig = plt.figure()
    result = TableResult(TABLE, "measure", {}, Rows(df, {"loss": loss}), fig, "")
    paths = save_tables(result, tmp_path, "t")
    assert [p.name for p in paths] == [
        "pipeline_systems-t.csv",
        "pipeline_systems-t.png",
        "pipeline_systems-t-loss.csv",
    ]
    assert pd.read_csv(tmp_path / "pipeline_systems-t-loss.csv").equals(loss)
    plt.close(fig)
