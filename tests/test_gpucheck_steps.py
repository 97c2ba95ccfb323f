"""The GPU check's steps and measurements (tplib.gpucheck.steps, .kernels, .training),
exercised on the CPU at small sizes or with stand-in commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import pytest
import torch

from tplib.gpucheck import kernels, measures, proofs, steps, training
from tplib.gpucheck.sizes import DRY, GPU, Sizes
from tplib.nn.configs import get_config, n_params_per_layer
from tplib.nn.model import build_model

matplotlib.use("Agg")


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# ---- kernels ------------------------------------------------------------------------------


def test_time_alternating_alternates_and_drops_the_warmup() -> None:
    calls: list[str] = []
    times = kernels.time_alternating(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        "cpu",
        repeats=3,
        warmup=2,
    )
    assert calls == ["a", "b"] * 5
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    with pytest.raises(ValueError, match="repeats=0"):
        kernels.time_alternating({"a": lambda: None}, "cpu", repeats=0, warmup=0)


def test_time_layer_forward_on_cpu() -> None:
    cfg = get_config("tiny")
    df = kernels.time_layer_forward(
        cfg, [16, 1, 4, 64], device="cpu", dtype=torch.float32, repeats=3, warmup=1
    )
    assert list(df.columns) == ["tokens", "median_ms", "min_ms", "max_ms", "tokens_per_s", "tflops"]
    assert df.tokens.tolist() == [1, 4, 16, 64]
    assert (df.drop(columns="tokens") > 0).all().all()
    assert ((df.min_ms <= df.median_ms) & (df.median_ms <= df.max_ms)).all()
    with pytest.raises(ValueError, match="must lie in"):
        kernels.time_layer_forward(
            cfg, [cfg.seq_len + 1], device="cpu", dtype=torch.float32, repeats=1, warmup=0
        )


def test_layer_forward_flops_counts_matmuls_and_causal_attention() -> None:
    cfg = get_config("GPT3-1B")
    assert kernels.layer_forward_flops(cfg, 1) == 2 * n_params_per_layer(cfg) + 2 * 2048
    quadratic = kernels.layer_forward_flops(cfg, 2048) - 2 * n_params_per_layer(cfg) * 2048
    assert quadratic == 2 * 2048**2 * 2048  # QK^T and AV, each 2 n^2 h, halved: causal


def test_time_slicing_rows_and_ratios() -> None:
    df = kernels.time_slicing(
        get_config("tiny"),
        layers=1,
        seq_len=32,
        slices=(4,),
        precision="bf16",
        device="cpu",
        repeats=2,
        warmup=1,
    )
    assert df.variant.tolist() == ["whole", "4 slices", "4 slices, fused W"]
    assert df.slices.tolist() == [1, 4, 4] and df.fused.tolist() == [False, False, True]
    assert df.ratio[0] == 1.0
    assert df.ratio[1] == pytest.approx(df.median_ms[1] / df.median_ms[0])
    with pytest.raises(ValueError, match="does not split into 5 equal token slices"):
        kernels.time_slicing(
            get_config("tiny"),
            layers=1,
            seq_len=32,
            slices=(5,),
            precision="fp32",
            device="cpu",
            repeats=1,
            warmup=0,
        )


def test_time_dropout_compares_each_part_with_its_own_base() -> None:
    df = kernels.time_dropout(
        get_config("tiny"), seq_len=32, precision="fp32", device="cpu", repeats=2, warmup=1
    )
    assert df.variant.tolist() == [
        "layer",
        "layer, keyed dropout",
        "attention, fused",
        "attention, written out",
        "attention, keyed dropout",
    ]
    assert df.ratio[0] == df.ratio[2] == 1.0
    assert df.ratio[4] == pytest.approx(df.median_ms[4] / df.median_ms[2])


# ---- training -----------------------------------------------------------------------------


def test_train_flops_by_hand() -> None:
    """One layer of hidden 64, vocabulary 256, 16 tokens: the count written out by hand."""
    cfg = get_config("tiny").with_(n_layer=1, hidden=64, n_head=4, vocab_size=256)
    per_layer = 12 * 64 * 64 + 13 * 64  # QKV, projection, 4H MLP; their biases and LNs
    forward = 2 * per_layer * 16 + 2 * 2 * 16 * 16 * 64 / 2 + 2 * 64 * 256 * 16
    assert training.train_flops(cfg, batch=3, seq_len=16) == 3 * 3 * forward


def test_peak_bf16_by_device_name() -> None:
    assert training.peak_bf16("NVIDIA H100 80GB HBM3") == 989.4
    assert training.peak_bf16("NVIDIA H100 PCIe") == 756.0
    assert training.peak_bf16("NVIDIA H200") == 989.4
    assert training.peak_bf16("NVIDIA A100-SXM4-80GB") == 312.0
    assert training.peak_bf16("Tesla V100-SXM2-16GB") is None  # no bf16 tensor cores


def test_measure_efficiency_on_cpu_has_no_mfu() -> None:
    record = training.measure_efficiency(
        get_config("tiny"), batch=2, seq_len=16, device="cpu", repeats=2, warmup=1
    )
    assert record.mfu is None and record.peak_bf16_tflops is None
    assert record.tokens_per_s == pytest.approx(32 / (record.step_median_ms / 1e3))
    assert record.n_params == sum(p.numel() for p in build_model(get_config("tiny")).parameters())


# ---- steps --------------------------------------------------------------------------------


def test_pytest_counts() -> None:
    assert proofs.pytest_counts("1 failed, 3 passed, 2 skipped, 1 error in 2.5s") == {
        "failed": 1,
        "passed": 3,
        "skipped": 2,
        "errors": 1,
    }
    assert proofs.pytest_counts("no tests ran in 0.01s") == {}


def test_the_exactness_step_collects_only_its_file() -> None:
    command = proofs.exactness_command()
    assert command[-1] == "tests/test_runtime_cuda.py" and "-m" in command


def test_exactness_step_records_counts(tmp_path: Path) -> None:
    ok = proofs.exactness_step(tmp_path, DRY, _python("print('4 passed, 1 skipped in 0.1s')"))
    assert ok.ok and ok.summary == "4 passed, 1 skipped"
    text = (tmp_path / "exactness.txt").read_text()
    assert "result: PASS" in text and "TPLIB_TEST_DEVICE=cpu" in text
    failed = proofs.exactness_step(
        tmp_path, DRY, _python("import sys; print('1 failed, 3 passed in 0.1s'); sys.exit(1)")
    )
    assert not failed.ok
    text = (tmp_path / "exactness.txt").read_text()
    assert "result: FAIL (1 failed, 3 passed)" in text and "exit code: 1" in text
    # No test marked cuda (pytest's exit code 5): nothing was checked, so not a pass.
    none = proofs.exactness_step(
        tmp_path, DRY, _python("import sys; print('12 deselected in 0.1s'); sys.exit(5)")
    )
    assert not none.ok and "no test marked cuda passed" in none.summary


def test_multi_rank_step_saves_json_or_stderr(tmp_path: Path) -> None:
    bench = {"schedule": "terapipe", "median_latency_s": 0.0125, "backend": "gloo"}
    step = proofs.multi_rank_step(
        tmp_path, DRY, _python(f"print('a log line'); print({json.dumps(json.dumps(bench))})")
    )
    assert step.ok and "12.5 ms" in step.summary and "on gloo" in step.summary
    record = json.loads((tmp_path / "multi_rank.json").read_text())
    assert record["ok"] and record["bench"] == bench and record["returncode"] == 0
    step = proofs.multi_rank_step(
        tmp_path, DRY, _python("import sys; sys.exit('error: no --device option')")
    )
    assert not step.ok and "no --device option" in step.summary
    record = json.loads((tmp_path / "multi_rank.json").read_text())
    assert not record["ok"] and "no --device option" in record["stderr_tail"]
    assert "bench" not in record


def test_figure3_step_writes_both_files_or_neither(tmp_path: Path) -> None:
    step = measures.figure3_step(tmp_path, DRY)
    assert step.ok and "1 tok" in step.summary
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fig3_layer_forward.csv",
        "fig3_layer_forward.png",
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    too_long = Sizes(**{**DRY.__dict__, "fig3_tokens": (1, 10_000)})
    with pytest.raises(ValueError):
        measures.figure3_step(empty, too_long)
    assert list(empty.iterdir()) == []


def test_gpu_sizes_are_the_issues() -> None:
    """What a GPU check measures: GPT3-1B at L = 2048, 8 and 16 slices, Figure 3's 1-2048
    tokens, and a budget that keeps the whole check under 8 minutes."""
    gpu = GPU
    assert (gpu.model, gpu.seq_len, gpu.slices) == ("GPT3-1B", 2048, (8, 16))
    assert gpu.fig3_tokens == tuple(2**i for i in range(12))
    assert sum(budget for _, budget in steps.STEPS.values()) < 8 * 60
