"""A paper setting on the simulated cluster: plan it, simulate it, count its FLOPs.

"w/o TeraPipe" is GPipe with microbatches of one sequence; "w/ TeraPipe" is the DP
planner's joint batch x token plan (:func:`tplib.planner.plan`) on
:class:`~tplib.cluster.ClusterCostModel`, run as the ``terapipe`` schedule. Both are timed
by :func:`tplib.sim.simulate.simulate`, so the planner's own latency estimate only chooses
the plan.

Beyond the paper, :func:`simulate_virtual` runs a setting with virtual stages (v chunks
per stage, v dividing its N / K layers): Megatron's interleaved 1F1B on GPipe's
microbatches, a modern baseline, and TeraPipe's token slices interleaved
(``terapipe-interleaved``) or breadth-first (``terapipe-bfs``), planned for the
objective sum t + (K - 1) / v max t (:mod:`tplib.planner.dp`), each at its best v.

TFLOPS per GPU follow the paper's own formula (it reproduces the paper's TFLOPS column
to 0.2% from its latencies; see :func:`paper_flops`): the model FLOPs of ONE pipeline's
batch (B / #Data sequences) divided by the latency and by ALL #GPUs, which undercounts
the data-parallel settings by #Data; we keep it for comparability. (For Table 4's longer
sequences the paper also kept L = 2048 in the count; we count the real L.)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Literal, cast

import pandas as pd

from tplib.cluster import CALIBRATION, FIT_STAGES, Calibration, ClusterCostModel
from tplib.cluster.implementation import PAPER_PLATFORM, Platform
from tplib.cluster.memory import schedule_memory_per_gpu
from tplib.paper import TERAPIPE, PaperResult, Setting, main_row, seqlen_row, setting
from tplib.plan import Plan
from tplib.planner import pipeline_latency, plan_slices
from tplib.planner.zero_bubble import plan_zero_bubble
from tplib.schedule import make_schedule
from tplib.schedule.chunks import interleaved
from tplib.sim.costs import SliceCostModel
from tplib.sim.simulate import SimResult, simulate, simulate_schedule

__all__ = [
    "EPS",
    "GRANULARITY",
    "VIRTUAL",
    "Method",
    "beside_paper",
    "chunk_choices",
    "compare_joint_methods",
    "cost_model",
    "paper_flops",
    "plan_terapipe",
    "rel",
    "setting_fields",
    "simulate_on_cluster",
    "simulate_setting",
    "simulate_virtual",
    "tflops_per_gpu",
]

EPS = 1e-4  # the paper's eps = 0.1 ms (§3.3)
GRANULARITY = 8  # every slice in the paper's tables is a multiple of 8 tokens
Method = Literal["exact", "paper"]


def paper_flops(s: Setting, seq_len: int | None = None) -> float:
    """The paper's FLOP count of one iteration of one pipeline (the authors' formula:
    6 x N x [12 b L H^2 + 7 b L H + b n_head L^2 (H / n_head + 1)], b = B / #Data),
    i.e. 6 x (multiply-adds of the layers' matrix products and main element-wise ops);
    embeddings and the LM head are not counted. Table 4's TFLOPS column for L > 2048 is
    only reproduced with ``seq_len=2048``: the paper counted L = 2048 for every length
    (it undercounts those rows by L / 2048 or more). By default we count the real L."""
    cfg, b, L = s.config, s.pipeline_batch, seq_len or s.seq_len
    h, heads = cfg.hidden, cfg.n_head
    c, a = b * L * h, b * heads * L * L
    per_layer = 12 * c * h + 7 * c + a * (h / heads + 1)
    return 6.0 * cfg.n_layer * per_layer


def tflops_per_gpu(s: Setting, latency: float, seq_len: int | None = None) -> float:
    """The paper's "TFlops (per GPU)": :func:`paper_flops` / latency / #GPUs / 1e12."""
    return paper_flops(s, seq_len) / latency / s.n_gpus / 1e12


def cost_model(
    s: Setting,
    calibration: Calibration = CALIBRATION,
    *,
    on: Platform = PAPER_PLATFORM,
) -> ClusterCostModel:
    """Setting ``s``'s layout on platform ``on`` (the paper's p3.16xlarge nodes and
    implementation by default) under ``calibration`` (the platform's nodes')."""
    return ClusterCostModel.for_setting(
        s, calibration, hardware=on.hardware, implementation=on.implementation
    )


def simulate_on_cluster(
    s: Setting,
    p: Plan,
    schedule: str = "terapipe",
    *,
    calibration: Calibration = CALIBRATION,
    on: Platform = PAPER_PLATFORM,
    validate: bool = False,
) -> SimResult:
    """Simulate plan ``p`` as ``schedule`` on setting ``s``'s cluster model (without
    validating the schedule by default: see :func:`tplib.sim.simulate.simulate_schedule`)."""
    p.check_covers(s.pipeline_batch, s.seq_len)
    return simulate_schedule(
        schedule,
        s.n_stages,
        p,
        cost_model(s, calibration, on=on),
        validate=validate,
    )


def plan_terapipe(
    s: Setting,
    *,
    method: Method = "exact",
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
    on: Platform = PAPER_PLATFORM,
    cost: SliceCostModel | None = None,
    n_chunks: int = 1,
) -> Plan:
    """The DP planner's joint batch x token plan for setting ``s`` on the cluster model,
    or on ``cost`` (e.g. a profile measured on the GPUs at hand); with ``n_chunks`` v,
    for the token slices interleaved over v chunks per stage (the cluster model of the
    interleaved placement by default)."""
    if cost is None:
        cost = cost_model(s, calibration, on=on).placed(interleaved(s.n_stages, n_chunks))
    return plan_slices(
        cost,
        seq_len=s.seq_len,
        batch=s.pipeline_batch,
        n_stages=s.n_stages,
        granularity=GRANULARITY,
        eps=eps,
        method=method,
        n_chunks=n_chunks,
    )


def simulate_setting(
    n: int,
    *,
    seq_len: int | None = None,
    method: Method = "exact",
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
    on: Platform = PAPER_PLATFORM,
) -> dict[str, object]:
    """Setting ``(n)`` (or its Table-4 variant at ``seq_len``) without and with TeraPipe:
    latencies, speedup, the plan and what the simulator saw; and the paper's own TeraPipe
    plan simulated (``latency_paper_plan``), which separates the cost model's error from
    the planner's choice. ``gpipe_row`` says whether the GPipe row entered the stored
    calibration's fit ("fit") or not ("held out")."""
    s = setting(n, seq_len)
    paper_t = seqlen_row(s.seq_len, TERAPIPE) if s.seq_len != 2048 else main_row(n, TERAPIPE)
    fitted = s.seq_len == 2048 and any(n in rows for _, rows in FIT_STAGES)
    t0 = time.perf_counter()
    p = plan_terapipe(
        s,
        method=method,
        eps=eps,
        calibration=calibration,
        on=on,
    )
    t_plan = time.perf_counter() - t0
    gpipe = simulate_on_cluster(
        s,
        s.gpipe_plan(),
        "gpipe",
        calibration=calibration,
        on=on,
    )
    tera = simulate_on_cluster(s, p, "terapipe", calibration=calibration, on=on)
    memory = cost_model(s, calibration, on=on).memory(p)
    # Beyond the paper: split backwards, planned by the zero-bubble objective.
    pz = plan_zero_bubble(
        cost_model(s, calibration, on=on),
        seq_len=s.seq_len,
        batch=s.pipeline_batch,
        n_stages=s.n_stages,
        granularity=GRANULARITY,
        eps=eps,
    )
    zb = {
        name: simulate_on_cluster(s, pz, name, calibration=calibration, on=on).latency
        for name in ("terapipe-zb", "1f1b-zb")
    }
    return setting_fields(s) | {
        "latency_gpipe": gpipe.latency,
        "latency_terapipe": tera.latency,
        "speedup": gpipe.latency / tera.latency,
        "tflops_gpipe": tflops_per_gpu(s, gpipe.latency),
        "tflops_per_gpu": tflops_per_gpu(s, tera.latency),
        "bubble_gpipe": gpipe.bubble_fraction,
        "bubble_terapipe": tera.bubble_fraction,
        "plan": p.to_paper(),
        "planner_latency": p.latency,
        "plan_seconds": t_plan,
        "memory_gib": memory.total / 2**30,
        "fits_memory": memory.fits,
        "latency_terapipe_zb": zb["terapipe-zb"],
        "latency_1f1b_zb": zb["1f1b-zb"],
        "speedup_zb": gpipe.latency / min(zb.values()),
        "gain_zb_over_terapipe": tera.latency / min(zb.values()),
        "plan_zb": pz.to_paper(),
        "latency_paper_plan": simulate_on_cluster(
            s,
            paper_t.plan,
            "terapipe",
            calibration=calibration,
            on=on,
        ).latency,
        "gpipe_row": "fit" if fitted else "held out",
    }


# The schedules with virtual stages a setting is simulated with (simulate_virtual), and
# what each runs with one chunk per stage: 1F1B, and TeraPipe's own fill-drain.
VIRTUAL = {"interleaved-1f1b": "1f1b", "terapipe-interleaved": "1f1b", "terapipe-bfs": "terapipe"}


def chunk_choices(s: Setting) -> tuple[int, ...]:
    """Every v that divides setting ``s``'s N / K layers per stage (each of the vK parts
    gets as many layers), 1 first."""
    n = s.layers_per_stage
    return tuple(v for v in range(1, n + 1) if n % v == 0)


def simulate_virtual(
    s: Setting,
    terapipe: Plan | None = None,
    *,
    method: Method = "exact",
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
    on: Platform = PAPER_PLATFORM,
) -> dict[str, object]:
    """Setting ``s`` with virtual stages (see the module docstring): for each schedule of
    :data:`VIRTUAL`, the v of least simulated latency among :func:`chunk_choices`, its
    latency, the busiest GPU's memory and, for the token-sliced ones, the plan (the DP's
    for (K - 1) / v; ``terapipe``, TeraPipe's own, when v = 1). ``note_<schedule>`` says
    which v could not run: interleaving needs as many units per iteration as stages
    (Megatron's rule). Columns are named by schedule, with ``-`` as ``_``."""
    plans = {
        1: terapipe
        or plan_terapipe(
            s,
            method=method,
            eps=eps,
            calibration=calibration,
            on=on,
        )
    }
    best: dict[str, tuple[float, int, Plan, float]] = {}
    notes: dict[str, list[str]] = {name: [] for name in VIRTUAL}
    for v in chunk_choices(s):
        cost = cost_model(s, calibration, on=on).placed(interleaved(s.n_stages, v))
        if v not in plans:
            plans[v] = plan_terapipe(
                s,
                method=method,
                eps=eps,
                calibration=calibration,
                on=on,
                n_chunks=v,
            )
        for name, one in VIRTUAL.items():
            plan = s.gpipe_plan() if name == "interleaved-1f1b" else plans[v]
            if v > 1 and name != "terapipe-bfs" and plan.n_units < s.n_stages:
                notes[name].append(
                    f"v={v} needs >= {s.n_stages} units per iteration, the plan has {plan.n_units}"
                )
                continue
            schedule = make_schedule(
                name if v > 1 else one, s.n_stages, plan, n_chunks=v, validate=False
            )
            latency = simulate(schedule, cost).latency
            if name not in best or latency < best[name][0]:
                memory, _ = schedule_memory_per_gpu(
                    s.config,
                    schedule,
                    n_op=s.n_op,
                    calibration=calibration,
                    hardware=on.hardware,
                    implementation=on.implementation,
                    n_data=s.n_data,
                )
                best[name] = (latency, v, plan, memory.total / 2**30)
    row: dict[str, object] = {}
    for name, (latency, v, plan, gib) in best.items():
        key = name.replace("-", "_")
        row |= {f"latency_{key}": latency, f"v_{key}": v, f"memory_gib_{key}": gib}
        if name != "interleaved-1f1b":
            row[f"plan_{key}"] = plan.to_paper()
        row[f"note_{key}"] = "; ".join(notes[name])
    return row


def setting_fields(s: Setting) -> dict[str, object]:
    """What a row says of its setting: number, model, L, B/#Data and the layout."""
    return {
        "setting": s.index,
        "model": s.model,
        "seq_len": s.seq_len,
        "pipeline_batch": s.pipeline_batch,
        "n_stages": s.n_stages,
        "n_op": s.n_op,
        "n_data": s.n_data,
    }


def rel(ours: float, paper: float) -> float:
    """Relative error of ours against the paper's: ours / paper - 1."""
    return ours / paper - 1.0


def beside_paper(r: dict[str, object], g: PaperResult, t: PaperResult) -> dict[str, object]:
    """Our simulated row ``r`` with the paper's w/o (``g``) and w/ (``t``) TeraPipe values
    and the relative errors (of the paper's own plan too, when ``r`` simulated it)."""
    lat_g, lat_t, speedup = (
        cast(float, r[k]) for k in ("latency_gpipe", "latency_terapipe", "speedup")
    )
    return (
        r
        | {
            "paper_latency_gpipe": g.latency,
            "paper_latency_terapipe": t.latency,
            "paper_speedup": g.latency / t.latency,
            "paper_tflops_per_gpu": t.tflops,
            "paper_plan": t.scheme,
            "err_latency_gpipe": rel(lat_g, g.latency),
            "err_latency_terapipe": rel(lat_t, t.latency),
            "err_speedup": rel(speedup, g.latency / t.latency),
        }
        | (
            {"err_latency_paper_plan": rel(cast(float, r["latency_paper_plan"]), t.latency)}
            if "latency_paper_plan" in r
            else {}
        )
    )


def compare_joint_methods(
    settings: Iterable[int] = range(1, 11),
    eps: float = EPS,
    calibration: Calibration = CALIBRATION,
    on: Platform = PAPER_PLATFORM,
) -> pd.DataFrame:
    """The paper's joint DP (knapsack over per-batch-slice T_b, which counts the
    (K - 1) t_max fill once per batch slice) against the exact one (one t_max shared by
    all batch slices), each plan judged by the true fill-drain latency
    sum t + (K - 1) max t and by the simulator."""
    rows = []
    for n in settings:
        s = setting(n)
        cost = cost_model(s, calibration, on=on)
        row: dict[str, object] = {"setting": n, "model": s.model}
        latency, simulated = {}, {}
        for method in ("paper", "exact"):
            t0 = time.perf_counter()
            p = plan_terapipe(
                s,
                method=method,
                eps=eps,
                calibration=calibration,
                on=on,
            )
            row[f"plan_seconds_{method}"] = time.perf_counter() - t0
            row[f"plan_{method}"] = p.to_paper()
            latency[method] = pipeline_latency(p, cost, s.n_stages)
            simulated[method] = simulate_on_cluster(s, p, calibration=calibration, on=on).latency
            row[f"latency_{method}"] = latency[method]
            row[f"simulated_{method}"] = simulated[method]
        row["paper_over_exact"] = latency["paper"] / latency["exact"]
        row["simulated_paper_over_exact"] = simulated["paper"] / simulated["exact"]
        rows.append(row)
    return pd.DataFrame(rows)
