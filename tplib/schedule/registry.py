"""Every schedule a run, the simulator or a table can name, and :func:`make_schedule`.

===============  ============  =========================================================
name             asynchronous  generator
===============  ============  =========================================================
``gpipe``        no            :func:`~tplib.schedule.generators.gpipe`
``terapipe``     no            :func:`~tplib.schedule.generators.terapipe`
``1f1b``         no            :func:`~tplib.schedule.generators.one_f_one_b`
``terapipe-zb``  no            :func:`~tplib.schedule.generators.terapipe_zb`
``1f1b-zb``      no            :func:`~tplib.schedule.generators.one_f_one_b_zb`
``pipedream``    yes           :func:`~tplib.schedule.asynchronous.pipedream`
``2bw``          yes           :func:`~tplib.schedule.asynchronous.two_bw`
===============  ============  =========================================================

With virtual stages (``n_chunks`` v per stage, :mod:`tplib.schedule.virtual`):

========================  ======  ========================================================
name                      v       order
========================  ======  ========================================================
``interleaved-1f1b``      >= 1    Megatron's interleaved 1F1B over microbatches
``terapipe-interleaved``  >= 1    the same over TeraPipe's (batch slice, token slice) units
``looped-bfs``            >= 1    breadth-first over the chunks, over microbatches
``terapipe-bfs``          >= 1    the same over token slices
``zbv``                   2       V-shape zero bubble (split B and W), over microbatches
``terapipe-zbv``          2       the same over token slices
========================  ======  ========================================================

A synchronous schedule is one iteration of its plan, flushed and ended by the update; an
asynchronous one spans ``n_iterations`` iterations without a flush. The two kinds of
generator take different arguments, so callers build through :func:`make_schedule`,
which knows both, rather than calling an entry's generator themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tplib.plan import Plan
from tplib.schedule.actions import Schedule
from tplib.schedule.asynchronous import pipedream, two_bw
from tplib.schedule.generators import gpipe, one_f_one_b, one_f_one_b_zb, terapipe, terapipe_zb
from tplib.schedule.validate import validate as validate_schedule
from tplib.schedule.virtual import CHUNKED

__all__ = ["REGISTRY", "RegisteredSchedule", "make_schedule", "registered", "schedule_names"]


@dataclass(frozen=True)
class RegisteredSchedule:
    """A schedule by name. ``generator`` is ``(n_stages, plan) -> Schedule`` for a
    synchronous schedule, ``(n_stages, plan, n_iterations) -> Schedule`` for an
    ``asynchronous`` one, ``(n_stages, plan, n_chunks) -> Schedule`` for one with virtual
    stages, which takes ``min_chunks`` to ``max_chunks`` (None: any number) chunks per
    stage; ``vertical_sync`` says whether it takes PipeDream's option of that name (a
    choice among stashed weight versions); ``token_slices`` whether it runs plans that
    cut sequences into token slices (the microbatch schedules refuse them)."""

    name: str
    generator: Callable[..., Schedule]
    asynchronous: bool = False
    vertical_sync: bool = False
    min_chunks: int = 1
    max_chunks: int | None = 1
    token_slices: bool = True

    @property
    def chunked(self) -> bool:
        """Whether it places virtual stages (takes ``n_chunks``)."""
        return self.max_chunks != 1

    @property
    def default_chunks(self) -> int:
        """v when a caller names none: 2 for a schedule with virtual stages."""
        return max(self.min_chunks, 2) if self.chunked else 1

    def check_chunks(self, n_chunks: int) -> None:
        """Refuse a chunk count outside the schedule's range, naming it."""
        top = self.max_chunks
        if n_chunks < self.min_chunks or (top is not None and n_chunks > top):
            allowed = (
                f"exactly {top}"
                if top == self.min_chunks
                else f"at least {self.min_chunks}"
                if top is None
                else f"{self.min_chunks} to {top}"
            )
            raise ValueError(
                f"n_chunks={n_chunks} with schedule {self.name!r}: it holds {allowed} "
                "chunk(s) (virtual stages) per stage"
            )


REGISTRY: Mapping[str, RegisteredSchedule] = MappingProxyType(
    {
        entry.name: entry
        for entry in (
            RegisteredSchedule("gpipe", gpipe, token_slices=False),
            RegisteredSchedule("terapipe", terapipe),
            RegisteredSchedule("1f1b", one_f_one_b),
            RegisteredSchedule("terapipe-zb", terapipe_zb),
            RegisteredSchedule("1f1b-zb", one_f_one_b_zb),
            RegisteredSchedule("pipedream", pipedream, asynchronous=True, vertical_sync=True),
            RegisteredSchedule("2bw", two_bw, asynchronous=True),
            *(
                RegisteredSchedule(
                    name, generator, min_chunks=lo, max_chunks=hi, token_slices=sliced
                )
                for name, generator, lo, hi, sliced in CHUNKED
            ),
        )
    }
)


def schedule_names(*, asynchronous: bool | None = None) -> tuple[str, ...]:
    """The registered names in :data:`REGISTRY`'s order: all of them, or only the
    asynchronous (``True``) or synchronous (``False``) ones."""
    return tuple(
        name
        for name, entry in REGISTRY.items()
        if asynchronous is None or entry.asynchronous == asynchronous
    )


def registered(name: str) -> RegisteredSchedule:
    """The entry of schedule ``name``; ``ValueError`` naming the known ones if none."""
    # A name read from JSON may be any value: refuse it by name, not with a TypeError.
    entry = REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown schedule {name!r}: known schedules are {list(REGISTRY)}")
    return entry


def make_schedule(
    name: str,
    n_stages: int,
    plan: Plan,
    *,
    n_iterations: int = 1,
    vertical_sync: bool = False,
    n_chunks: int | None = None,
    validate: bool = True,
) -> Schedule:
    """Build the schedule registered as ``name`` and (``validate``) check it with
    :func:`tplib.schedule.validate`. A synchronous schedule is one iteration of ``plan``
    whatever ``n_iterations`` says (a run of several repeats it); an asynchronous one
    spans ``n_iterations`` of them. ``vertical_sync`` is PipeDream's option; ``n_chunks``
    is v, the chunks per stage of a schedule with virtual stages (None: its default)."""
    entry = registered(name)
    chunks = entry.default_chunks if n_chunks is None else n_chunks
    entry.check_chunks(chunks)
    if vertical_sync and not entry.vertical_sync:
        takes = [n for n, e in REGISTRY.items() if e.vertical_sync]
        raise ValueError(
            f"vertical_sync=True with schedule {name!r}: vertical sync chooses among the "
            f"stashed weight versions of {takes}, which {name!r} does not stash"
        )
    if entry.chunked:
        schedule = entry.generator(n_stages, plan, chunks)
    elif not entry.asynchronous:
        schedule = entry.generator(n_stages, plan)
    elif vertical_sync:
        schedule = entry.generator(n_stages, plan, n_iterations, vertical_sync=True)
    else:
        schedule = entry.generator(n_stages, plan, n_iterations)
    if validate:
        validate_schedule(schedule)
    return schedule
