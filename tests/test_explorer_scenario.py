"""Tests for tplib.explorer.scenario: validation, the builders, and the cost model a
scenario names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tplib.explorer.scenario as scenario_module
from tests.explorer_cases import BASE
from tplib.cluster import ClusterCostModel, check_layout
from tplib.explorer.scenario import (
    CLUSTER,
    Scenario,
    cost_model,
    make_scenario,
    scenario_for_profile,
    scenario_for_setting,
)
from tplib.nn.configs import GPTConfig, get_config
from tplib.perfmodel import Profile


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"pipeline_batch": 0}, r"Scenario\.pipeline_batch=0"),
        ({"pipeline_batch": True}, r"Scenario\.pipeline_batch=True"),
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
def test_scenario_rejects_bad_values(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Scenario(**{**BASE, **changes})


def test_cluster_layout_errors_come_from_check_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # The layout rules are written once, in tplib.cluster: the scenario's error is theirs.
    with pytest.raises(ValueError, match="the paper partitions operations only inside a node"):
        Scenario(**{**BASE, "n_op": 3})
    calls: list[tuple[str, int, int, int]] = []

    def spy(cfg: GPTConfig, *, n_stages: int, n_op: int, n_data: int) -> None:
        calls.append((cfg.name, n_stages, n_op, n_data))
        check_layout(cfg, n_stages=n_stages, n_op=n_op, n_data=n_data)

    monkeypatch.setattr(scenario_module, "check_layout", spy)
    Scenario(**{**BASE, "n_op": 2, "n_data": 4})
    assert calls == [("GPT3-1B", 24, 2, 4)]
    with pytest.raises(ValueError, match="n_op=3"):
        Scenario(**{**BASE, "n_op": 3})
    assert calls[-1] == ("GPT3-1B", 24, 3, 1)
    calls.clear()
    Scenario(**{**BASE, "cost": "p.json"})  # a profile has no cluster layout to check
    assert calls == []


def test_scenario_for_setting_follows_table1() -> None:
    sc = scenario_for_setting(9)  # Table 1 row (9): GPT3-175B, B = 2 on #Pipe 96 x #Op 4
    assert (sc.model, sc.seq_len, sc.pipeline_batch) == ("GPT3-175B", 2048, 2)
    assert (sc.n_stages, sc.n_op, sc.n_data, sc.cost) == (96, 4, 1, CLUSTER)
    assert "2 sequence(s) per pipeline" in sc.label
    long = scenario_for_setting(5, 8192, eps=0.0)  # Table 4: L = 8192 with B = 2
    assert (long.seq_len, long.pipeline_batch, long.eps) == (8192, 2, 0.0)
    # The notebook's parameters: a Table-4 length takes the variant, any other overrides L.
    assert make_scenario(5, seq_len=8192) == scenario_for_setting(5, 8192)
    assert make_scenario(9, seq_len=1024).seq_len == 1024
    assert make_scenario(None, **BASE) == Scenario(**BASE)


def test_scenario_for_profile_reads_the_profile(profile_path: Path) -> None:
    sc = scenario_for_profile(profile_path, pipeline_batch=4)
    # "tiny" has 4 layers and the profile times 1 of them: 4 stages by default.
    assert (sc.model, sc.seq_len, sc.n_stages, sc.granularity) == ("tiny", 64, 4, 8)
    assert (sc.pipeline_batch, sc.cost, sc.uses_cluster) == (4, str(profile_path), False)
    assert make_scenario(None, profile=profile_path, n_stages=2) == sc.with_(
        pipeline_batch=1, n_stages=2
    )


def test_cost_model_of_each_source(profile_path: Path) -> None:
    cluster = cost_model(Scenario(**BASE))
    assert isinstance(cluster, ClusterCostModel)
    assert isinstance(cost_model(scenario_for_profile(profile_path)), Profile)
    # A shorter L than the model's own is priced at that L.
    short = cost_model(Scenario(**{**BASE, "seq_len": 1024}))
    assert isinstance(short, ClusterCostModel)
    assert short.cfg.seq_len == 1024 and get_config("GPT3-1B").seq_len == 2048


def test_cost_model_checks_the_profile(profile_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="measured on model 'tiny'"):
        cost_model(Scenario("mini", 64, 1, 4, cost=str(profile_path)))
    with pytest.raises(ValueError, match="off profile"):
        cost_model(Scenario("tiny", 64, 1, 4, cost=str(profile_path), granularity=4))
    with pytest.raises(ValueError, match="does not exist"):
        cost_model(Scenario("tiny", 64, 1, 4, cost=str(tmp_path / "missing.json")))
