"""The model as a chain of layers: what the partitioning planners read.

PipeDream, PipeDream-2BW and GPipe each cut a chain of layers into stages from three
numbers per layer (PipeDream §3.1's profile): its compute time, the size of its output
activation and the size of its parameters; 2BW's memory function adds what a layer
keeps for its backward. A :class:`LayerChain` holds them for one microbatch, on one GPU
of an #Op group, with the model's two ends folded into its first and last layer: layer 0
carries the embeddings, layer N-1 the final LayerNorm, the LM head and the loss. That
makes the first and last stages heavier, as they are, and keeps every cut a cut of the
runtime's stages (a stage is a layer range ``[lo, hi)``, :mod:`tplib.nn.layer_ranges`), so a
planner's partition runs as ``Parallelism(stage_ranges=...)``, a run's layout.

Two sources build a chain:

* :func:`cluster_chain`: the V100 cluster model (:mod:`tplib.cluster`): each block's
  time as a stage of the simulator prices it (host floor included), the ends from
  :func:`~tplib.cluster.compute.embedding_times` and
  :func:`~tplib.cluster.compute.head_times`, memory as :mod:`tplib.cluster.memory`
  counts it (mixed precision, attention scores materialised);
* :func:`profile_chain`: stage profiles measured with ``python -m tplib profile`` (or
  :func:`~tplib.perfmodel.profile_pipeline`) on the machine at hand: a middle stage's
  time per block, and the first and last stages' excess over their blocks as the two
  ends; memory from the runtime's own model (:func:`~tplib.cluster.runtime_memory.stage_memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tplib.cluster.calibration import CALIBRATION, Calibration
from tplib.cluster.compute import embedding_times, head_times
from tplib.cluster.cost import ClusterCostModel
from tplib.cluster.hardware import FP16, FP32, P3_16XLARGE, Hardware
from tplib.cluster.memory import STATE_BYTES, activation_rates
from tplib.cluster.runtime_memory import stage_memory
from tplib.nn.configs import GPTConfig, check_precision, get_config, stage_params
from tplib.perfmodel.profile import Profile
from tplib.plan import Plan
from tplib.schedule import Action, Kind

__all__ = ["DoesNotFit", "Layer", "LayerChain", "cluster_chain", "profile_chain"]


class DoesNotFit(ValueError):
    """No configuration a planner may choose fits in memory. ``closest`` describes the
    configuration that needs the least memory, and ``memory`` is what it needs (bytes),
    so the message can say how far off the capacity is."""

    def __init__(self, message: str, closest: str, memory: float, capacity: float) -> None:
        gib = 2**30
        super().__init__(
            f"{message}: nothing fits in {capacity / gib:.1f} GiB per GPU; the closest is "
            f"{closest}, which needs {memory / gib:.1f} GiB"
        )
        self.closest, self.memory, self.capacity = closest, memory, capacity


@dataclass(frozen=True)
class Layer:
    """One layer of the chain for one microbatch, on one GPU of its #Op group."""

    name: str
    forward: float  # seconds
    backward: float  # seconds
    params: float  # parameters the GPU holds
    stash: float  # bytes kept from the forward to the backward (no recomputation)
    output: float  # bytes of the output activation (its gradient is as large)
    states: float  # bytes of weights, gradients and optimizer state

    @property
    def compute(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class LayerChain:
    """A model's layers for one ``microbatch`` of ``seq_len``-token sequences.

    ``version_bytes`` per parameter: what one more weight version costs (weight
    stashing, 2BW); ``grad_bytes`` per parameter: what a data-parallel all-reduce moves;
    ``capacity`` and ``reserve``: a GPU's memory and what the framework keeps of it."""

    layers: tuple[Layer, ...]
    microbatch: int
    seq_len: int
    n_op: int
    version_bytes: float
    grad_bytes: float
    capacity: float
    reserve: float
    source: str

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a LayerChain needs at least one layer")

    def __len__(self) -> int:
        return len(self.layers)

    @cached_property
    def _prefix(self) -> dict[str, np.ndarray]:
        cols = {
            f: np.array([getattr(x, f) for x in self.layers])
            for f in ("forward", "backward", "params", "stash", "states")
        }
        return {f: np.concatenate([[0.0], np.cumsum(v)]) for f, v in cols.items()}

    def total(self, what: str, lo: int, hi: int) -> float:
        """Sum of field ``what`` over layers ``[lo, hi)``."""
        self.check_range(lo, hi)
        p = self._prefix[what]
        return float(p[hi] - p[lo])

    def check_range(self, lo: int, hi: int) -> None:
        if not 0 <= lo < hi <= len(self.layers):
            raise ValueError(
                f"layer range [{lo}, {hi}) is outside the chain's {len(self.layers)} layers: "
                "a stage needs 0 <= lo < hi <= number of layers"
            )

    def compute(self, lo: int, hi: int, recompute: bool = False) -> float:
        """Forward + backward seconds of layers ``[lo, hi)`` for one microbatch; with
        recomputation the backward runs the forward again first."""
        fwd, bwd = self.total("forward", lo, hi), self.total("backward", lo, hi)
        return fwd + bwd + (fwd if recompute else 0.0)

    def boundary(self, lo: int, hi: int) -> float:
        """Bytes a stage ``[lo, hi)`` sends forward per microbatch (0 for the last)."""
        return self.layers[hi - 1].output if hi < len(self.layers) else 0.0

    def stage_memory(
        self, lo: int, hi: int, *, in_flight: int, versions: int = 1, recompute: bool = False
    ) -> float:
        """Bytes one GPU of stage ``[lo, hi)`` needs with ``in_flight`` microbatches
        forwarded and not yet backwarded and ``versions`` weight versions: its states,
        each version beyond the first, what the microbatches keep (with recomputation
        only the stage's input, and one microbatch's activations rebuilt at a time), the
        output each keeps until its gradient returns, and the reserve."""
        if in_flight < 1 or versions < 1:
            raise ValueError(
                f"in_flight={in_flight}, versions={versions}: a stage holds at least one "
                "microbatch and one weight version"
            )
        states = self.total("states", lo, hi)
        states += (versions - 1) * self.version_bytes * self.total("params", lo, hi)
        stash, out = self.total("stash", lo, hi), self.boundary(lo, hi)
        if recompute:
            given = self.layers[lo - 1].output if lo > 0 else 0.0
            acts = in_flight * (given + out) + stash
        else:
            acts = in_flight * (stash + out)
        return states + acts + self.reserve


# ---- the V100 cluster model ------------------------------------------------------------


def cluster_chain(
    model: GPTConfig | str,
    *,
    microbatch: int,
    seq_len: int | None = None,
    n_op: int = 1,
    calibration: Calibration = CALIBRATION,
    hardware: Hardware = P3_16XLARGE,
) -> LayerChain:
    """The chain of ``model`` on the cluster model: ``microbatch`` whole sequences of
    ``seq_len`` tokens (default: the model's) per microbatch, each layer on ``n_op`` GPUs."""
    cfg = get_config(model) if isinstance(model, str) else model
    L = seq_len or cfg.seq_len
    if microbatch < 1:
        raise ValueError(f"microbatch={microbatch}: a microbatch holds at least one sequence")
    cost = ClusterCostModel(cfg, n_stages=1, n_op=n_op, seq_len=L, calibration=calibration)
    fwd, bwd = cost.layer_seconds(microbatch, np.array([L]), np.array([0]))
    tokens = microbatch * L
    per_token, score_bytes = activation_rates(cfg, n_op)
    block_stash = tokens * per_token + tokens * L * score_bytes
    output = FP16 * tokens * cfg.hidden
    e_fwd, e_bwd = embedding_times(cfg, n_op, tokens, cal=calibration, hw=hardware)
    h_fwd, h_bwd = head_times(cfg, n_op, tokens, cal=calibration, hw=hardware)
    vocab_rows = -(-cfg.vocab_size // n_op)
    first_stash = tokens * cfg.hidden if cfg.dropout else 0.0  # the embeddings' dropout mask
    # The last keeps the fp32 softmax of the loss and the final LayerNorm's in/out.
    last_stash = tokens * (vocab_rows * FP32 + 2 * cfg.hidden * FP16)
    n = cfg.n_layer
    layers = []
    for i in range(n):
        params = float(stage_params(cfg, i, i + 1, n_op=n_op))
        f, b = float(fwd[0]), float(bwd[0])
        stash = block_stash
        if i == 0:
            f, b, stash = f + e_fwd, b + e_bwd, stash + first_stash
        if i == n - 1:
            f, b, stash = f + h_fwd, b + h_bwd, stash + last_stash
        layers.append(Layer(f"block {i}", f, b, params, stash, output, STATE_BYTES * params))
    return LayerChain(
        tuple(layers),
        microbatch,
        L,
        n_op,
        version_bytes=FP16,
        grad_bytes=FP16,
        capacity=hardware.gpu_memory,
        reserve=calibration.memory_reserve,
        source=f"V100 cluster model ({cfg.name}, #Op={n_op})",
    )


# ---- measured stage profiles -----------------------------------------------------------


def profile_chain(
    profiles: Sequence[Profile],
    *,
    microbatch: int,
    seq_len: int | None = None,
    precision: str = "fp32",
    capacity: float = float("inf"),
) -> LayerChain:
    """The chain from measured stage profiles (:class:`~tplib.perfmodel.Profile`, each of
    an actual stage: ``Profile.stage`` set) that cover the model's layers contiguously and
    include a middle stage (neither first nor last). Each block of a middle stage costs
    that stage's time over its blocks (their median over middle stages); the first and
    last stages' excess over their blocks is the embeddings' and the head's. The forward
    share is each profile's measured ``fwd_fraction``. Memory: the runtime's model in
    ``precision``."""
    check_precision(precision)
    staged = sorted((p.stage, p) for p in profiles if p.stage is not None)
    if not profiles or len(staged) != len(profiles):
        raise ValueError(
            "profile_chain needs profiles of actual stages (Profile.stage set): profile "
            "them with python -m tplib profile --stage LO HI, or profile_pipeline"
        )
    profs = [p for _, p in staged]
    ranges = [r for r, _ in staged]
    cfg: GPTConfig = profs[0].config
    n = cfg.n_layer
    if [lo for lo, _ in ranges] != [0, *(hi for _, hi in ranges[:-1])] or ranges[-1][1] != n:
        raise ValueError(
            f"profiled stages {ranges} do not cover {cfg.name}'s layers [0, {n}) "
            "contiguously: profile every stage of one pipeline"
        )
    L = seq_len or min(p.seq_len for p in profs)

    def timed(p: Profile) -> np.ndarray:  # (forward, backward) of the whole stage
        t = float(np.asarray(p.compute_time(microbatch, np.array([L]), np.array([0])))[0])
        return np.array([p.fwd_fraction * t, (1 - p.fwd_fraction) * t])

    middle = [(r, p) for r, p in staged if r[0] > 0 and r[1] < n]
    if not middle:
        raise ValueError(
            f"profiled stages {ranges} have no middle stage: the blocks' own time is read "
            "from a stage holding neither the embeddings nor the head (profile >= 3 stages)"
        )
    block = np.median(np.stack([timed(p) / (hi - lo) for (lo, hi), p in middle]), axis=0)
    times = [block.copy() for _ in range(n)]
    for (lo, hi), p in (staged[0], staged[-1]):
        excess = np.maximum(timed(p) - (hi - lo) * block, 0.0)
        times[0 if lo == 0 else n - 1] += excess
    plan = Plan.gpipe(microbatch, L, microbatch=microbatch)
    one = (Action(Kind.F, 0, 0, 0),)
    element = FP32 if precision != "fp16" else FP16
    output = microbatch * L * cfg.hidden * element
    layers = []
    for i in range(n):
        mem = stage_memory(cfg, i, i + 1, plan=plan, actions=one, precision=precision)
        kept_output = output if i < n - 1 else 0.0  # counted by LayerChain.stage_memory
        params = float(stage_params(cfg, i, i + 1))
        f, b = (float(x) for x in times[i])
        stash = mem.activations - kept_output
        layers.append(Layer(f"block {i}", f, b, params, stash, output, mem.states))
    return LayerChain(
        tuple(layers),
        microbatch,
        L,
        1,
        version_bytes=float(element if precision == "fp16" else FP32),
        grad_bytes=float(element),
        capacity=capacity,
        reserve=0.0,
        source=f"measured profiles ({cfg.name}, {profs[0].device})",
    )
