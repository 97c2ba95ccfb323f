"""The GPU check (``make gpu-check``) on a machine without a GPU: it must say so, write
nothing and exit 0; and its parts (the Figure 3 timing, the subprocess steps and the
step bookkeeping) must work, exercised here on CPU or with stand-in commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest
import torch

from tplib import gpucheck
from tplib.config import get_config, n_params_per_layer
from tplib.gpucheck import StepResult

matplotlib.use("Agg")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_script_without_gpu_says_so_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    # Hide any GPU so that the test means the same on a GPU machine.
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU is present" in lines[0]
    assert "exactness" in lines[0] and "Figure 3" in lines[0] and str(out) in lines[0]
    assert not out.exists()


def test_main_without_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpucheck.main(["--out", str(tmp_path / "gpu")]) == 0
    assert "no CUDA GPU is present" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_time_layer_forward_on_cpu() -> None:
    cfg = get_config("tiny")
    df = gpucheck.time_layer_forward(
        cfg, [16, 1, 4, 64], device="cpu", dtype=torch.float32, repeats=3, warmup=1
    )
    assert list(df.columns) == ["tokens", "median_ms", "min_ms", "max_ms", "tokens_per_s", "tflops"]
    assert df.tokens.tolist() == [1, 4, 16, 64]
    assert (df.drop(columns="tokens") > 0).all().all()
    assert ((df.min_ms <= df.median_ms) & (df.median_ms <= df.max_ms)).all()
    with pytest.raises(ValueError, match="must lie in"):
        gpucheck.time_layer_forward(
            cfg, [cfg.seq_len + 1], device="cpu", dtype=torch.float32, repeats=1, warmup=0
        )


def test_layer_forward_flops_counts_matmuls_and_causal_attention() -> None:
    cfg = get_config("GPT3-1B")
    assert gpucheck.layer_forward_flops(cfg, 1) == 2 * n_params_per_layer(cfg) + 2 * 2048
    quadratic = gpucheck.layer_forward_flops(cfg, 2048) - 2 * n_params_per_layer(cfg) * 2048
    assert quadratic == 2 * 2048**2 * 2048  # QK^T and AV, each 2 n^2 h, halved: causal


def test_figure3_check_on_cpu_writes_csv_and_figure(tmp_path: Path) -> None:
    step = gpucheck.figure3_check(tmp_path, get_config("tiny"), device="cpu", tokens=[1, 8, 64])
    assert step.ok and "1 tok" in step.summary
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fig3_layer_forward.csv",
        "fig3_layer_forward.png",
    ]


def test_figure3_check_writes_nothing_when_timing_fails(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        gpucheck.figure3_check(tmp_path, get_config("tiny"), device="cpu", tokens=[1, 10_000])
    assert list(tmp_path.iterdir()) == []


def test_pytest_counts() -> None:
    assert gpucheck.pytest_counts("1 failed, 3 passed, 2 skipped, 1 error in 2.5s") == {
        "failed": 1,
        "passed": 3,
        "skipped": 2,
        "errors": 1,
    }
    assert gpucheck.pytest_counts("no tests ran in 0.01s") == {}


def test_exactness_check_records_counts(tmp_path: Path) -> None:
    ok = gpucheck.exactness_check(tmp_path, _python("print('4 passed, 1 skipped in 0.1s')"))
    assert ok.ok and ok.summary == "4 passed, 1 skipped"
    assert "result: PASS" in (tmp_path / "exactness.txt").read_text()
    failed = gpucheck.exactness_check(
        tmp_path, _python("import sys; print('1 failed, 3 passed in 0.1s'); sys.exit(1)")
    )
    assert not failed.ok
    text = (tmp_path / "exactness.txt").read_text()
    assert "result: FAIL (1 failed, 3 passed)" in text and "exit code: 1" in text
    # No test marked cuda (pytest's exit code 5): nothing was checked, so not a pass.
    none = gpucheck.exactness_check(
        tmp_path, _python("import sys; print('12 deselected in 0.1s'); sys.exit(5)")
    )
    assert not none.ok and "no test marked cuda passed" in none.summary


def test_multi_rank_check_saves_json_or_stderr(tmp_path: Path) -> None:
    bench = {"schedule": "terapipe", "median_latency_s": 0.0125}
    step = gpucheck.multi_rank_check(
        tmp_path, _python(f"print('a log line'); print({json.dumps(json.dumps(bench))})")
    )
    assert step.ok and "12.5 ms" in step.summary
    record = json.loads((tmp_path / "multi_rank.json").read_text())
    assert record["ok"] and record["bench"] == bench and record["returncode"] == 0
    step = gpucheck.multi_rank_check(
        tmp_path, _python("import sys; sys.exit('error: no --device option')")
    )
    assert not step.ok and "no --device option" in step.summary
    record = json.loads((tmp_path / "multi_rank.json").read_text())
    assert not record["ok"] and "no --device option" in record["stderr_tail"]
    assert "bench" not in record


def test_run_gpu_check_runs_every_step_and_fails_if_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []

    def step(name: str, ok: bool) -> StepResult:
        ran.append(name)
        return StepResult(name, ok, f"{name} summary")

    def broken(out: Path) -> StepResult:
        ran.append("exactness")
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(gpucheck, "device_check", lambda out: step("device", True))
    monkeypatch.setattr(gpucheck, "exactness_check", broken)
    monkeypatch.setattr(gpucheck, "multi_rank_check", lambda out: step("multi-rank", True))
    monkeypatch.setattr(gpucheck, "figure3_check", lambda out, cfg: step("figure 3", True))
    assert gpucheck.run_gpu_check(tmp_path) == 1
    assert ran == ["device", "exactness", "multi-rank", "figure 3"]
    printed = capsys.readouterr().out
    assert "RuntimeError: CUDA error: out of memory" in printed
    assert "FAILED: exactness" in printed

    monkeypatch.setattr(gpucheck, "exactness_check", lambda out: step("exactness", True))
    assert gpucheck.run_gpu_check(tmp_path) == 0
    assert "all steps passed" in capsys.readouterr().out
