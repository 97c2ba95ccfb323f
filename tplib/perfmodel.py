"""Cost model: profile one pipeline stage and predict its slice times (paper §3.3, Eq. 9).

The planner needs t(b, l, c), the forward+backward seconds of one stage for a slice of b
sequences x l tokens after c tokens of context, at every (l, c) of the token grid. Timing
all O(L^2) points is too slow, so, as in the paper,

    t(b, l, c) = t(b, l, 0) + t_ctx(l, c),   t_ctx = a0 + a1 l + a2 c + a3 l c      (Eq. 9)

:func:`profile_stage` times t(b, l, 0) at every grid length l = g, 2g, ..., L and
t(b, l, c) on a lattice of (l, c) points, fits a0..a3 per batch size b by least squares,
and scores the fit on held-out points it never saw. The result is a :class:`Profile`:
plain data, saved as JSON, so a cluster's profile can be planned on a laptop.
``Profile.slice_time`` adds the slice's communication (activation bytes / bandwidth +
latency, once forward and once backward) and is the planner's ``SliceCostModel``;
``Profile.compute_time`` is the stage's own compute, which the simulator prices apart.

A profile times either a middle stage of ``n_layers`` blocks (what the paper's uniform
stages are) or an actual stage ``[lo, hi)`` of a K-stage pipeline: the first stage with
the embeddings, the last with the LM head and loss. :func:`profile_pipeline` profiles
every stage of a pipeline that way, one :class:`Profile` each, and also records what the
simulator needs beyond Eq. 9: the forward's share of forward+backward and the stage's
optimizer step. On a machine shared with other jobs, rounds can be combined by their
median rather than their least, and the table smoothed (:func:`smooth_lengths`).

:func:`build_profile` is the same pipeline fed by any ``measure(b, l, c) -> seconds``:
the real timer (:class:`StageTimer`) or, in tests, an analytic function.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from tplib.config import GPTConfig, get_config
from tplib.context import StageContext
from tplib.model import build_model
from tplib.runtime import balanced_stages

__all__ = [
    "DEFAULT_BANDWIDTH", "DEFAULT_LATENCY", "DTYPES", "Profile", "ProfileError",
    "StageTimer", "build_profile", "context_points", "context_time", "fit_context",
    "profile_pipeline", "profile_stage", "smooth_lengths",
]  # fmt: skip

FORMAT = "tplib.profile/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Order of magnitude of CPU gloo over loopback; pass values measured on the real link.
DEFAULT_BANDWIDTH = 2e9  # bytes/s
DEFAULT_LATENCY = 50e-6  # seconds per message
REPROFILE = "re-profile to cover it (python -m tplib profile ... --seq-len/--batch/--granularity)"

Measure = Callable[[int, int, int], float]
# How a point's timings over rounds combine. "min": interference only adds time, so the
# least is the machine's own speed (a quiet machine). "median": the typical time, what a
# pipeline sharing the machine with other jobs will see.
REDUCE: dict[str, Callable[[np.ndarray], float]] = {
    "min": lambda t: float(np.min(t)),
    "median": lambda t: float(np.median(t)),
}


class ProfileError(ValueError):
    """A profile is invalid, or does not cover a requested slice."""


# ---- Eq. 9 ----------------------------------------------------------------------------


def _features(length: np.ndarray, context: np.ndarray) -> np.ndarray:
    lc = np.broadcast_arrays(np.asarray(length, float), np.asarray(context, float))
    return np.stack([np.ones_like(lc[0]), lc[0], lc[1], lc[0] * lc[1]], axis=-1)


def context_time(coef: Sequence[float], length: np.ndarray, context: np.ndarray) -> np.ndarray:
    """The context overhead ``t_ctx(l, c) = a0 + a1 l + a2 c + a3 l c`` (Eq. 9) for c > 0,
    and 0 for c = 0, where the table holds the whole time. Clamped at 0: context never
    makes a slice cheaper, and a fit bent by timing noise must not predict negative time."""
    fit = _features(length, context) @ np.asarray(coef, float)
    return np.where(np.asarray(context) > 0, np.maximum(fit, 0.0), 0.0)


def fit_context(length: np.ndarray, context: np.ndarray, overhead: np.ndarray) -> np.ndarray:
    """Least-squares ``(a0, a1, a2, a3)`` of Eq. 9 from samples of t(b,l,c) - t(b,l,0)."""
    x, y = _features(length, context), np.asarray(overhead, float)
    if x.ndim != 2 or len(x) < 4 or x.shape[0] != y.shape[0]:
        raise ProfileError(f"Eq. 9 has 4 coefficients: fitting needs >= 4 samples, not {len(x)}")
    # Columns range from 1 to L^2: unit-norm columns keep the solve well conditioned.
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    sol = np.linalg.lstsq(x / scale, y, rcond=None)[0]
    return sol / scale


def context_points(
    seq_len: int, granularity: int, *, side: int = 5, n_holdout: int = 8, seed: int = 0
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(fit, held_out)`` lists of (l, c) token points with c > 0 and l + c <= L.

    Fit points are a ``side`` x ``side`` lattice over the triangle, so the fit spans the
    whole range it is used on; held-out points are drawn at random off the lattice (from
    it only when the grid is too small) and never used for fitting."""
    n = _n_grid(seq_len, granularity)
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


def _n_grid(seq_len: int, granularity: int) -> int:
    if granularity < 1 or seq_len < granularity or seq_len % granularity:
        raise ProfileError(
            f"seq_len L={seq_len} is not a positive multiple of granularity g={granularity}: "
            "profiled lengths are g, 2g, ..., L, so pick a g that divides L"
        )
    return seq_len // granularity


def _seconds(value: float, what: str) -> float:
    value = float(value)
    if not np.isfinite(value) or value < 0:
        raise ProfileError(f"{what} is {value}: times must be finite, non-negative seconds")
    return value


# ---- the profile ----------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """Measured slice times of one stage; the planner's ``SliceCostModel``."""

    config: GPTConfig  # the profiled model (name and fields)
    n_layers: int  # blocks in the profiled stage
    seq_len: int  # L: the longest l + c profiled
    granularity: int  # g: profiled lengths are g, 2g, ..., L
    batch_sizes: tuple[int, ...]
    times: tuple[tuple[float, ...], ...]  # times[i][k] = t(batch_sizes[i], (k+1) g, 0), s
    coef: tuple[tuple[float, ...], ...]  # coef[i] = Eq. 9's (a0, a1, a2, a3) for batch_sizes[i]
    samples: tuple[tuple[int, int, int, float, bool], ...]  # (b, l, c, t(b,l,c), used in fit)
    holdout_error: tuple[float, ...]  # per b: mean |pred - meas| / meas of t(b,l,c), held out
    # Per b, over held-out points: sum |pred - meas| / sum |meas| of t_ctx. Summed, not
    # per point: a small overhead is mostly timing noise and its ratio would be meaningless.
    holdout_error_ctx: tuple[float, ...]
    device: str = "cpu"
    dtype: str = "float32"
    bandwidth: float = DEFAULT_BANDWIDTH  # bytes/s of the link between stages
    latency: float = DEFAULT_LATENCY  # seconds per message
    repeats: int = 0  # back-to-back timings per point and round (median); 0: analytic
    rounds: int = 1  # sweeps over the points, in random orders, reduced by ``reduce``
    reduce: str = "min"  # how rounds combine: "min" (quiet machine) or "median" (busy one)
    threads: int = 0  # torch CPU threads while measuring (0: not recorded)
    # An actual pipeline stage: layers [lo, hi), with the embeddings if lo == 0 and the LM
    # head and loss if hi == config.n_layer. None: a middle stage of n_layers blocks.
    stage: tuple[int, int] | None = None
    fwd_fraction: float = 1 / 3  # the forward's share of t(b, l, c); 1/3 unless measured
    optimizer_time: float = 0.0  # seconds of the stage's AdamW step (0: not measured)
    # The measured table when ``times`` holds its smoothed fit (smooth_lengths); else empty.
    raw_times: tuple[tuple[float, ...], ...] = ()
    torch_version: str = torch.__version__
    created: str = ""  # ISO 8601, UTC
    _table: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fix = object.__setattr__  # frozen: normalise JSON lists into tuples once, here
        fix(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
        fix(self, "times", tuple(tuple(float(t) for t in row) for row in self.times))
        fix(self, "coef", tuple(tuple(float(a) for a in row) for row in self.coef))
        fix(
            self,
            "samples",
            tuple((int(b), int(s), int(c), float(t), bool(f)) for b, s, c, t, f in self.samples),
        )
        fix(self, "holdout_error", tuple(float(e) for e in self.holdout_error))
        fix(self, "holdout_error_ctx", tuple(float(e) for e in self.holdout_error_ctx))
        fix(self, "raw_times", tuple(tuple(float(t) for t in row) for row in self.raw_times))
        if self.stage is not None:  # JSON gives a list
            lo, hi = (int(x) for x in self.stage)
            fix(self, "stage", (lo, hi))
            if not 0 <= lo < hi <= self.config.n_layer or hi - lo != self.n_layers:
                raise ProfileError(
                    f"stage {self.stage} is not a range of n_layers={self.n_layers} of the "
                    f"model's {self.config.n_layer} layers"
                )
        if not 0.0 < self.fwd_fraction < 1.0:
            raise ProfileError(f"fwd_fraction={self.fwd_fraction}: must lie strictly in (0, 1)")
        _seconds(self.optimizer_time, "optimizer_time")
        if self.reduce not in REDUCE:
            raise ProfileError(f"reduce={self.reduce!r}: choose one of {sorted(REDUCE)}")
        n, nb = _n_grid(self.seq_len, self.granularity), len(self.batch_sizes)
        if (
            not nb
            or list(self.batch_sizes) != sorted(set(self.batch_sizes))
            or self.batch_sizes[0] < 1
        ):
            raise ProfileError(
                f"batch_sizes {self.batch_sizes}: need distinct positive sizes, sorted"
            )
        table = np.asarray(self.times, float)
        if table.shape != (nb, n):
            raise ProfileError(f"times has shape {table.shape}, not (batch sizes, L/g) = {(nb, n)}")
        for i, b in enumerate(self.batch_sizes):
            for k in range(n):
                _seconds(table[i, k], f"t(b={b}, l={(k + 1) * self.granularity}, c=0)")
        for b, s, c, t, _ in self.samples:
            _seconds(t, f"t(b={b}, l={s}, c={c})")
        if np.asarray(self.coef, float).shape != (nb, 4) or not np.isfinite(self.coef).all():
            raise ProfileError(
                f"coef must hold 4 finite Eq. 9 coefficients per batch size: {self.coef}"
            )
        if not (np.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ProfileError(f"bandwidth={self.bandwidth}: must be positive bytes/s")
        _seconds(self.latency, "latency")
        for name in ("holdout_error", "holdout_error_ctx"):
            if len(getattr(self, name)) != nb:
                raise ProfileError(f"{name} needs one value per batch size: {getattr(self, name)}")
        if self.raw_times and np.asarray(self.raw_times, float).shape != table.shape:
            raise ProfileError(f"raw_times must have the shape of times, {table.shape}")
        fix(self, "_table", table)

    @property
    def max_batch(self) -> int:
        """The largest profiled batch-slice size (the planner never exceeds it)."""
        return self.batch_sizes[-1]

    @property
    def bytes_per_element(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def comm_time(self, batch: int, length: np.ndarray) -> np.ndarray:
        """Seconds to send a slice's activations forward and its gradient backward."""
        nbytes = batch * np.asarray(length, float) * self.config.hidden * self.bytes_per_element
        return 2 * (nbytes / self.bandwidth + self.latency)

    def slice_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        """t(b, l, 0) from the table + Eq. 9's t_ctx (for c > 0) + communication."""
        return self.compute_time(batch, length, context) + self.comm_time(batch, length)

    def compute_time(self, batch: int, length: np.ndarray, context: np.ndarray) -> np.ndarray:
        """The stage's forward+backward seconds, t(b, l, 0) + t_ctx(l, c), without sends."""
        if batch not in self.batch_sizes:
            raise ProfileError(
                f"batch size {batch} was not profiled (profiled: {list(self.batch_sizes)}): "
                + REPROFILE
            )
        length, context = np.broadcast_arrays(np.asarray(length), np.asarray(context))
        g = self.granularity
        off = (length % g != 0) | (length < g)
        if off.any():
            raise ProfileError(
                f"slice length {length[off].ravel()[0]} is off the profiled grid g, 2g, ..., "
                f"L with g={g}: plan at a multiple of g, or {REPROFILE}"
            )
        if np.any(context < 0):
            raise ProfileError(f"negative context {context.min()}: a slice starts at token >= 0")
        if np.any(length + context > self.seq_len):
            raise ProfileError(
                f"a slice ending at token {int((length + context).max())} is beyond the "
                f"profile's seq_len L={self.seq_len}: {REPROFILE}"
            )
        k = (length // g).astype(np.int64)
        i = self.batch_sizes.index(batch)
        ctx = context_time(self.coef[i], length, context)
        return self._table[i, k - 1] + ctx

    # ---- files -----------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = {"format": FORMAT, **asdict(self)}
        d.pop("_table", None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ProfileError(f"not a {FORMAT} profile: its 'format' field is missing or wrong")
        d = {k: v for k, v in d.items() if k != "format"}
        try:
            return cls(**{**d, "config": GPTConfig(**d["config"])})
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"malformed profile: {exc}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically: a temp file in the same folder, then ``os.replace``, so a
        reader never sees half a profile."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as exc:
                raise ProfileError(f"profile {path} is not valid JSON: {exc}") from None
        return cls.from_dict(d)


# ---- measuring ------------------------------------------------------------------------


class StageTimer:
    """``timer(b, l, c)``: median seconds of forward+backward of one slice of b x l tokens
    at ``start=c`` through a stage of ``n_layers`` blocks.

    By default the stage is a middle one (no embedding, no head). With ``stage=(lo, hi)``
    it is exactly layers [lo, hi) of ``cfg`` as a pipeline builds them: the first stage
    takes token ids and embeds them, the last computes the LM head and the summed
    cross-entropy and starts backward from that loss, as the runtime does.

    Every call also records the forward's share of the time (``forward_fractions``), and
    :meth:`optimizer_time` times the stage's AdamW step.
    """

    def __init__(
        self, cfg: GPTConfig, n_layers: int, *, seq_len: int, device: str = "cpu",
        dtype: str = "float32", repeats: int = 5, warmup: int = 1, seed: int = 0,
        stage: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        if seq_len > cfg.seq_len:
            raise ProfileError(
                f"seq_len {seq_len} exceeds model {cfg.name}'s context {cfg.seq_len}"
            )
        if stage is not None:
            lo, hi = stage
            if not 0 <= lo < hi <= cfg.n_layer:
                raise ProfileError(
                    f"stage=({lo}, {hi}) is not a layer range of model {cfg.name}'s "
                    f"{cfg.n_layer} layers: need 0 <= lo < hi <= n_layer"
                )
            n_layers = hi - lo
        if n_layers < 1 or repeats < 1 or warmup < 0:
            raise ProfileError(
                f"need n_layers >= 1, repeats >= 1, warmup >= 0: {n_layers, repeats, warmup}"
            )
        if dtype not in DTYPES:
            raise ProfileError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ProfileError(f"unknown device {device!r}: use cpu or cuda") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ProfileError(f"device {device!r}: CUDA is not available here, use cpu")
        if stage is None:
            # A middle stage is blocks [1, 1 + n_layers) of a model with layers after them; a
            # small config gets more layers, which changes only init scales, not the time.
            big = cfg if cfg.n_layer >= n_layers + 2 else cfg.with_(n_layer=n_layers + 2)
            lo, hi = 1, 1 + n_layers
        else:
            big = cfg
        self.stage = build_model(big, lo, hi, seed=seed, device=device, dtype=DTYPES[dtype])
        self.device, self.dtype, self.seq_len = dev, DTYPES[dtype], seq_len
        self.repeats, self.warmup = repeats, warmup
        self.forward_fractions: list[float] = []
        self._contexts: dict[int, StageContext] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _inputs(self, batch: int, length: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The stage's input, the targets (last stage) and the output gradient (others)."""
        cfg, opts = self.stage.cfg, {"device": self.device, "dtype": self.dtype}
        if self.stage.is_first:
            x = torch.randint(0, cfg.vocab_size, (batch, length), device=self.device)
        else:
            x = torch.randn(batch, length, cfg.hidden, **opts, requires_grad=True)
        if self.stage.is_last:
            targets = torch.randint(0, cfg.vocab_size, (batch, length), device=self.device)
            return x, targets, None
        return x, None, torch.randn(batch, length, cfg.hidden, **opts)

    def __call__(self, batch: int, length: int, context: int) -> float:
        if batch not in self._contexts:  # one batch size at a time: bounded memory
            self._contexts = {batch: self.stage.new_context(batch, self.seq_len)}
        ctx = self._contexts[batch]
        # Earlier slices would have left finite keys/values in [0, c); random ones cost the same.
        for layer in ctx.layers.values():
            layer.k[:, :, :context].normal_()
            layer.v[:, :, :context].normal_()
        x, targets, grad = self._inputs(batch, length)
        times, forwards = [], []
        for _ in range(self.warmup + self.repeats):
            x.grad = None
            self._sync()
            t0 = time.perf_counter()
            out = self.stage(x, start=context, context=ctx, targets=targets)
            self._sync()
            t1 = time.perf_counter()
            out.backward(grad)  # grad is None for the last stage's scalar loss
            self._sync()
            times.append(time.perf_counter() - t0)
            forwards.append(t1 - t0)
        total = float(np.median(times[self.warmup :]))
        self.forward_fractions.append(float(np.median(forwards[self.warmup :])) / total)
        return total

    def optimizer_time(self, repeats: int = 5, **adamw: float) -> float:
        """Median seconds of one AdamW step plus ``zero_grad``, what the runtime's ``OPT``
        action does. ``adamw`` are optimizer options (the runtime's: lr, betas, ...)."""
        params = [p for p in self.stage.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, **adamw)  # type: ignore[arg-type]
        times = []
        for _ in range(repeats + 1):  # the first step allocates AdamW's state: not timed
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            self._sync()
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            self._sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))


def _fit_and_score(
    t0: np.ndarray, samples: list[tuple[int, int, int, float, bool]], g: int
) -> tuple[np.ndarray, float, float]:
    """Eq. 9 fitted on one batch size's fit samples; its errors on the held-out ones."""
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
    measure: Measure, *, config: GPTConfig, n_layers: int, seq_len: int, granularity: int = 8,
    batch_sizes: Sequence[int] = (1,), rounds: int = 1, progress: bool = False,
    side: int = 5, n_holdout: int = 8, seed: int = 0, desc: str = "profiling",
    smooth: bool = False, reduce: str = "min", **meta: object,
) -> Profile:  # fmt: skip
    """Measure the table and the Eq. 9 samples with ``measure(b, l, c)`` (``rounds``
    times each, keeping the least, or with ``reduce="median"`` the median), fit and score. With ``smooth`` the table is replaced
    by its fit :func:`smooth_lengths` (the measured one is kept as ``raw_times``) before
    Eq. 9 is fitted on top of it. ``meta`` holds the remaining :class:`Profile` fields
    (device, dtype, bandwidth, ...)."""
    if rounds < 1:
        raise ProfileError(f"rounds={rounds}: need at least one measuring round")
    if reduce not in REDUCE:
        raise ProfileError(f"reduce={reduce!r}: choose one of {sorted(REDUCE)}")
    g = granularity
    fit_pts, held_pts = context_points(seq_len, g, side=side, n_holdout=n_holdout, seed=seed)
    batch_sizes = sorted(set(batch_sizes))
    points = [
        *((s, 0, None) for s in range(g, seq_len + 1, g)),
        *((s, c, True) for s, c in fit_pts),
        *((s, c, False) for s, c in held_pts),
    ]
    times, raw, coefs, samples, err, err_ctx = [], [], [], [], [], []
    rng = np.random.default_rng(seed)
    total = len(batch_sizes) * len(points) * rounds
    bar = tqdm(total=total, desc=desc, disable=not progress)
    with bar:
        for b in batch_sizes:
            per_round = np.empty((rounds, len(points)))
            # Each round visits the points in a new random order, so a slow spell (other
            # jobs, clock changes) hits scattered points, not one region such as the table;
            # the min over rounds then discards it (see REDUCE).
            for r in range(rounds):
                for i in rng.permutation(len(points)):
                    s, c, _ = points[i]
                    bar.set_postfix_str(f"b={b} l={s} c={c}", refresh=False)
                    ti = _seconds(measure(b, s, c), f"measured t(b={b}, l={s}, c={c})")
                    per_round[r, i] = ti
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
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return Profile(
        config=config, n_layers=n_layers, seq_len=seq_len, granularity=g,
        batch_sizes=tuple(batch_sizes), times=tuple(times), coef=tuple(coefs),
        samples=tuple(samples), holdout_error=tuple(err), holdout_error_ctx=tuple(err_ctx),
        rounds=rounds, reduce=reduce, raw_times=tuple(raw) if smooth else (),
        **{"created": created, **meta},  # type: ignore[arg-type]
    )  # fmt: skip


def profile_stage(
    model: str | GPTConfig, *, n_layers: int = 1, seq_len: int | None = None,
    max_batch: int = 1, batch_sizes: Sequence[int] | None = None, granularity: int = 8,
    repeats: int = 5, warmup: int = 1, device: str | None = None, dtype: str = "float32",
    bandwidth: float = DEFAULT_BANDWIDTH, latency: float = DEFAULT_LATENCY,
    rounds: int = 1, threads: int | None = None, progress: bool = True, seed: int = 0,
    stage: tuple[int, int] | None = None, smooth: bool = False, reduce: str = "min",
) -> Profile:  # fmt: skip
    """Profile a middle stage of ``n_layers`` blocks of ``model`` (or, with
    ``stage=(lo, hi)``, exactly that stage of a pipeline, embeddings or head included) on
    ``device`` (CUDA when present, else CPU) for batch sizes ``batch_sizes`` (default
    1..max_batch). The profile also records the forward's median share of the time and
    the stage's optimizer step.

    On a machine shared with other jobs, use ``rounds`` > 1 (each point timed at several
    moments, keeping the least) and ``threads`` (torch's CPU threads while measuring,
    restored after) below the core count: spin-waiting threads that lose their core
    make timings many times slower and noisier. Where the machine stays busy, the
    typical time (``reduce="median"``) predicts a pipeline run better than the least,
    and ``smooth`` fits the table t(b, l, 0) by :func:`smooth_lengths` against what is
    left of the noise."""
    cfg = get_config(model) if isinstance(model, str) else model
    seq_len = cfg.seq_len if seq_len is None else seq_len
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    bs = list(range(1, max_batch + 1)) if batch_sizes is None else list(batch_sizes)
    if not bs or min(bs) < 1:
        raise ProfileError(f"batch sizes {bs}: need at least one, all >= 1")
    _n_grid(seq_len, granularity)  # fail before building anything
    timer = StageTimer(cfg, n_layers, seq_len=seq_len, device=device, dtype=dtype,
                       repeats=repeats, warmup=warmup, seed=seed, stage=stage)  # fmt: skip
    n_layers = len(timer.stage.blocks)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        desc = "profiling" if stage is None else f"profiling layers [{stage[0]}, {stage[1]})"
        prof = build_profile(
            timer, config=cfg, n_layers=n_layers, seq_len=seq_len, granularity=granularity,
            batch_sizes=bs, rounds=rounds, progress=progress, seed=seed, desc=desc,
            device=str(timer.device), dtype=dtype, bandwidth=bandwidth, latency=latency,
            repeats=repeats, threads=torch.get_num_threads(), stage=stage, smooth=smooth,
            reduce=reduce,
        )  # fmt: skip
        # Measured after the sweep, in the same thread setting. The forward share is the
        # median over every timed point: it varies little with (b, l, c).
        return replace(
            prof,
            fwd_fraction=float(np.median(timer.forward_fractions)),
            optimizer_time=timer.optimizer_time(repeats),
        )
    finally:
        torch.set_num_threads(before)


def _pool_threads(world_size: int) -> int:
    """The torch threads each of ``world_size`` local pipeline processes gets
    (:class:`tplib.launch.LocalPool` splits this machine's cores the same way)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def profile_pipeline(
    model: str | GPTConfig, n_stages: int, *,
    stage_layers: Sequence[tuple[int, int]] | None = None, n_replicas: int = 1,
    threads: int | None = None, progress: bool = True, **kwargs: object,
) -> list[Profile]:  # fmt: skip
    """Profile every stage of a ``n_stages``-stage pipeline of ``model``, one
    :class:`Profile` per stage: layers ``stage_layers`` (default: the runtime's
    :func:`~tplib.runtime.balanced_stages`), the first with the embeddings, the last with
    the LM head and loss. ``kwargs`` go to :func:`profile_stage` (seq_len, batch_sizes,
    granularity, repeats, rounds, ...).

    ``threads`` defaults to what each process of a local pipeline of
    ``n_stages x n_replicas`` processes gets: a stage timed with all cores runs several
    times faster than it does in the pipeline."""
    cfg = get_config(model) if isinstance(model, str) else model
    layers = list(stage_layers or balanced_stages(cfg.n_layer, n_stages))
    if len(layers) != n_stages:
        raise ProfileError(
            f"stage_layers has {len(layers)} ranges for n_stages={n_stages}: give one per stage"
        )
    threads = threads or _pool_threads(n_stages * n_replicas)
    return [
        profile_stage(cfg, stage=(lo, hi), threads=threads, progress=progress, **kwargs)  # type: ignore[arg-type]
        for lo, hi in layers
    ]
