"""``python -m tplib schedule export|import|show`` (tplib.cli.schedule), run in-process
through ``main``: a registered schedule out to torch's CSV and back in, checked; the grid
and the simulated latency of a name, a torch class or a file; bad input exits with 2 and
a message naming the value and the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from tplib.cli import main
from tplib.plan import Plan
from tplib.schedule import Schedule, make_schedule


def _export(path: Path, name: str, *options: str, fmt: str = "compute_only") -> list[str]:
    return ["schedule", "export", name, *options, "--format", fmt, "--out", str(path)]


def test_export_then_import_gives_the_schedule_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    csv, back = tmp_path / "il.csv", tmp_path / "il-tplib.csv"
    options = ["--stages", "2", "--chunks", "2", "--microbatches", "4"]
    assert main(_export(csv, "interleaved-1f1b", *options, fmt="compute_comms")) == 0
    assert (
        "2 ranks, 2 stages per rank, 4 microbatches, torch compute_comms" in capsys.readouterr().out
    )
    assert csv.read_text().splitlines()[0].startswith("0UNSHARD,2UNSHARD,0F0,0SEND_F0")
    args = ["schedule", "import", str(csv), "--seq-len", "16", "--name", "interleaved-1f1b"]
    assert main([*args, "--out", str(back)]) == 0
    printed = capsys.readouterr().out
    for line in (
        "format: compute_comms",
        "ranks (K): 2, stages per rank (v): 2",
        "placement: interleaved: stage i on rank i % K",
        "microbatches: 4",
        "its sends and receives: consistent",
        "valid: complete",
    ):
        assert line in printed
    want = make_schedule("interleaved-1f1b", 2, Plan.gpipe(4, 16), n_chunks=2)
    assert Schedule.from_csv(back) == want


def test_import_says_what_a_v_shaped_split_order_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    csv = tmp_path / "zbv.csv"
    assert main(_export(csv, "zbv", "--stages", "2", "--microbatches", "3")) == 0
    assert main(["schedule", "import", str(csv)]) == 0
    printed = capsys.readouterr().out
    assert "placement: V-shape: stages r and 2K-1-r on rank r" in printed
    assert "backwards split into I (tplib's B) and W" in printed


def test_show_prices_a_registered_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    """GPipe on K=3, M=4 with F=1, B=2: (M + K - 1)(F + B) = 18; busy 12 of 18 per stage."""
    assert main(["schedule", "show", "gpipe", "--stages", "3", "--microbatches", "4"]) == 0
    printed = capsys.readouterr().out
    assert "stage 2 |" in printed and "F b3 t0" in printed
    assert "costs per stage: F 1.0, B 2.0, send 0.0" in printed
    assert "latency 18, bubble 33.3%" in printed


def test_show_reads_a_torch_class_and_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["schedule", "show", "Schedule1F1B", "--stages", "2", "--microbatches", "4"]
    assert main([*args, "--t-send", "0.5"]) == 0
    torch_printed = capsys.readouterr().out
    assert "Schedule1F1B: 2 ranks x 1 chunk(s), 4 microbatches" in torch_printed
    csv, ours = tmp_path / "1f1b.csv", tmp_path / "1f1b-tplib.csv"
    assert main(_export(csv, "1f1b", "--stages", "2", "--microbatches", "4")) == 0
    make_schedule("1f1b", 2, Plan.gpipe(4, 1)).to_csv(ours)
    latencies = []
    for path in (csv, ours):
        assert main(["schedule", "show", str(path), "--t-send", "0.5"]) == 0
        latencies.append(capsys.readouterr().out.rsplit("latency ", 1)[1])
    # Schedule1F1B is tplib's 1f1b: the same grid and latency whichever way it came.
    assert latencies == [torch_printed.rsplit("latency ", 1)[1]] * 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["export", "nope", "--stages", "2", "--microbatches", "2"], "unknown schedule 'nope'"),
        (["export", "1f1b", "--microbatches", "2"], "schedule '1f1b' needs --stages"),
        (
            ["export", "1f1b", "--stages", "2", "--microbatches", "2", "--chunks", "2"],
            "--chunks 2 with schedule '1f1b': it places one chunk per stage",
        ),
        (
            ["export", "2bw", "--stages", "2", "--microbatches", "2"],
            "is asynchronous",
        ),
        (
            ["export", "zbv", "--stages", "2", "--microbatches", "2", "--chunks", "3"],
            "n_chunks=3 with schedule 'zbv'",
        ),
        (["show", "nope"], "'nope' is neither a file, a registered schedule"),
        (["show", "ScheduleGPipe"], "ScheduleGPipe needs --stages and --microbatches"),
        (
            ["show", "gpipe", "--stages", "2", "--microbatches", "2", "--t-w", "3"],
            "--t-w 3.0 is more than --t-b 2.0",
        ),
        (["import", "/nonexistent/torch.csv"], "No such file"),
    ],
)
def test_bad_input_exits_2_naming_the_value_and_the_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    if argv[0] == "export":
        argv = [*argv, "--format", "compute_only", "--out", str(tmp_path / "x.csv")]
    assert main(["schedule", *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_malformed_torch_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    csv = tmp_path / "bad.csv"
    csv.write_text("0F0,0B0\r\n1F1,1B0\r\n")
    assert main(["schedule", "import", str(csv)]) == 2
    assert "torch stage 1 runs the forwards of microbatches [1]" in capsys.readouterr().err
    csv.write_text("0F0,0B0,0X\r\n")
    assert main(["schedule", "show", str(csv)]) == 2
    assert "cannot parse torch action '0X'" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "export", "1f1b", "--stages", "0", "--out", "x"]) == 2
    assert "0 is not a positive integer" in capsys.readouterr().err
    assert main(["schedule", "show", "gpipe", "--t-f", "-1"]) == 2
    assert "-1 is not >= 0" in capsys.readouterr().err
