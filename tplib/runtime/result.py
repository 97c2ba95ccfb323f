"""What a run returns: every rank's :class:`~tplib.runtime.rank.RankResult` gathered into
one :class:`RunResult`, with the trace as a DataFrame, the global losses, latencies and
memory, and the gradients and parameters with #Op shards joined into whole tensors.
Under context parallelism the loss sums every CP rank's share of it, and the gradients and
parameters are CP rank 0's (the reduction over #Data x #CP makes them every CP rank's).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch

from tplib.nn.oppart import merge_shards, shard_spec
from tplib.runtime.rank import TRACE_COLUMNS, RankResult
from tplib.runtime.runconfig import RunConfig

__all__ = ["RunResult"]


@dataclass
class RunResult:
    """Results of a run, gathered from every rank."""

    config: RunConfig
    ranks: list[RankResult]

    @property
    def trace(self) -> pd.DataFrame:
        """Every traced action: rank, stage, replica, op_rank, iteration, kind, b, t, start,
        end (s)."""
        rows = [row for r in self.ranks for row in r.trace]
        return pd.DataFrame(rows, columns=list(TRACE_COLUMNS))

    @property
    def losses(self) -> list[float]:
        """The global mean loss of each timed iteration (summed over the shares of the
        replicas and CP ranks)."""
        loss_stage = self.config.schedule.placement[-1]  # the model's last part's stage
        last = [r for r in self.ranks if r.stage == loss_stage and r.op_rank == 0]
        return [sum(vals) for vals in zip(*(r.losses for r in last), strict=True)]

    @property
    def grad_norms(self) -> list[float]:
        """The global gradient norm before clipping of each timed iteration (every rank
        computes the same; empty when the run does not clip)."""
        return min(self.ranks, key=lambda r: r.rank).grad_norms

    @property
    def iteration_s(self) -> list[float]:
        """Wall time of each timed iteration (the slowest rank's, barrier to barrier)."""
        return [max(vals) for vals in zip(*(r.iteration_s for r in self.ranks), strict=True)]

    @property
    def median_latency_s(self) -> float:
        return statistics.median(self.iteration_s)

    def grads(self, replica: int = 0) -> dict[tuple[int, str], torch.Tensor]:
        """First-iteration gradients, keyed by (stage, parameter name); with #Op > 1 the
        op ranks' shards are joined into the whole model's tensors."""
        return self._merged(replica, lambda r: r.grads)

    def params(self, replica: int = 0) -> dict[tuple[int, str], torch.Tensor]:
        """Parameters after the last step, keyed by (stage, parameter name), joined as
        :meth:`grads` are."""
        return self._merged(replica, lambda r: r.params)

    def _merged(
        self, replica: int, tensors: Callable[[RankResult], dict[str, torch.Tensor]]
    ) -> dict[tuple[int, str], torch.Tensor]:
        shards: dict[tuple[int, str], list[torch.Tensor]] = {}
        for r in sorted(self.ranks, key=lambda r: r.op_rank):
            if r.replica == replica and r.cp_rank == 0:
                for name, t in tensors(r).items():
                    shards.setdefault((r.stage, name), []).append(t)
        vocab, n_op = self.config.cfg.vocab_size, self.config.parallelism.n_op
        out = {}
        for (stage, name), parts in shards.items():
            spec = shard_spec(name)
            if spec is None:  # replicated: every op rank holds the same tensor
                out[stage, name] = parts[0]
                continue
            size = vocab if spec.vocab else parts[0].shape[spec.dim] * n_op
            out[stage, name] = merge_shards(parts, spec, size)
        return out

    @property
    def memory(self) -> pd.DataFrame:
        """Each rank's measured peak memory (bytes) and its parts."""
        rows = [
            {"rank": r.rank, "stage": r.stage, "replica": r.replica, "op_rank": r.op_rank}
            | {"cp_rank": r.cp_rank}
            | dataclasses.asdict(r.memory)
            | {"total": r.memory.total}
            for r in self.ranks
            if r.memory is not None
        ]
        return pd.DataFrame(rows)

    def stage_peak_bytes(self) -> list[int]:
        """Each stage's peak memory: the largest of its ranks' (bytes)."""
        peaks = [0] * self.config.parallelism.n_stages
        for r in self.ranks:
            if r.memory is not None:
                peaks[r.stage] = max(peaks[r.stage], r.memory.total)
        return peaks
