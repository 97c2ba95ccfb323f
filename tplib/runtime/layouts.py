"""Table 1's layouts as runs: a :class:`~tplib.runtime.RunConfig` for paper setting (N).

:func:`setting_run` builds row N exactly: the model (with the setting's L), #Data, #Pipe
and #Op, the global batch, eight ranks per node (p3.16xlarge), fp16 (the paper's V100s)
and a plan: the DP planner's on the cluster cost model (``"cluster"``, what the
simulated tables run), the paper's own printed plan (``"paper"``), GPipe's microbatches
(``"gpipe"``), or the DP planner's on a measured profile (a path to a profile JSON, from
``python -m tplib profile`` on the target GPU). :func:`launch_commands` says how to start
it across nodes with torchrun, directly or under SLURM.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from tplib.paper import TERAPIPE, main_row, setting
from tplib.plan import Plan
from tplib.runtime.config import RunConfig

__all__ = ["PLAN_SOURCES", "launch_commands", "setting_plan", "setting_run"]

PLAN_SOURCES = ("cluster", "paper", "gpipe")  # or the path of a measured profile
GPUS_PER_NODE = 8  # p3.16xlarge, the paper's nodes


def setting_plan(n: int, source: str = "cluster", seq_len: int | None = None) -> Plan:
    """The plan setting ``n`` trains with, from ``source`` (see the module docstring)."""
    s = setting(n, seq_len)
    if source == "gpipe":
        return s.gpipe_plan()
    if source == "paper":
        if seq_len not in (None, s.seq_len) and n != 5:
            raise ValueError(f"the paper prints plans for setting ({n}) at L={s.seq_len} only")
        return main_row(n, TERAPIPE).plan
    if source == "cluster":
        from tplib.tables.settings import plan_terapipe

        return plan_terapipe(s)
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"plan source {source!r} is neither one of {PLAN_SOURCES} nor a profile file"
        )
    from tplib.perfmodel import Profile
    from tplib.planner import plan as plan_slices
    from tplib.tables.settings import EPS, GRANULARITY

    profile = Profile.load(path)
    return plan_slices(
        profile,
        seq_len=s.seq_len,
        batch=s.pipeline_batch,
        n_stages=s.n_stages,
        granularity=GRANULARITY,
        eps=EPS,
        max_batch_slice_size=profile.max_batch_slice_size,
    )


def setting_run(
    n: int,
    *,
    plan: str = "cluster",
    seq_len: int | None = None,
    precision: str = "fp16",
    recompute: str = "none",
    device: str = "cuda",
    steps: int = 10,
    warmup: int = 2,
    timeout_s: float = 600.0,
) -> RunConfig:
    """Table 1 row ``n`` (or its Table-4 variant at ``seq_len``) as a run."""
    s = setting(n, seq_len)
    p = setting_plan(n, plan, seq_len)
    return RunConfig(
        model=s.model,
        model_overrides=(("seq_len", s.seq_len),) if s.config.seq_len != 2048 else (),
        schedule="gpipe" if plan == "gpipe" else "terapipe",
        n_stages=s.n_stages,
        n_data=s.n_data,
        n_op=s.n_op,
        batch=s.batch,
        seq_len=s.seq_len,
        slicing=p,
        precision=precision,
        recompute=recompute,
        device=device,
        ranks_per_node=GPUS_PER_NODE,
        steps=steps,
        warmup=warmup,
        timeout_s=timeout_s,
    )


def launch_commands(run: RunConfig, config: str, out: str) -> dict[str, str]:
    """How to start ``run`` (saved as ``config``) on its nodes: a torchrun line for
    every node, and the same under SLURM (one task per node)."""
    per_node = run.ranks_per_node or GPUS_PER_NODE
    nodes = -(-run.world_size // per_node)
    module = f"-m tplib.runtime.torchrun --config {shlex.quote(config)} --out {shlex.quote(out)}"
    torchrun = (
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint $HEAD_NODE:29500 {module}"
    )
    slurm = (
        f"srun --nodes {nodes} --ntasks-per-node 1 --gpus-per-node {per_node} "
        f"bash -c 'torchrun --nnodes $SLURM_NNODES --nproc-per-node {per_node} "
        f"--rdzv-id $SLURM_JOB_ID --rdzv-backend c10d "
        f'--rdzv-endpoint "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)":29500 '
        f"{module}'"
    )
    return {"torchrun": torchrun, "slurm": slurm}
