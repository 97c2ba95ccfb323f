"""The long-context study's question: which layout runs a method fastest at length L?

:func:`best_layout` answers it for a model, a platform (nodes and training code), a GPU
count, a global batch (in sequences or in tokens) and a sequence length, by one
:func:`~tplib.search.layout.autoplan` search restricted to the method's schedules and
#CP values, with no, selective and full recomputation:

=====================  ==================================================================
method                 what is searched
=====================  ==================================================================
``1f1b``               Megatron's 1F1B over microbatches, no context parallelism
``interleaved-1f1b``   the same interleaved over v > 1 chunks per stage
``cp``                 both, with every #CP that can run (1 included: where CP does not
                       pay, its best is the best layout without it, as in NeMo's table)
``seq1f1b``            1F1B over token slices, Seq1F1B's slicing (see below)
``terapipe``           TeraPipe: the DP planner's batch x token plan, fill-drain, in 1, 2,
                       4, ... rounds of gradient accumulation
``terapipe-zb``        the same with split backwards (the zero-bubble planner's plan)
``terapipe-cp``        ``terapipe`` with every #CP that can run
=====================  ==================================================================

The platform defaults to :data:`LONG_CONTEXT`: DGX H100 nodes under their calibration,
running Megatron-LM's long-context configuration (FlashAttention-2, sequence
parallelism where #Op > 1, the distributed optimizer, the embedding and the LM head on
the end stages, one checkpoint per layer under full recomputation). A layout fits when
the memory model (:mod:`tplib.cluster.memory`) puts its busiest GPU within the budget,
the GPU's memory less nothing: the calibration's ``memory_reserve`` is counted inside.

The answer (:class:`LongContextResult`) has the layout (TeraPipe's ``slicing`` is one
round's plan, its ``rounds`` how many run before the update), the iteration time, tokens per
second per GPU, MFU (Narayanan et al. 2021's model FLOPs,
:func:`~tplib.search.megatron.model_flops`; context parallelism changes no FLOP) and
peak memory per GPU, or, when nothing fits, the reason and the closest layout's memory.

Speed. The token planner works on a grid of L / :data:`GRID_STEPS` tokens (at least 8,
and a multiple of 2 #CP), the candidates are pruned by their memory floor first, then by
their latency floor, and 1F1B pipelines are simulated over 2K microbatches and
extrapolated (:func:`~tplib.search.pricing.periodic`).

``seq1f1b`` cuts every sequence by Seq1F1B's equal-FLOP rule
(:func:`~tplib.search.pricing.seq1f1b_slicing`) unless the ``slicing`` argument says
otherwise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from tplib.cluster import ClusterCostModel
from tplib.cluster.calibration import CALIBRATIONS, Calibration
from tplib.cluster.hardware import DGX_H100
from tplib.cluster.implementation import Implementation, Platform
from tplib.nn.configs import GPTConfig, get_config
from tplib.partition.chain import DoesNotFit
from tplib.search.layout import Candidate, NoLayout, autoplan
from tplib.search.megatron import model_flops
from tplib.search.pricing import Layout, Slicing, layout_cost_model

__all__ = [
    "GRID_STEPS",
    "LONG_CONTEXT",
    "METHODS",
    "MODELS",
    "LongContextResult",
    "best_layout",
    "layout_cost",
    "search_grid",
]

GRID_STEPS = 64  # token-grid steps per sequence for the TeraPipe planners
RECOMPUTE = ("none", "selective", "full")

# The platform of the study: DGX H100, Megatron-LM's long-context configuration.
LONG_CONTEXT = Platform(
    hardware=DGX_H100,
    implementation=Implementation(
        attention="flash",
        sequence_parallel=True,
        distributed_optimizer=True,
        ends=True,
        layer_checkpoints=True,
    ),
)

# method -> (schedules, #CP values: None for every one that can run)
METHODS: dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]] = {
    "1f1b": (("1f1b",), (1,)),
    "interleaved-1f1b": (("interleaved-1f1b",), (1,)),
    "cp": (("1f1b", "interleaved-1f1b"), None),
    "seq1f1b": (("seq1f1b",), (1,)),
    "terapipe": (("terapipe",), (1,)),
    "terapipe-zb": (("terapipe-zb",), (1,)),
    "terapipe-cp": (("terapipe",), None),
}

# Llama-2-like models as GPT configs (no SwiGLU nor rotary embeddings: a GELU MLP of
# 4H has about the parameters and FLOPs of Llama's 3 x 2.7H SwiGLU).
MODELS: dict[str, GPTConfig] = {
    c.name: c
    for c in (
        GPTConfig("Llama-2-7B", n_layer=32, hidden=4096, n_head=32, vocab_size=32000),
        GPTConfig("Llama-2-13B", n_layer=40, hidden=5120, n_head=40, vocab_size=32000),
    )
}


@dataclass(frozen=True)
class LongContextResult:
    """A method's best layout at one length, or why none fits (``fits`` False, the layout
    fields None, ``reason`` and ``memory_gib`` the closest candidate's: its memory floor
    where it was not planned)."""

    model: str
    method: str
    seq_len: int
    n_gpus: int
    batch: int
    budget_gib: float
    fits: bool
    reason: str = ""
    tp: int | None = None
    cp: int | None = None
    pp: int | None = None
    dp: int | None = None
    v: int | None = None
    microbatch: int | None = None
    rounds: int | None = None
    recompute: str = ""
    schedule: str = ""
    slicing: str = ""
    iteration_s: float = math.nan
    tokens_per_s_per_gpu: float = math.nan
    mfu: float = math.nan
    memory_gib: float = math.nan
    search_seconds: float = 0.0

    def row(self) -> dict[str, Any]:
        """One row of a results table."""
        return asdict(self)


def _model(model: GPTConfig | str) -> GPTConfig:
    if isinstance(model, GPTConfig):
        return model
    return MODELS[model] if model in MODELS else get_config(model)


def _batch(batch: int | None, batch_tokens: int | None, seq_len: int) -> int:
    """Sequences per iteration from ``batch`` or ``batch_tokens`` (exactly one given)."""
    if (batch is None) == (batch_tokens is None):
        raise ValueError(
            f"batch={batch!r}, batch_tokens={batch_tokens!r}: give the global batch one way"
        )
    if batch_tokens is not None:
        if batch_tokens < seq_len or batch_tokens % seq_len:
            raise ValueError(
                f"batch_tokens={batch_tokens} is not a whole number of sequences of "
                f"seq_len={seq_len} tokens"
            )
        return batch_tokens // seq_len
    assert batch is not None
    return batch


def best_layout(
    model: GPTConfig | str,
    n_gpus: int,
    seq_len: int,
    method: str,
    *,
    batch: int | None = None,
    batch_tokens: int | None = None,
    platform: Platform = LONG_CONTEXT,
    calibration: Calibration | None = None,
    memory_gib: float | None = None,
    slicing: Slicing | None = None,
) -> LongContextResult:
    """The fastest layout of ``method`` (:data:`METHODS`) for ``model`` (a config, or a
    name in :data:`MODELS` or :data:`tplib.nn.configs.MODELS`) on ``n_gpus`` GPUs of
    ``platform`` (under ``calibration``, default its nodes'), a global batch of
    ``batch`` sequences or ``batch_tokens`` tokens of ``seq_len``, within ``memory_gib``
    per GPU (default the GPU's); see the module docstring. Where nothing fits or no
    layout can run the method the result says why; ``ValueError`` for a bad request."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: choose one of {list(METHODS)}")
    cfg = _model(model)
    cfg = cfg if cfg.seq_len >= seq_len else cfg.with_(seq_len=seq_len)
    sequences = _batch(batch, batch_tokens, seq_len)
    hw = platform.hardware
    if memory_gib is not None:
        hw = replace(hw, gpu_memory=memory_gib * 2**30)
    budget = hw.gpu_memory / 2**30
    head = LongContextResult(cfg.name, method, seq_len, n_gpus, sequences, budget, False)
    schedules, cps = METHODS[method]
    try:
        search = autoplan(
            cfg,
            n_gpus,
            sequences,
            seq_len=seq_len,
            cluster=hw.name,
            hardware=hw,
            recompute=RECOMPUTE,
            calibration=calibration or CALIBRATIONS[hw.name],
            implementation=platform.implementation,
            schedules=schedules,
            context_parallel=cps,
            granularity=search_grid(seq_len),
            slicing=slicing,
            accumulate=True,
        )
    except DoesNotFit as e:
        return replace(head, reason=str(e), memory_gib=e.memory / 2**30)
    except NoLayout as e:  # the method cannot run this model on these GPUs at all
        return replace(head, reason=str(e))
    return _result(head, search.best, cfg, hw.peak_fp16, search.seconds)


def _result(
    head: LongContextResult, best: Candidate, cfg: GPTConfig, peak: float, seconds: float
) -> LongContextResult:
    lay, t = best.layout, best.latency
    tokens = head.batch * head.seq_len
    return replace(
        head,
        fits=True,
        tp=lay.n_op,
        cp=lay.n_cp,
        pp=lay.n_stages,
        dp=lay.n_data,
        v=lay.n_chunks,
        microbatch=lay.microbatch,
        rounds=lay.rounds,
        recompute=lay.recompute,
        schedule=lay.schedule,
        slicing=best.plan,
        iteration_s=t,
        tokens_per_s_per_gpu=tokens / t / head.n_gpus,
        mfu=model_flops(cfg.with_(seq_len=head.seq_len), head.batch) / (t * head.n_gpus * peak),
        memory_gib=best.memory / 2**30,
        search_seconds=seconds,
    )


def search_grid(seq_len: int, n_cp: int = 1) -> int:
    """The token planners' grid at ``seq_len``: L / :data:`GRID_STEPS` tokens, at least 8,
    and a multiple of 2 #CP where #CP > 1 (as :func:`~tplib.search.layout.autoplan` makes
    it for a context-parallel layout)."""
    grid = max(8, seq_len // GRID_STEPS)
    return math.lcm(grid, 2 * n_cp) if n_cp > 1 else grid


def layout_cost(
    result: LongContextResult,
    platform: Platform = LONG_CONTEXT,
    calibration: Calibration | None = None,
) -> ClusterCostModel:
    """The cluster cost model of ``result``'s layout (which must fit), as the search priced
    it (:func:`~tplib.search.pricing.layout_cost_model`)."""
    if not result.fits or result.pp is None or result.tp is None:
        raise ValueError(f"{result.method} at L={result.seq_len} has no layout: {result.reason}")
    hw = replace(platform.hardware, gpu_memory=result.budget_gib * 2**30)
    cfg = _model(result.model)
    lay = Layout(
        n_data=result.dp or 1, n_stages=result.pp, n_op=result.tp,
        recompute=result.recompute, n_cp=result.cp or 1,
    )  # fmt: skip
    return layout_cost_model(
        cfg if cfg.seq_len >= result.seq_len else cfg.with_(seq_len=result.seq_len),
        lay,
        result.seq_len,
        calibration=calibration or CALIBRATIONS[hw.name],
        hardware=hw,
        implementation=platform.implementation,
    )
