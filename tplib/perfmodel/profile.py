"""A measured stage profile: the planner's cost model of one pipeline stage, as plain data.

The planner needs t(b, l, c), the forward+backward seconds of one stage for a slice of b
sequences x l tokens after c tokens of context, at every (l, c) of the token grid. A
:class:`Profile` holds, per batch-slice size b, the table t(b, l, 0) at every grid length
l = g, 2g, ..., L and the four coefficients of the paper's context model

    t(b, l, c) = t(b, l, 0) + t_ctx(l, c),   t_ctx = a0 + a1 l + a2 c + a3 l c      (Eq. 9)

(:func:`context_time`, fitted by :func:`fit_context`), with the samples they were fitted
on and their held-out errors.
``Profile.slice_time`` adds the slice's communication over the link between stages
(activation bytes / bandwidth + latency, once forward and once backward) and is a
:class:`~tplib.sim.costs.SliceCostModel`; ``Profile.compute_time`` is the stage's own
compute, which the simulator prices apart.

A profile also says what it timed: the ``precision`` (as a run's: fp32, bf16 autocast,
fp16), the ``attention`` implementation and the ``dropout`` rate. A plan is only as good
as the cost it was priced with, so a run planned from a profile that timed something else
is warned about (:meth:`Profile.differences`, :meth:`Profile.check_run`;
:mod:`tplib.perfmodel.conditions`).

A profile is saved as JSON (:meth:`Profile.save`, format ``tplib.profile/3``; files of
formats 1 and 2 still load, their precision read from the dtype they were timed in), so a
cluster's profile can be planned on a laptop. Nothing here imports torch: planning from a
saved profile does not pay for it. Profiles are measured by :mod:`tplib.perfmodel.profiler`
and built by :mod:`tplib.perfmodel.build`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tplib.nn.configs import GPTConfig
from tplib.nn.layer_ranges import check_stage_range
from tplib.perfmodel.conditions import (
    UNKNOWN,
    WIRE_BYTES,
    check_timed,
    describe_timed,
    differences,
    warn_mismatch,
)
from tplib.plan import grid_size
from tplib.sim.costs import Link
from tplib.util.files import write_json

__all__ = [
    "DEFAULT_LINK_BANDWIDTH",
    "DEFAULT_LINK_LATENCY",
    "FORMAT",
    "Profile",
    "ProfileError",
    "context_time",
    "fit_context",
]

FORMAT = "tplib.profile/3"
# Format 1 named four fields differently; a format-1 file loads with its keys renamed.
_FORMAT_1 = "tplib.profile/1"
_RENAMED_IN_2 = {
    "n_layers": "layers_per_stage",
    "batch_sizes": "batch_slice_sizes",
    "bandwidth": "link_bandwidth",
    "latency": "link_latency",
}
# Formats 1 and 2 timed a stage built in ``dtype``, without autocast, without dropout, and
# with the device's default attention. A float32 stage is an fp32 run's and a float16
# one an fp16 run's; a bfloat16 stage is no run's (bf16 runs keep fp32 weights).
_FORMAT_2 = "tplib.profile/2"
_PRECISION_OF_DTYPE = {"float32": "fp32", "float16": "fp16"}
# Order of magnitude of CPU gloo over loopback; pass values measured on the real link.
DEFAULT_LINK_BANDWIDTH = 2e9  # bytes/s
DEFAULT_LINK_LATENCY = 50e-6  # seconds per message
REPROFILE = "re-profile to cover it (python -m tplib profile ... --seq-len/--batch/--granularity)"
# How a point's timings over rounds combine. "min": interference only adds time, so the
# least is the machine's own speed (a quiet machine). "median": the typical time, what a
# pipeline sharing the machine with other jobs will see.
REDUCE: dict[str, Callable[[np.ndarray], float]] = {
    "min": lambda t: float(np.min(t)),
    "median": lambda t: float(np.median(t)),
}


class ProfileError(ValueError):
    """A profile is invalid, or does not cover a requested slice."""


def _features(length: float | np.ndarray, context: float | np.ndarray) -> np.ndarray:
    lc = np.broadcast_arrays(np.asarray(length, float), np.asarray(context, float))
    return np.stack([np.ones_like(lc[0]), lc[0], lc[1], lc[0] * lc[1]], axis=-1)


def context_time(
    coef: Sequence[float] | np.ndarray, length: float | np.ndarray, context: float | np.ndarray
) -> np.ndarray:
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


def grid_steps(seq_len: int, granularity: int) -> int:
    """:func:`tplib.plan.grid_size`, raising :class:`ProfileError`."""
    try:
        return grid_size(seq_len, granularity)
    except ValueError as exc:
        raise ProfileError(str(exc)) from None


def seconds(value: float, what: str) -> float:
    """``value`` as float, or :class:`ProfileError` unless it is finite and >= 0."""
    value = float(value)
    if not np.isfinite(value) or value < 0:
        raise ProfileError(f"{what} is {value}: times must be finite, non-negative seconds")
    return value


@dataclass(frozen=True)
class Profile:
    """Measured slice times of one stage; the planner's ``SliceCostModel``."""

    config: GPTConfig  # the profiled model (name and fields)
    layers_per_stage: int  # blocks in the profiled stage
    seq_len: int  # L: the longest l + c profiled
    granularity: int  # g: profiled lengths are g, 2g, ..., L
    batch_slice_sizes: tuple[int, ...]
    # times[i][k] = t(batch_slice_sizes[i], (k+1) g, 0), seconds
    times: tuple[tuple[float, ...], ...]
    coef: tuple[tuple[float, ...], ...]  # coef[i] = Eq. 9's (a0, a1, a2, a3) for size i
    samples: tuple[tuple[int, int, int, float, bool], ...]  # (b, l, c, t(b,l,c), used in fit)
    holdout_error: tuple[float, ...]  # per b: mean |pred - meas| / meas of t(b,l,c), held out
    # Per b, over held-out points: sum |pred - meas| / sum |meas| of t_ctx. Summed, not
    # per point: a small overhead is mostly timing noise and its ratio would be meaningless.
    holdout_error_ctx: tuple[float, ...]
    device: str = "cpu"
    precision: str = "fp32"  # as a run's: "fp32", "bf16" (autocast), "fp16"; or "unknown"
    attention: str = "default"  # one of ATTENTIONS, or "unknown"
    dropout: float = 0.0  # the rate the stage trained with while timed
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH  # bytes/s of the link between stages
    link_latency: float = DEFAULT_LINK_LATENCY  # seconds per message on that link
    repeats: int = 0  # back-to-back timings per point and round (median); 0: analytic
    rounds: int = 1  # sweeps over the points, in random orders, reduced by ``reduce``
    reduce: str = "min"  # how rounds combine: "min" (quiet machine) or "median" (busy one)
    threads: int = 0  # torch CPU threads while measuring (0: not recorded)
    # An actual pipeline stage: layers [lo, hi), with the embeddings if lo == 0 and the LM
    # head and loss if hi == config.n_layer. None: a middle stage of layers_per_stage blocks.
    stage: tuple[int, int] | None = None
    fwd_fraction: float = 1 / 3  # the forward's share of t(b, l, c); 1/3 unless measured
    optimizer_time: float = 0.0  # seconds of the stage's AdamW step (0: not measured)
    # The weight gradients' share of a whole-sequence t(b, L, 0), computed at once after a
    # split backward (tplib.nn.wgrad); 0: not measured.
    wgrad_fraction: float = 0.0
    # The measured table when ``times`` holds its smoothed fit (smooth_lengths); else empty.
    raw_times: tuple[tuple[float, ...], ...] = ()
    torch_version: str = ""  # of the timer ("": not measured with torch)
    created: str = ""  # ISO 8601, UTC
    _table: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fix = object.__setattr__  # frozen: normalise JSON lists into tuples once, here
        fix(self, "batch_slice_sizes", tuple(int(b) for b in self.batch_slice_sizes))
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
            try:
                check_stage_range(self.config, lo, hi)
            except ValueError as exc:
                raise ProfileError(f"Profile.stage: {exc}") from None
            if hi - lo != self.layers_per_stage:
                raise ProfileError(
                    f"stage [{lo}, {hi}) holds {hi - lo} layers, not the profile's "
                    f"layers_per_stage={self.layers_per_stage}"
                )
        if not 0.0 < self.fwd_fraction < 1.0:
            raise ProfileError(f"fwd_fraction={self.fwd_fraction}: must lie strictly in (0, 1)")
        seconds(self.optimizer_time, "optimizer_time")
        if not 0.0 <= self.wgrad_fraction < 1.0 - self.fwd_fraction:
            raise ProfileError(
                f"wgrad_fraction={self.wgrad_fraction}: must lie in [0, 1 - fwd_fraction), "
                "the weight gradients are part of the backward"
            )
        if self.reduce not in REDUCE:
            raise ProfileError(f"reduce={self.reduce!r}: choose one of {sorted(REDUCE)}")
        self._check_timed()
        sizes = self.batch_slice_sizes
        n, nb = grid_steps(self.seq_len, self.granularity), len(sizes)
        if not nb or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ProfileError(f"batch_slice_sizes {sizes}: need distinct positive sizes, sorted")
        table = np.asarray(self.times, float)
        if table.shape != (nb, n):
            raise ProfileError(
                f"times has shape {table.shape}, not (batch slice sizes, L/g) = {(nb, n)}"
            )
        for i, b in enumerate(sizes):
            for k in range(n):
                seconds(table[i, k], f"t(b={b}, l={(k + 1) * self.granularity}, c=0)")
        for b, s, c, t, _ in self.samples:
            seconds(t, f"t(b={b}, l={s}, c={c})")
        if np.asarray(self.coef, float).shape != (nb, 4) or not np.isfinite(self.coef).all():
            raise ProfileError(
                f"coef must hold 4 finite Eq. 9 coefficients per batch slice size: {self.coef}"
            )
        if not (np.isfinite(self.link_bandwidth) and self.link_bandwidth > 0):
            raise ProfileError(f"link_bandwidth={self.link_bandwidth}: must be positive bytes/s")
        seconds(self.link_latency, "link_latency")
        for name in ("holdout_error", "holdout_error_ctx"):
            if len(getattr(self, name)) != nb:
                raise ProfileError(
                    f"{name} needs one value per batch slice size: {getattr(self, name)}"
                )
        if self.raw_times and np.asarray(self.raw_times, float).shape != table.shape:
            raise ProfileError(f"raw_times must have the shape of times, {table.shape}")
        fix(self, "_table", table)

    @property
    def max_batch_slice_size(self) -> int:
        """The largest profiled batch-slice size (the planner never exceeds it)."""
        return self.batch_slice_sizes[-1]

    @property
    def link(self) -> Link:
        """The link between stages the profile assumes."""
        return Link(self.link_bandwidth, self.link_latency)

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one activation element between stages (:data:`WIRE_BYTES`)."""
        return WIRE_BYTES[self.precision]

    def _check_timed(self) -> None:
        try:
            check_timed(self.precision, self.attention, self.dropout)
        except ValueError as exc:
            raise ProfileError(str(exc)) from None

    def timed(self) -> str:
        """What was timed, in words: device, precision, attention, dropout."""
        return describe_timed(self.device, self.precision, self.attention, self.dropout)

    def differences(self, *, precision: str, dropout: float, device: str) -> list[str]:
        """How a run in ``precision`` with ``dropout`` on ``device`` differs from what this
        profile timed (:func:`~tplib.perfmodel.conditions.differences`)."""
        timed = {
            "device": self.device.split(":")[0],
            "precision": self.precision,
            "attention": self.attention,
            "dropout": f"{self.dropout:g}",
        }
        return differences(timed, precision=precision, dropout=dropout, device=device)

    def check_run(
        self, *, precision: str, dropout: float, device: str, source: str = "the profile"
    ) -> list[str]:
        """Warn (:class:`~tplib.perfmodel.conditions.ProfileMismatchWarning`) when a run
        planned from this profile, read from ``source``, will do something else than it
        timed; return the differences."""
        diffs = self.differences(precision=precision, dropout=dropout, device=device)
        warn_mismatch(
            diffs,
            source=source,
            timed=self.timed(),
            precision=precision,
            dropout=dropout,
            device=device,
        )
        return diffs

    def comm_time(self, batch_slice_size: int, length: float | np.ndarray) -> np.ndarray:
        """Seconds to send a slice's activations forward and its gradient backward."""
        nbytes = (
            batch_slice_size
            * np.asarray(length, float)
            * self.config.hidden
            * self.bytes_per_element
        )
        return 2 * self.link.time(nbytes)

    def slice_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        """t(b, l, 0) from the table + Eq. 9's t_ctx (for c > 0) + communication."""
        compute = self.compute_time(batch_slice_size, length, context)
        return compute + self.comm_time(batch_slice_size, length)

    def wgrad_time(self, batch_slice_size: int, length: np.ndarray) -> np.ndarray:
        """Seconds of the stage's weight gradients over ``batch_slice_size`` sequences of
        ``length`` tokens at once: the measured share of t(b, length, 0)."""
        if self.wgrad_fraction == 0.0:
            raise ProfileError(
                "this profile has no weight-gradient measurement (wgrad_fraction=0): " + REPROFILE
            )
        length = np.asarray(length)
        return self.wgrad_fraction * self.compute_time(
            batch_slice_size, length, np.zeros_like(length)
        )

    def compute_time(
        self, batch_slice_size: int, length: np.ndarray, context: np.ndarray
    ) -> np.ndarray:
        """The stage's forward+backward seconds, t(b, l, 0) + t_ctx(l, c), without sends."""
        b = batch_slice_size
        if b not in self.batch_slice_sizes:
            raise ProfileError(
                f"batch size {b} was not profiled (profiled: {list(self.batch_slice_sizes)}): "
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
        i = self.batch_slice_sizes.index(b)
        ctx = context_time(self.coef[i], length, context)
        return self._table[i, k - 1] + ctx

    # ---- files -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = {"format": FORMAT, **asdict(self)}
        d.pop("_table", None)
        return d

    @classmethod
    def from_dict(cls, d: object) -> Profile:
        """A profile from :meth:`to_dict`'s output, of this format or an older one."""
        if not isinstance(d, dict) or d.get("format") not in (FORMAT, _FORMAT_2, _FORMAT_1):
            raise ProfileError(f"not a {FORMAT} profile: its 'format' field is missing or wrong")
        fields = {k: v for k, v in d.items() if k != "format"}
        if d["format"] == _FORMAT_1:
            fields = {_RENAMED_IN_2.get(k, k): v for k, v in fields.items()}
        if d["format"] != FORMAT:
            dtype = fields.pop("dtype", "float32")
            fields["precision"] = _PRECISION_OF_DTYPE.get(dtype, UNKNOWN)
            fields["attention"], fields["dropout"] = "default", 0.0
        try:
            return cls(**{**fields, "config": GPTConfig(**fields["config"])})
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"malformed profile: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (:func:`tplib.util.files.write_json`): a reader never sees
        half a profile."""
        write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as exc:
                raise ProfileError(f"profile {path} is not valid JSON: {exc}") from None
        return cls.from_dict(d)
