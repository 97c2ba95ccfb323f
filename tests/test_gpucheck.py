"""The GPU check (``make gpu-check``) on a machine without a GPU: its rehearsal runs every
step on the CPU through the same script, with only the packages a GPU node is promised;
a node with no GPU is told so and nothing is written; a GPU that torch cannot use fails
the check, saying why; a step past its budget is skipped and the rest still run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from tplib.gpucheck import driver, steps
from tplib.gpucheck.node import Node, device_slug, inspect_node, version_tuple
from tplib.gpucheck.proofs import exactness_step
from tplib.gpucheck.result import StepResult

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
# What a GPU node need not have: the notebooks', the explorer's and the test suite's extras.
NOT_ON_A_NODE = (
    "papermill",
    "nbformat",
    "nbclient",
    "ipykernel",
    "IPython",
    "ipywidgets",
    "jupyterlab",
    "tqdm",
    "hypothesis",
    "transformers",
    "playwright",
    "psutil",
)
FILES = {
    "device.json",
    "exactness.txt",
    "multi_rank.json",
    "fig3_layer_forward.csv",
    "fig3_layer_forward.png",
    "slicing.csv",
    "dropout.csv",
    "efficiency.json",
    "memory.csv",
    "summary.txt",
    "results.json",
    "logs",
}


def _node_like(tmp_path: Path, *, smi: str | None, device_files: bool = False) -> dict[str, str]:
    """An environment for the script: PATH with only this Python's folder and, if given,
    a stand-in nvidia-smi printing ``smi``; /dev/nvidia* replaced by a file of the test's
    (or nothing)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if smi is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\nprintf '%s\\n' '{smi}'\n")
        tool.chmod(0o755)
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    if device_files:
        (dev / "nvidia0").touch()
    return os.environ | {
        "PATH": os.pathsep.join(
            [str(bin_dir), str(Path(sys.executable).parent), "/usr/bin", "/bin"]
        ),
        "GPU_CHECK_DEVICE_FILES": str(dev / "nvidia[0-9]*"),
        "CUDA_VISIBLE_DEVICES": "",  # on a GPU machine too: torch sees no GPU here
    }


def _script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )


# ---- the rehearsal: part of make test ----------------------------------------------------


@pytest.fixture()
def node_packages_only(tmp_path: Path) -> dict[str, str]:
    """The environment with every package a GPU node is not promised made unimportable
    (a sitecustomize that refuses them, in this process's children too)."""
    site = tmp_path / "site"
    site.mkdir()
    # None in sys.modules: import raises ModuleNotFoundError and importlib.util.find_spec
    # returns None, as for a package that is not installed.
    (site / "sitecustomize.py").write_text(
        f"import sys\nsys.modules.update(dict.fromkeys({NOT_ON_A_NODE!r}))\n"
    )
    env = _node_like(tmp_path, smi=None)
    return env | {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def test_the_rehearsal_runs_every_step_with_only_a_nodes_packages(
    tmp_path: Path, node_packages_only: dict[str, str]
) -> None:
    refused = subprocess.run(
        [sys.executable, "-c", "import tqdm"], env=node_packages_only, capture_output=True
    )
    assert refused.returncode != 0, "the stand-in node must refuse what it lacks"
    out, carry = tmp_path / "gpu", tmp_path / "carry"
    env = node_packages_only | {"GPU_CHECK_DRY": "1", "GPU_CHECK_OUT": str(carry)}
    proc = _script(env, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    folder = out / "cpu-rehearsal"
    assert {p.name for p in folder.iterdir()} == FILES
    record = json.loads((folder / "results.json").read_text())
    assert [s["name"] for s in record["steps"]] == list(steps.STEPS)
    assert all(s["status"] == "ok" for s in record["steps"]), record["steps"]
    exactness = (folder / "exactness.txt").read_text()
    assert "TPLIB_TEST_DEVICE=cpu" in exactness and "result: PASS" in exactness
    # The summary: one screen, every step, the targets said not to be judged here.
    summary = (folder / "summary.txt").read_text()
    assert len(summary.splitlines()) <= 24
    assert "all 8 steps passed" in summary and "not judged" in summary
    assert summary in proc.stdout
    # Two files carry it back: the folder's archive and the summary.
    assert sorted(p.name for p in carry.iterdir()) == [
        "gpu-check-cpu-rehearsal.tar.gz",
        "gpu-check-cpu-rehearsal.txt",
    ]
    with tarfile.open(carry / "gpu-check-cpu-rehearsal.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"cpu-rehearsal/{f}" for f in FILES} <= names
    assert (carry / "gpu-check-cpu-rehearsal.txt").read_text() == summary
    assert not list(out.glob(".*")), "no staging folder is left behind"


# ---- the node: no GPU, or one torch cannot use --------------------------------------------


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    proc = _script(_node_like(tmp_path, smi=None), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no GPU on this node" in proc.stdout and "GPU_CHECK_DRY=1" in proc.stdout
    assert f"torch {torch.__version__}" in proc.stdout.splitlines()[0]
    assert not out.exists()


@pytest.mark.parametrize("shown", ["smi", "device files"])
def test_a_gpu_torch_cannot_use_fails_the_check_naming_why(tmp_path: Path, shown: str) -> None:
    if torch.version.cuda is not None:
        pytest.skip("this torch is a CUDA build: the CPU-only message does not apply")
    smi = "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04" if shown == "smi" else None
    env = _node_like(tmp_path, smi=smi, device_files=shown == "device files")
    out = tmp_path / "gpu"
    proc = _script(env, "--out", str(out))
    assert proc.returncode == 1
    assert "a GPU is visible" in proc.stderr and "torch cannot use it" in proc.stderr
    assert f"torch {torch.__version__} is a CPU-only build" in proc.stderr
    assert "TORCH_INDEX" in proc.stderr and "PYTHON=python3" in proc.stderr
    if shown == "smi":
        assert "NVIDIA H100 80GB HBM3 (81559 MiB)" in proc.stderr
        assert "driver 580.159.04" in proc.stdout
    else:
        assert "nvidia0" in proc.stderr
    assert not out.exists()


def _node(**changes: object) -> Node:
    fields: dict[str, object] = {
        "python": "3.12.3",
        "torch": "2.11.0+cu130",
        "torch_cuda": "13.0",
        "cuda_available": False,
        "cuda_error": "RuntimeError: The NVIDIA driver on your system is too old (found version 12020)",
        "gpus": (),
        "smi_gpus": ("NVIDIA H100 80GB HBM3 (81559 MiB)",),
        "device_files": ("/dev/nvidia0",),
        "driver": "535.54.03",
        "missing": (),
    }
    return Node(**(fields | changes))  # type: ignore[arg-type]


def test_node_refusals_name_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    why = _node().refusal(dry=False)
    assert why is not None and "driver 535.54.03" in why and "too old" in why
    assert _node().refusal(dry=True) is None  # a rehearsal needs the software only
    assert _node(cuda_available=True, gpus=("NVIDIA H100",)).refusal(dry=False) is None
    assert _node(smi_gpus=(), device_files=()).refusal(dry=False) is None  # no GPU at all
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    hidden = _node().refusal(dry=False)
    assert hidden is not None and "CUDA_VISIBLE_DEVICES=''" in hidden
    old = _node(torch="2.3.1+cu121").refusal(dry=True)
    assert old is not None and "torch 2.3.1+cu121 is older than 2.4" in old
    assert "python 3.10.12 is older than 3.11" in str(_node(python="3.10.12").refusal(dry=True))
    lacking = _node(missing=("seaborn",)).refusal(dry=True)
    assert lacking is not None and "lacks seaborn" in lacking and "pytest" in lacking


def test_the_node_here_and_names() -> None:
    node = inspect_node()
    assert node.torch == torch.__version__ and not node.missing
    assert node.refusal(dry=True) is None
    assert version_tuple("2.11.0+cu130") == (2, 11, 0) and version_tuple("3.12") == (3, 12)
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert device_slug("  ") == "gpu"


# ---- the driver: budgets, the folder, the summary -----------------------------------------


def test_a_step_past_its_budget_is_skipped_and_the_rest_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(steps.STEPS, "exactness", (exactness_step, 2.0))
    out = tmp_path / "gpu"
    stale = out / "cpu-rehearsal"
    stale.mkdir(parents=True)
    (stale / "memory.csv").write_text("from an earlier check\n")
    node = inspect_node()
    code = driver.run_check(out, node, dry=True, names=["exactness", "device"], archive_to=None)
    assert code == 1
    record = json.loads((stale / "results.json").read_text())
    status = {s["name"]: s["status"] for s in record["steps"]}
    assert status == {"exactness": "skipped", "device": "ok"}
    skipped = record["steps"][0]
    assert "overran its budget of 2 s" in skipped["summary"] and skipped["seconds"] < 30
    assert not (stale / "exactness.txt").exists()  # a stopped step leaves no file
    assert not (stale / "memory.csv").exists()  # the folder is this check's alone
    assert "FAILED: exactness" in (stale / "summary.txt").read_text()


def test_a_step_reports_its_result_or_why_it_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "logs").mkdir()
    result = driver.run_step("device", tmp_path, dry=True, budget=120)
    assert result.ok and "CPU rehearsal" in result.summary and result.seconds > 0
    # A step process that dies without a result: its log's last line is the reason.
    python = tmp_path / "dying-python"
    python.write_text("#!/bin/sh\necho 'Fatal Python error: Segmentation fault'\nexit 3\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    failed = driver.run_step("device", tmp_path, dry=True, budget=120)
    assert failed.status == "failed"
    assert failed.summary == "exit code 3 without a result: Fatal Python error: Segmentation fault"


def test_the_summary_fits_a_screen_and_lists_targets() -> None:
    node = _node(cuda_available=True, gpus=("NVIDIA H100 80GB HBM3",))
    results = [StepResult(name, "ok", f"{name} found this", seconds=12.0) for name in steps.STEPS]
    results[4] = StepResult("slicing", "ok", "8 slices x1.04", target="<= 1.10x: met")
    text = driver.summary_text(node, "results/gpu/nvidia-h100-80gb-hbm3", False, results, 300.0)
    lines = text.splitlines()
    assert lines[0].startswith("gpu-check on NVIDIA H100 80GB HBM3: all 8 steps passed in 5 min")
    assert len(lines) <= 24 and "    slicing     <= 1.10x: met" in lines
    failing = [*results[:-1], StepResult("memory", "skipped", "overran")]
    assert "FAILED: memory" in driver.summary_text(node, "x", False, failing, 1.0)


def test_steps_refuse_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        driver.main(["--out", str(tmp_path), "--steps", "device,warp"])


def test_an_interpreter_without_torch_is_told_so(tmp_path: Path) -> None:
    """-S: no site-packages, as a node's Python without torch (or a wrong PYTHON=)."""
    proc = subprocess.run(
        [sys.executable, "-S", str(SCRIPT), "--out", str(tmp_path / "gpu")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert f"{sys.executable} cannot import torch" in proc.stderr and "TORCH_INDEX" in proc.stderr
