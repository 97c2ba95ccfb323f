"""The planners' choices as runs: what a layout search or a partitioning planner chose,
as a :class:`~tplib.runtime.RunConfig` the runtime executes.

* :func:`search_run`: the layout search's best (or any) candidate
  (:func:`tplib.search.layout.autoplan`): its #Data x #Pipe x #Op, recomputation and DP plan,
  the ``terapipe`` schedule, in fp16 on eight ranks per node as Table 1's runs are;
* :func:`twobw_run`: PipeDream-2BW's configuration (:func:`tplib.partition.twobw_plan`):
  w replicas (#Data) of a d-stage ``2bw`` pipeline on the planner's stage ranges, g
  microbatches of b sequences per update, recomputation as chosen;
* :func:`pipedream_run`: PipeDream's partition (:func:`tplib.partition.pipedream_partition`)
  as a ``pipedream`` run on its stage ranges. The runtime replicates whole pipelines
  (#Data), not single stages: a plan that puts every stage on r GPUs runs as r replicas,
  one that replicates its stages unequally is refused.

* :func:`balance_run`: GPipe's balance (:func:`tplib.partition.balance`) as a ``gpipe``
  run on its stage ranges, the batch in microbatches of a given size.

``python -m tplib autoplan --out`` and ``python -m tplib partition --out`` write them.
"""

from __future__ import annotations

from typing import Any

from tplib.nn.configs import get_config
from tplib.nn.layer_ranges import StageRange
from tplib.partition.pipedream import PipeDreamPlan
from tplib.partition.twobw import TwoBWConfig
from tplib.plan import Plan
from tplib.runtime.parts import Data, Optim, Parallelism
from tplib.runtime.runconfig import RunConfig
from tplib.search.layout import Candidate, Search

__all__ = ["balance_run", "pipedream_run", "search_run", "twobw_run"]

GPUS_PER_NODE = 8  # p3.16xlarge, the cluster the search prices
# Asynchronous schedules do not clip the global gradient norm (RunConfig says why).
NO_CLIPPING = Optim(grad_clip=0.0)


def search_run(search: Search, candidate: Candidate | None = None, **fields: Any) -> RunConfig:
    """The run of ``candidate`` (default: the best) of a layout search; ``fields`` set
    the rest of the :class:`RunConfig` (``timing``, ``device``, ...)."""
    c = candidate or search.best
    if not c.plan:
        raise ValueError(
            f"candidate {c.layout} was not planned ({c.status}): only a planned candidate "
            "has a plan to run"
        )
    lay = c.layout
    if lay.schedule != "terapipe" or lay.n_cp > 1 or lay.rounds > 1:
        raise ValueError(
            f"candidate {lay} runs {lay.schedule} with #CP={lay.n_cp} in {lay.rounds} "
            "round(s): a search's run is TeraPipe's plan in one round without context "
            "parallelism (the runtime runs #CP on CPU processes only)"
        )
    longer = search.seq_len > get_config(search.model).seq_len
    defaults: dict[str, Any] = {"precision": "fp16", "device": "cuda"}
    return RunConfig(
        model=search.model,
        model_overrides=(("seq_len", search.seq_len),) if longer else (),
        schedule_name="terapipe",
        parallelism=Parallelism(
            n_stages=lay.n_stages,
            n_data=lay.n_data,
            n_op=lay.n_op,
            ranks_per_node=GPUS_PER_NODE if search.n_gpus > GPUS_PER_NODE else 0,
        ),
        data=Data(batch=search.batch, seq_len=search.seq_len),
        slicing=Plan.from_paper(c.plan),
        recompute=lay.recompute,
        **(defaults | fields),
    )


def twobw_run(config: TwoBWConfig, model: str, seq_len: int, **fields: Any) -> RunConfig:
    """The run of a 2BW configuration for ``model`` at ``seq_len`` tokens; ``fields``
    set the rest of the :class:`RunConfig` (an ``optim`` given must not clip)."""
    b, g = config.microbatch, config.accumulation
    plan = Plan((b,) * g, ((seq_len,),) * g)
    return RunConfig(
        model=model,
        schedule_name="2bw",
        parallelism=Parallelism(
            n_stages=config.depth, n_data=config.width, stage_ranges=config.stage_ranges
        ),
        data=Data(batch=config.width * b * g, seq_len=seq_len),
        slicing=plan,
        recompute="full" if config.recompute else "none",
        **({"optim": NO_CLIPPING} | fields),
    )


def pipedream_run(
    plan: PipeDreamPlan, model: str, seq_len: int, microbatch: int, **fields: Any
) -> RunConfig:
    """The run of a PipeDream partition with minibatches of ``microbatch`` sequences;
    ``fields`` set the rest of the :class:`RunConfig` (an ``optim`` given must not
    clip)."""
    replicas = {s.replicas for s in plan.stages}
    if len(replicas) > 1:
        which = ", ".join(f"[{s.lo}, {s.hi}) on {s.replicas}" for s in plan.stages)
        raise ValueError(
            f"the plan replicates its stages unequally ({which}): tplib's runtime replicates "
            "whole pipelines (#Data), not single stages; plan with memory or topology that "
            "keeps one GPU per stage, or run its stage ranges without the replication"
        )
    # Every stage on r GPUs: r replicas of the whole pipeline, each its own minibatches.
    n_data = replicas.pop()
    return RunConfig(
        model=model,
        schedule_name="pipedream",
        parallelism=Parallelism(
            n_stages=len(plan.stages), n_data=n_data, stage_ranges=plan.stage_ranges
        ),
        data=Data(batch=n_data * microbatch, seq_len=seq_len),
        slicing=Plan((microbatch,), ((seq_len,),)),
        **({"optim": NO_CLIPPING} | fields),
    )


def balance_run(
    ranges: tuple[StageRange, ...] | list[StageRange],
    model: str,
    seq_len: int,
    batch: int,
    microbatch: int,
    **fields: Any,
) -> RunConfig:
    """The ``gpipe`` run of a balance's stage ``ranges``: ``batch`` sequences per
    iteration in microbatches of ``microbatch``; ``fields`` set the rest."""
    if batch % microbatch:
        raise ValueError(
            f"batch={batch} is not a multiple of microbatch={microbatch}: GPipe's "
            "microbatches are equal"
        )
    n = batch // microbatch
    return RunConfig(
        model=model,
        schedule_name="gpipe",
        parallelism=Parallelism(n_stages=len(ranges), stage_ranges=tuple(ranges)),
        data=Data(batch=batch, seq_len=seq_len),
        slicing=Plan((microbatch,) * n, ((seq_len,),) * n),
        **fields,
    )
