"""Tests for tplib.cli: commands run in-process through ``main``; bad input exits with 2."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tplib.cli import main
from tplib.nn.configs import get_config
from tplib.perfmodel import Profile, build_profile
from tplib.plan import Plan
from tplib.runs.settings import setting_run

ROOT = Path(__file__).resolve().parents[1]


def _analytic(b: int, s: int, c: int) -> float:
    return b * (1e-3 + 2e-6 * s + (1e-4 + 1e-8 * s * c if c else 0.0))


@pytest.fixture(scope="module")
def analytic_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A profile of a known function: fast and deterministic for the error cases. Shared by
    the module's tests: a test that edits it edits a copy."""
    path = tmp_path_factory.mktemp("cli") / "analytic.json"
    build_profile(
        _analytic,
        config=get_config("tiny"),
        layers_per_stage=1,
        seq_len=64,
        batch_slice_sizes=(1, 2),
    ).save(path)
    return path


def plan_args(path: Path, *extra: str) -> list[str]:
    return ["plan", "--profile", str(path), "--seq-len", "64", "--batch", "4", *extra]


def test_profile_then_plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.json"
    args = ["profile", "--model", "tiny", "--layers", "1", "--seq-len", "64", "--batch", "2"]
    args += ["--repeats", "2", "--threads", "1", "--quiet", "--out", str(out)]
    args += ["--link-bandwidth", "1e8", "--link-latency", "1e-4"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "held-out error" in printed and "b=2" in printed
    # What it timed: on CPU an fp32 run's precision, tiny's dropout (none), the default
    # attention.
    assert "on cpu, precision fp32, attention default, dropout 0," in printed
    prof = Profile.load(out)
    assert prof.batch_slice_sizes == (1, 2) and prof.layers_per_stage == 1
    assert (prof.link_bandwidth, prof.link_latency) == (1e8, 1e-4)

    assert main(plan_args(out, "--stages", "4", "--json")) == 0
    result = json.loads(capsys.readouterr().out)  # exactly one JSON object
    for key in ("token_slices", "batch_slices", "latency", "plan_seconds", "uniform"):
        assert key in result
    assert sum(result["batch_slices"]) == 4
    assert all(sum(ts) == 64 for ts in result["token_slices"])
    assert Plan.from_paper(result["paper"]).batch == 4
    assert (result["precision"], result["attention"], result["dropout"]) == ("fp32", "default", 0)
    assert result["latency"] > 0 and 0 <= result["plan_seconds"] < 60
    assert result["uniform"]["latency"] > 0
    assert result["speedup_vs_uniform"] == pytest.approx(
        result["uniform"]["latency"] / result["latency"]
    )


def test_plan_text(analytic_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(plan_args(analytic_file, "--stages", "4", "--method", "paper")) == 0
    text = capsys.readouterr().out
    assert "predicted latency" in text and "best uniform" in text and "uniform / plan" in text
    assert "[(" in text  # the paper's notation


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--stages", "0"], "n_stages K=0"),
        (["--stages", "2", "--seq-len", "60"], "not a positive multiple of granularity"),
        (["--stages", "2", "--seq-len", "128"], "beyond the profile's seq_len"),
        (
            ["--stages", "2", "--max-batch-slice-size", "4"],
            "max_batch_slice_size=4 is outside 1..2",
        ),
        (["--stages", "2", "--granularity", "4"], "off the profiled grid"),
    ],
)
def test_plan_errors(
    analytic_file: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(plan_args(analytic_file, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_plan_needs_every_batch_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "b2.json"
    build_profile(
        _analytic,
        config=get_config("tiny"),
        layers_per_stage=1,
        seq_len=64,
        batch_slice_sizes=(2,),
    ).save(path)
    assert main(plan_args(path, "--stages", "2")) == 2
    assert "batch size 1 was not profiled" in capsys.readouterr().err


def test_bad_profile_files(
    analytic_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = json.loads(analytic_file.read_text())
    d["times"][0][0] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(d))
    assert main(plan_args(tmp_path / "nan.json", "--stages", "2")) == 2
    assert "is nan: times must be finite" in capsys.readouterr().err
    assert main(plan_args(tmp_path / "missing.json", "--stages", "2")) == 2
    assert "error: cannot read profile" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope"], "unknown model"),
        (["--model", "tiny", "--seq-len", "60"], "not a positive multiple of granularity"),
        (["--model", "tiny", "--seq-len", "128"], "exceeds model tiny's context"),
    ],
)
def test_profile_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["profile", *args, "--quiet", "--out", str(tmp_path / "p.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_profile_times_the_precision_and_dropout_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bf16.json"
    args = ["profile", "--model", "tiny", "--seq-len", "16", "--granularity", "4"]
    args += ["--repeats", "1", "--threads", "1", "--quiet", "--out", str(out)]
    assert main([*args, "--dtype", "bf16", "--dropout", "0.1"]) == 0
    assert "precision bf16, attention math, dropout 0.1," in capsys.readouterr().out
    prof = Profile.load(out)
    assert (prof.precision, prof.attention, prof.dropout) == ("bf16", "math", 0.1)
    # tiny trains without dropout: planning a run of it on this profile says so.
    plan = ["plan", "--profile", str(out), "--seq-len", "16", "--batch", "1", "--stages", "2"]
    assert main(plan) == 0
    captured = capsys.readouterr()
    assert "(tiny on cpu, precision bf16, attention math, dropout 0.1)" in captured.out
    assert captured.err == (
        f"warning: profile {out} timed dropout 0.1, but tiny trains with dropout 0: a run of "
        "it pays another cost than the plan is priced on (re-profile with --dropout 0)\n"
    )
    assert main([*args, "--attention", "split"]) == 0
    assert "precision fp32, attention split, dropout 0," in capsys.readouterr().out
    assert main(plan) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dtype", "fp16"], "precision 'fp16' needs device='cuda', got device='cpu'"),
        (["--attention", "split", "--dropout", "0.1"], "attention='split' with dropout=0.1"),
        (["--dropout", "1"], "argument --dropout: 1 is not < 1"),
        (["--dtype", "float32"], "argument --dtype: invalid choice: 'float32'"),
    ],
)
def test_profile_refuses_what_no_run_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    args = ["profile", "--model", "tiny", "--device", "cpu", *extra]
    assert main([*args, "--quiet", "--out", str(tmp_path / "p.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_profile_on_missing_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["profile", "--model", "tiny", "--device", "cuda", "--out", str(tmp_path / "p")]
    assert main(args) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--seq-len", "64"]) == 2
    assert "give exactly one of --profile FILE or --setting N" in capsys.readouterr().err
    assert main(["plan", "--profile", "p.json", "--seq-len", "64", "--batch", "1"]) == 2
    assert "--stages is required with --profile" in capsys.readouterr().err
    assert main([]) == 2


def test_plan_a_paper_setting_on_the_cluster_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--setting", "10", "--eps", "1e-4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "GPT3-175B" and out["n_stages"] == 48
    assert sum(out["batch_slices"]) == 2
    assert all(sum(ts) == 2048 for ts in out["token_slices"])
    assert out["latency"] <= out["uniform"]["latency"] * (1 + 1e-9)


def test_simulate_a_paper_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--setting", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["latency_terapipe"] < out["latency_gpipe"]
    # The same setting's row of the committed main results (simulate mode is deterministic).
    committed = pd.read_csv(ROOT / "results/main_results/main_results-simulate.csv")
    row = committed[committed.setting == 10].iloc[0]
    assert out["speedup"] == row.speedup and out["plan"] == row.plan
    assert out["paper_speedup"] == row.paper_speedup and out["paper_plan"] == row.paper_plan


@pytest.mark.parametrize(
    ("argv", "table", "paper"),
    [
        (["--setting", "10"], 2, ("5.822 s", "1.160 s", "5.02x", "[(1, [128] * 16)] * 2")),
        (["--setting", "5", "--seq-len", "4096"], 4, ("2.526 s", "0.913 s", "2.77x", "[(1, [552")),
    ],
)
def test_simulate_prints_the_paper_s_numbers_beside_ours(
    capsys: pytest.CaptureFixture[str], argv: list[str], table: int, paper: tuple[str, ...]
) -> None:
    assert main(["simulate", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    ours, theirs = lines[1].index("ours"), lines[1].index(f"paper's reference (Table {table}")
    gpipe, tera, speedup = (
        next(ln for ln in lines if ln.strip().startswith(name))
        for name in ("w/o TeraPipe", "w/  TeraPipe", "speedup")
    )
    # Each of the paper's values stands in the paper's column, ours in our column.
    for line, value in zip((gpipe, tera, speedup), paper, strict=False):
        assert line[theirs:].strip() == value, line
        assert line[ours:theirs].strip() not in ("", value), line
    assert any(ln.strip().startswith(f"paper's plan: {paper[3]}") for ln in lines), lines


def test_plan_needs_exactly_one_cost_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--setting", "10", "--profile", "x.json"]) == 2
    assert "exactly one of --profile FILE or --setting N" in capsys.readouterr().err
    assert main(["plan", "--setting", "11"]) == 2
    assert "setting (11) is not in Table 1" in capsys.readouterr().err


def test_numpy_only_commands_do_not_import_torch(fresh_python: Callable[..., str]) -> None:
    """Planning and simulating a paper setting need numpy, not torch (2-3 s to import)."""
    fresh_python("""
        import tplib
        light("torch")
        from tplib.cli import main
        assert main(["plan", "--setting", "10", "--json"]) == 0
        assert main(["simulate", "--setting", "10", "--json"]) == 0
        assert main(["autoplan", "--model", "GPT3-175B", "--gpus", "384", "--batch", "2"]) == 0
        assert main(["partition", "--planner", "2bw", "--model", "GPT3-1B", "--batch", "8"]) == 0
        light("torch")
    """)


def test_table_command_prints_and_saves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["table", "seqlen_sweep", "--params", '{"seq_lens": [4096]}', "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4096" in out and "within ±15% of the paper's" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "seqlen_sweep-simulate.csv",
        "seqlen_sweep-simulate.png",
    ]
    assert main(["table", "seqlen_sweep", "--params", '{"settings": [9]}']) == 2
    assert "has no parameter settings" in capsys.readouterr().err
    assert main(["table", "seqlen_sweep", "--params", "[1]"]) == 2
    assert "must be a JSON object" in capsys.readouterr().err


def test_run_writes_a_setting_config_and_prints_how_to_launch_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tplib.runtime import load_run_config

    out = tmp_path / "tmp" / "run.json"
    assert main(["run", "--setting", "9", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    run = load_run_config(out)
    expected = setting_run(9)  # fp16, cluster plan, 10 steps after 2 warm-up
    # The JSON keeps the plan's slicing, not what the planner predicted (its latency,
    # t_max, eps): see test_runtime_layouts.py::test_planned_configs_round_trip_through_json.
    sliced = Plan(expected.plan.batch_slices, expected.plan.token_slices)
    assert run == dataclasses.replace(expected, slicing=sliced)
    assert run.plan.to_paper() == expected.plan.to_paper()
    assert (
        run.parallelism.n_data,
        run.parallelism.n_stages,
        run.parallelism.n_op,
        run.parallelism.world_size,
    ) == (1, 96, 4, 384)
    assert "vocabulary padded from 50257 to 50260" in printed  # a multiple of #Op = 4
    torchrun = [ln.strip() for ln in printed.splitlines() if ln.strip().startswith("torchrun ")]
    assert len(torchrun) == 1, printed
    tokens = torchrun[0].split()
    assert tokens[tokens.index("--nnodes") + 1] == "48"  # 384 GPUs / 8 per node
    assert tokens[tokens.index("--nproc-per-node") + 1] == "8"
    assert tokens[tokens.index("--config") + 1] == str(out)
    assert tokens[tokens.index("--out") + 1] == "result.pt"


def test_run_on_packed_documents_records_the_source(tmp_path: Path) -> None:
    from tplib.runtime import load_run_config

    out = tmp_path / "run.json"
    argv = ["run", "--setting", "9", "--plan", "gpipe", "--out", str(out), "--packed", "corpus"]
    assert main(argv) == 0
    data = load_run_config(out).data
    assert (data.source, data.packing, data.document_masking) == ("corpus-documents", "ffd", True)


def test_run_with_sequence_parallelism_records_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tplib.runtime import load_run_config

    out = tmp_path / "run.json"
    argv = ["run", "--setting", "9", "--plan", "gpipe", "--out", str(out), "--sequence-parallel"]
    assert main(argv) == 0
    run = load_run_config(out)
    assert run.parallelism.sequence_parallel and run.parallelism.n_op == 4
    assert "sequence-parallel" in capsys.readouterr().out


def test_run_writes_the_distributed_optimizer_into_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tplib.runtime import load_run_config

    out = tmp_path / "run.json"
    argv = ["run", "--setting", "1", "--plan", "gpipe", "--distributed-optimizer"]
    assert main([*argv, "--out", str(out)]) == 0
    assert "#Data=8 x #Pipe=24" in capsys.readouterr().out
    run = load_run_config(out)
    assert (run.parallelism.n_data, run.parallelism.distributed_optimizer) == (8, True)
    assert run == dataclasses.replace(
        setting_run(1, plan="gpipe"),
        parallelism=dataclasses.replace(run.parallelism, distributed_optimizer=True),
    )


def test_run_refuses_a_setting_outside_table1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--setting", "11", "--out", str(tmp_path / "run.json")]) == 2
    assert "setting (11) is not in Table 1" in capsys.readouterr().err
    assert not (tmp_path / "run.json").exists()


BENCH = ["bench", "--model", "tiny", "--schedule", "terapipe", "--stages", "2", "--batch", "2"]
BENCH += ["--seq-len", "16", "--slices", "4"]


@pytest.mark.system  # bench's local processes start inside main()
def test_bench_3d_with_recompute_reports_memory(capsys: pytest.CaptureFixture[str]) -> None:
    # #Pipe x #Op = 2 x 2: four local processes, one quick iteration.
    argv = [*BENCH, "--op", "2", "--recompute", "full", "--iters", "1", "--warmup", "0"]
    assert main([*argv, "--backend", "gloo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "gloo"
    assert (out["n_op"], out["recompute"], out["precision"], out["device"]) == (
        2,
        "full",
        "fp32",
        "cpu",
    )
    assert out["iterations"] == 1 and out["plan"] == "[(1, [4] * 4)] * 2"
    assert len(out["stage_peak_bytes"]) == 2 and len(out["modelled_peak_bytes"]) == 2
    assert all(b > 0 for b in out["stage_peak_bytes"]) and out["memory_source"] == "counted"
    worst = max(
        abs(m / x - 1)
        for m, x in zip(out["modelled_peak_bytes"], out["stage_peak_bytes"], strict=True)
    )
    assert out["memory_error"] == pytest.approx(worst) and out["memory_error"] < 0.1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dtype", "fp16"], "precision 'fp16' needs device='cuda', got device='cpu'"),
        (["--op", "3"], "n_op=3 must divide tiny's 4 attention heads"),
        (["--recompute", "partial"], "recompute='partial' is not a recompute mode"),
        (["--dtype", "fp8"], "unknown precision 'fp8'"),
        (["--device", "tpu"], "device='tpu'"),
        (["--packed", "corpus", "--schedule", "2bw", "--slices", "1"], "packed documents run"),
        (["--chunks", "2"], "n_chunks=2 with schedule 'terapipe': it holds exactly 1"),
        (
            ["--schedule", "terapipe-interleaved", "--chunks", "3"],
            "n_chunks=3 with 2 stages of model tiny's 4 layers",
        ),
        (["--schedule", "interleaved-1f1b"], "--slices=4 with interleaved-1f1b: interleaved-1f1b"),
        (["--sequence-parallel"], "sequence_parallel=True with n_op=1: sequence parallelism"),
        (["--cp", "4"], "token slice 0 of batch slice 0 (plan [(1, [4] * 4)] * 2) of 4 tokens"),
        (
            ["--op", "4", "--slices", "8", "--sequence-parallel"],
            "n_op=4: token slices [2, 2, 2, 2, 2, 2, 2, 2] of batch slice 0",
        ),
        (
            ["--schedule", "2bw", "--slices", "1", "--distributed-optimizer"],
            "schedule_name='2bw' with distributed_optimizer=True: an asynchronous",
        ),
    ],
)
def test_bench_bad_layouts_exit_2(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main([*BENCH, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--backend", "nccl"], "error: backend 'nccl' for a run on device 'cpu': NCCL moves"),
        (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
    ],
)
def test_bench_refuses_a_backend_that_cannot_work_before_starting(
    extra: list[str], message: str
) -> None:
    code, err = run_cli([*BENCH, *extra])
    assert code == 2 and message in err, err
    assert run_cli([*BENCH, "--backend", "gloo"])[0] == "started"  # the positive control


# ---- bad input, generated -------------------------------------------------------------
# Each example is one valid command with one option given a value that breaks its rule.
# Whatever would start work (timing a stage, local processes, papermill, a table's rows)
# is replaced by a sentinel, so an input that got through shows up as Started, not as
# minutes of work. Derandomized: the same argv lists on every run.

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=120)
MODELS = {"gpt3-1b", "gpt3-13b", "gpt3-44b", "gpt3-175b", "gpt2", "tiny", "mini", "small"}


class Started(Exception):
    """The command accepted its input and began its work."""


def _start(*args: object, **kwargs: object) -> NoReturn:
    raise Started


def _check_then_start(table: Any, mode: str, params: Any) -> NoReturn:
    table.check(mode, params)
    raise Started


WORK = [
    "tplib.runtime.bench",
    "tplib.reproduce.reproduce",
    "tplib.perfmodel.profiler.build_profile",
]


def run_cli(argv: list[str]) -> tuple[int | str, str]:
    """``main(argv)``'s exit code ("started" if it began work) and its stderr."""
    err = io.StringIO()
    with contextlib.ExitStack() as stack:
        for target in WORK:
            stack.enter_context(mock.patch(target, _start))
        stack.enter_context(mock.patch("tplib.tables.run", _check_then_start))
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            return main(argv), err.getvalue()
        except Started:
            return "started", err.getvalue()


def _not_an_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return True
    return False


def _not_a_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False


NOT_INT = st.one_of(
    st.sampled_from(["x", "1.5", "", "1e3", "0x10", "nan", "inf", "2 3", "--1"]),
    st.text(max_size=6).filter(_not_an_int),
)
NOT_FLOAT = st.one_of(
    st.sampled_from(["x", "", "1,5", "0x10", "--1", "1e"]), st.text(max_size=6).filter(_not_a_float)
)
NOT_FINITE = st.sampled_from(["nan", "inf", "-inf", "NaN", "1e400", "-1e999"])
HUGE = st.integers(min_value=2**31).map(str)
# The values that break each kind of option's rule.
BAD: dict[str, st.SearchStrategy[str]] = {
    "count": st.one_of(NOT_INT, HUGE, st.integers(max_value=0).map(str)),
    "natural": st.one_of(NOT_INT, HUGE, st.integers(max_value=-1).map(str)),
    "int": st.one_of(NOT_INT, HUGE),  # its range is the library's, tested by example
    "setting": st.one_of(NOT_INT, HUGE, st.integers().filter(lambda n: not 1 <= n <= 10).map(str)),
    "stages": st.one_of(NOT_INT, HUGE, st.integers(max_value=0).map(str)),
    "positive": st.one_of(NOT_FLOAT, NOT_FINITE, st.floats(max_value=0).map(str)),
    "nonneg": st.one_of(NOT_FLOAT, NOT_FINITE, st.floats(max_value=-1e-300).map(str)),
    "model": st.text(max_size=10).filter(lambda t: t.lower() not in MODELS),
    "schedule": st.text(max_size=10).filter(
        lambda t: t not in {"gpipe", "terapipe", "1f1b", "terapipe-zb", "1f1b-zb", "pipedream", "2bw"}
    ),
    "dtype": st.text(max_size=6).filter(lambda t: t not in {"fp32", "bf16"}),  # fp16 needs CUDA
    "precision": st.text(max_size=6).filter(lambda t: t not in {"fp32", "bf16", "fp16"}),
    "device": st.text(max_size=6).filter(lambda t: t not in {"cpu", "cuda"}),
    "recompute": st.text(max_size=6).filter(lambda t: t not in {"none", "selective", "full"}),
    "method": st.text(max_size=6).filter(lambda t: t not in {"exact", "paper"}),
    "rate": st.one_of(NOT_FLOAT, NOT_FINITE, st.floats(min_value=1).map(str), st.floats(max_value=-1e-300).map(str)),
    "attention": st.text(max_size=6).filter(lambda t: t not in {"split", "masked"}),
    "lr_schedule": st.text(max_size=8).filter(lambda t: t not in {"cosine", "constant"}),
    "decay_params": st.text(max_size=8).filter(lambda t: t not in {"matrices", "all"}),
}  # fmt: skip


def check_bad_option(
    base: list[str],
    options: dict[str, str],
    data: st.DataObject,
    kinds: dict[str, st.SearchStrategy[str]] = BAD,
) -> None:
    """Give one of ``options`` (option -> kind of ``kinds``) a bad value on the valid
    command ``base``: it must exit with 2 and an ``error:`` line naming the value, before
    any work."""
    option = data.draw(st.sampled_from(sorted(options)))
    value = data.draw(kinds[options[option]])
    argv = [a for i, a in enumerate(base) if option not in (a, base[i - 1] if i else "")]
    code, err = run_cli([*argv, f"{option}={value}"])
    assert code == 2, (argv, option, value, code, err)
    assert "error: " in err and "Traceback" not in err, err
    assert value in err or repr(value) in err or repr(value)[1:-1] in err, (value, err)


PROFILE = ["profile", "--model", "tiny", "--seq-len", "64", "--quiet", "--out", "unused.json"]
PROFILE_OPTIONS = {
    "--model": "model", "--layers": "count", "--seq-len": "count", "--batch": "count",
    "--granularity": "count", "--repeats": "count", "--rounds": "count", "--threads": "count",
    "--link-bandwidth": "positive", "--link-latency": "nonneg", "--dtype": "precision",
    "--dropout": "rate", "--attention": "attention",
}  # fmt: skip


@FUZZ
@given(st.data())
def test_profile_refuses_bad_options_before_timing(data: st.DataObject) -> None:
    check_bad_option(PROFILE, PROFILE_OPTIONS, data)


# The options of a command that plans a paper setting (plan --setting, simulate).
SETTING_OPTIONS = {
    "--setting": "setting",
    "--eps": "nonneg",
    "--seq-len": "count",
    "--method": "method",
}


@FUZZ
@given(st.data())
def test_plan_refuses_bad_options(analytic_file: Path, data: st.DataObject) -> None:
    if data.draw(st.booleans()):
        base = [
            "plan",
            "--profile",
            str(analytic_file),
            "--seq-len",
            "64",
            "--batch",
            "4",
            "--stages",
            "2",
        ]
        options = {
            "--seq-len": "count",
            "--batch": "count",
            "--stages": "stages",
            "--eps": "nonneg",
            "--granularity": "count",
            "--max-batch-slice-size": "count",
            "--method": "method",
        }
    else:
        base, options = ["plan", "--setting", "9"], SETTING_OPTIONS
    check_bad_option(base, options, data)


@FUZZ
@given(st.data())
def test_simulate_refuses_bad_options(data: st.DataObject) -> None:
    check_bad_option(["simulate", "--setting", "9"], SETTING_OPTIONS, data)


BENCH_OPTIONS = {
    "--schedule": "schedule", "--stages": "stages", "--batch": "count", "--seq-len": "count",
    "--slices": "count", "--model": "model", "--data": "count", "--op": "stages",
    "--recompute": "recompute", "--dtype": "dtype", "--device": "device", "--iters": "count",
    "--warmup": "natural", "--timeout": "positive", "--threads": "natural",
    "--grad-clip": "nonneg", "--lr-schedule": "lr_schedule", "--weight-decay-params": "decay_params",
}  # fmt: skip


@FUZZ
@given(st.data())
def test_bench_refuses_bad_options_before_starting_processes(data: st.DataObject) -> None:
    check_bad_option(BENCH, BENCH_OPTIONS, data)


@FUZZ
@given(st.data())
def test_run_refuses_bad_options_before_writing(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    out = tmp_path_factory.getbasetemp() / "never.json"
    options = {
        "--setting": "setting",
        "--seq-len": "count",
        "--dtype": "precision",
        "--recompute": "recompute",
        "--steps": "count",
        "--warmup": "natural",
    }
    check_bad_option(["run", "--setting", "9", "--out", str(out)], options, data)
    assert not out.exists()  # fmt: skip


JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.floats(), st.text(max_size=4)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
PARAM_NAMES = st.sampled_from(["settings", "seq_lens", "eps", "method", "batches", "window", "simulate", "measure", "x"])  # fmt: skip


@FUZZ
@given(
    st.sampled_from(["table main_results", "table seqlen_sweep", "table pipeline_systems", "reproduce"]),
    st.one_of(
        st.text(max_size=12),
        JSON.map(json.dumps),
        st.dictionaries(PARAM_NAMES, JSON, max_size=2).map(json.dumps),
        st.dictionaries(st.sampled_from(["main_results", "seqlen_sweep", "simulate"]),
                        st.dictionaries(PARAM_NAMES, JSON, max_size=2), max_size=2).map(json.dumps),
    ),
)  # fmt: skip
def test_params_json_is_refused_or_checked_before_the_tables_run(command: str, text: str) -> None:
    code, err = run_cli([*command.split(), f"--params={text}"])
    assert code in (2, "started"), (text, code, err)
    if code == 2:
        assert "error: " in err and "Traceback" not in err, err


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.text(max_size=8),
            st.sampled_from(["--json", "--out", "-x", "plan", "--setting", "--eps", "9", "table"]),
        ),
        max_size=5,
    )
)
def test_random_argv_never_raises(argv: list[str]) -> None:
    code, err = run_cli(argv)
    assert code in (0, 2, "started"), (argv, code, err)
    if code == 2:
        assert "error: " in err and "Traceback" not in err, err  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--setting", "9", "--eps=nan"], "argument --eps: nan is not a finite number"),
        (["plan", "--setting", "9", "--eps=-1"], "argument --eps: -1 is not >= 0"),
        (["plan", "--setting", "9", "--granularity", "16"], "--granularity applies only to --profile"),
        (["plan", "--setting", "9", "--batch", "2", "--stages", "4"], "--batch, --stages apply only to --profile"),
        (["simulate", "--setting", "9", "--seq-len", "0"], "argument --seq-len: 0 is not a positive integer"),
        (["profile", "--model", "tiny", "--layers", "99999999999", "--out", "p.json"], "argument --layers: 99999999999 is beyond 2147483647"),
        (["profile", "--model", "tiny", "--layers", "5", "--out", "p.json"], "--layers 5 is more than tiny's 4 layers"),
        (["profile", "--model", "tiny", "--threads", "-1", "--out", "p.json"], "argument --threads: -1 is not a positive integer"),
        (["profile", "--model", "tiny", "--link-bandwidth", "0", "--out", "p.json"], "argument --link-bandwidth: 0 is not > 0"),
        ([*BENCH, "--timeout", "inf"], "argument --timeout: inf is not a finite number"),
        ([*BENCH, "--batch", "two"], "argument --batch: 'two' is not an integer"),
        (["reproduce", "--params", '{"main_results": 3}'], "--params 'main_results': 3 is not a JSON object"),
        (["reproduce", "--params", '{"main_results": {"simulate": [9]}}'], "is not a JSON object of the table's parameters"),
        (["reproduce", "--params", '{"main_results": {"settings": 9}}'], "settings=9 is not of type Iterable[int]"),
        (["table", "main_results", "--params", '{"settings": []}'], "settings=[] is empty"),
    ],
)  # fmt: skip
def test_bad_options_name_the_value_and_the_rule(argv: list[str], message: str) -> None:
    code, err = run_cli(argv)
    assert code == 2 and message in err, err


def test_python_m_tplib_exits_2_with_an_error_line() -> None:
    argv = [sys.executable, "-m", "tplib", "simulate", "--setting", "9", "--eps", "nan"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines()[-1] == (
        "tplib simulate: error: argument --eps: nan is not a finite number"
    )
