"""Tests for tplib.cli.planning's slicings and memory limit: ``plan --slicing``,
``--slices``, ``--memory-gib`` and ``--schedule`` on a paper setting (the cluster
model), checked against the library's own functions and the cluster's memory model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tplib.cli import main
from tplib.cluster.memory import memory_per_gpu
from tplib.paper import setting
from tplib.plan import Plan
from tplib.planner import FlopModel, equal_flop_slices

SETTING = 7  # GPT3-44B on 24 stages, 4 sequences of 2048 tokens: plans in a tenth of a second


def plan(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert main(["plan", "--setting", str(SETTING), "--json", *extra]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_seq1f1b_and_uniform_slicings(capsys: pytest.CaptureFixture[str]) -> None:
    dp = plan(capsys)
    seq = plan(capsys, "--slicing", "seq1f1b")
    k = len(seq["token_slices"][0])
    flops = FlopModel.of(setting(SETTING).config)
    assert seq["token_slices"] == [list(equal_flop_slices(flops, 2048, k, 8))] * 4
    assert seq["slicing"] == "seq1f1b" and seq["method"] is None
    assert dp["latency"] <= seq["latency"] * (1 + 1e-12)  # the DP searches Seq1F1B's too
    three = plan(capsys, "--slicing", "seq1f1b", "--slices", "3")
    assert three["token_slices"][0] == list(equal_flop_slices(flops, 2048, 3, 8))
    uni = plan(capsys, "--slicing", "uniform", "--slices", "4")
    assert uni["token_slices"] == [[512] * 4] * 4


def test_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    s = setting(SETTING)
    free = plan(capsys)
    need = memory_per_gpu(s.config, n_stages=24, n_op=8, plan=_plan(free)).total / 2**30
    assert main(["plan", "--setting", str(SETTING), "--memory-gib", "1"]) == 2
    err = capsys.readouterr().err
    least = float(err.split("smallest peak any plan attains is ")[1].split(" GiB")[0])
    gib = (least + need) / 2
    out = plan(capsys, "--memory-gib", str(gib))
    assert out["peak_gib"] <= gib and out["schedule"] == "terapipe"
    assert memory_per_gpu(s.config, n_stages=24, n_op=8, plan=_plan(out)).total <= gib * 2**30
    assert out["latency"] > free["latency"]
    seq = plan(capsys, "--slicing", "seq1f1b", "--memory-gib", str(gib), "--schedule", "1f1b")
    assert seq["peak_gib"] <= gib and seq["schedule"] == "1f1b"


def _plan(out: dict[str, Any]) -> Plan:
    return Plan.from_paper(out["paper"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--slices", "3"], "--slices applies to --slicing seq1f1b or uniform"),
        (["--slicing", "seq1f1b", "--method", "paper"], "--method applies to --slicing dp"),
        (["--schedule", "1f1b"], "--schedule applies with --memory-gib"),
        (["--memory-gib", "0"], "argument --memory-gib: 0 is not > 0"),
        (["--slicing", "seq1f1b", "--slices", "300"], "n_slices=300 exceeds the 256 grid steps"),
    ],
)
def test_bad_options_are_refused(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["plan", "--setting", str(SETTING), *extra]) == 2
    assert message in capsys.readouterr().err


def test_memory_needs_a_setting(capsys: pytest.CaptureFixture[str], profile_path: Path) -> None:
    argv = ["plan", "--profile", str(profile_path), "--seq-len", "64", "--batch", "4"]
    assert main([*argv, "--stages", "2", "--memory-gib", "16"]) == 2
    assert "--memory-gib needs --setting" in capsys.readouterr().err
