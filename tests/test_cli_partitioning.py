"""The layout commands: ``autoplan`` and ``partition``, their output and their errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_cli import BAD, check_bad_option, run_cli
from tplib.cli import main
from tplib.nn.configs import get_config
from tplib.paper import SETTINGS
from tplib.perfmodel import build_profile


def test_autoplan_json_has_the_best_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["autoplan", "--model", "GPT3-175B", "--gpus", "384", "--batch", "2", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    best = out["candidates"][0]
    assert (out["model"], out["n_gpus"], out["batch"], out["seq_len"]) == (
        "GPT3-175B",
        384,
        2,
        2048,
    )
    assert best["status"] == "fits" and best["reason"] == "best"
    assert best["n_data"] * best["n_stages"] * best["n_op"] == 384
    unplanned = [c for c in out["candidates"] if c["status"] != "fits"]
    assert unplanned and all(c["latency"] is None for c in unplanned)  # NaN is not JSON
    assert out["seconds"] > 0


def test_autoplan_text_gives_latency_memory_and_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    s = SETTINGS[10]
    argv = ["autoplan", "--model", s.model, "--gpus", str(s.n_gpus), "--batch", str(s.batch)]
    assert main([*argv, "--top", "3", "--recompute", "none"]) == 0
    out = capsys.readouterr().out
    assert "layouts searched in" in out and " 1. #Data=" in out and "best" in out
    assert "GiB" in out and ("slower: +" in out or "out of memory" in out)
    assert "recompute" not in out.split("\n", 1)[1].replace("recompute=", "")


def test_autoplan_writes_the_best_layouts_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tplib.runtime import load_run_config

    out = tmp_path / "run.json"
    argv = ["autoplan", "--model", "GPT3-175B", "--gpus", "384", "--batch", "2"]
    assert main([*argv, "--out", str(out), "--steps", "3"]) == 0
    printed = capsys.readouterr().out
    assert "torchrun --nnodes 48 --nproc-per-node 8" in printed and str(out) in printed
    run = load_run_config(out)
    assert (
        run.parallelism.world_size == 384
        and run.timing.steps == 3
        and run.schedule_name == "terapipe"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "12", "--batch", "2"], "n_gpus=12 does not fill whole nodes"),
        (["--gpus", "384", "--batch", "2", "--memory", "4"], "nothing fits in 4.0 GiB"),
        (["--gpus", "384", "--batch", "2", "--cluster", "tpu"], "cluster='tpu'"),
    ],
)
def test_autoplan_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["autoplan", "--model", "GPT3-175B", *argv]) == 2
    assert message in capsys.readouterr().err


def test_autoplan_searches_context_parallelism_and_seq1f1b(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["autoplan", "--model", "GPT3-13B", "--gpus", "64", "--batch", "16"]
    argv += ["--seq-len", "131072", "--cluster", "dgx-h100", "--recompute", "all", "--json"]
    assert main([*argv, "--schedules", "1f1b", "seq1f1b", "--cp", "0"]) == 0
    found = json.loads(capsys.readouterr().out)["candidates"]
    assert {c["schedule"] for c in found} == {"1f1b", "seq1f1b"}
    assert {c["n_cp"] for c in found} >= {1, 2, 4, 8}
    assert main([*argv, "--cp", "0", "2"]) == 2
    assert "--cp 0 2: 0 (every #CP) stands alone" in capsys.readouterr().err
    out = str(tmp_path / "run.json")
    assert main([*argv, "--schedules", "1f1b", "--out", out]) == 2
    assert "a search's run is TeraPipe's plan in one round" in capsys.readouterr().err


def test_partition_gpipe(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["partition", "--planner", "gpipe", "--model", "GPT3-1B", "--stages", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ranges = out["stage_ranges"]
    assert len(ranges) == 4 and ranges[0][0] == 0 and ranges[-1][1] == 24
    assert main(["partition", "--planner", "gpipe", "--model", "GPT3-1B"]) == 2
    assert "--stages is required" in capsys.readouterr().err
    assert main([*argv[:-3], "--stages", "25"]) == 2
    assert "n_stages=25 is more than the chain's 24 layers" in capsys.readouterr().err


def test_partition_pipedream_and_2bw(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["partition", "--model", "GPT3-1B", "--gpus", "8", "--seq-len", "512"]
    assert main([*argv, "--planner", "pipedream"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: layers [0, " in out and "GPUs" in out
    # Whole 2048-token sequences: weight stashing's in-flight activations do not fit.
    full = ["partition", "--model", "GPT3-1B", "--gpus", "8", "--planner", "pipedream"]
    assert main(full) == 2
    assert "nothing fits in 16.0 GiB" in capsys.readouterr().err
    assert main([*full, "--no-memory-check"]) == 0
    capsys.readouterr()
    assert main([*argv, "--planner", "2bw", "--batch", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["fits"] and out["best"]["width"] * out["best"]["depth"] <= 8
    assert main([*argv, "--planner", "2bw"]) == 2
    assert "--batch is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("planner", "options", "schedule"),
    [
        ("gpipe", ["--stages", "4", "--batch", "8", "--microbatch", "2"], "gpipe"),
        ("pipedream", ["--seq-len", "512", "--gpus", "4"], "pipedream"),
        ("2bw", ["--seq-len", "512", "--batch", "64", "--gpus", "8"], "2bw"),
    ],
)
def test_partition_writes_its_choice_as_a_run(
    planner: str, options: list[str], schedule: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from tplib.runtime import load_run_config

    argv = ["partition", "--planner", planner, "--model", "GPT3-1B", *options]
    assert main([*argv, "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    out = tmp_path / "run.json"
    assert main([*argv, "--out", str(out), "--steps", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {'GPipe' if planner == 'gpipe' else ''}" in printed and "torchrun" in printed
    run = load_run_config(out)
    assert (run.model, run.schedule_name, run.timing.steps) == ("GPT3-1B", schedule, 3)
    assert run.cfg.dropout == (0.1 if planner == "gpipe" else 0.0)
    assert ("sets dropout 0.1 to 0" in printed) == (planner != "gpipe")
    ranges = [list(r) for r in run.parallelism.stage_ranges or ()]
    if planner == "gpipe":
        assert ranges == chosen["stage_ranges"] and run.data.batch == 8
        assert run.plan.batch_slices == (2, 2, 2, 2)
    elif planner == "pipedream":
        assert ranges == [[s["lo"], s["hi"]] for s in chosen["stages"]]
        assert run.optim.grad_clip == 0.0  # asynchronous: no clipping
    else:
        best = chosen["best"]
        assert ranges == best["stage_ranges"] and run.data.seq_len == 512
        assert (run.parallelism.n_data, run.parallelism.n_stages) == (best["width"], best["depth"])
        assert run.data.batch == best["width"] * best["microbatch"] * best["accumulation"]


def test_partition_out_refuses_what_it_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "r.json")
    argv = ["partition", "--planner", "gpipe", "--model", "GPT3-1B", "--stages", "4"]
    assert main([*argv, "--out", out]) == 2
    assert "--out with --planner gpipe needs --batch" in capsys.readouterr().err
    # On 8 GPUs PipeDream replicates some stages only, which the runtime does not.
    argv = ["partition", "--planner", "pipedream", "--model", "GPT3-1B", "--seq-len", "512"]
    assert main([*argv, "--gpus", "8", "--out", out]) == 2
    assert "the plan replicates its stages unequally ([0, 6) on 2" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def _tiny_profiles(tmp_path: Path) -> list[str]:
    """Profiles of every stage of the 4-layer tiny model, where the head costs three
    blocks: GPipe's balance gives the head a stage of its own."""
    cfg = get_config("tiny")
    files = []

    def timed(cost: float) -> Callable[[int, int, int], float]:
        return lambda b, length, c: 1e-3 * cost * b * length / 64

    for lo, hi in [(0, 1), (1, 3), (3, 4)]:
        cost = (hi - lo) + (3.0 if hi == cfg.n_layer else 0.0)
        prof = build_profile(
            timed(cost), config=cfg, layers_per_stage=hi - lo, seq_len=64, stage=(lo, hi),
            batch_slice_sizes=(1, 2),
        )  # fmt: skip
        files.append(str(tmp_path / f"stage{lo}.json"))
        prof.save(files[-1])
    return files


@pytest.mark.parametrize(
    "options",
    [
        ["--planner", "gpipe", "--stages", "2", "--batch", "4", "--microbatch", "2"],
        ["--planner", "pipedream", "--gpus", "2", "--microbatch", "2", "--no-memory-check"],
        ["--planner", "2bw", "--gpus", "2", "--batch", "4"],
    ],
)
def test_a_partition_of_measured_profiles_trains_as_its_update_rule_says(
    options: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each planner's choice on this machine's profiles, written with --out, runs on local
    processes and matches the single-device run of the same update rule."""
    from tplib.runtime import launch, load_run_config, train_reference

    out = tmp_path / "run.json"
    argv = ["partition", "--profiles", *_tiny_profiles(tmp_path), *options]
    assert main([*argv, "--out", str(out), "--steps", "2", "--warmup", "0"]) == 0
    capsys.readouterr()
    run = load_run_config(out)
    assert run.model == "tiny" and run.model_overrides == ()
    got, want = launch(run).losses, train_reference(run).losses
    assert got == pytest.approx(want, rel=1e-5) and len(got) == 2


def test_partition_on_measured_profiles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _tiny_profiles(tmp_path)
    argv = ["partition", "--profiles", *files, "--json"]
    assert main([*argv, "--planner", "gpipe", "--stages", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stage_ranges"] == [[0, 3], [3, 4]]
    assert out["on"] == "tiny, 8 workers (profiles measured on cpu)"
    assert main([*argv, "--planner", "pipedream", "--gpus", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"]
    assert main([*argv, "--planner", "2bw", "--gpus", "2", "--batch", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["microbatch"] in (1, 2)
    assert main([*argv, "--planner", "gpipe", "--model", "tiny", "--stages", "2"]) == 2
    assert "exactly one of --model" in capsys.readouterr().err
    assert main(["partition", "--planner", "gpipe", "--profiles", "missing.json"]) == 2
    assert "cannot read profile missing.json" in capsys.readouterr().err
    # A format-2 file timed in bfloat16 weights says no run's precision: its memory
    # cannot be priced.
    old = json.loads(Path(files[0]).read_text())
    for field in ("precision", "attention", "dropout"):
        del old[field]
    Path(files[0]).write_text(json.dumps(old | {"format": "tplib.profile/2", "dtype": "bfloat16"}))
    assert main([*argv, "--planner", "gpipe", "--stages", "2"]) == 2
    assert f"profile {files[0]} does not say which precision it timed" in capsys.readouterr().err


# ---- bad input, generated (the harness is test_cli's) ---------------------------------

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=120)
KINDS = {
    **BAD,
    "cluster": st.text(max_size=12).filter(lambda t: t != "p3.16xlarge"),
    "planner": st.text(max_size=10).filter(lambda t: t not in {"gpipe", "pipedream", "2bw"}),
    "recompute": st.text(max_size=6).filter(lambda t: t not in {"both", "none", "full"}),
}
AUTOPLAN = ["autoplan", "--model", "GPT3-1B", "--gpus", "8", "--batch", "8"]
AUTOPLAN_OPTIONS = {
    "--model": "model", "--gpus": "count", "--batch": "count", "--seq-len": "count",
    "--cluster": "cluster", "--memory": "positive", "--recompute": "recompute", "--top": "count",
    "--steps": "count", "--warmup": "natural",
}  # fmt: skip


@FUZZ
@given(st.data())
def test_autoplan_refuses_bad_options_before_searching(data: st.DataObject) -> None:
    check_bad_option(AUTOPLAN, AUTOPLAN_OPTIONS, data, KINDS)


@FUZZ
@given(st.data())
def test_partition_refuses_bad_options(data: st.DataObject) -> None:
    planner = data.draw(st.sampled_from(["gpipe", "pipedream", "2bw"]))
    base = ["partition", "--planner", planner, "--model", "GPT3-1B", "--seq-len", "512"]
    options = {
        "--planner": "planner",
        "--model": "model",
        "--gpus": "count",
        "--microbatch": "count",
        "--seq-len": "count",
        "--top": "count",
        "--memory": "positive",
    }
    if planner == "gpipe":
        base, options = [*base, "--stages", "2"], {**options, "--stages": "stages"}
    if planner == "2bw":
        base, options = [*base, "--batch", "8"], {**options, "--batch": "count"}
    check_bad_option(base, options, data, KINDS)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*AUTOPLAN, "--seq-len", "0"], "argument --seq-len: 0 is not a positive integer"),
        ([*AUTOPLAN, "--top", "-1"], "argument --top: -1 is not a positive integer"),
        ([*AUTOPLAN, "--steps", "0", "--out", "run.json"], "argument --steps: 0 is not a positive integer"),
        ([*AUTOPLAN, "--memory", "inf"], "argument --memory: inf is not a finite number"),
        (["partition", "--planner", "gpipe", "--model", "GPT3-1B", "--stages", "2", "--seq-len", "-5"], "argument --seq-len: -5 is not a positive integer"),
        (["partition", "--planner", "2bw", "--model", "GPT3-1B", "--batch", "99999999999999999999"], "argument --batch: 99999999999999999999 is beyond 2147483647"),
        (["partition", "--planner", "2bw", "--model", "GPT3-1B", "--batch", "8", "--microbatch", "0"], "argument --microbatch: 0 is not a positive integer"),
    ],
)  # fmt: skip
def test_bad_layout_options_name_the_value_and_the_rule(argv: list[str], message: str) -> None:
    code, err = run_cli(argv)
    assert code == 2 and message in err, err
