"""The packed-sequences study on this machine: the same documents padded, packed without
and with document masking, under uniform slices and the per-batch DP
(``packed_sequences`` in measure mode).

Four schemes per document source (each stdlib file a document, or log-normal lengths;
:data:`~tplib.packing.DOCUMENT_SOURCES`), on two local processes running ``terapipe`` over
batches of ``batch`` rows of ``seq_len`` tokens of the ``small`` model:

======================  ===========================================================================
``scheme``              what runs
======================  ===========================================================================
``pad``                 (a) one document (or a piece of L) per row, padded to L: what the other
                        pipeline systems force; uniform slices
``packed-unmasked``     (b) rows packed first-fit decreasing, attention across documents;
                        uniform slices
``packed-uniform``      (c) packed, attention within documents; uniform slices
``packed-dp``           (d) packed, attention within documents; each batch its own plan
                        (:func:`~tplib.planner.plan_packed`, per-batch plans of the runtime)
======================  ===========================================================================

Every batch slice is one row (so the per-batch plans keep the batch split the runtime's
K/V contexts need). The uniform slice count and the DP's costs come from the stages'
measured profiles (:class:`~tplib.measure.pricing.BottleneckCost`, fitted to a
:class:`~tplib.planner.PackedCost`). Iteration i of every run trains on the batch of seed
``seed + i``, so each scheme sees the same document stream each round.

The schemes run in turn, ``rounds`` times (A B C D A B C D ...), so a slow spell of the
machine falls on all of them. ``latency`` is the median timed iteration, ``real_tokens``
the mean tokens of documents (not padding) per timed iteration, ``real_tokens_per_s``
their ratio; ``_round_min`` / ``_max`` its spread over the rounds' medians.
``loss_vs_masked``: scheme (b)'s mean loss over the timed iterations against (c)'s on
the same batches, relative (what attending across documents changes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
from tqdm.auto import tqdm

from tplib.measure.options import Profiling
from tplib.plan import Plan
from tplib.tables.base import Rows

if TYPE_CHECKING:
    from tplib.measure.harness import Bench, Measured
    from tplib.planner import PackedCost
    from tplib.runtime import Data, LocalPool

__all__ = ["SCHEMES", "measure"]

SCHEMES = ("pad", "packed-unmasked", "packed-uniform", "packed-dp")
_SLICE_COUNTS = (1, 2, 4, 8, 16)


def _data(source: str, scheme: str, batch: int, seq_len: int, seed: int) -> Data:
    from tplib.runtime import Data

    return Data(
        batch=batch,
        seq_len=seq_len,
        source=f"{source}-documents",
        seed=seed,
        packing="pad" if scheme == "pad" else "ffd",
        document_masking=scheme != "packed-unmasked",
    )


def _uniform(cost: PackedCost, batch: int, seq_len: int, n_stages: int, g: int) -> Plan:
    """Equal slices of one row per batch slice, the count of least latency on whole rows."""
    from tplib.documents import Documents
    from tplib.planner import packed_latency

    whole = Documents.whole(batch, seq_len)
    plans = [
        Plan(
            (1,) * batch,
            (tuple(Plan.uniform(1, seq_len, n_token_slices=k).token_slices[0]),) * batch,
        )
        for k in _SLICE_COUNTS
        if seq_len // k >= g
    ]
    return min(plans, key=lambda p: packed_latency(p, cost, whole, n_stages))


def _per_batch_plans(
    bench: Bench, cost: PackedCost, data: Data, granularity: int
) -> tuple[tuple[Plan, ...], float]:
    """Each iteration's DP plan on its packed batch, and the mean planning seconds."""
    from tplib.nn.data import document_batch
    from tplib.planner import plan_packed

    plans, seconds = [], []
    for i in range(bench.warmup + bench.iters):
        batch = document_batch(bench.cfg, data.source, data.batch, data.seq_len, data.seed + i)
        start = time.perf_counter()
        plans.append(
            plan_packed(
                cost,
                batch.documents,
                n_stages=bench.n_stages,
                granularity=granularity,
                max_batch_slice_size=1,
            )
        )
        seconds.append(time.perf_counter() - start)
    return tuple(plans), statistics.fmean(seconds)


def _real_tokens(bench: Bench, data: Data) -> float:
    """Mean tokens of documents per timed iteration."""
    from tplib.runtime.batches import real_tokens

    return statistics.fmean(
        real_tokens(bench.cfg, data, range(bench.warmup, bench.warmup + bench.iters))
    )


def _row(runs: list[Measured], real: float, batch: int, seq_len: int) -> dict[str, Any]:
    every = [t for m in runs for t in m.latencies]
    latency = statistics.median(every)
    by_round = [real / m.latency for m in runs]
    losses = [x for m in runs for x in m.result.losses]
    return {
        "latency": latency,
        "latency_round_min": min(m.latency for m in runs),
        "latency_round_max": max(m.latency for m in runs),
        "real_tokens": real,
        "padding_fraction": 1.0 - real / (batch * seq_len),
        "real_tokens_per_s": real / latency,
        "real_tokens_per_s_round_min": min(by_round),
        "real_tokens_per_s_round_max": max(by_round),
        "loss": statistics.fmean(losses),
        "iterations": len(every),
    }


def measure(
    seq_len: int = 2048,
    batch: int = 2,
    model: str = "small",
    model_overrides: Mapping[str, object] | Sequence[tuple[str, object]] = (),
    n_stages: int = 2,
    sources: Sequence[str] = ("corpus", "lognormal"),
    schemes: Sequence[str] = SCHEMES,
    rounds: int = 3,
    iters: int = 2,
    warmup: int = 1,
    seed: int = 1,
    granularity: int = 32,
    profiling: Profiling | Mapping[str, Any] = Profiling(granularity=256),
    link: Sequence[float] | None = None,
    pool: LocalPool | None = None,
    progress: bool = True,
) -> Rows:
    """The schemes of the module docstring for each of ``sources``, measured in ``rounds``
    alternating rounds of ``iters`` timed iterations (after ``warmup`` untimed ones);
    the per-batch DP plans on a grid of ``granularity`` tokens."""
    if bad := [s for s in schemes if s not in SCHEMES]:
        raise ValueError(f"schemes={bad!r}: choose among {list(SCHEMES)}")
    if bad := [s for s in sources if s not in ("corpus", "lognormal")]:
        raise ValueError(f"sources={bad!r}: choose among ['corpus', 'lognormal']")
    if rounds < 1 or seq_len % granularity:
        raise ValueError(
            f"rounds={rounds}, seq_len={seq_len}, granularity={granularity}: need rounds >= 1 "
            "and a grid that divides the rows"
        )
    from tplib.measure.harness import measured_bench  # starts processes: torch
    from tplib.measure.pricing import BottleneckCost
    from tplib.planner import PackedCost

    prof = Profiling.of(profiling)
    with measured_bench(
        model, model_overrides, n_stages, iters, warmup, link, prof, progress, pool
    ) as bench:
        profiles = bench.profile(seq_len, prof.granularity or 256)
        g = profiles[0].granularity
        cost = PackedCost.fit(
            BottleneckCost(profiles), seq_len=seq_len, max_batch_slice_size=1, granularity=g
        )
        uniform = _uniform(cost, batch, seq_len, n_stages, g)
        configs: dict[tuple[str, str], tuple[Data, dict[str, Any], float]] = {}
        for source in sources:
            for scheme in schemes:
                data = _data(source, scheme, batch, seq_len, seed)
                options: dict[str, Any] = {"data": data}
                plan_s = float("nan")
                if scheme == "packed-dp":
                    options["batch_plans"], plan_s = _per_batch_plans(
                        bench, cost, data, granularity
                    )
                configs[source, scheme] = (data, options, plan_s)
        runs: dict[tuple[str, str], list[Measured]] = {key: [] for key in configs}
        for _ in tqdm(range(rounds), desc="rounds", disable=not progress):
            for key, (_, options, _) in configs.items():
                runs[key].append(bench.run("terapipe", uniform, **options))
        rows = []
        for (source, scheme), (data, options, plan_s) in configs.items():
            plans = options.get("batch_plans", (uniform,))
            rows.append(
                {
                    "model": model,
                    "seq_len": seq_len,
                    "batch": batch,
                    "source": source,
                    "scheme": scheme,
                    "n_slices": statistics.fmean(len(p.token_slices[0]) for p in plans),
                    "plan": "per batch" if scheme == "packed-dp" else uniform.to_paper(),
                    "plan_ms": 1e3 * plan_s,
                    "fit_residual": cost.residual,
                }
                | _row(runs[source, scheme], _real_tokens(bench, data), batch, seq_len)
            )
    df = pd.DataFrame(rows)
    for source in sources:
        mine = df.source == source
        pad = df.real_tokens_per_s[mine & (df.scheme == "pad")]
        df.loc[mine, "speedup_over_pad"] = (
            df.real_tokens_per_s[mine] / pad.iloc[0] if len(pad) else float("nan")
        )
        masked = df.loss[mine & (df.scheme == "packed-uniform")]
        df.loc[mine, "loss_vs_masked"] = (
            df.loss[mine] / masked.iloc[0] - 1.0 if len(masked) else float("nan")
        )
    return Rows(df)
