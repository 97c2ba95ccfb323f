"""Table 1's layouts as runs: a :class:`~tplib.runtime.RunConfig` for paper setting (N).

:func:`setting_run` builds row N exactly: the model (with the setting's L), #Data, #Pipe
and #Op, the global batch, eight ranks per node (p3.16xlarge), fp16 (the paper's V100s)
and a plan: the DP planner's on the cluster cost model (``"cluster"``, what the
simulated tables run), the paper's own printed plan (``"paper"``), GPipe's microbatches
(``"gpipe"``), or the DP planner's on a measured profile (a path to a profile JSON, from
``python -m tplib profile`` on the target GPU; a profile that timed another precision,
dropout, attention or device than the run's is warned about, since the plan is priced on
it). :func:`launch_commands` says how to start
it across nodes with torchrun, directly or under SLURM.
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tplib.paper import TERAPIPE, main_row, seqlen_row, setting
from tplib.plan import Plan
from tplib.runtime.parts import Data, Parallelism, Timing
from tplib.runtime.result import RunResult
from tplib.runtime.runconfig import RunConfig
from tplib.runtime.runfile import save_run_config

__all__ = [
    "LAUNCHERS",
    "Launch",
    "launch_commands",
    "run_on_nodes",
    "setting_plan",
    "setting_run",
]

_PLAN_SOURCES = ("cluster", "paper", "gpipe")  # or the path of a measured profile
GPUS_PER_NODE = 8  # p3.16xlarge, the paper's nodes


def setting_plan(
    n: int,
    source: str | Plan = "cluster",
    seq_len: int | None = None,
    *,
    precision: str = "fp16",
    device: str = "cuda",
) -> Plan:
    """The plan setting ``n`` trains with, from ``source`` (see the module docstring), or
    ``source`` itself when it is a :class:`~tplib.plan.Plan` (checked to cover B/#Data x L).

    A profile is checked against the run it plans, in ``precision`` on ``device`` with the
    model's dropout (:meth:`~tplib.perfmodel.Profile.check_run`: a
    :class:`~tplib.perfmodel.conditions.ProfileMismatchWarning` names both)."""
    s = setting(n, seq_len)
    if isinstance(source, Plan):
        source.check_covers(s.pipeline_batch, s.seq_len)
        return source
    if source == "gpipe":
        return s.gpipe_plan()
    if source == "paper":  # Table 2's plan, or Table 4's for setting (5) at another L
        if s.seq_len != setting(n).seq_len:
            return seqlen_row(s.seq_len, TERAPIPE).plan
        return main_row(n, TERAPIPE).plan
    from tplib.search.setting import plan_terapipe

    if source == "cluster":
        return plan_terapipe(s)
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"plan source {source!r} is neither one of {_PLAN_SOURCES} nor a profile file"
        )
    from tplib.perfmodel import Profile

    prof = Profile.load(path)
    prof.check_run(
        precision=precision, dropout=s.config.dropout, device=device, source=f"profile {path}"
    )
    # The planner keeps batch slices within what the profile measured.
    return plan_terapipe(s, cost=prof)


def setting_run(
    n: int,
    *,
    plan: str | Plan = "cluster",
    seq_len: int | None = None,
    precision: str = "fp16",
    recompute: str = "none",
    device: str = "cuda",
    steps: int = 10,
    warmup: int = 2,
    timeout_s: float = 600.0,
) -> RunConfig:
    """Table 1 row ``n`` (or its Table-4 variant at ``seq_len``) as a run; ``plan`` is a
    plan source (see :func:`setting_plan`) or a plan."""
    s = setting(n, seq_len)
    p = setting_plan(n, plan, seq_len, precision=precision, device=device)
    return RunConfig(
        model=s.model,
        model_overrides=(("seq_len", s.seq_len),) if s.config.seq_len != 2048 else (),
        schedule_name="gpipe" if plan == "gpipe" else "terapipe",
        parallelism=Parallelism(
            n_stages=s.n_stages, n_data=s.n_data, n_op=s.n_op, ranks_per_node=GPUS_PER_NODE
        ),
        data=Data(batch=s.batch, seq_len=s.seq_len),
        slicing=p,
        precision=precision,
        recompute=recompute,
        device=device,
        timing=Timing(steps=steps, warmup=warmup, timeout_s=timeout_s),
    )


def launch_commands(run: RunConfig, config: str, out: str) -> dict[str, str]:
    """How to start ``run`` (saved as ``config``) on its nodes: a torchrun line for
    every node (a node that has not joined within ``run.timing.timeout_s`` fails the start),
    and the same under SLURM (``scripts/slurm/tplib-run.sbatch``: one
    torchrun per node)."""
    per_node = run.parallelism.ranks_per_node or GPUS_PER_NODE
    nodes = -(-run.parallelism.world_size // per_node)
    module = f"-m tplib.runtime.torchrun --config {shlex.quote(config)} --out {shlex.quote(out)}"
    # torchrun waits 600 s for a node that never starts; the run's own timeout is the
    # bound its users set for every other wait.
    torchrun = (
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint $HEAD_NODE:29500 "
        f"--rdzv-conf join_timeout={math.ceil(run.timing.timeout_s)} "
        f"{module}"
    )
    slurm = (
        f"GPUS_PER_NODE={per_node} sbatch --nodes={nodes} --gpus-per-node={per_node} "
        f"scripts/slurm/tplib-run.sbatch {shlex.quote(config)} {shlex.quote(out)}"
    )
    return {"torchrun": torchrun, "slurm": slurm}


# The command that starts one run; {python}, {nodes}, {nproc}, {config} and {out} are
# filled in. "srun": one torchrun per node of the current SLURM allocation; "local": one
# torchrun on this machine (a single node, or a scaled-down run). The first host is taken
# with sed, which reads all of scontrol's output: head would close the pipe early, and
# under pipefail scontrol's SIGPIPE (exit 141) would fail the job script at random.
LAUNCHERS = {
    "srun": (
        "srun --kill-on-bad-exit=1 --nodes {nodes} --ntasks-per-node 1 {python} -m "
        "torch.distributed.run --nnodes {nodes} --nproc-per-node {nproc} "
        "--rdzv-id $SLURM_JOB_ID --rdzv-backend c10d --rdzv-endpoint "
        '"$(scontrol show hostnames $SLURM_JOB_NODELIST | sed -n 1p)":29500 '
        "-m tplib.runtime.torchrun --config {config} --out {out}"
    ),
    "local": (
        "{python} -m torch.distributed.run --standalone --nproc-per-node {nproc} "
        "-m tplib.runtime.torchrun --config {config} --out {out}"
    ),
}


@dataclass(frozen=True)
class Launch:
    """How a table's runs start on GPU nodes: a launcher of :data:`LAUNCHERS` (or a
    ``command`` template of your own with the same fields), the processes per node, a
    folder for configs and results, and a time limit per run."""

    launcher: str = "srun"
    command: str = ""
    nproc_per_node: int = 8
    workdir: str = "results/runs"
    timeout_s: float = 4 * 3600.0

    def __post_init__(self) -> None:
        if not self.command and self.launcher not in LAUNCHERS:
            raise ValueError(
                f"launcher={self.launcher!r}: choose one of {sorted(LAUNCHERS)} or give a "
                "command template with {config} and {out}"
            )
        template = self.command or LAUNCHERS[self.launcher]
        if "{config}" not in template or "{out}" not in template:
            raise ValueError(f"launch command {template!r} must contain {{config}} and {{out}}")
        if self.nproc_per_node < 1 or not self.timeout_s > 0:
            raise ValueError(
                f"nproc_per_node={self.nproc_per_node}, timeout_s={self.timeout_s}: "
                "need at least one process per node and a positive time limit"
            )

    @property
    def name(self) -> str:
        """The launcher's name, or "command" for a template of one's own."""
        return "command" if self.command else self.launcher

    @classmethod
    def of(cls, value: Launch | Mapping[str, Any]) -> Launch:
        return value if isinstance(value, Launch) else cls(**dict(value))

    def command_for(self, run: RunConfig, config: Path, out: Path) -> str:
        per_node = min(self.nproc_per_node, run.parallelism.world_size)
        return (self.command or LAUNCHERS[self.launcher]).format(
            python=shlex.quote(sys.executable),
            nodes=-(-run.parallelism.world_size // per_node),
            nproc=per_node,
            config=shlex.quote(str(config)),
            out=shlex.quote(str(out)),
        )


def run_on_nodes(run: RunConfig, launch: Launch, name: str) -> RunResult:
    """Start ``run`` with ``launch`` (its config and results named ``name`` in the
    launch's folder), wait for it, and return the gathered results. A failed or timed-out
    run raises ``RuntimeError`` with the end of its output."""
    from tplib.runtime.torchrun import load_result

    folder = Path(launch.workdir)
    folder.mkdir(parents=True, exist_ok=True)
    config, out = folder / f"{name}.json", folder / f"{name}.pt"
    save_run_config(run, config)
    command = launch.command_for(run, config, out)
    try:
        done = subprocess.run(
            command,
            shell=True,
            capture_output=True,
            text=True,
            timeout=launch.timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{name}: `{command}` ran past {launch.timeout_s:g} s") from exc
    if done.returncode != 0 or not out.exists():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"{name}: `{command}` failed (exit {done.returncode}):\n{tail}")
    return load_result(out)
