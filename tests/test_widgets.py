"""Tests for tplib.widgets: scenarios, explore(), the figure, the explorer widget and the
explore notebook run headless under papermill (about 20 s in all, most of it the kernel)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import numpy as np
import pytest
from matplotlib.figure import Figure

from tplib.config import get_config
from tplib.paper import setting
from tplib.perfmodel import Profile, build_profile
from tplib.planner import pipeline_latency
from tplib.reproduce import notebooks_dir
from tplib.widgets import (
    CLUSTER,
    Exploration,
    Scenario,
    build_explorer,
    explore,
    figure,
    make_scenario,
    scenario_for_profile,
    scenario_for_setting,
)

SMALL = 7  # GPT3-44B on 24 stages, 4 sequences per pipeline: plans in well under a second


@pytest.fixture(scope="module")
def small() -> Exploration:
    return explore(scenario_for_setting(SMALL))


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic profile of one "tiny" layer: an analytic t(b, l, c) whose attention
    term grows with the context, so slicing has something to trade off."""

    def measure(b: int, length: int, context: int) -> float:
        return 1e-3 * (0.3 + b * length * (1 + (context + length) / 32) / 64)

    prof = build_profile(measure, config=get_config("tiny"), n_layers=1, seq_len=64,
                         granularity=8, batch_sizes=(1, 2))  # fmt: skip
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    prof.save(path)
    return path


# ---- Scenario ----------------------------------------------------------------------------

BASE = {"model": "GPT3-1B", "seq_len": 2048, "batch": 4, "n_stages": 24}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"batch": 0}, r"Scenario\.batch=0"),
        ({"batch": True}, r"Scenario\.batch=True"),
        ({"n_stages": 2.0}, r"Scenario\.n_stages=2\.0"),
        ({"seq_len": 2044}, r"seq_len=2044 is not a multiple of granularity=8"),
        ({"model": "GPT3-2B"}, r"Scenario\.model='GPT3-2B' is unknown"),
        ({"n_stages": 5}, r"n_stages=5 does not divide GPT3-1B's 24 layers"),
        ({"n_op": 3}, r"n_op=3 must divide"),
        ({"method": "greedy"}, r"method='greedy'"),
        ({"eps": -1e-3}, r"eps=-0\.001"),
        ({"eps": float("nan")}, r"eps=nan"),
        ({"cost": "  "}, r"Scenario\.cost"),
        ({"cost": "p.json", "n_op": 8}, r"n_op=8, n_data=1 with a profile"),
    ],
)
def test_scenario_rejects_bad_values(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Scenario(**{**BASE, **changes})


def test_scenario_for_setting_follows_table1() -> None:
    sc = scenario_for_setting(9)
    s = setting(9)
    assert (sc.model, sc.seq_len, sc.batch) == (s.model, s.seq_len, s.pipeline_batch)
    assert (sc.n_stages, sc.n_op, sc.n_data, sc.cost) == (s.n_stages, s.n_op, s.n_data, CLUSTER)
    long = scenario_for_setting(5, 8192, eps=0.0)
    assert (long.seq_len, long.batch, long.eps) == (8192, 2, 0.0)
    # The notebook's parameters: a Table-4 length takes the variant, any other overrides L.
    assert make_scenario(5, seq_len=8192) == scenario_for_setting(5, 8192)
    assert make_scenario(9, seq_len=1024).seq_len == 1024
    assert make_scenario(None, **BASE) == Scenario(**BASE)


# ---- explore -----------------------------------------------------------------------------


def test_explore_plans_the_setting(small: Exploration) -> None:
    sc = small.scenario
    small.plan.check_covers(sc.batch, sc.seq_len)
    assert list(small.uniform["n_slices"]) == [2**e for e in range(9)]  # 1 .. L/g = 256
    assert small.gpipe_predicted == small.uniform["predicted"].iloc[0]  # GPipe = 1 slice
    # The summary's speedups are what its latencies say.
    table = small.summary()
    assert len(table) == 3
    dp = table.iloc[0]
    assert dp["speedup_simulated"] == pytest.approx(small.gpipe.latency / small.sim.latency)
    assert "DP plan: [(" in small.describe()


def test_dp_beats_every_uniform_slicing_under_the_planners_cost(small: Exploration) -> None:
    # "exact" minimises the fill-drain latency sum t + (K-1) max t itself (Plan.latency is
    # that number), over a space holding every uniform slicing of one-sequence batch
    # slices, to within (K-1) eps: the eps-window around a slicing's t_max.
    sc = small.scenario
    assert small.objective == pytest.approx(small.predicted, rel=1e-12)
    tol = (sc.n_stages - 1) * sc.eps + 1e-12
    assert (small.predicted <= small.uniform["predicted"] + tol).all()
    assert small.predicted < small.gpipe_predicted


def test_paper_method_objective_bounds_its_fill_drain_latency() -> None:
    # §3.4 sums T_b over batch slices, counting the fill term once per batch slice: it is
    # an upper bound of the plan's real fill-drain latency, not that latency.
    ex = explore(scenario_for_setting(SMALL, method="paper"))
    assert ex.objective >= ex.predicted - 1e-12
    assert "paper objective" in ex.describe()


def test_timeline_has_every_unit_on_every_stage(small: Exploration) -> None:
    df, sc, p = small.sim.timeline, small.scenario, small.plan
    assert sorted(df["stage"].unique()) == list(range(sc.n_stages))
    for _, part in df.groupby("stage"):
        kinds = part["kind"].value_counts()
        assert kinds["F"] == kinds["B"] == p.n_units
        assert kinds["AR"] == kinds["OPT"] == 1
    assert small.sim.latency == pytest.approx(df["end"].max())


def test_memory_on_the_cluster_model(small: Exploration) -> None:
    assert small.memory is not None and small.gpipe_memory is not None
    # Token slicing keeps fewer attention scores than whole sequences: (L^2 + sum s^2) / 2.
    assert small.memory.activations < small.gpipe_memory.activations


def test_figure_has_the_three_panels(small: Exploration) -> None:
    fig = figure(small)
    assert isinstance(fig, Figure)
    titles = [ax.get_title() for ax in fig.axes]
    assert [t[:3] for t in titles] == ["(a)", "(b)", "(c)"]


def test_explore_with_a_profile(profile_path: Path) -> None:
    sc = scenario_for_profile(profile_path, batch=4)
    assert (sc.model, sc.seq_len, sc.n_stages, sc.granularity) == ("tiny", 64, 4, 8)
    ex = explore(sc)
    ex.plan.check_covers(4, 64)
    assert max(ex.plan.batch_slices) <= 2  # the largest profiled batch slice
    prof = Profile.load(profile_path)
    assert ex.predicted == pytest.approx(pipeline_latency(ex.plan, prof, sc.n_stages))
    assert (ex.predicted <= ex.uniform["predicted"] + (sc.n_stages - 1) * sc.eps).all()
    # A profile prices slices only, so the simulation is the fill-drain of those times.
    assert ex.sim.latency == pytest.approx(ex.predicted, rel=1e-9)
    assert ex.gpipe.latency == pytest.approx(ex.gpipe_predicted, rel=1e-9)
    assert ex.memory is None and np.isnan(ex.summary()["memory_gib"]).all()
    figure(ex)


def test_explore_checks_the_profile(profile_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="measured on model 'tiny'"):
        explore(Scenario("mini", 64, 1, 4, cost=str(profile_path)))
    with pytest.raises(ValueError, match="off profile"):
        explore(Scenario("tiny", 64, 1, 4, cost=str(profile_path), granularity=4))
    with pytest.raises(ValueError, match="does not exist"):
        explore(Scenario("tiny", 64, 1, 4, cost=str(tmp_path / "missing.json")))


# ---- the widget ----------------------------------------------------------------------------


def test_explorer_recomputes_on_change(profile_path: Path) -> None:
    ex = build_explorer(SMALL, show_figure=False)
    c = ex.controls
    assert ex.runs == 1 and ex.error is None
    assert ex.exploration.scenario == scenario_for_setting(SMALL)
    shown = ex.output.outputs  # the plan's text, then the DP / uniform / GPipe table
    assert "DP plan: [(" in shown[0]["text"] and "GPipe" in shown[1]["data"]["text/html"]
    assert ex.setting.value == (SMALL, 2048)

    c["n_stages"].value = 48  # a hand edit: recompute, and the setting becomes "custom"
    assert ex.runs == 2 and ex.exploration.scenario.n_stages == 48
    assert ex.setting.value is None

    c["n_stages"].value = 5  # an invalid layout: shown as an error, nothing raised
    assert ex.runs == 3 and ex.exploration is None and "n_stages=5" in ex.error
    assert ex.output.outputs[0]["text"].startswith("cannot plan this")

    ex.setting.value = (10, 2048)  # a paper setting fills in every field, recomputes once
    assert ex.runs == 4 and ex.error is None
    assert ex.exploration.scenario == scenario_for_setting(10)
    assert (c["model"].value, c["n_stages"].value, c["n_op"].value) == ("GPT3-175B", 48, 8)

    c["source"].value = "profile file"
    c["profile"].value = str(profile_path)  # the profile's model and grid are adopted
    assert ex.error is None, ex.error
    sc = ex.exploration.scenario
    assert (sc.model, sc.cost, sc.n_op, sc.n_data, sc.seq_len) == (
        "tiny",
        str(profile_path),
        1,
        1,
        64,
    )
    assert c["n_op"].disabled


# ---- the notebook --------------------------------------------------------------------------


def test_notebook_runs_headless(profile_path: Path, tmp_path: Path) -> None:
    # On the small profile: the cluster model's path is tested above, and the kernel's
    # start and imports already take most of the ~15 s.
    import papermill as pm

    out = tmp_path / "explore.ipynb"
    pm.execute_notebook(
        str(notebooks_dir() / "explore.ipynb"), str(out), kernel_name="python3",
        parameters={"setting": None, "cost_source": "profile", "profile": str(profile_path),
                    "custom": {"batch": 2}},
        cwd=str(notebooks_dir()), progress_bar=False,
        start_timeout=120, execution_timeout=300,  # fail, not hang, if the kernel is stuck
    )  # fmt: skip
    nb = nbformat.read(out, as_version=4)
    text = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "DP plan: [(" in text and "cost: profile" in text
    kinds = {k for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             for k in o.get("data", {})}  # fmt: skip
    assert {"image/png", "application/vnd.jupyter.widget-view+json"} <= kinds
