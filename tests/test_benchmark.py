import json

import pandas as pd
import pytest

from tplib.cli import main
from tplib.runtime import TRACE_COLUMNS
from tplib.runtime.benchmark import busiest_stage_work


def test_busiest_stage_work_sums_compute_per_rank() -> None:
    rows = [
        # rank, stage, replica, op_rank, iteration, kind, b, t, v, start, end
        (0, 0, 0, 0, 0, "F", 0, 0, -1, 0.0, 1.0),
        (0, 0, 0, 0, 0, "SA", 0, 0, -1, 1.0, 1.5),  # communication: not compute
        (0, 0, 0, 0, 0, "B", 0, 0, -1, 4.0, 6.0),
        (1, 1, 0, 0, 0, "F", 0, 0, -1, 1.5, 2.0),
        (1, 1, 0, 0, 0, "B", 0, 0, -1, 2.0, 3.0),
        (1, 1, 0, 0, 0, "OPT", -1, -1, -1, 6.0, 6.5),
        (0, 0, 0, 0, 1, "F", 0, 0, -1, 0.0, 0.5),
        (1, 1, 0, 0, 1, "F", 0, 0, -1, 0.0, 2.0),
    ]
    busiest = busiest_stage_work(pd.DataFrame(rows, columns=list(TRACE_COLUMNS)))
    assert busiest.tolist() == [3.0, 2.0]


def test_bench_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench",
        "--schedule",
        "terapipe",
        "--stages",
        "2",
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--slices",
        "4",
        "--model",
        "tiny",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["median_latency_s"] > 0 and out["iterations"] == 2
    assert out["plan"] == "[(1, [8] * 4)] * 2"
    assert out["overhead_s"] <= out["median_latency_s"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "zero-bubble"], "unknown schedule 'zero-bubble'"),
        (["--schedule", "gpipe", "--slices", "4"], "--slices=4 with gpipe"),
        (
            ["--schedule", "terapipe", "--seq-len", "100"],
            "seq_len=100 exceeds the model's context of 64",
        ),
    ],
)
def test_bench_bad_input_is_an_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    base = ["bench", "--stages", "2", "--batch", "1", "--seq-len", "32", "--model", "tiny"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err
