"""The pipeline systems on real local processes (tiny model, 2 stages): the measured
steady state beside the simulator, the weight versions the runtime held against the
schedule's count, the loss on the stdlib corpus, and the notebook under papermill."""

from __future__ import annotations

import math
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from tests.unit_costs import ConstantCosts
from tplib.measure import Profiling
from tplib.plan import Plan
from tplib.reproduce import notebooks_dir
from tplib.schedule import Action, Kind
from tplib.sim.throughput import steady_window
from tplib.tables import run_table
from tplib.tables.systems_measure import RecomputeCosts, measured_systems, statistical_efficiency

pytestmark = pytest.mark.filterwarnings("ignore:.*cores were busy with other work")

LINK = (1e9, 1e-4)  # bytes/s, s: given, so no ping-pong is measured
SMALL = {
    "model": "tiny",
    "n_stages": 2,
    "batch": 2,
    "seq_len": 32,
    "n_slices": 2,
    "iters": 2,
    "warmup": 1,
    "profiling": Profiling(granularity=8, rounds=1),
    "link": LINK,
    "progress": False,
}


def test_recompute_costs_run_the_forward_again_in_the_backward() -> None:
    costs = RecomputeCosts(ConstantCosts(t_f=1.0, t_b=2.0, t_send=0.5))
    plan = Plan.gpipe(1, 8)
    assert costs.compute(0, Action(Kind.F, 0, 0, 0), plan) == 1.0
    assert costs.compute(0, Action(Kind.B, 0, 0, 0), plan) == 3.0
    assert costs.transfer(0, Action(Kind.SA, 0, 0, 0), plan) == 0.5


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[Hashable, Any]]:
    systems = ("GPipe", "GPipe+recompute", "PipeDream", "PipeDream-2BW", "TeraPipe+2BW")
    df = measured_systems(systems, **SMALL)  # type: ignore[arg-type]
    return {str(r["system"]): r for r in df.to_dict("records")}


def test_measured_systems(measured: dict[str, dict[Hashable, Any]]) -> None:
    rows = list(measured.values())
    assert all(r["feasible"] and r["iteration_time"] > 0 for r in rows)
    assert all(math.isfinite(r["err_simulated_iteration_time"]) for r in rows)
    # The runtime held what the schedule says: PipeDream's stage 0 two versions on two
    # stages, 2BW two everywhere, GPipe one.
    assert [r["weight_versions"] for r in rows] == [1, 1, 2, 2, 2]
    assert all(r["weight_versions"] == r["schedule_weight_versions"] for r in rows)
    assert [r["delay"] for r in rows] == [0, 0, 1, 1, 1]
    # An asynchronous system ran as many iterations as its steady-state window needs.
    n, _, _ = steady_window(2, Plan((2,), ((32,),)), window=2)
    assert measured["PipeDream"]["iterations"] == n
    assert measured["GPipe"]["iterations"] == 2
    assert measured["PipeDream"]["plan"] == "[(2, [32])]"
    assert measured["TeraPipe+2BW"]["plan"] == "[(1, [16] * 2)] * 2"
    # Recomputation keeps less for the backward.
    assert measured["GPipe+recompute"]["peak_memory_mib"] < measured["GPipe"]["peak_memory_mib"]


def test_statistical_efficiency_on_the_stdlib_corpus() -> None:
    df = statistical_efficiency(
        40,
        systems=("PipeDream-Flush", "PipeDream-2BW"),
        batch=4,
        seq_len=32,
        lr=3e-3,
        smooth=5,
        progress=False,
    )
    assert list(df.groupby("system").size()) == [40, 40]
    first = {str(r["system"]): float(r["loss"]) for r in df[df["step"] == 0].to_dict("records")}
    # A fresh model predicts about uniformly over 256 bytes: ln 256 = 5.55.
    assert first["PipeDream-Flush"] == pytest.approx(math.log(256), abs=0.3)
    # Step 0 runs version 0 on the same batch in both: the same loss.
    assert first["PipeDream-2BW"] == pytest.approx(first["PipeDream-Flush"], rel=1e-5)
    for name, g in df.groupby("system"):
        last = float(g["loss_smoothed"].to_numpy()[-1])
        assert last < first[str(name)] - 0.5  # it learns the text
    assert set(df["delay"]) == {0, 1}


def test_measure_mode_through_the_notebook(tmp_path: Path) -> None:
    import papermill as pm

    params = {
        **{k: v for k, v in SMALL.items() if k not in ("profiling", "progress")},
        "link": list(LINK),
        "profiling": {"granularity": 8, "rounds": 1},
        "systems": ["GPipe", "PipeDream-Flush", "PipeDream-2BW"],
        "efficiency_steps": 6,
        "efficiency": {"batch": 2, "seq_len": 32},
    }
    pm.execute_notebook(
        str(notebooks_dir() / "pipeline_systems.ipynb"),
        str(tmp_path / "executed.ipynb"),
        parameters={"mode": "measure", "params": params, "out_dir": str(tmp_path), "tag": "t"},
        kernel_name="python3",
        cwd=str(notebooks_dir()),
        progress_bar=False,
    )
    df = pd.read_csv(tmp_path / "pipeline_systems-t.csv")
    assert list(df["system"]) == ["GPipe", "PipeDream-Flush", "PipeDream-2BW"]
    assert (df["throughput"] > 0).all()
    # The efficiency runs train the default three systems; GPipe is not one of them.
    assert list(df["final_loss"].notna()) == [False, True, True]
    loss = pd.read_csv(tmp_path / "pipeline_systems-t-loss.csv")
    assert list(loss.groupby("system", sort=False).size().index) == [
        "PipeDream-Flush",
        "PipeDream-2BW",
        "PipeDream",
    ]
    assert len(loss) == 3 * 6
    assert (tmp_path / "pipeline_systems-t.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_measure_parameters_fail_before_running() -> None:
    with pytest.raises(ValueError, match="has no parameter setings"):
        run_table("pipeline_systems", "measure", setings=[8])
    with pytest.raises(ValueError, match=r"unknown systems \['GPipe2'\]"):
        measured_systems(["GPipe2"], **SMALL)  # type: ignore[arg-type]
    plt.close("all")
