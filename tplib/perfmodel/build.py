"""Building a profile from timings: where to measure, Eq. 9's fit and its held-out score.

Timing all O(L^2) points (l, c) of the token grid is too slow, so, as in the paper,
:func:`build_profile` times t(b, l, 0) at every grid length l = g, 2g, ..., L and
t(b, l, c) on a lattice of (l, c) points (:func:`context_points`), fits Eq. 9's a0..a3
per batch-slice size b by least squares (:func:`~tplib.perfmodel.profile.fit_context`),
and scores the fit on held-out points it never saw. On a machine shared with other
jobs, rounds can be combined by their median rather than their least, and the table
smoothed (:func:`smooth_lengths`).

``measure(b, l, c) -> seconds`` is any function: the real timer
(:class:`~tplib.perfmodel.timer.StageTimer`) or, in tests, an analytic one. Nothing here
imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np

from tplib.nn.configs import GPTConfig
from tplib.perfmodel.profile import (
    REDUCE,
    Profile,
    ProfileError,
    context_time,
    fit_context,
    grid_steps,
    seconds,
)

__all__ = ["Measure", "build_profile", "context_points", "smooth_lengths"]

Measure = Callable[[int, int, int], float]


def context_points(
    seq_len: int, granularity: int, *, side: int = 5, n_holdout: int = 8, seed: int = 0
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(fit, held_out)`` lists of (l, c) token points with c > 0 and l + c <= L.

    Fit points are a ``side`` x ``side`` lattice over the triangle, so the fit spans the
    whole range it is used on; held-out points are drawn at random off the lattice (from
    it only when the grid is too small) and never used for fitting."""
    n = grid_steps(seq_len, granularity)
    every = [(k, j) for k in range(1, n) for j in range(1, n - k + 1)]
    ticks = set(np.linspace(1, max(n - 1, 1), side).round().astype(int).tolist())
    lattice = [p for p in every if p[0] in ticks and p[1] in ticks]
    on_lattice = set(lattice)
    rest = [p for p in every if p not in on_lattice]
    rng = np.random.default_rng(seed)
    order = [rest[i] for i in rng.permutation(len(rest))]
    order += [lattice[i] for i in rng.permutation(len(lattice))]
    held = order[: min(n_holdout, len(every) // 3)]
    fit = [p for p in lattice if p not in set(held)]
    if len(fit) < 4 or not held:
        raise ProfileError(
            f"L={seq_len} at granularity g={granularity} has too few (l, c) grid points to "
            "fit Eq. 9 and hold some out: use a smaller granularity or a longer seq_len"
        )
    g = granularity
    return [(k * g, j * g) for k, j in fit], [(k * g, j * g) for k, j in held]


def smooth_lengths(times: np.ndarray, granularity: int) -> np.ndarray:
    """The table t(b, l, 0) at l = g, 2g, ..., L fitted by ``p0 + p1 l + p2 l^2`` (a
    slice's fixed overhead, its matrix products, its causal attention), by least squares
    on relative errors, and never below the least measured time.

    On a machine shared with other jobs each table entry carries its own few percent of
    noise, and the DP, which picks slice lengths by their time, chases the lucky ones:
    it plans uneven slicings that are only fast on paper. Tables of fewer than 4 lengths
    are returned as measured."""
    row = np.asarray(times, float)
    if len(row) < 4:
        return row.copy()
    length = granularity * np.arange(1, len(row) + 1, dtype=float)
    basis = np.stack([np.ones_like(length), length, length * length], axis=1)
    x = basis / row[:, None]  # relative residuals: short slices count as much as long ones
    scale = np.linalg.norm(x, axis=0)
    coef = np.linalg.lstsq(x / scale, np.ones_like(row), rcond=None)[0] / scale
    return np.maximum(basis @ coef, row.min())


def _fit_and_score(
    t0: np.ndarray, samples: list[tuple[int, int, int, float, bool]], g: int
) -> tuple[np.ndarray, float, float]:
    """Eq. 9 fitted on one batch-slice size's fit samples; its errors on the held-out ones."""
    s, c, t = (np.array([m[i] for m in samples], float) for i in (1, 2, 3))
    used = np.array([m[4] for m in samples])
    base = t0[s.astype(int) // g - 1]  # t(b, l, 0) from the table
    coef = fit_context(s[used], c[used], (t - base)[used])
    held = ~used  # scored only where the fit never looked
    pred, meas = context_time(coef, s[held], c[held]), t[held] - base[held]
    err = float(np.mean(np.abs(base[held] + pred - t[held]) / t[held]))
    err_ctx = float(np.abs(pred - meas).sum() / max(np.abs(meas).sum(), 1e-300))
    return coef, err, err_ctx


def build_profile(
    measure: Measure,
    *,
    config: GPTConfig,
    layers_per_stage: int,
    seq_len: int,
    granularity: int = 8,
    batch_slice_sizes: Sequence[int] = (1,),
    rounds: int = 1,
    progress: bool = False,
    side: int = 5,
    n_holdout: int = 8,
    seed: int = 0,
    desc: str = "profiling",
    smooth: bool = False,
    reduce: str = "min",
    **meta: Any,
) -> Profile:
    """Measure the table and the Eq. 9 samples with ``measure(b, l, c)`` (``rounds``
    times each, keeping the least, or with ``reduce="median"`` the median), fit and
    score. With ``smooth`` the table is replaced by its fit :func:`smooth_lengths` (the
    measured one is kept as ``raw_times``) before Eq. 9 is fitted on top of it. ``meta``
    holds the remaining :class:`Profile` fields (device, dtype, link_bandwidth, ...)."""
    if rounds < 1:
        raise ProfileError(f"rounds={rounds}: need at least one measuring round")
    if reduce not in REDUCE:
        raise ProfileError(f"reduce={reduce!r}: choose one of {sorted(REDUCE)}")
    g = granularity
    fit_pts, held_pts = context_points(seq_len, g, side=side, n_holdout=n_holdout, seed=seed)
    sizes = sorted(set(batch_slice_sizes))
    points = [
        *((s, 0, None) for s in range(g, seq_len + 1, g)),
        *((s, c, True) for s, c in fit_pts),
        *((s, c, False) for s, c in held_pts),
    ]
    times, raw, coefs, samples, err, err_ctx = [], [], [], [], [], []
    rng = np.random.default_rng(seed)
    # Imported here: planning and the GPU check import this module, and a GPU node
    # need not have tqdm.
    from tqdm.auto import tqdm

    bar = tqdm(total=len(sizes) * len(points) * rounds, desc=desc, disable=not progress)
    with bar:
        for b in sizes:
            per_round = np.empty((rounds, len(points)))
            # Each round visits the points in a new random order, so a slow spell (other
            # jobs, clock changes) hits scattered points, not one region such as the table;
            # the min over rounds then discards it (see REDUCE).
            for r in range(rounds):
                for i in rng.permutation(len(points)):
                    s, c, _ = points[i]
                    bar.set_postfix_str(f"b={b} l={s} c={c}", refresh=False)
                    per_round[r, i] = seconds(measure(b, s, c), f"measured t(b={b}, l={s}, c={c})")
                    bar.update()
            t = np.array([REDUCE[reduce](per_round[:, i]) for i in range(len(points))])
            tagged = zip(points, t.tolist(), strict=True)
            mine = [(b, s, c, ti, f) for (s, c, f), ti in tagged if f is not None]
            row = t[: seq_len // g]
            raw.append(tuple(row.tolist()))
            if smooth:
                row = smooth_lengths(row, g)
            coef, e, e_ctx = _fit_and_score(row, mine, g)
            times.append(tuple(row.tolist()))
            coefs.append(tuple(coef))
            err.append(e)
            err_ctx.append(e_ctx)
            samples += mine
    created = datetime.now(UTC).isoformat(timespec="seconds")
    return Profile(
        config=config,
        layers_per_stage=layers_per_stage,
        seq_len=seq_len,
        granularity=g,
        batch_slice_sizes=tuple(sizes),
        times=tuple(times),
        coef=tuple(coefs),
        samples=tuple(samples),
        holdout_error=tuple(err),
        holdout_error_ctx=tuple(err_ctx),
        rounds=rounds,
        reduce=reduce,
        raw_times=tuple(raw) if smooth else (),
        **{"created": created, **meta},
    )
