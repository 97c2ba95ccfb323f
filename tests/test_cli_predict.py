"""``python -m tplib predict``: the text and JSON of a run's prediction, and bad input
named with exit code 2 before anything is priced."""

from __future__ import annotations

import json

import pytest

from tplib.cli import main
from tplib.search.megatron import MegatronRun, predict

_ARGS = [
    "predict", "--cluster", "dgx-h100", "--gpus", "64", "--layers", "16", "--hidden", "2048",
    "--heads", "16", "--tp", "4", "--pp", "4", "--interleave", "2", "--batch", "64",
    "--microbatch", "1", "--recompute", "selective", "--sequence-parallel",
    "--distributed-optimizer",
]  # fmt: skip


def test_json_has_the_issues_fields_and_equals_the_library(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*_ARGS, "--cp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("iteration_s", "tflops_per_gpu", "mfu", "memory_gib", "fits"):
        assert key in out
    run = MegatronRun(
        cluster="dgx-h100", gpus=64, layers=16, hidden=2048, heads=16, tp=4, pp=4, cp=2,
        interleave=2, batch=64, microbatch=1, recompute="selective",
        sequence_parallel=True, distributed_optimizer=True,
    )  # fmt: skip
    p = predict(run)
    assert out["iteration_s"] == pytest.approx(p.iteration_s)
    assert out["mfu"] == pytest.approx(p.mfu)
    assert out["n_data"] == 2 and out["cp"] == 2 and out["schedule"] == "interleaved-1f1b"
    assert out["attention"] == "flash"


def test_text_states_the_flop_formula_and_the_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_ARGS) == 0
    text = capsys.readouterr().out
    assert "Narayanan et al. 2021" in text and "72 B s l h^2" in text
    assert "GiB of 80 GiB per GPU: fits" in text
    assert main([*_ARGS[:-4], "--recompute", "full"]) == 0
    assert "96 B s l h^2" in capsys.readouterr().out  # full recomputation's count


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        (["--heads", "10"], "heads=10 is not divisible by tp=4"),
        (["--layers", "12"], "layers=12 is not divisible by pp x interleave = 4 x 2"),
        (["--batch", "66"], "batch=66 is not divisible by microbatch x #Data = 1 x 4"),
        (["--gpus", "60"], "gpus=60 is not whole nodes"),
        (["--tp", "1"], "sequence parallelism needs tp > 1"),
    ],
)
def test_bad_input_names_the_rule_and_exits_2(
    change: list[str], rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_ARGS, *change]) == 2
    assert rule in capsys.readouterr().err


def test_unknown_cluster_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_ARGS[:2], "dgx-b200", *_ARGS[3:]]) == 2
    assert "dgx-a100" in capsys.readouterr().err
