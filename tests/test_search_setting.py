"""Tests for tplib.search.setting's virtual stages: the chunk counts a setting admits, the
plan for the chunks' objective, and simulate_virtual's choice of v (the rest of the
module is tested through the tables, tests/test_tables.py)."""

from __future__ import annotations

import pytest

from tplib.cluster.memory import schedule_memory_per_gpu
from tplib.paper import SETTINGS, setting
from tplib.planner import pipeline_latency
from tplib.schedule import make_schedule
from tplib.schedule.chunks import interleaved
from tplib.search.setting import (
    VIRTUAL,
    chunk_choices,
    cost_model,
    plan_terapipe,
    simulate_virtual,
)
from tplib.sim.simulate import simulate


def test_chunk_counts_divide_the_layers_per_stage() -> None:
    # 4 layers per stage in setting (7), 2 in (8), 1 in (9).
    assert [chunk_choices(SETTINGS[n]) for n in (7, 8, 9)] == [(1, 2, 4), (1, 2), (1,)]


def test_the_plan_for_chunks_minimises_their_objective() -> None:
    s = setting(7)
    placed = cost_model(s).placed(interleaved(s.n_stages, 2))
    two, one = plan_terapipe(s, n_chunks=2), plan_terapipe(s)
    objective = pipeline_latency(two, placed, s.n_stages, n_chunks=2)
    assert two.latency == pytest.approx(objective)
    assert objective <= pipeline_latency(one, placed, s.n_stages, n_chunks=2)
    assert one == plan_terapipe(s, n_chunks=1, cost=cost_model(s))  # v = 1: TeraPipe's


def test_setting_7_with_virtual_stages() -> None:
    """Four sequences on 24 stages: too few microbatches to interleave, and TeraPipe's 22
    slices for v = 2 too few units; breadth-first, v = 2 beats TeraPipe's own plan."""
    s = setting(7)
    row = simulate_virtual(s)
    assert set(VIRTUAL) == {"interleaved-1f1b", "terapipe-interleaved", "terapipe-bfs"}
    assert row["v_interleaved_1f1b"] == row["v_terapipe_interleaved"] == 1
    assert row["note_interleaved_1f1b"] == (
        "v=2 needs >= 24 units per iteration, the plan has 4; "
        "v=4 needs >= 24 units per iteration, the plan has 4"
    )
    assert "the plan has 22" in str(row["note_terapipe_interleaved"])
    one_f_one_b = simulate(make_schedule("1f1b", 24, s.gpipe_plan()), cost_model(s))
    assert row["latency_interleaved_1f1b"] == one_f_one_b.latency
    assert row["v_terapipe_bfs"] == 2 and row["note_terapipe_bfs"] == ""
    bfs = make_schedule("terapipe-bfs", 24, plan_terapipe(s, n_chunks=2), n_chunks=2)
    bfs_latency = simulate(bfs, cost_model(s)).latency
    assert row["latency_terapipe_bfs"] == bfs_latency
    memory, _ = schedule_memory_per_gpu(s.config, bfs, n_op=s.n_op)
    assert row["memory_gib_terapipe_bfs"] == memory.total / 2**30
    tera = simulate(make_schedule("terapipe", 24, plan_terapipe(s)), cost_model(s)).latency
    assert bfs_latency < tera
