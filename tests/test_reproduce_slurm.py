"""``reproduce --launcher slurm`` with stand-ins for sbatch, srun and squeue: one array
task per configuration, each a real papermill run; a failed task is named with its log;
a second invocation resubmits only what is not done; ``--no-wait`` returns and a later
invocation gathers; the gathered CSVs are those a local run writes."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tplib.cli import main
from tplib.reproduce import reproduce
from tplib.tables import run_table

from .conftest import code_copy

ROOT = Path(__file__).resolve().parents[1]
CODE = ("tplib", "notebooks", "pyproject.toml", "scripts/slurm")


def _code_copy(dest: Path) -> Path:
    return code_copy(dest, CODE)


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _stand_ins(tmp_path: Path) -> Path:
    """sbatch: runs every array task at once, in the background as a cluster would, with
    SLURM's variables and the log --output names, then prints 'Submitted batch job N'
    (N = 100, 101, ...) and records its arguments. srun: runs its command, unless the
    task's configuration (its job list entry's tag) is listed in ``fail``. squeue: lists
    the array while the file ``running`` exists (once more only, if ``once`` exists)."""
    bin_dir, state = tmp_path / "bin", tmp_path / "slurm-state"
    bin_dir.mkdir()
    state.mkdir()
    s = shlex.quote(str(state))
    _fake(
        bin_dir,
        "sbatch",
        f"""state={s}
printf '%s\\n' "$@" > "$state/sbatch-$(ls "$state" | grep -c '^sbatch-').args"
while [ $# -gt 0 ]; do
  case $1 in
    --array=*) last=${{1#--array=0-}};;
    --output=*) output=${{1#--output=}};;
    --chdir=*) chdir=${{1#--chdir=}};;
    -*) ;;
    *) break;;
  esac
  shift
done
id=$(cat "$state/next" 2>/dev/null || echo 100)
echo $((id + 1)) > "$state/next"
cd "$chdir"
for i in $(seq 0 "$last"); do
  log=${{output//%A/$id}}
  SLURM_ARRAY_JOB_ID=$id SLURM_ARRAY_TASK_ID=$i SLURM_JOB_ID=$((id * 100 + i)) \\
    bash "$@" > "${{log//%a/$i}}" 2>&1 &
done
wait
echo "Submitted batch job $id"
[ -e "$state/running" ] && echo "$id" > "$state/running"
exit 0""",
    )
    _fake(
        bin_dir,
        "srun",
        f"""while [[ $1 == -* ]]; do shift; done
# "$@" is: python -m tplib.reproduce.slurm JOB_LIST INDEX
tag=$("$1" -c 'import json, sys
print(json.load(open(sys.argv[1]))["jobs"][int(sys.argv[2])]["tag"])' "$4" "$5")
if grep -qx "$tag" {s}/fail 2>/dev/null; then echo "stand-in srun: task $tag failed" >&2; exit 3; fi
exec "$@"
""",
    )
    _fake(
        bin_dir,
        "squeue",
        f"if [ -e {s}/running ]; then cat {s}/running; [ -e {s}/once ] && rm {s}/running; fi\n"
        "exit 0",
    )
    return bin_dir


def _submissions(tmp_path: Path) -> list[list[str]]:
    """Each sbatch call's arguments, in order."""
    state = tmp_path / "slurm-state"
    count = len(list(state.glob("sbatch-*.args")))
    return [(state / f"sbatch-{i}.args").read_text().splitlines() for i in range(count)]


def _submitted_tags(args: list[str]) -> list[str]:
    """The configurations one sbatch call submitted: its job list's (table, tag)s."""
    job_list = json.loads(Path(args[-2]).read_text())
    return [f"{e['table']}-{e['tag']}" for e in job_list["jobs"]]


def _reproduce(
    copy: Path, bin_dir: Path, results: Path, params: dict[str, object], *extra: str
) -> subprocess.CompletedProcess[str]:
    """``python -m tplib reproduce --launcher slurm`` in simulate mode on the copy, with the
    stand-ins first on PATH and no SLURM variables of the machine running the tests."""
    command = [sys.executable, "-m", "tplib", "reproduce", "--mode", "simulate"]
    command += ["--only", *params, "--params", json.dumps(params), "--results", str(results)]
    command += ["--launcher", "slurm", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=300)


def test_an_array_per_configuration_names_failures_resumes_and_gathers(tmp_path: Path) -> None:
    copy = _code_copy(tmp_path / "repo")
    bin_dir = _stand_ins(tmp_path)
    results = tmp_path / "results"
    params: dict[str, object] = {
        "main_results": {"settings": [1, 7]},
        "dp_ablation": {"settings": [8]},
    }
    (tmp_path / "slurm-state" / "fail").write_text("simulate-s8\n")  # dp_ablation's
    out = _reproduce(copy, bin_dir, results, params, "--sbatch-args", "--partition=p --time=9")
    assert out.returncode == 1, out.stderr[-3000:]
    parts = results / "slurm"
    log = parts / "logs" / "100_2.log"
    assert (
        f"dp_ablation (simulate) settings=[8]: array task 100_2, log {log}: "
        "stand-in srun: task simulate-s8 failed"
    ) in out.stderr
    (first,) = _submissions(tmp_path)
    assert first[:2] == ["--array=0-2", f"--output={parts / 'logs' / '%A_%a.log'}"]
    assert first[first.index("--partition=p") + 1] == "--time=9"
    assert first[-3] == str(copy / "scripts/slurm/tplib-reproduce.sbatch")
    assert _submitted_tags(first) == [
        "main_results-simulate-s1",
        "main_results-simulate-s7",
        "dp_ablation-simulate-s8",
    ]
    # The table whose configurations all finished is gathered; the other is not written.
    assert (results / "main_results" / "main_results-simulate.csv").exists()
    assert not (results / "dp_ablation").exists() and not (results / "SUMMARY.md").exists()

    # Again, with a finished configuration's CSV removed: it and the failed one only.
    (parts / "main_results" / "main_results-simulate-s1.csv").unlink()
    kept = parts / "main_results" / "main_results-simulate-s7.ipynb"
    kept_at = kept.stat().st_mtime_ns
    (tmp_path / "slurm-state" / "fail").unlink()
    out = _reproduce(copy, bin_dir, results, params)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skip main_results (simulate) settings=[7]: finished earlier in this run" in out.stdout
    assert "resumed an interrupted run: ran 2 of 3 notebooks" in out.stdout
    second = _submissions(tmp_path)[1]
    assert second[0] == "--array=0-1"
    assert _submitted_tags(second) == ["main_results-simulate-s1", "dp_ablation-simulate-s8"]
    assert kept.stat().st_mtime_ns == kept_at
    for name in ("main_results-simulate-s1", "main_results-simulate-s7"):
        for suffix in (".ipynb", ".csv", ".png"):
            assert (parts / "main_results" / f"{name}{suffix}").exists(), name + suffix

    # The gathered tables are what a local run writes for the same configurations.
    for table, given in params.items():
        assert isinstance(given, dict)
        local, _ = run_table(table, "simulate", **given).save(tmp_path / "local" / table)
        gathered = results / table / f"{table}-simulate.csv"
        assert gathered.read_bytes() == local.read_bytes(), table
        assert (results / table / f"{table}-simulate.png").read_bytes().startswith(b"\x89PNG")
    state = json.loads((results / ".run.json").read_text())
    assert state["finished"] and all(j["finished"] for j in state["jobs"])
    summary = (results / "SUMMARY.md").read_text()
    assert "### Main results" in summary and "DP" in summary and "| 7 |" in summary
    assert not [p for p in results.rglob(".*") if p.name != ".run.json"]  # no temporary file


def test_no_wait_returns_and_a_later_call_gathers_without_resubmitting(tmp_path: Path) -> None:
    copy = _code_copy(tmp_path / "repo")
    bin_dir = _stand_ins(tmp_path)
    results = tmp_path / "results"
    params: dict[str, object] = {"main_results": {"settings": [7]}}
    (tmp_path / "slurm-state" / "running").write_text("")  # squeue lists the array
    for _ in range(2):
        out = _reproduce(copy, bin_dir, results, params, "--no-wait")
        assert out.returncode == 0, out.stderr[-3000:]
        assert "1 configurations queued or running on SLURM (0 finished)" in out.stdout
    assert "wait for SLURM array 100: 1 configurations submitted earlier" in out.stdout
    assert len(_submissions(tmp_path)) == 1  # the second call did not submit it again
    assert not (results / "main_results" / "main_results-simulate.csv").exists()

    (tmp_path / "slurm-state" / "once").write_text("")  # the array ends after one more squeue
    out = _reproduce(copy, bin_dir, results, params, "--poll", "0.1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "waiting for SLURM array 100: squeue every 0.1 s" in out.stdout
    assert "ran  main_results (simulate) settings=[7] in array task 100_0" in out.stdout
    assert len(_submissions(tmp_path)) == 1
    assert (results / "main_results" / "main_results-simulate.csv").exists()
    assert (results / "SUMMARY.md").exists()


# ---- bad input, before any work --------------------------------------------------------


def test_without_sbatch_the_slurm_launcher_stops_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"launcher 'slurm' needs sbatch and squeue on PATH"):
        reproduce("simulate", root=tmp_path / "results", launcher="slurm")
    assert main(["reproduce", "--launcher", "slurm", "--results", str(tmp_path / "r")]) == 2
    assert "error: launcher 'slurm' needs sbatch and squeue on PATH" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no manifest, no results folder


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"launcher": "k8s"}, r"launcher='k8s': choose 'local' \(this machine\) or 'slurm'"),
        ({"sbatch_args": "-p gpu"}, r"sbatch_args and wait=False: only with launcher 'slurm'"),
        ({"launcher": "slurm", "sbatch_args": "--array=0-3"}, r"'--array=0-3': tplib sets --array"),
        ({"launcher": "slurm", "sbatch_args": "-o x.log"}, r"'-o': tplib sets --output"),
        ({"launcher": "slurm", "sbatch_args": "-p 'gpu"}, r"sbatch_args \"-p 'gpu\" cannot be"),
        ({"launcher": "slurm", "poll_s": 0}, r"poll_s=0: give a positive number"),
    ],
)
def test_bad_launcher_options_name_the_value_and_the_rule(
    kwargs: dict[str, object], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = _stand_ins(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    with pytest.raises(ValueError, match=message):
        reproduce("simulate", root=tmp_path / "results", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "results").exists()


def test_cli_refuses_slurm_options_without_the_slurm_launcher(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["reproduce", "--no-wait"]) == 2
    assert "error: --no-wait: only with --launcher slurm" in capsys.readouterr().err
    assert main(["reproduce", "--launcher", "k8s"]) == 2
    assert "argument --launcher: invalid choice: 'k8s'" in capsys.readouterr().err
