"""Table 1's layouts as runs: ``setting_run(n)`` is row (n) exactly, its plan
comes from the named source, and :func:`launch_commands` starts it on the paper's nodes
(8 GPUs each) with torchrun, directly or under SLURM."""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import stat
import subprocess
import warnings
from pathlib import Path

import pytest

from tplib.paper import SETTINGS, TERAPIPE, main_row, seqlen_row, setting
from tplib.perfmodel import ProfileError, ProfileMismatchWarning, build_profile
from tplib.plan import Plan
from tplib.runs.settings import launch_commands, setting_plan, setting_run
from tplib.runtime import load_run_config, save_run_config

ROOT = Path(__file__).resolve().parents[1]

# Table 1 of the paper, typed in again as the independent reference:
# model, N, H, L, #GPUs, B, #Data, #Pipe, #Op.
TABLE1 = {
    1: ("GPT3-1B", 24, 2048, 2048, 192, 128, 8, 24, 1),
    2: ("GPT3-1B", 24, 2048, 2048, 192, 72, 2, 12, 8),
    3: ("GPT3-1B", 24, 2048, 2048, 192, 72, 1, 24, 8),
    4: ("GPT3-13B", 40, 5120, 2048, 320, 32, 2, 20, 8),
    5: ("GPT3-13B", 40, 5120, 2048, 320, 32, 1, 40, 8),
    6: ("GPT3-44B", 96, 6144, 2048, 384, 8, 4, 96, 1),
    7: ("GPT3-44B", 96, 6144, 2048, 384, 8, 2, 24, 8),
    8: ("GPT3-44B", 96, 6144, 2048, 384, 8, 1, 48, 8),
    9: ("GPT3-175B", 96, 12288, 2048, 384, 2, 1, 96, 4),
    10: ("GPT3-175B", 96, 12288, 2048, 384, 2, 1, 48, 8),
}
# Table 4: setting (5) at longer sequences, with the batch the paper shrank to fit.
TABLE4_BATCH = {4096: 8, 6144: 4, 8192: 2}
SETTING_IDS = sorted(TABLE1)


def _covers(plan: Plan, batch: int, seq_len: int) -> bool:
    return plan.batch == batch and all(sum(ts) == seq_len for ts in plan.token_slices)


def test_the_reference_table_is_the_library_table() -> None:
    assert sorted(SETTINGS) == SETTING_IDS
    for n, (model, n_layer, hidden, seq_len, gpus, batch, data, pipe, op) in TABLE1.items():
        s = SETTINGS[n]
        assert (s.model, s.n_layer, s.hidden, s.seq_len, s.n_gpus) == (
            model,
            n_layer,
            hidden,
            seq_len,
            gpus,
        )
        assert (s.batch, s.n_data, s.n_stages, s.n_op) == (batch, data, pipe, op)


@pytest.mark.parametrize("n", SETTING_IDS)
def test_for_setting_is_the_table1_row(n: int) -> None:
    model, n_layer, hidden, seq_len, gpus, batch, data, pipe, op = TABLE1[n]
    run = setting_run(n)  # the default plan: the DP planner on the cluster model
    assert (
        run.model,
        run.parallelism.n_data,
        run.parallelism.n_stages,
        run.parallelism.n_op,
        run.data.batch,
        run.data.seq_len,
    ) == (
        model,
        data,
        pipe,
        op,
        batch,
        seq_len,
    )
    assert (run.cfg.n_layer, run.cfg.hidden, run.cfg.seq_len) == (n_layer, hidden, seq_len)
    assert run.parallelism.world_size == gpus == data * pipe * op
    assert run.precision == "fp16" and run.device == "cuda" and run.recompute == "none"
    assert run.parallelism.ranks_per_node == 8
    assert run.schedule_name == "terapipe"
    assert run.pipeline_batch == batch // data
    assert _covers(run.plan, batch // data, seq_len)
    # Equal stages: N / #Pipe layers each, in order.
    per_stage = n_layer // pipe
    assert run.ranges == tuple((k * per_stage, (k + 1) * per_stage) for k in range(pipe))


@pytest.mark.parametrize("n", SETTING_IDS)
def test_gpipe_and_paper_plan_sources(n: int) -> None:
    _, _, _, seq_len, _, batch, data, pipe, op = TABLE1[n]
    gpipe = setting_run(n, plan="gpipe")
    assert gpipe.schedule_name == "gpipe"
    assert gpipe.plan == Plan.gpipe(batch // data, seq_len)
    # "w/o TeraPipe": microbatches of one whole sequence.
    assert gpipe.plan.batch_slices == (1,) * (batch // data)
    assert gpipe.plan.token_slices == ((seq_len,),) * (batch // data)

    paper = setting_run(n, plan="paper")
    assert paper.schedule_name == "terapipe"
    assert paper.plan == main_row(n, TERAPIPE).plan  # the plan Table 2 prints
    assert _covers(paper.plan, batch // data, seq_len)
    # The layout does not depend on where the plan comes from.
    for run in (gpipe, paper):
        assert (
            run.parallelism.n_data,
            run.parallelism.n_stages,
            run.parallelism.n_op,
            run.data.batch,
        ) == (data, pipe, op, batch)


def test_paper_plans_as_printed() -> None:
    # Two rows typed in from Table 2, independent of tplib.paper.
    assert setting_run(1, plan="paper").plan == Plan((1,) * 16, ((776, 640, 632),) * 16)
    assert setting_run(10, plan="paper").plan == Plan((1, 1), ((128,) * 16,) * 2)


@pytest.mark.parametrize("source", ["nope", "profiles/missing.json"])
def test_unknown_plan_source_is_named(source: str) -> None:
    with pytest.raises(ValueError, match=rf"plan source {source!r} is neither one of"):
        setting_run(9, plan=source)
    with pytest.raises(ValueError, match=rf"plan source {source!r}"):
        setting_plan(9, source)


def test_a_profile_that_timed_another_run_is_warned_about(tmp_path: Path) -> None:
    """Setting (9) trains in fp16 on CUDA with GPT-3's dropout 0.1 (attention written out):
    a plan priced on a profile of anything else is named, difference by difference, before
    it is planned. The profile covers 1024 of the setting's 2048 tokens, so that planning
    then stops at once (planning L = 2048 at g = 8 takes seconds)."""
    s = setting(9)
    cpu = build_profile(
        lambda b, length, c: 1e-3 + 1e-6 * b * length * (1 + c / 512),
        config=s.config,
        layers_per_stage=2,
        seq_len=1024,
        granularity=8,
    )
    path = tmp_path / "cpu.json"
    cpu.save(path)
    with pytest.warns(ProfileMismatchWarning) as caught, pytest.raises(ProfileError):
        setting_run(9, plan=str(path))
    (warning,) = caught
    text = str(warning.message)
    assert text.startswith(f"profile {path} timed cpu, precision fp32, attention default")
    for difference in (
        "device: the profile timed 'cpu', the run 'cuda'",
        "precision: the profile timed 'fp32', the run 'fp16'",
        "attention: the profile timed 'default', the run 'math'",
        "dropout: the profile timed '0', the run '0.1'",
    ):
        assert difference in text
    # A run in bf16 is compared in bf16; a profile of the run itself raises no warning.
    with pytest.warns(ProfileMismatchWarning, match="the run 'bf16'"), pytest.raises(ProfileError):
        setting_run(9, plan=str(path), precision="bf16")
    gpu = {"device": "cuda:0", "precision": "fp16", "attention": "math", "dropout": 0.1}
    dataclasses.replace(cpu, **gpu).save(path)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would be raised before the plan's error
        with pytest.raises(ProfileError, match="beyond the profile's seq_len L=1024"):
            setting_run(9, plan=str(path))


@pytest.mark.parametrize("n", SETTING_IDS)
def test_op_ranks_of_a_stage_share_a_node(n: int) -> None:
    run = setting_run(n, plan="gpipe")
    seen = set()
    for rank in range(run.parallelism.world_size):
        replica, stage, op_rank, cp_rank = run.parallelism.position(rank)
        assert cp_rank == 0
        assert run.parallelism.rank_of(replica, stage, op_rank) == rank
        seen.add((replica, stage, op_rank))
    assert len(seen) == run.parallelism.world_size
    for replica in range(run.parallelism.n_data):
        for stage in range(run.parallelism.n_stages):
            nodes = {
                run.parallelism.rank_of(replica, stage, o) // 8 for o in range(run.parallelism.n_op)
            }
            assert len(nodes) == 1, (replica, stage, nodes)


@pytest.mark.parametrize("n", SETTING_IDS)
def test_setting_configs_round_trip_through_json(n: int, tmp_path: Path) -> None:
    run = setting_run(n, plan="paper")
    save_run_config(run, tmp_path / "run.json")
    assert load_run_config(tmp_path / "run.json") == run


def test_planned_configs_round_trip_through_json(tmp_path: Path) -> None:
    run = setting_run(9)  # the default plan: the DP planner's on the cluster model
    assert run.plan.latency is not None
    save_run_config(run, tmp_path / "run.json")
    assert load_run_config(tmp_path / "run.json") == run


@pytest.mark.parametrize(("seq_len", "batch"), sorted(TABLE4_BATCH.items()))
@pytest.mark.parametrize("plan", ["cluster", "gpipe"])
def test_setting_5_at_longer_sequences(seq_len: int, batch: int, plan: str) -> None:
    run = setting_run(5, seq_len=seq_len, plan=plan)
    assert (run.model, run.data.seq_len, run.data.batch) == ("GPT3-13B", seq_len, batch)
    assert (
        run.parallelism.n_data,
        run.parallelism.n_stages,
        run.parallelism.n_op,
        run.parallelism.world_size,
    ) == (1, 40, 8, 320)
    assert run.cfg.seq_len == seq_len  # the model's context grows with L
    assert run.pipeline_batch == batch  # L=8192: B=2
    assert _covers(run.plan, batch, seq_len)


@pytest.mark.parametrize("seq_len", sorted(TABLE4_BATCH))
def test_paper_plan_of_setting_5_at_longer_sequences(seq_len: int) -> None:
    run = setting_run(5, seq_len=seq_len, plan="paper")
    assert run.plan == seqlen_row(seq_len, TERAPIPE).plan


def test_only_setting_5_varies_the_sequence_length() -> None:
    with pytest.raises(ValueError, match=r"varies L only for setting \(5\)"):
        setting_run(9, seq_len=4096)
    with pytest.raises(ValueError, match=r"setting \(11\) is not in Table 1"):
        setting_run(11)


def _option(tokens: list[str], name: str) -> str:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in a command line."""
    for i, tok in enumerate(tokens):
        if tok == name:
            return tokens[i + 1]
        if tok.startswith(name + "="):
            return tok.split("=", 1)[1]
    raise AssertionError(f"{name} not in {tokens}")


@pytest.mark.parametrize("n", SETTING_IDS)
def test_torchrun_line(n: int) -> None:
    run = setting_run(n, plan="gpipe")
    config, out = "configs/setting 9.json", "results/run.pt"  # a space: must be quoted
    line = launch_commands(run, config, out)["torchrun"]
    tokens = shlex.split(line)
    assert tokens[0] == "torchrun"
    assert _option(tokens, "--nnodes") == str(TABLE1[n][4] // 8)
    assert _option(tokens, "--nproc-per-node") == "8"
    assert tokens[tokens.index("-m") + 1] == "tplib.runtime.torchrun"
    assert _option(tokens, "--config") == config and _option(tokens, "--out") == out
    assert _option(tokens, "--rdzv-backend") == "c10d"
    # A node that never starts fails the rendezvous within the run's timeout, not 600 s.
    assert _option(tokens, "--rdzv-conf") == f"join_timeout={math.ceil(run.timing.timeout_s)}"


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("n", [1, 9])
def test_slurm_line_starts_torchrun_on_every_node_with_srun(n: int, tmp_path: Path) -> None:
    """Run the SLURM command (its batch script) with stand-ins for sbatch, srun and
    scontrol: srun must start torchrun with the setting's nodes, 8 processes per node,
    the config and the results path."""
    run = setting_run(n, plan="gpipe")
    nodes = TABLE1[n][4] // 8
    line = launch_commands(run, "run.json", "out.pt")["slurm"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "srun.args"
    # sbatch: run the script at once, as the job would, with SLURM's variables set.
    _fake(
        bin_dir,
        "sbatch",
        'for a in "$@"; do case $a in --nodes=*) export SLURM_JOB_NUM_NODES=${a#--nodes=};; '
        '-*) ;; *) break;; esac; shift; done\nexec bash "$@"',
    )
    _fake(bin_dir, "srun", f'printf "%s\\n" "$@" > {shlex.quote(str(log))}')
    _fake(bin_dir, "scontrol", "echo node-a; echo node-b")
    # SLURM_JOB_NUM_NODES comes only from the sbatch line's --nodes (the script runs
    # under `set -u`: without it, it fails).
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.pop("GPUS_PER_NODE", None)
    env |= {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_ID": "42",
    }
    proc = subprocess.run(
        ["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    args = log.read_text().splitlines()
    assert any(a.endswith("torchrun") for a in args), args
    assert _option(args, "--nnodes") == str(nodes)
    assert _option(args, "--nproc-per-node") == "8"
    assert _option(args, "--rdzv-endpoint").startswith("node-a:")
    assert args[args.index("-m") + 1] == "tplib.runtime.torchrun"
    assert _option(args, "--config") == "run.json" and _option(args, "--out") == "out.pt"
