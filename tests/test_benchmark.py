import json
from collections.abc import Callable

import pandas as pd
import pytest

from tplib.cli import main
from tplib.runtime import TRACE_COLUMNS, LocalPool, RunConfig
from tplib.runtime.benchmark import BenchResult, bench, busiest_stage_work
from tplib.schedule import registered, schedule_names


def test_busiest_stage_work_sums_compute_per_rank() -> None:
    rows = [
        # rank, stage, replica, op_rank, iteration, kind, b, t, v, chunk, start, end
        (0, 0, 0, 0, 0, "F", 0, 0, -1, 0, 0.0, 1.0),
        (0, 0, 0, 0, 0, "SA", 0, 0, -1, 0, 1.0, 1.5),  # communication: not compute
        (0, 0, 0, 0, 0, "B", 0, 0, -1, 0, 4.0, 6.0),
        (1, 1, 0, 0, 0, "F", 0, 0, -1, 0, 1.5, 2.0),
        (1, 1, 0, 0, 0, "B", 0, 0, -1, 0, 2.0, 3.0),
        (1, 1, 0, 0, 0, "OPT", -1, -1, -1, 0, 6.0, 6.5),
        (0, 0, 0, 0, 1, "F", 0, 0, -1, 0, 0.0, 0.5),
        (1, 1, 0, 0, 1, "F", 0, 0, -1, 0, 0.0, 2.0),
    ]
    busiest = busiest_stage_work(pd.DataFrame(rows, columns=list(TRACE_COLUMNS)))
    assert busiest.tolist() == [3.0, 2.0]


@pytest.mark.system  # bench's local processes start inside main()
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


# ---- every schedule, with bench's defaults ----------------------------------------------------

# Two iterations: an asynchronous schedule's one pass then spans two, as bench's default
# run spans six (modelling its memory once read units past the first iteration's plan).
TINY = ["bench", "--model", "tiny", "--stages", "2", "--batch", "1", "--seq-len", "8"]
TINY += ["--iters", "2", "--warmup", "0"]


@pytest.fixture(scope="module")
def bench_on_a_warm_pool(
    pools: Callable[[int], LocalPool],
) -> Callable[..., BenchResult]:
    """``bench`` with its runs on one pool of two ranks: the command is what is under test,
    and starting two processes per schedule would cost more than the runs."""

    def run_bench(run: RunConfig, backend: str | None = None) -> BenchResult:
        return bench(run, pools(run.parallelism.world_size).run(run), backend=backend)

    return run_bench


@pytest.mark.parametrize("schedule", schedule_names())
def test_bench_runs_every_schedule_with_its_defaults(
    schedule: str,
    bench_on_a_warm_pool: Callable[..., BenchResult],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("tplib.runtime.bench", bench_on_a_warm_pool)
    # Interleaved 1F1B needs a microbatch per stage at least (Megatron's rule).
    batch = ["--batch", "2"] if registered(schedule).chunked else []
    assert main([*TINY, *batch, "--schedule", schedule, "--json"]) == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    assert out["schedule"] == schedule and out["iterations"] == 2 and out["median_latency_s"] > 0
    assert len(out["modelled_peak_bytes"]) == 2 and all(b > 0 for b in out["modelled_peak_bytes"])
    # The default recipe clips, which an asynchronous schedule refuses: bench says it
    # trains that one unclipped, in one line, and says nothing for the others.
    notes = printed.err.splitlines()
    if registered(schedule).asynchronous:
        assert len(notes) == 1 and "--grad-clip 0 instead of the default 1" in notes[0], notes
    else:
        assert notes == []


class Received(Exception):
    """What the stand-in for bench raises once it has the run: nothing needs to train."""


def test_bench_trains_the_recipe_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[RunConfig] = []

    def keep(run: RunConfig, backend: str | None = None) -> BenchResult:
        runs.append(run)
        raise Received

    monkeypatch.setattr("tplib.runtime.bench", keep)
    recipe = ["--grad-clip", "0.5", "--lr-schedule", "constant", "--weight-decay-params", "all"]
    for schedule, clip in (("1f1b", 0.5), ("2bw", 0.0)):
        given = recipe if clip else recipe[2:]
        with pytest.raises(Received):
            main([*TINY, "--schedule", schedule, *given])
        optim = runs[-1].optim
        assert (optim.grad_clip, optim.lr_schedule_name, optim.weight_decay_params) == (
            clip,
            "constant",
            "all",
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--schedule", "pipedream", "--grad-clip", "0.5"],
            "--grad-clip=0.5 with --schedule pipedream: an asynchronous schedule",
        ),
        (["--schedule", "2bw", "--weight-decay-params", "biases"], "weight_decay_params='biases'"),
        (["--schedule", "1f1b", "--lr-schedule", "linear"], "invalid choice: 'linear'"),
    ],
)
def test_bench_refuses_a_recipe_the_schedule_does_not_take(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def never(*args: object, **kwargs: object) -> BenchResult:
        raise AssertionError("bench started processes for a refused recipe")

    monkeypatch.setattr("tplib.runtime.bench", never)
    assert main([*TINY, *argv]) == 2
    assert message in capsys.readouterr().err
