"""How much the stages of a local pipeline slow each other by computing at the same time.

Profiles (:mod:`~tplib.perfmodel.timer`) time each stage alone. A local pipeline's
processes each have cores of their own (:func:`tplib.util.machine.threads_per_process`), but
they share the memory bandwidth, the last-level cache and the package's clock budget, so
a stage that computes while another does runs slower than its profile says.

:func:`measure_contention` measures that slowdown by itself, never from pipeline runs:
one process per stage of the pipeline, with the threads a pipeline process gets, each
working through one sequence's token slices (:meth:`StageTimer.sequence_time`) in
rounds where one stage works alone and rounds where every stage works at once. Each
alone round is paired with the together round next to it, and the order alternates
round by round, so that a change in the machine's load falls on both sides of a pair.
A stage's factor is the median over pairs of together / alone;
:func:`tplib.measure.simulate_shared` stretches its work by it while the others work.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier

import torch

from tplib.nn.configs import GPTConfig, get_config
from tplib.nn.layer_ranges import balanced_stages, check_stage_ranges
from tplib.perfmodel.profile import ProfileError, grid_steps
from tplib.perfmodel.timer import StageTimer

__all__ = ["Contention", "measure_contention"]


@dataclass(frozen=True)
class Contention:
    """Seconds of one sequence's work per stage and round: ``alone[k][r]`` with stage k
    the only one working, ``together[k][r]`` with every stage working."""

    alone: tuple[tuple[float, ...], ...]
    together: tuple[tuple[float, ...], ...]
    threads: int
    seq_len: int
    granularity: int

    @property
    def ratios(self) -> tuple[tuple[float, ...], ...]:
        """Per stage, per round: together / alone."""
        return tuple(
            tuple(t / a for a, t in zip(alone, together, strict=True))
            for alone, together in zip(self.alone, self.together, strict=True)
        )

    @property
    def factors(self) -> tuple[float, ...]:
        """Per stage: the median ratio, how much its work stretches while all the others
        work too."""
        return tuple(statistics.median(r) for r in self.ratios)

    def columns(self) -> dict[str, object]:
        """What a table records of it: the factors, the spread of the pairs, the rounds."""
        ratios = [x for r in self.ratios for x in r]
        return {
            "contention_factors": " / ".join(f"{f:.4f}" for f in self.factors),
            "contention_pairs_min": min(ratios),
            "contention_pairs_max": max(ratios),
            "contention_rounds": len(self.ratios[0]),
        }

    def describe(self) -> str:
        """One line per stage: factor, the spread of the pairs, the median seconds."""
        return "\n".join(
            f"stage {k}: x{f:.3f} (pairs {min(r):.3f}..{max(r):.3f}; alone "
            f"{statistics.median(a):.4g} s, together {statistics.median(t):.4g} s)"
            for k, (f, r, a, t) in enumerate(
                zip(self.factors, self.ratios, self.alone, self.together, strict=True)
            )
        )


def _rounds(n_stages: int, rounds: int) -> list[int | None]:
    """Who works in each round: a stage alone (its index) or all of them (None), each
    stage's alone round and a together round in alternating order."""
    order: list[int | None] = []
    for r in range(rounds):
        block: list[int | None] = [*range(n_stages), None]
        order += block if r % 2 == 0 else block[::-1]
    return order


def _worker(
    rank: int,
    cfg: GPTConfig,
    stage: tuple[int, int],
    seq_len: int,
    granularity: int,
    threads: int,
    order: list[int | None],
    barrier: Barrier,
    results: mp.Queue,
) -> None:
    try:
        torch.set_num_threads(threads)
        timer = StageTimer(cfg, 0, seq_len=seq_len, stage=stage, repeats=1, warmup=0)
        timer.sequence_time(1, granularity)  # first-touch allocations, not timed
        alone, together = [], []
        for who in order:
            barrier.wait()
            if who is None:
                together.append(timer.sequence_time(1, granularity))
            elif who == rank:
                alone.append(timer.sequence_time(1, granularity))
        barrier.wait()
        results.put((rank, alone, together, None))
    except BaseException:
        barrier.abort()  # the others stop waiting for this rank
        results.put((rank, [], [], traceback.format_exc()))


def measure_contention(
    model: str | GPTConfig,
    n_stages: int,
    *,
    seq_len: int,
    granularity: int,
    threads: int,
    rounds: int = 5,
    stage_ranges: Sequence[tuple[int, int]] | None = None,
    timeout: float = 300.0,
) -> Contention:
    """Measure, on ``n_stages`` processes of ``threads`` torch threads each, how much the
    stages of ``model`` (``stage_ranges``, default balanced) slow each other when they
    work at once: ``rounds`` pairs per stage of one ``seq_len``-token sequence in
    ``granularity``-token slices, alone against together. A worker's error, or no
    result within ``timeout`` seconds, raises with the rank that failed."""
    cfg = get_config(model) if isinstance(model, str) else model
    if n_stages < 1 or rounds < 1 or threads < 1 or timeout <= 0:
        raise ProfileError(
            f"n_stages={n_stages}, rounds={rounds}, threads={threads}, timeout={timeout}: "
            "each must be at least 1 (timeout positive)"
        )
    if seq_len > cfg.seq_len:
        raise ProfileError(f"seq_len {seq_len} exceeds model {cfg.name}'s context {cfg.seq_len}")
    grid_steps(seq_len, granularity)
    ranges = list(stage_ranges or balanced_stages(cfg.n_layer, n_stages))
    check_stage_ranges(cfg, ranges, n_stages)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
    barrier = ctx.Barrier(n_stages, timeout=timeout)
    results = ctx.Queue()
    order = _rounds(n_stages, rounds)
    procs = [
        ctx.Process(
            target=_worker,
            args=(k, cfg, ranges[k], seq_len, granularity, threads, order, barrier, results),
            daemon=True,
        )
        for k in range(n_stages)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[list[float], list[float]]] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) + len(errors) < n_stages:
            try:
                rank, alone, together, error = results.get(timeout=1.0)
            except queue.Empty:
                dead = [k for k, p in enumerate(procs) if p.exitcode not in (None, 0)]
                late = time.monotonic() > deadline
                if dead or late:
                    why = f"rank {dead[0]} exited with {procs[dead[0]].exitcode}" if dead else ""
                    raise RuntimeError(
                        "contention benchmark: " + (why or f"no result within timeout={timeout} s")
                    ) from None
                continue
            if error is None:
                got[rank] = (alone, together)
            else:
                errors[rank] = error
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        # A rank that broke the barrier is the cause; the others only saw it break.
        first = min(errors, key=lambda k: "BrokenBarrierError" in errors[k])
        raise RuntimeError(f"contention benchmark: rank {first} failed:\n{errors[first]}")
    return Contention(
        alone=tuple(tuple(got[k][0]) for k in range(n_stages)),
        together=tuple(tuple(got[k][1]) for k in range(n_stages)),
        threads=threads,
        seq_len=seq_len,
        granularity=granularity,
    )
