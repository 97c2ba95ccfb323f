"""How measure mode measures: the CPU table model and the profiling options.

Plain data, importable without torch, so the tables can name their defaults without
starting anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tplib.plan import grid_size

__all__ = ["TABLE_MODEL", "Profiling", "grid"]

# The CPU table model: "small" cut to 4 layers of hidden 128 (2 per stage at K=2) with a
# 512-token vocabulary, keeping its 4096-token context. Attention's FLOPs relative to the
# matrix products' are about L / 12 h: 0.3 at L = 512, 2.7 at L = 4096, so the context
# effect that Eq. 9 models and the DP's uneven slices exploit shows, while one iteration
# of any table configuration stays under ~2 s on one core per stage.
TABLE_MODEL: tuple[str, tuple[tuple[str, object], ...]] = (
    "small",
    (("hidden", 128), ("n_head", 2), ("n_layer", 4), ("vocab_size", 512)),
)


@dataclass(frozen=True)
class Profiling:
    """How the stages are profiled (:func:`tplib.perfmodel.profile_stage` options).

    The defaults suit a machine shared with other jobs: each point is timed once per
    round (``warmup=0``: the first visit's colder run is one round among ``rounds``),
    rounds are combined by their median, the typical time a pipeline run will see, and
    the table t(b, l, 0) is smoothed so that the DP plans on the trend, not on lucky
    timings. ``granularity`` None: the calling table's default grid. After the profiles,
    :func:`~tplib.perfmodel.contention.measure_contention` measures how much the stages
    slow each other when they work at once, in ``contention_rounds`` pairs per stage."""

    granularity: int | None = None
    batch_slice_sizes: tuple[int, ...] = (1,)
    repeats: int = 1
    warmup: int = 0
    rounds: int = 3
    reduce: str = "median"
    smooth: bool = True
    threads: int | None = None  # None: what each pipeline process gets
    # Alone/together pairs per stage of the contention benchmark; 0: assume none.
    contention_rounds: int = 5

    @classmethod
    def of(cls, value: Profiling | Mapping[str, Any]) -> Profiling:
        """``value`` itself, or the options a notebook passed as a dict."""
        if isinstance(value, Profiling):
            return value
        try:
            return cls(
                **{**value, "batch_slice_sizes": tuple(value.get("batch_slice_sizes", (1,)))}
            )
        except TypeError as exc:
            raise ValueError(f"profiling={value!r}: {exc}") from None

    def kwargs(self) -> dict[str, Any]:
        return {
            "batch_slice_sizes": tuple(self.batch_slice_sizes),
            "repeats": self.repeats,
            "warmup": self.warmup,
            "rounds": self.rounds,
            "reduce": self.reduce,
            "smooth": self.smooth,
            "threads": self.threads,
        }


def grid(seq_len: int, granularity: int | None, n_grid: int) -> int:
    """The profile's grid: ``granularity`` tokens, or L / ``n_grid``; it must divide L."""
    g = granularity or max(1, seq_len // n_grid)
    grid_size(seq_len, g)
    return g
