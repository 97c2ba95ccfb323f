"""``make reproduce``: a fresh copy of the repository regenerates every simulate table,
an interrupted run resumes without redoing what it finished, anything else starts anew,
and the summary compares each table with the paper and the committed reference."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import pandas as pd
import pytest

import tplib.reproduce as rp
import tplib.reproduce.jobs as jobs
from tplib.reproduce import Job, default_jobs, reproduce
from tplib.reproduce.summary import equal_to_reference, section
from tplib.tables import get_table

from .conftest import code_copy

# psutil (which ipykernel requires) ships no type information: its objects are Any here.
psutil: Any = importlib.import_module("psutil")

ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "main_results": {"settings": [9, 10]},
    "dp_ablation": {"settings": [8]},
    "seqlen_sweep": {"seq_lens": [2048, 8192]},
    "pipeline_systems": {"settings": [8]},
    "layout_search": {"settings": [10]},
    "modern_clusters": {"settings": [10], "clusters": ["dgx-h100"]},
    "long_context": {"studies": ["GPT3-13B/dgx-h100"], "seq_lens": [32768]},
    "packed_sequences": {"settings": [9], "clusters": ["dgx-h100"]},
}


# ---- the real thing, on a fresh copy ------------------------------------------------------


def _command(copy: Path) -> list[str]:
    # `python -m` puts the working directory first on sys.path: the copy's own tplib runs.
    return [
        sys.executable,
        "-m",
        "tplib",
        "reproduce",
        "--mode",
        "simulate",
        "--params",
        json.dumps(SMALL),
    ]


def test_a_fresh_copy_reproduces_and_an_interrupted_run_resumes(tmp_path: Path) -> None:
    copy = code_copy(tmp_path / "repo", ["."])  # what a clone of this checkout has
    results = copy / "results"
    first = results / "main_results" / "main_results-simulate.ipynb"
    committed = first.read_bytes()
    # Start a run and kill it (and its kernel) once its first notebook has finished.
    proc = subprocess.Popen(
        _command(copy),
        cwd=copy,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            manifest = results / ".run.json"
            if manifest.exists() and json.loads(manifest.read_text())["jobs"][0]["finished"]:
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    state = json.loads((results / ".run.json").read_text())
    assert state["jobs"][0]["finished"] is True and state["finished"] is None
    assert first.read_bytes() != committed  # it ran: a new executed notebook
    ran_at = first.stat().st_mtime_ns

    out = subprocess.run(_command(copy), cwd=copy, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed an interrupted run" in out.stdout
    assert "skip main_results (simulate): finished earlier in this run" in out.stdout
    assert first.stat().st_mtime_ns == ran_at  # not redone
    for name in (
        "main_results",
        "dp_ablation",
        "seqlen_sweep",
        "pipeline_systems",
        "layout_search",
        "modern_clusters",
        "long_context",
        "packed_sequences",
    ):
        assert (results / name / f"{name}-simulate.png").exists()
    summary = (results / "SUMMARY.md").read_text()
    assert summary.startswith("# Reproduction summary\n"), summary[:200]
    # The command ends with the line naming the summary's file, a blank line, and the
    # summary it wrote, as it is in that file; progress lines come before.
    _, said, after = out.stdout.partition("; summary in ")
    path, blank, printed = after.partition("\n\n")
    assert said and blank, out.stdout[-3000:]
    assert (copy / path).resolve() == (results / "SUMMARY.md").resolve()
    assert printed == summary + "\n"
    # Each table's reproduced rows equal the copy's committed ones.
    assert summary.count("**Equal to the committed reference**") == 8, summary
    assert "| 9 | GPT3-175B | 6.745 |" in summary  # the paper's speedup beside ours
    assert not list(results.rglob(".*.ipynb")) and not list(results.rglob(".*.csv"))


# ---- killed while a notebook runs ----------------------------------------------------------

CHEAP = {"main_results": {"settings": [1]}, "dp_ablation": {"settings": [8]}}
PNG_END = b"IEND\xaeB`\x82"  # a PNG's last chunk: a truncated figure lacks it


CODE = ("tplib", "notebooks", "pyproject.toml")


def _code_copy(dest: Path) -> Path:
    return code_copy(dest, CODE)


def _complete(path: Path) -> bool:
    """Whether a result file is whole: a notebook or CSV that parses, a PNG with its end."""
    try:
        if path.suffix == ".ipynb":
            return bool(json.loads(path.read_text())["cells"])
        if path.suffix == ".csv":
            return len(pd.read_csv(path)) > 0
        if path.suffix == ".png":
            return path.read_bytes().endswith(PNG_END)
    except (ValueError, KeyError, pd.errors.ParserError):
        return False
    return path.suffix == ".json" and bool(json.loads(path.read_text()))


def _running_cell(out_dir: Path, name: str, code: str) -> bool:
    """Whether papermill's copy of notebook ``name`` (its temporary file, which it rewrites
    as each cell starts and ends) shows the cell holding ``code`` running."""
    for tmp in out_dir.glob(f".{name}-*.ipynb"):
        try:
            cells = json.loads(tmp.read_text())["cells"]
        except (OSError, ValueError, KeyError):
            continue  # being rewritten
        for cell in cells:
            status = cell.get("metadata", {}).get("papermill", {}).get("status")
            if code in "".join(cell["source"]) and status == "running":
                return True
    return False


def test_a_run_killed_mid_notebook_redoes_only_that_notebook(tmp_path: Path) -> None:
    copy = _code_copy(tmp_path / "repo")
    results = tmp_path / "results"
    command = [sys.executable, "-m", "tplib", "reproduce", "--mode", "simulate"]
    command += ["--only", "main_results", "dp_ablation", "--params", json.dumps(CHEAP)]
    command += ["--results", str(results)]
    manifest = results / ".run.json"
    first, second = results / "main_results", results / "dp_ablation"
    proc = subprocess.Popen(
        command, cwd=copy, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    tree: list[Any] = []
    try:
        deadline = time.monotonic() + 120
        # The first notebook done, the second one's table being computed in its kernel.
        while not (
            manifest.exists()
            and (jobs := json.loads(manifest.read_text())["jobs"])[0]["finished"]
            and jobs[1]["started"]
            and _running_cell(second, "dp_ablation-simulate", "run_table(")
        ):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the second notebook never ran"
            time.sleep(0.05)
        # The kernel has a session of its own: killing the group does not reach it.
        reproducing = psutil.Process(proc.pid)
        tree = [reproducing, *reproducing.children(recursive=True)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"processes of the killed run still running: {alive}"
    assert len(tree) >= 2  # the reproduce process and its kernel

    state = json.loads(manifest.read_text())
    assert [j["finished"] for j in state["jobs"]] == [True, False] and state["finished"] is None
    assert state["jobs"][1]["started"]
    visible = sorted(p for p in results.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert [p.relative_to(results).as_posix() for p in visible][:3] == [
        "main_results/main_results-simulate.csv",
        "main_results/main_results-simulate.ipynb",
        "main_results/main_results-simulate.png",
    ]
    # The interrupted notebook's executed copy is written only once it finished; its CSV
    # and figure, if it got that far, whole.
    assert not (second / "dp_ablation-simulate.ipynb").exists()
    assert all(_complete(p) for p in visible), [p for p in visible if not _complete(p)]
    hidden = [p for p in results.rglob(".*") if p != manifest]
    assert all(p.parent == second and p.name.startswith(".dp_ablation-") for p in hidden)
    kept = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in first.iterdir()}

    out = subprocess.run(command, cwd=copy, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed an interrupted run: ran 1 of 2 notebooks (1 finished earlier" in out.stdout
    assert "skip main_results (simulate): finished earlier in this run" in out.stdout
    assert "redo dp_ablation (simulate): started earlier in this run, did not finish" in out.stdout
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in first.iterdir()} == kept
    state = json.loads(manifest.read_text())
    assert state["finished"] and all(j["finished"] for j in state["jobs"])
    for name in (
        "dp_ablation-simulate.ipynb",
        "dp_ablation-simulate.csv",
        "dp_ablation-simulate.png",
    ):
        assert _complete(second / name), name
    assert [p for p in results.rglob(".*")] == [manifest]  # the temporary files removed
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in results.rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # as any new file, not 0600


# ---- one notebook, as run_job runs it ------------------------------------------------------


def test_a_job_s_kernel_talks_over_unix_sockets_without_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # A one-cell stand-in for a table notebook: the kernel's start is what is under test.
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell("mode = None", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            "from ipykernel.kernelapp import IPKernelApp\nprint(IPKernelApp.instance().transport)"
        ),
    ]
    nbformat.write(nb, notebooks / "main_results.ipynb")
    monkeypatch.setattr(jobs, "notebooks_dir", lambda: notebooks)
    job = Job("main_results", "simulate", root=str(tmp_path / "results"))
    jobs.run_job(job)
    out, err = capfd.readouterr()  # the kernel's own stderr is this process's
    assert "without encryption" not in out + err, err
    executed = nbformat.read(job.executed, as_version=4)
    assert executed.cells[-1].outputs[0]["text"].strip() == "ipc"


# ---- resuming, with notebooks replaced by a stand-in ---------------------------------------


@dataclass
class FakeNotebooks:
    """Papermill replaced by a stand-in that writes a job's three outputs; a job whose
    table is in ``fail`` raises instead, like a run interrupted there."""

    ran: list[str] = field(default_factory=list)
    fail: list[str] = field(default_factory=list)

    def run_job(self, job: Job, **_: object) -> None:
        if job.table in self.fail:
            raise KeyboardInterrupt
        self.ran.append(job.table)
        job.out_dir.mkdir(parents=True, exist_ok=True)
        for path in (job.executed, job.figure):
            path.write_text("x")
        pd.DataFrame({"x": [1]}).to_csv(job.csv, index=False)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNotebooks:
    notebooks = FakeNotebooks()
    monkeypatch.setattr(rp, "run_job", notebooks.run_job)
    monkeypatch.setattr(rp, "_summary", lambda *args: "summary\n")
    return notebooks


def test_only_this_runs_finished_jobs_are_skipped(tmp_path: Path, fake: FakeNotebooks) -> None:
    fake.fail.append("dp_ablation")
    with pytest.raises(KeyboardInterrupt):
        reproduce("simulate", root=tmp_path, progress=False)
    assert fake.ran == ["main_results"]
    fake.fail.clear()
    report = reproduce("simulate", root=tmp_path, progress=False)
    assert report.resumed and [j.table for j in report.skipped] == ["main_results"]
    assert fake.ran == [
        "main_results",
        "dp_ablation",
        "seqlen_sweep",
        "pipeline_systems",
        "layout_search",
        "modern_clusters",
        "long_context",
        "packed_sequences",
    ]
    # A finished run starts anew: every job again.
    report = reproduce("simulate", root=tmp_path, progress=False)
    assert not report.resumed and len(report.ran) == 8 and not report.skipped


@pytest.mark.parametrize("change", ["params", "code", "force", "outputs"])
def test_anything_but_the_same_unfinished_run_starts_anew(
    tmp_path: Path, fake: FakeNotebooks, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    fake.fail.append("seqlen_sweep")
    with pytest.raises(KeyboardInterrupt):
        reproduce("simulate", root=tmp_path, progress=False)
    fake.fail.clear()
    params = {"main_results": {"settings": [9]}} if change == "params" else None
    if change == "code":
        monkeypatch.setattr(rp, "code_version", lambda: "changed")
    if change == "outputs":  # a finished job's outputs were deleted: that job runs again
        (tmp_path / "main_results" / "main_results-simulate.csv").unlink()
    report = reproduce(
        "simulate", root=tmp_path, progress=False, params=params, force=change == "force"
    )
    if change == "outputs":
        assert report.resumed and [j.table for j in report.skipped] == ["dp_ablation"]
    else:
        assert not report.resumed and not report.skipped and len(report.ran) == 8


def test_the_manifest_is_never_half_written(tmp_path: Path, fake: FakeNotebooks) -> None:
    reproduce("simulate", root=tmp_path, progress=False)
    state = json.loads((tmp_path / ".run.json").read_text())
    assert state["format"] == "tplib.run/1" and state["finished"]
    assert [j["table"] for j in state["jobs"]] == [
        "main_results",
        "dp_ablation",
        "seqlen_sweep",
        "pipeline_systems",
        "layout_search",
        "modern_clusters",
        "long_context",
        "packed_sequences",
    ]
    assert all(j["finished"] and j["seconds"] >= 0 for j in state["jobs"])
    hidden = [p.relative_to(tmp_path) for p in tmp_path.rglob(".*")]
    assert hidden == [Path(".run.json")]  # no temporary file left behind, no reference here


def test_default_jobs_cover_the_tables_of_each_mode() -> None:
    assert [(j.table, j.mode) for j in default_jobs("all")] == [
        ("main_results", "simulate"),
        ("dp_ablation", "simulate"),
        ("seqlen_sweep", "simulate"),
        ("pipeline_systems", "simulate"),
        ("layout_search", "simulate"),
        ("modern_clusters", "simulate"),
        ("long_context", "simulate"),
        ("packed_sequences", "simulate"),
        ("main_results", "measure"),
        ("dp_ablation", "measure"),
        ("seqlen_sweep", "measure"),
        ("simulator_validation", "measure"),
        ("pipeline_systems", "measure"),
        ("long_context", "measure"),
        ("packed_sequences", "measure"),
    ]
    per_mode = default_jobs("all", {"main_results": {"simulate": {"settings": [9]}}})
    assert per_mode[0].params == {"settings": [9]} and per_mode[6].params == {}
    with pytest.raises(ValueError, match=r"mode='fast'"):
        default_jobs("fast")
    with pytest.raises(ValueError, match=r"unknown table 'table9'"):
        default_jobs("simulate", {"table9": {}})


# ---- the summary ---------------------------------------------------------------------------


def _main_rows() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "setting": [9, 10],
            "model": ["GPT3-175B"] * 2,
            "speedup": [6.5, 5.4],
            "paper_speedup": [6.745, 5.019],
            "plan_seconds": [0.1, 0.2],
        }
    )


def test_summary_states_equality_timing_columns_aside() -> None:
    ours = _main_rows()
    reference = ours.assign(plan_seconds=[9.0, 9.0])  # only wall time differs
    text = section(get_table("main_results"), "simulate", ours, reference)
    assert "**Equal to the committed reference**: all 2 reproduced rows" in text
    assert "| 9 | GPT3-175B | 6.745 | 6.500 | -3.6% | 6.500 | = |" in text


def test_summary_shows_the_rows_that_differ() -> None:
    ours = _main_rows()
    reference = ours.assign(speedup=[6.5, 5.0])
    text = section(get_table("main_results"), "simulate", ours, reference.iloc[::-1])
    assert "**Differs from the committed reference:**" in text
    assert "{'setting': 10}: speedup 5.400 (reference 5.000)" in text
    assert "| 10 | GPT3-175B | 5.019 | 5.400 | +7.6% | 5.000 | +8.0% |" in text
    notes, rows = equal_to_reference(ours, reference.drop(columns=["model"]), ("setting",))
    assert notes == ["columns differ: not reproduced [], new ['model']"] and len(rows) == 1


def test_summary_of_a_reference_from_before_a_rename_shows_the_table_alone() -> None:
    ours = _main_rows()
    text = section(get_table("main_results"), "simulate", ours, ours.drop(columns=["setting"]))
    assert "The committed reference has no column ['setting']." in text
    assert "| 9 | GPT3-175B | 6.745 | 6.500 | -3.6% | — | — |" in text


def test_a_failed_summary_is_written_by_the_next_run(
    tmp_path: Path, fake: FakeNotebooks, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> str:
        raise RuntimeError("summary failed")

    monkeypatch.setattr(rp, "_summary", broken)
    with pytest.raises(RuntimeError, match="summary failed"):
        reproduce("simulate", root=tmp_path, progress=False)
    monkeypatch.setattr(rp, "_summary", lambda *args: "summary\n")
    report = reproduce("simulate", root=tmp_path, progress=False)
    assert report.resumed and len(report.skipped) == 8 and not report.ran
    assert (tmp_path / "SUMMARY.md").read_text() == "summary\n"


def test_summary_of_a_measured_table_has_no_paper_column() -> None:
    df = pd.DataFrame({"pipeline_batch": [1, 2], "speedup": [1.2, 1.3]})
    text = section(get_table("main_results"), "measure", df, None)
    assert "| pipeline batch | reproduced | reference | Δ reference |" in text
    assert "No committed reference" in text


def test_summary_compares_an_error_column_in_percentage_points() -> None:
    # A ratio of two errors (-278% here) says nothing a reader can use; a speedup's
    # difference stays relative (the tests above).
    df = pd.DataFrame({"schedule": ["gpipe", "1f1b"], "err_simulated_latency": [0.032, 0.04]})
    reference = df.assign(err_simulated_latency=[-0.018, 0.04])
    text = section(get_table("simulator_validation"), "measure", df, reference)
    assert "| gpipe | +3.2% | -1.8% | +5.0 pp |" in text
    assert "| 1f1b | +4.0% | +4.0% | = |" in text
    assert "differences are in percentage points (pp)" in text
