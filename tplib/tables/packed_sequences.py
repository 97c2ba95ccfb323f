"""Packed sequences, simulated: what padding wastes, what packing recovers, and what a
plan made for each packed batch adds, on the paper's settings (table ``packed_sequences``).

Real text comes in documents of every length; a batch holds rows of L = 2048 tokens. For
each setting (Table 1's; default (1), (5), (6), (9)), cluster model and document source
(:mod:`tplib.nn.doc_lengths`: the stdlib's files, ``"corpus"``, or log-normal lengths of
median 256, ``"lognormal"``), ``n_batches`` batches of the setting's pipeline batch
(B = B / #Data rows) run under five schemes:

====================  =================================================================
scheme                rows, plan, price
====================  =================================================================
``pad``               every document (pieces of L if longer) alone in a row padded to
                      L (:func:`~tplib.packing.pad_each`); the plan for unpacked rows;
                      priced on unpacked rows (padding computed, causal attention)
``packed-unmasked``   rows packed first-fit decreasing (:func:`~tplib.packing.pack`);
                      the same plan and price: attention over the whole row, so no
                      saving, only more real tokens per batch
``packed-uniform``    packed, document-masked: uniform token slices with the slice count
                      and batch split of the unpacked plan, priced on the packed rows
``packed-dp``         packed, document-masked: :func:`~tplib.planner.plan_packed` per
                      batch (on the grid of ``granularity`` tokens), priced on them
``packed-snap``       packed, document-masked: :func:`~tplib.planner.snap_uniform`
                      (the uniform cuts moved to document boundaries, no DP)
====================  =================================================================

The stream (:func:`batches`): documents' lengths in a seeded order
(:func:`~tplib.nn.doc_lengths.document_stream`), each cut into pieces of L; a batch takes the pieces the one
before left out, then new ones until they fill it (padded: B pieces; packed: B L tokens),
and leaves out what does not fit, for the next. Every scheme gets the same stream.

The price (:func:`~tplib.planner.packed_latency`): a plan's fill-drain latency ``sum t +
(K - 1) max t`` on a :class:`~tplib.planner.PackedCost` fitted once per setting and
cluster to its cluster model (the paper's p3.16xlarge V100s, unfused attention; or DGX
H100, FlashAttention), whose worst relative residual is ``fit_residual``. Every plan
lies on one grid of ``granularity`` tokens (32 by default: a packed batch's DP takes tens
of milliseconds there, against hundreds on the paper's 8-token grid), the unpacked plan
too (:func:`~tplib.planner.plan_packed` on whole rows, once per setting and cluster), so
the schemes differ only by their rows and plans. A masked slice computes no more pairs
than the same slice unmasked, and the DP's plan is within ``(K - 1) eps`` of the best on
the grid (batch slices of at most ``bmax`` rows), so (d) is never slower than (b) or (c)
by more than that. The iteration leaves out the gradient all-reduce and the optimizer step,
which no scheme changes. ``plan_ms`` is wall-clock planning on this machine, per batch
(``packed-dp`` and ``packed-snap``): a timing column, left out of the committed CSV.

Caveat: the cost model prices attention by the query-key pairs it computes, as a
variable-length kernel does (FlashAttention). The paper's implementation writes the
score rectangle out and masks it, so on the V100 model the masked schemes' savings in
attention are credited but would not be had (:mod:`tplib.planner.packed_cost`).

Extra ``cache``: :class:`~tplib.planner.PlanCache` in front of the DP on the corpus's
batches, at ``cache_buckets``: hit rate, planning per batch (misses pay their DP) and its
share of the iteration, and what the cached plans cost against each batch's own.

``measure`` mode: CPU runs of the ``small`` model on this machine, in
``tplib/tables/packed_measure.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
import pandas as pd

from tplib.cluster import CALIBRATION, Calibration
from tplib.cluster.calibration import CALIBRATIONS
from tplib.cluster.hardware import CLUSTERS
from tplib.cluster.implementation import PAPER_PLATFORM, Implementation, Platform
from tplib.documents import Documents
from tplib.nn.doc_lengths import SOURCES, corpus_lengths, document_stream, lognormal_lengths
from tplib.packing import Packing, pack, pad_each, piece_lengths
from tplib.paper import SETTINGS, setting
from tplib.plan import Plan, grid_size
from tplib.planner import PackedCost, PlanCache, packed_latency, plan_packed, snap_uniform
from tplib.search.setting import EPS, GRANULARITY, cost_model
from tplib.tables.base import Comparison, Rows, Table, TableMode
from tplib.tables.packed_measure import measure
from tplib.tables.packed_report import figure, findings, measured_figure, measured_findings

__all__ = [
    "PLATFORMS",
    "SCHEMES",
    "SEQ_LEN",
    "SOURCES",
    "TABLE",
    "batches",
    "simulate",
]

SEQ_LEN = 2048
SCHEMES = ("pad", "packed-unmasked", "packed-uniform", "packed-dp", "packed-snap")
# Cluster -> its calibration and platform: the paper's, and DGX H100 with FlashAttention.
PLATFORMS: dict[str, tuple[Calibration, Platform]] = {
    "p3.16xlarge": (CALIBRATION, PAPER_PLATFORM),
    "dgx-h100": (
        CALIBRATIONS["dgx-h100"],
        Platform(CLUSTERS["dgx-h100"], Implementation(attention="flash")),
    ),
}


def batches(
    lengths: Iterator[int], *, rows: int, n_batches: int, packed: bool, seq_len: int = SEQ_LEN
) -> list[Packing]:
    """``n_batches`` batches of ``rows`` rows from the stream ``lengths`` (see the module
    docstring); each :class:`~tplib.packing.Packing`'s ``lengths`` are the pieces it was
    given, the carried-over ones first, and ``left_out`` those carried to the next."""
    waiting: list[int] = []
    out = []
    for _ in range(n_batches):
        while (sum(waiting) < rows * seq_len) if packed else (len(waiting) < rows):
            n = next(lengths)
            waiting += piece_lengths(n, seq_len)
        if packed:
            p = pack(waiting, seq_len, rows=rows, method="ffd")
        else:
            p = pad_each(waiting, seq_len, rows=rows)
        out.append(p)
        waiting = [waiting[d] for d in p.left_out]
    return out


def _timed(f: Callable[..., Plan], *args: Any, **kwargs: Any) -> tuple[Plan, float]:
    """``f(*args, **kwargs)`` and the milliseconds it took."""
    start = time.perf_counter()
    plan = f(*args, **kwargs)
    return plan, 1e3 * (time.perf_counter() - start)


def _planned(plan: Plan, documents: Documents) -> Plan:
    """A batch's DP plan, made already (its time is the batch's own planning)."""
    return plan


def _check(
    settings: Sequence[int],
    clusters: Sequence[str],
    sources: Sequence[str],
    n_batches: int,
    granularity: int,
    eps: float,
    bmax: int,
    cache_buckets: Sequence[int],
) -> None:
    if bad := [i for i in settings if i not in SETTINGS]:
        raise ValueError(f"settings={bad!r}: Table 1's settings are {list(SETTINGS)}")
    if bad_c := [c for c in clusters if c not in PLATFORMS]:
        raise ValueError(f"clusters={bad_c!r}: choose among {list(PLATFORMS)}")
    if bad_s := [s for s in sources if s not in SOURCES]:
        raise ValueError(f"sources={bad_s!r}: choose among {list(SOURCES)}")
    if n_batches < 1 or bmax < 1 or not eps >= 0:
        raise ValueError(
            f"n_batches={n_batches}, bmax={bmax}, eps={eps}: at least one batch, batch "
            "slices of at least one row, and eps >= 0 seconds"
        )
    if granularity % GRANULARITY or SEQ_LEN % granularity:
        raise ValueError(
            f"granularity={granularity}: the DP's grid must be a multiple of the paper's "
            f"{GRANULARITY} tokens that divides L={SEQ_LEN}"
        )
    if bad_b := [b for b in cache_buckets if not granularity <= b <= SEQ_LEN]:
        raise ValueError(
            f"cache_buckets={bad_b!r}: a bucket is no finer than the DP's grid "
            f"({granularity}) and at most L={SEQ_LEN} tokens"
        )


def simulate(
    settings: Sequence[int] = (1, 5, 6, 9),
    clusters: Sequence[str] = tuple(PLATFORMS),
    sources: Sequence[str] = SOURCES,
    n_batches: int = 20,
    granularity: int = 32,
    eps: float = EPS / 10,
    bmax: int = 4,
    cache_buckets: Sequence[int] = (32, 256, SEQ_LEN),
    seed: int = 0,
) -> Rows:
    """The schemes' rows for every setting, cluster and source (see the module
    docstring): DP plans on the grid of ``granularity`` tokens within ``(K - 1) eps`` of
    the optimum (``eps``: a tenth of the paper's 0.1 ms, DGX H100's iterations being
    several times shorter than the V100s'), batch slices of at most ``bmax`` rows.
    Traces: ``per_batch`` (each batch's iteration, real tokens and planning), ``lengths``
    (the sources' lengths) and ``example`` (one batch's rows and DP plan, for
    :func:`~tplib.tables.packed_report.draw_plan`)."""
    _check(settings, clusters, sources, n_batches, granularity, eps, bmax, cache_buckets)
    rows: list[dict[str, Any]] = []
    per_batch: list[dict[str, Any]] = []
    cache: list[dict[str, Any]] = []
    example: dict[str, Any] | None = None
    for i in settings:
        s = setting(i)
        B, K, b = s.pipeline_batch, s.n_stages, min(bmax, s.pipeline_batch)
        streams = {
            (src, packed): batches(
                document_stream(src, seq_len=SEQ_LEN, seed=seed),
                rows=B,
                n_batches=n_batches,
                packed=packed,
            )
            for src in sources
            for packed in (False, True)
        }
        for cluster in clusters:
            calibration, platform = PLATFORMS[cluster]
            model = cost_model(s, calibration, on=platform)
            cost = PackedCost.fit(model, seq_len=SEQ_LEN, max_batch_slice_size=b)
            whole = plan_packed(
                cost, Documents.whole(B, SEQ_LEN), n_stages=K, granularity=granularity,
                eps=eps, max_batch_slice_size=b,
            )  # fmt: skip
            label = {"setting": i, "cluster": cluster}
            for src in sources:
                out, plans = _schemes(
                    streams[src, False], streams[src, True], cost, whole, K, granularity, eps, b
                )
                head = {**label, "source": src, "B": B, "K": K, "batches": n_batches}
                per_batch += [{**head, **r} for r in out]
                rows += _summary(pd.DataFrame(out), head, cost.residual)
                if src == "corpus":
                    cache += _cache(head, streams[src, True], plans, cost, K, granularity,
                                    cache_buckets)  # fmt: skip
                # The figure draws the largest batch of many documents a row.
                if src == "lognormal" and (example is None or example["plan"].batch < B):
                    first = streams[src, True][0]
                    example = {"documents": first.documents(), "plan": plans[0][0],
                               "title": f"({i}) {cluster}, {src}: batch 0's DP plan",
                               "real": first.row_lengths}  # fmt: skip
    lengths = pd.concat(
        [pd.DataFrame({"source": src, "length": _lengths(src, seed)}) for src in sources]
    )
    traces = {"per_batch": pd.DataFrame(per_batch), "lengths": lengths, "example": example}
    return Rows(pd.DataFrame(rows), {"cache": pd.DataFrame(cache)}, traces)


def _lengths(source: str, seed: int) -> list[int]:
    """What the figure draws of a source: every corpus file, 4000 log-normal lengths."""
    if source == "corpus":
        return list(corpus_lengths())
    return lognormal_lengths(4000, seq_len=SEQ_LEN, seed=seed)


def _schemes(
    padded: list[Packing],
    packed: list[Packing],
    cost: PackedCost,
    whole: Plan,
    n_stages: int,
    granularity: int,
    eps: float,
    bmax: int,
) -> tuple[list[dict[str, Any]], list[tuple[Plan, float]]]:
    """Per batch and scheme: its iteration, real tokens, padding and planning; and each
    packed batch's DP plan with its planning milliseconds."""
    B = whole.batch
    unpacked = packed_latency(whole, cost, Documents.whole(B, SEQ_LEN), n_stages)
    n_slices = min(max(map(len, whole.token_slices)), grid_size(SEQ_LEN, granularity))
    split = whole.batch_slices
    uniform = snap_uniform(
        Documents.whole(B, SEQ_LEN), n_slices, granularity=granularity, window=0,
        batch_slices=split,
    )  # fmt: skip
    out: list[dict[str, Any]] = []
    plans = []
    for k, (pad, p) in enumerate(zip(padded, packed, strict=True)):
        docs = p.documents()
        dp, dp_ms = _timed(
            plan_packed, cost, docs, n_stages=n_stages, granularity=granularity, eps=eps,
            max_batch_slice_size=bmax,
        )  # fmt: skip
        snap, snap_ms = _timed(
            snap_uniform, docs, n_slices, granularity=granularity, batch_slices=split
        )
        plans.append((dp, dp_ms))
        for scheme, rows, plan, t, ms in (
            ("pad", pad, whole, unpacked, np.nan),
            ("packed-unmasked", p, whole, unpacked, np.nan),
            ("packed-uniform", p, uniform, packed_latency(uniform, cost, docs, n_stages), np.nan),
            ("packed-dp", p, dp, packed_latency(dp, cost, docs, n_stages), dp_ms),
            ("packed-snap", p, snap, packed_latency(snap, cost, docs, n_stages), snap_ms),
        ):
            out.append(
                {"scheme": scheme, "batch": k, "iteration_s": t, "real_tokens": rows.real_tokens,
                 "padding_tokens": rows.padding_tokens, "documents": len(rows.pieces),
                 "n_slices": max(map(len, plan.token_slices)), "plan_ms": ms}
            )  # fmt: skip
    return out, plans


def _summary(df: pd.DataFrame, head: dict[str, Any], residual: float) -> list[dict[str, Any]]:
    """One row per scheme from its batches: totals over the stream, speedup over pad."""
    out = []
    for scheme, part in df.groupby("scheme", sort=False):
        real, seconds = int(part.real_tokens.sum()), float(part.iteration_s.sum())
        out.append(
            {**{k: head[k] for k in ("setting", "cluster", "source")}, "scheme": scheme,
             **head, "real_tokens": real,
             "padding_fraction": part.padding_tokens.sum() / (len(part) * head["B"] * SEQ_LEN),
             "docs_per_row": part.documents.sum() / (len(part) * head["B"]),
             "n_slices": part.n_slices.mean(), "iteration_s": part.iteration_s.mean(),
             "real_tokens_per_s": real / seconds, "plan_ms": part.plan_ms.mean(),
             "fit_residual": residual}
        )  # fmt: skip
    pad = out[0]["real_tokens_per_s"]
    return [{**r, "speedup_over_pad": r["real_tokens_per_s"] / pad} for r in out]


def _cache(
    head: dict[str, Any],
    packed: list[Packing],
    plans: list[tuple[Plan, float]],
    cost: PackedCost,
    n_stages: int,
    granularity: int,
    buckets: Sequence[int],
) -> list[dict[str, Any]]:
    """A PlanCache per bucket in front of the DP: a miss pays that batch's DP."""
    t_dp = float(np.mean([packed_latency(dp, cost, p.documents(), n_stages)
                          for p, (dp, _) in zip(packed, plans, strict=True)]))  # fmt: skip
    out = []
    for bucket in buckets:
        cache = PlanCache(granularity=granularity, bucket=bucket)
        used, ms = [], []
        for p, (dp, dp_ms) in zip(packed, plans, strict=True):
            docs, hits = p.documents(), cache.hits
            plan, lookup = _timed(cache.get_or_plan, docs, partial(_planned, dp))
            ms.append(lookup if cache.hits > hits else lookup + dp_ms)
            used.append(packed_latency(plan, cost, docs, n_stages))
        out.append(
            {**{k: head[k] for k in ("setting", "cluster", "source", "B")}, "bucket": bucket,
             "hit_rate": cache.hit_rate, "plans": len(cache), "iteration_s": np.mean(used),
             "over_own_plans": np.mean(used) / t_dp - 1, "plan_ms": np.mean(ms),
             "plan_pct": 100 * np.mean(ms) / (1e3 * np.mean(used))}
        )  # fmt: skip
    return out


TABLE = Table(
    "packed_sequences",
    "beyond the paper: packed documents",
    "Packed sequences: padding, packing and document-masked plans per batch",
    {
        "simulate": TableMode(
            simulate,
            figure=figure,
            findings=findings,
            columns="setting cluster source scheme B K batches real_tokens padding_fraction "
            "iteration_s real_tokens_per_s speedup_over_pad plan_ms fit_residual",
            compare=Comparison(("setting", "cluster", "source", "scheme"), "real_tokens_per_s"),
        ),
        "measure": TableMode(
            measure,
            figure=measured_figure,
            findings=measured_findings,
            columns="source scheme n_slices latency latency_round_min latency_round_max "
            "real_tokens padding_fraction real_tokens_per_s speedup_over_pad "
            "loss_vs_masked plan_ms",
            compare=Comparison(("source", "scheme"), "real_tokens_per_s", None, ()),
        ),
    },
)
