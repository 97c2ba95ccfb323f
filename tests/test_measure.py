"""Tests for tplib.measure: costs from measured profiles, stages sharing cores, and the
harness's rows; the measured tables run end to end on the tiny model, on real processes,
in well under a minute. The accuracy target itself (the simulator within 10% on the
"small" model) is a measurement, not a unit test: ``notebooks/simulator_validation.ipynb``."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from tests.unit_costs import ConstantCosts
from tplib.measure import (
    BYTES_PER_ACTIVATION,
    BottleneckCost,
    Measured,
    Profiling,
    context_parallel_costs,
    grid,
    local_costs,
    simulate_shared,
)
from tplib.measure.harness import measured_bench
from tplib.perfmodel import Profile, profile_pipeline, profile_stage
from tplib.plan import Plan
from tplib.reproduce import notebooks_dir
from tplib.runtime import (
    Data,
    LocalPool,
    Parallelism,
    RankResult,
    RunConfig,
    RunResult,
    measure_link,
)
from tplib.schedule import make_schedule
from tplib.sim.costs import Link
from tplib.sim.simulate import simulate
from tplib.tables import run_table
from tplib.util import machine

# Other jobs on the machine make the harness warn; that is its business, not these tests'.
pytestmark = pytest.mark.filterwarnings("ignore:.*cores were busy with other work")

# Tables on the tiny model: short sequences, one timed iteration, no warm-up.
TINY = {"model": "tiny", "model_overrides": {}, "iters": 1, "warmup": 0, "progress": False}
FAST = {"rounds": 1, "contention_rounds": 1}


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip sampling the other jobs' load around each run (twice 0.25 s): the table
    tests check what the functions return, not this machine."""
    monkeypatch.setattr("tplib.measure.harness.busy_cores", lambda window_s=0.0: 0.0)


@pytest.fixture(scope="module")
def link() -> Link:
    return measure_link(n_bytes_list=(2**10, 2**16), repeats=3)


@pytest.fixture(scope="module")
def profiles() -> list[Profile]:
    return profile_pipeline("tiny", 2, seq_len=64, granularity=8, repeats=1, progress=False)


def test_pipeline_profiles_time_the_real_stages(profiles: list[Profile]) -> None:
    assert [p.stage for p in profiles] == [(0, 2), (2, 4)]
    assert [p.layers_per_stage for p in profiles] == [2, 2]
    for p in profiles:
        assert 0 < p.fwd_fraction < 1 and p.optimizer_time > 0
        assert 0 < p.wgrad_fraction < 1 - p.fwd_fraction
        assert p.threads == machine.threads_per_process(2)


def test_local_costs_drive_the_simulator(profiles: list[Profile], link: Link) -> None:
    costs = local_costs(profiles, link)
    p = Plan.uniform(2, 64, n_token_slices=4)
    sim = simulate(make_schedule("terapipe", 2, p), costs)
    assert sim.latency > 0 and 0 < sim.bubble_fraction < 1
    # Forward and backward split the profiled slice time of unit b0 t2 (16 tokens after 32).
    f, b = (
        sim.timeline.query(f"stage == 1 and kind == '{k}' and b == 0 and t == 2")
        for k in ("F", "B")
    )
    both = float((f.end - f.start).iloc[0] + (b.end - b.start).iloc[0])
    assert both == pytest.approx(
        float(profiles[1].compute_time(1, np.array([16]), np.array([32]))[0])
    )
    # A send of 16 tokens of tiny's 32 float32 hidden values takes the link's time for them.
    sends = sim.timeline[(sim.timeline.kind == "SA") & (sim.timeline.t == 2)]
    nbytes = 16 * 32 * 4
    assert (sends.end - sends.start).iloc[0] == pytest.approx(
        link.latency + nbytes / link.bandwidth
    )
    assert costs.optimizer(0) == profiles[0].optimizer_time


def test_local_costs_give_a_chunk_half_a_stage(profiles: list[Profile], link: Link) -> None:
    """Interleaved over two chunks: each chunk's forward and backward take half the
    stage's profiled slice time; the wrap from stage 1 back to stage 0 is the link."""
    costs = local_costs(profiles, link)
    p = Plan.uniform(2, 64, n_token_slices=4)
    sim = simulate(make_schedule("terapipe-interleaved", 2, p, n_chunks=2), costs)
    tl = sim.timeline[(sim.timeline.stage == 1) & (sim.timeline.b == 0) & (sim.timeline.t == 2)]
    for chunk in (0, 1):
        fb = tl[tl.kind.isin(["F", "B"]) & (tl.chunk == chunk)]
        assert float((fb.end - fb.start).sum()) == pytest.approx(
            float(profiles[1].compute_time(1, np.array([16]), np.array([32]))[0]) / 2
        )
    wrap = tl[(tl.kind == "SA") & (tl.chunk == 0)]
    assert float((wrap.end - wrap.start).iloc[0]) == pytest.approx(link.time(16 * 32 * 4))
    assert sim.n_chunks == 2 and costs.n_chunks == 1  # placed on a copy
    with pytest.raises(ValueError, match="profiles of 2"):
        costs.placed((0, 1, 2))


def test_local_costs_price_split_backwards(profiles: list[Profile], link: Link) -> None:
    """terapipe-zb: B + W of a unit is the unit's measured backward; a whole sequence's W
    is the measured weight-gradient share of the whole-sequence slice time."""
    costs = local_costs(profiles, link)
    p = Plan.uniform(1, 64, n_token_slices=4)
    sim = simulate(make_schedule("terapipe-zb", 2, p), costs)
    tl = sim.timeline[sim.timeline.stage == 1]
    span = (tl.end - tl.start).groupby(tl.kind).sum()
    whole = float(profiles[1].compute_time(1, np.array([64]), np.array([0]))[0])
    assert span["W"] == pytest.approx(profiles[1].wgrad_fraction * whole)
    # F and B of the four units are their slice times less each unit's own share of W.
    units = sum(
        float(profiles[1].compute_time(1, np.array([16]), np.array([16 * t]))[0]) for t in range(4)
    )
    per_unit_w = (
        4
        * profiles[1].wgrad_fraction
        * float(profiles[1].compute_time(1, np.array([16]), np.array([0]))[0])
    )
    assert span["F"] + span["B"] == pytest.approx(units - per_unit_w)


def test_allreduce_covers_the_tied_embedding_and_the_replicas(
    profiles: list[Profile],
) -> None:
    link = Link(bandwidth=1e9, latency=1e-5)
    one = local_costs(profiles, link)
    # tiny: vocabulary 96 x hidden 32, float32; a ring of 2 moves it once each way.
    tied = 96 * 32 * BYTES_PER_ACTIVATION / 1e9 + 2 * 1e-5
    assert one.allreduce(0) == pytest.approx(tied) and one.allreduce(1) == pytest.approx(tied)
    two = local_costs(profiles, link, n_data=2)
    assert two.allreduce(0) > one.allreduce(0)
    middle = profile_stage("tiny", seq_len=16, granularity=4, repeats=1, progress=False)
    with pytest.raises(ValueError, match="profile_pipeline"):
        local_costs([middle, middle], link)
    with pytest.raises(ValueError, match="positive bandwidth"):
        local_costs(profiles, Link(0.0, 1e-5))


def test_bottleneck_cost_is_the_slowest_stage_plus_communication(
    profiles: list[Profile],
) -> None:
    cost = BottleneckCost(profiles)
    s, c = np.array([8, 32]), np.array([8, 16])
    each = [p.compute_time(1, s, c) for p in profiles]
    expected = np.maximum(each[0], each[1]) + profiles[0].comm_time(1, s)
    np.testing.assert_allclose(cost.slice_time(1, s, c), expected)
    assert cost.max_batch_slice_size == 1


def test_shared_cores_stretch_only_what_runs_at_the_same_time() -> None:
    costs = ConstantCosts(t_f=1.0, t_b=2.0, t_optimizer=0.5)
    gpipe = make_schedule("gpipe", 2, Plan.gpipe(1, 64))
    tera = make_schedule("terapipe", 2, Plan.uniform(1, 64, n_token_slices=8))
    for schedule in (gpipe, tera):
        alone = simulate(schedule, costs).latency
        for busy in (0.0, float("nan")):  # the stages fit in the cores, or the load is unknown
            assert simulate_shared(schedule, costs, cores=2, busy=busy).latency == alone
        assert simulate_shared(schedule, costs, cores=8, busy=4).latency == alone
    # GPipe on one sequence: the stages never work at the same time but for the final
    # optimizer steps, so one busy core stretches only those; TeraPipe's stages overlap.
    slow = {
        s.name: simulate_shared(s, costs, cores=2, busy=1).latency / simulate(s, costs).latency
        for s in (gpipe, tera)
    }
    assert 1.0 <= slow["gpipe"] < slow["terapipe"] <= 1.5 + 1e-9
    crowded = simulate_shared(gpipe, costs, cores=2, busy=2).latency
    assert crowded / simulate(gpipe, costs).latency > 1.2 * slow["gpipe"]


def test_shared_cores_stretch_each_chunk_of_a_virtual_stage() -> None:
    """Interleaved chunks share their stage's core with the other stage's: one busy core
    of two stretches the overlapping work, chunk by chunk, and nothing when the cores
    suffice."""
    costs = ConstantCosts(t_f=1.0, t_b=2.0, t_optimizer=0.5)
    s = make_schedule("interleaved-1f1b", 2, Plan.gpipe(4, 64), n_chunks=2)
    alone = simulate(s, costs).latency
    assert simulate_shared(s, costs, cores=8).latency == alone
    shared = simulate_shared(s, costs, cores=2, busy=1)
    assert alone < shared.latency <= 1.5 * alone + 1e-9
    assert set(shared.timeline["chunk"]) == {0, 1}


def test_contention_stretches_work_while_the_other_stage_works() -> None:
    # K=2, one sequence in two token slices, a step per F or B, free messages. Alone:
    # stage 0 F0 [0,1] F1 [1,2] ... B0 [5,6]. Stage 0's F1 and stage 1's F0 run together,
    # so with factor 1.5 both take [1, 2.5]; stage 1's F1 [2.5, 3.5] and B1 [3.5, 4.5]
    # run alone; its B0 and stage 0's B1 run together, [4.5, 6]; stage 0's B0 [6, 7].
    costs = ConstantCosts(t_f=1.0, t_b=1.0, t_optimizer=0.0)
    tera = make_schedule("terapipe", 2, Plan.uniform(1, 2, n_token_slices=2))
    assert simulate(tera, costs).latency == 6.0
    assert simulate_shared(tera, costs, cores=2, contention=(1.0, 1.0)).latency == 6.0
    stretched = simulate_shared(tera, costs, cores=2, contention=(1.5, 1.5))
    assert stretched.latency == pytest.approx(7.0, rel=1e-3)
    # Only stage 1 slowed: stage 0's F1 and B1 keep 1 s, so they cover 1 s of stage 1's
    # F0 and B0 of f s each, and f = 1 + 0.5 / f: f = (1 + sqrt 3) / 2, 4 s + 2 f in all.
    one = simulate_shared(tera, costs, cores=2, contention=(1.0, 1.5))
    assert one.latency == pytest.approx(5.0 + 3**0.5, rel=1e-3)
    # GPipe on one sequence: the stages never work at the same time.
    gpipe = make_schedule("gpipe", 2, Plan.gpipe(1, 2))
    assert simulate_shared(gpipe, costs, cores=2, contention=(2.0, 2.0)).latency == 4.0
    with pytest.raises(ValueError, match="3 factors for 2 stages"):
        simulate_shared(tera, costs, cores=2, contention=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="must be positive"):
        simulate_shared(tera, costs, cores=2, contention=(1.0, 0.0))


def test_context_parallel_ranks_share_the_cores_in_step() -> None:
    """One stage run by two processes at once (#CP = 2): they fit two cores; a busy core
    more stretches every action by 3/2; a contention factor applies whole, the other
    rank working throughout. One process alone is stretched by neither."""
    costs = ConstantCosts(t_f=1.0, t_b=2.0, t_optimizer=0.5)
    s = make_schedule("terapipe", 1, Plan.uniform(1, 64, n_token_slices=4))
    alone = simulate(s, costs).latency
    assert alone == 12.5
    assert simulate_shared(s, costs, cores=2, processes_per_stage=2).latency == alone
    busy = simulate_shared(s, costs, cores=2, busy=1, processes_per_stage=2)
    assert busy.latency == pytest.approx(1.5 * alone, rel=1e-3)
    both = simulate_shared(s, costs, cores=2, contention=(1.2,), processes_per_stage=2)
    assert both.latency == pytest.approx(1.2 * alone, rel=1e-3)
    for kw in ({"busy": 1.0}, {"contention": (1.2,)}):
        assert simulate_shared(s, costs, cores=2, **kw).latency == alone
    with pytest.raises(ValueError, match="processes_per_stage=0 must be at least 1"):
        simulate_shared(s, costs, cores=2, processes_per_stage=0)


def test_a_measured_row_reports_the_median_and_the_simulators_error() -> None:
    run = RunConfig(parallelism=Parallelism(n_stages=1), data=Data(batch=1, seq_len=8))
    rank = RankResult(0, 0, 0, (0, 4), iteration_s=[1.0, 2.0, 10.0])
    sim = simulate(make_schedule("gpipe", 1, run.plan), ConstantCosts(t_f=1.0, t_b=2.0))
    assert sim.latency == 3.0
    m = Measured(RunResult(run, [rank]), sim, sim, busy_cores=0.5)
    row = m.row("_x")
    assert row["latency_x"] == 2.0  # the median of 1, 2 and 10
    assert row["latency_x_mean"] == pytest.approx(13 / 3) and row["latency_x_min"] == 1.0
    assert row["err_simulated_latency_x"] == pytest.approx(0.5)  # 3 s simulated vs 2 s measured
    assert row["busy_cores_x"] == 0.5


def test_profiling_options_come_from_a_notebook_dict() -> None:
    assert Profiling.of({"rounds": 2, "batch_slice_sizes": [1, 2]}) == Profiling(
        rounds=2, batch_slice_sizes=(1, 2)
    )
    with pytest.raises(ValueError, match="profiling="):
        Profiling.of({"round": 2})
    assert grid(1024, None, 8) == 128 and grid(1024, 64, 8) == 64
    with pytest.raises(ValueError, match="granularity g=100"):
        grid(1024, 100, 8)


def _check_measured(df: pd.DataFrame, suffixes: tuple[str, ...]) -> None:
    for s in suffixes:
        lat = df[f"latency{s}"]
        assert (df[f"latency{s}_min"] <= lat).all() and (lat > 0).all()
        assert (df[f"latency{s}_std"] >= 0).all()
        for col in (f"simulated_latency{s}", f"err_simulated_latency{s}", f"busy_cores{s}"):
            assert df[col].notna().all(), col
        assert (df[f"contention{s}"] > 0).all()


@pytest.mark.usefixtures("quiet")
def test_main_results_measured(link: Link, pools: Callable[[int], LocalPool]) -> None:
    result = run_table(
        "main_results",
        "measure",
        batches=[1, 2],
        seq_len=64,
        link=link,
        pool=pools(2),
        profiling={**FAST, "granularity": 16, "batch_slice_sizes": (1, 2)},
        **TINY,
    )
    plt.close(result.figure)
    df = result.df
    _check_measured(df, ("_gpipe", "_terapipe"))
    assert list(df.pipeline_batch) == [1, 2]
    Plan.from_paper(df.plan.iloc[1]).check_covers(2, 64)
    assert "pipeline_batch=2: TeraPipe" in result.findings


@pytest.mark.usefixtures("quiet")
def test_a_context_parallel_run_is_measured_beside_its_price(
    profiles: list[Profile], link: Link, pools: Callable[[int], LocalPool]
) -> None:
    """#CP = 2 on the pool of two: the run's ranks are its CP ranks, and its simulation is
    the one stage priced by ContextParallelCosts on the pipeline's profiles."""
    with measured_bench("tiny", (), 2, 1, 0, link, Profiling(), False, pools(2)) as bench:
        bench.profiles[64] = profiles
        bench.ring_link = link  # not measured again
        p = Plan.uniform(2, 64, n_token_slices=2)
        m = bench.run("terapipe", p, parallelism=Parallelism(n_cp=2))
    assert sorted(r.cp_rank for r in m.result.ranks) == [0, 1] and m.latency > 0
    costs = context_parallel_costs(profiles, link, 2)
    f = m.sim_dedicated.timeline.query("kind == 'F' and b == 1 and t == 1")
    assert float((f.end - f.start).iloc[0]) == pytest.approx(costs.unit_time(True, 1, 32, 32))
    assert set(m.sim.timeline.stage) == {0}


@pytest.mark.usefixtures("quiet")
def test_dp_ablation_measured(link: Link, pools: Callable[[int], LocalPool]) -> None:
    result = run_table(
        "dp_ablation",
        "measure",
        slices=[1, 4],
        seq_len=64,
        link=link,
        pool=pools(2),
        profiling={**FAST, "granularity": 8},
        **TINY,
    )
    plt.close(result.figure)
    df = result.df
    _check_measured(df, ("",))
    assert list(df.algorithm) == ["#Slices=1", "#Slices=4", "DP"]
    assert sorted(df["rank"])[0] == 1 and sorted(df.simulated_rank)[0] == 1
    with pytest.raises(ValueError, match="grid"):
        run_table("dp_ablation", "measure", slices=[3], seq_len=64, link=link, **TINY)


@pytest.mark.usefixtures("quiet")
def test_seqlen_sweep_measured(link: Link, pools: Callable[[int], LocalPool]) -> None:
    result = run_table(
        "seqlen_sweep",
        "measure",
        seq_lens=[32, 64],
        batches=[2, 1],
        n_grid=4,
        link=link,
        pool=pools(2),
        profiling=FAST,
        **TINY,
    )
    plt.close(result.figure)
    _check_measured(result.df, ("_gpipe", "_terapipe"))
    assert list(zip(result.df.seq_len, result.df.pipeline_batch, strict=True)) == [(32, 2), (64, 1)]
    with pytest.raises(ValueError, match="one batch size per"):
        run_table("seqlen_sweep", "measure", seq_lens=[32, 64], batches=[1], link=link, **TINY)


def test_validation_notebook_runs_under_papermill(link: Link, tmp_path: Path) -> None:
    import papermill as pm

    params = {"model": "tiny", "seq_len": 64, "n_slices": 4, "iters": 2, "link": list(link)}
    pm.execute_notebook(
        str(notebooks_dir() / "simulator_validation.ipynb"),
        str(tmp_path / "executed.ipynb"),
        parameters={"mode": "measure", "params": params, "out_dir": str(tmp_path), "tag": "test"},
        kernel_name="python3",
        cwd=str(notebooks_dir()),
        progress_bar=False,
    )
    df = pd.read_csv(tmp_path / "simulator_validation-test.csv")
    assert list(df.schedule) == ["gpipe", "1f1b", "terapipe", "terapipe-zb"]
    assert (df.latency > 0).all() and (df.contention > 0).all()
    assert list(df.plan[:2]) == ["[(1, [64])] * 2"] * 2 and df.n_slices.iloc[2] == 4
    assert (tmp_path / "simulator_validation-test.png").read_bytes()[:4] == b"\x89PNG"
    assert df.err_simulated_latency.iloc[1:].map(math.isfinite).all()
