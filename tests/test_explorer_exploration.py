"""Tests for tplib.explorer.exploration: a paper setting and a profile, planned and set beside
the uniform slicings and GPipe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.explorer_cases import SMALL
from tplib.explorer.exploration import Exploration, explore
from tplib.explorer.scenario import Scenario, scenario_for_profile, scenario_for_setting
from tplib.nn.configs import get_config
from tplib.perfmodel import Profile
from tplib.plan import Plan
from tplib.planner import FlopModel, equal_flop_slices, pipeline_latency


@pytest.fixture(scope="module")
def small() -> Exploration:
    return explore(scenario_for_setting(SMALL))


def test_explore_plans_the_setting(small: Exploration) -> None:
    sc = small.scenario
    small.plan.check_covers(4, 2048)  # setting (7): 4 sequences of 2048 tokens per pipeline
    assert list(small.uniform["n_slices"]) == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # .. L/g
    assert small.gpipe_predicted == small.uniform["predicted"].iloc[0]  # GPipe = 1 slice
    assert small.sim is not None and small.gpipe is not None
    table = small.summary()
    dp, seq, best, gpipe = table.index
    assert (dp, gpipe) == ("DP (TeraPipe)", "GPipe (w/o TeraPipe)")
    assert small.seq1f1b is not None
    assert seq == f"Seq1F1B (equal FLOPs, #slices={small.seq1f1b.n_token_slices(0)})"
    assert best == f"best uniform (#slices={small.best_uniform['n_slices']})"
    assert table["simulated_s"][dp] == small.sim.latency
    assert table["predicted_s"][dp] == small.predicted
    # Speedups are over GPipe: 1 for GPipe itself, above 1 for the DP.
    assert table["speedup_simulated"][gpipe] == table["speedup_predicted"][gpipe] == 1
    assert table["speedup_simulated"][dp] > 1 and table["speedup_predicted"][dp] > 1
    text = small.describe()
    assert "DP plan: [(" in text and f"K={sc.n_stages}" in text


def test_dp_beats_every_uniform_slicing_under_the_planners_cost(small: Exploration) -> None:
    # "exact" minimises the fill-drain latency sum t + (K-1) max t itself (Plan.latency is
    # that number), over a space holding every uniform slicing of one-sequence batch
    # slices, to within (K-1) eps: the eps-window around a slicing's t_max.
    sc = small.scenario
    assert small.objective == pytest.approx(small.predicted, rel=1e-12)
    tol = (sc.n_stages - 1) * sc.eps + 1e-12
    assert (small.predicted <= small.uniform["predicted"] + tol).all()
    assert small.predicted < small.gpipe_predicted
    assert small.best_uniform["predicted"] == small.uniform["predicted"].min()


def test_seq1f1b_beside_the_dp_and_the_uniform_slicings(small: Exploration) -> None:
    sc, seq = small.scenario, small.seq1f1b
    assert seq is not None and small.seq1f1b_sim is not None
    # The DP's search holds Seq1F1B's slicing; Seq1F1B's best #slices beats the table's.
    assert small.predicted <= small.seq1f1b_predicted + (sc.n_stages - 1) * sc.eps + 1e-12
    assert small.seq1f1b_predicted <= small.uniform["seq1f1b_predicted"].min() + 1e-12
    row = small.uniform.iloc[3]
    flops = FlopModel.of(get_config(sc.model))
    expected = equal_flop_slices(flops, sc.seq_len, int(row["n_slices"]), sc.granularity)
    assert Plan.from_paper(row["seq1f1b_plan"]).token_slices == (expected,) * 4
    assert "Seq1F1B (equal-FLOP slices)" in small.describe()


def test_paper_method_objective_bounds_its_fill_drain_latency() -> None:
    # §3.4 sums T_b over batch slices, counting the fill term once per batch slice: it is
    # an upper bound of the plan's real fill-drain latency, not that latency.
    ex = explore(scenario_for_setting(SMALL, method="paper"))
    assert ex.objective >= ex.predicted - 1e-12
    assert "paper objective" in ex.describe()


def test_timeline_has_every_unit_on_every_stage(small: Exploration) -> None:
    assert small.sim is not None
    df, p = small.sim.timeline, small.plan
    assert sorted(df["stage"].unique()) == list(range(24))
    for _, part in df.groupby("stage"):
        kinds = part["kind"].value_counts()
        assert kinds["F"] == kinds["B"] == p.n_units
        assert kinds["AR"] == kinds["OPT"] == 1  # the update is part of the schedule
    assert small.sim.latency == pytest.approx(df["end"].max())


def test_memory_on_the_cluster_model(small: Exploration) -> None:
    assert small.memory is not None and small.gpipe_memory is not None
    # Token slicing keeps fewer attention scores than whole sequences: (L^2 + sum s^2) / 2.
    assert small.memory.activations < small.gpipe_memory.activations
    assert "memory per GPU, DP plan" in small.describe()


def test_explore_with_a_profile(profile_path: Path) -> None:
    sc = scenario_for_profile(profile_path, pipeline_batch=4)
    ex = explore(sc)
    ex.plan.check_covers(4, 64)
    assert max(ex.plan.batch_slices) <= 2  # the largest profiled batch slice
    assert list(ex.uniform["n_slices"]) == [1, 2, 4, 8]  # L/g = 8
    prof = Profile.load(profile_path)
    assert ex.predicted == pytest.approx(pipeline_latency(ex.plan, prof, sc.n_stages))
    assert (ex.predicted <= ex.uniform["predicted"] + (sc.n_stages - 1) * sc.eps).all()
    # A profile prices slices only, so the simulation is the fill-drain of those times.
    assert ex.sim is not None and ex.gpipe is not None
    assert ex.sim.latency == pytest.approx(ex.predicted, rel=1e-9)
    assert ex.gpipe.latency == pytest.approx(ex.gpipe_predicted, rel=1e-9)
    assert ex.memory is None and np.isnan(ex.summary()["memory_gib"]).all()
    assert any("prices slices only" in n for n in ex.notes)


def test_explore_reports_the_profile_mismatch(profile_path: Path) -> None:
    with pytest.raises(ValueError, match="measured on model 'tiny'"):
        explore(Scenario("mini", 64, 1, 4, cost=str(profile_path)))
