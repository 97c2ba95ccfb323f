"""What a Megatron-style GPT training run costs on a cluster: ``python -m tplib predict``.

:class:`MegatronRun` is a run as Megatron-LM's arguments state it: the cluster and its
GPU count, the model (layers, hidden, heads, vocabulary, sequence length), tensor-,
context- and pipeline-parallel sizes (#Op = T, #CP = C, #Pipe = P; #Data = N / (T C P);
context parallelism as :mod:`tplib.cluster.context_parallel` prices it), the global batch and
microbatch, interleaving (v model chunks per stage), recomputation, sequence
parallelism, the distributed optimizer and the pipeline schedule. It is checked whole
before anything is priced (:meth:`MegatronRun.check`).

:func:`predict` simulates one iteration of it on
:class:`~tplib.cluster.cost.ClusterCostModel` under the cluster's hardware and
calibration (:data:`~tplib.cluster.calibration.CALIBRATIONS`), with the embedding and the
LM head on the end stages, and the busiest GPU's memory
(:func:`~tplib.cluster.memory.schedule_memory_per_gpu`).

FLOPs. Narayanan et al. 2021 count an iteration of l layers, hidden size h, sequence
length s, vocabulary V and global batch B as

    F = 72 B s l h^2 (1 + s / (6h) + V / (12 l h))        without recomputation,
    F = 96 B s l h^2 (1 + s / (6h) + V / (16 l h))        with full recomputation

(the second adds the layers' forward run again; the LM head is never recomputed).
``tflops_per_gpu`` divides the count for the run's recomputation (the second for
``full``, the first otherwise: selective recomputation's extra attention forward is not
counted) by the iteration time and the GPUs; ``mfu`` divides the first, the model's own
FLOPs, by the GPUs' dense fp16/bf16 peak. Context parallelism changes neither count: it
splits the same products over more GPUs.

Long pipelines. A microbatch schedule (GPipe, 1F1B, interleaved 1F1B) over M > 2P
uniform microbatches is periodic: once the pipeline is full, each further microbatch
adds the same time (interleaved: each group of P; Megatron requires M to be a multiple
of P there, as :meth:`MegatronRun.check` does). :func:`predict` simulates P and 2P
microbatches and extrapolates to M (:func:`~tplib.search.pricing.periodic`); tests check
that this equals simulating all M, on runs of every schedule, with interleaving, data
parallelism and the model's ends.
Token-sliced schedules are simulated whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tplib.cluster.calibration import CALIBRATIONS, Calibration
from tplib.cluster.cost import ClusterCostModel
from tplib.cluster.hardware import CLUSTERS
from tplib.cluster.implementation import RECOMPUTES, Attention, Implementation
from tplib.cluster.memory import schedule_memory_per_gpu
from tplib.nn.configs import GPTConfig
from tplib.plan import Plan
from tplib.schedule import Schedule, make_schedule, registered
from tplib.schedule.chunks import interleaved
from tplib.search.pricing import GRANULARITY, periodic
from tplib.sim.simulate import simulate

__all__ = ["MegatronRun", "Prediction", "model_flops", "narayanan_flops", "predict"]

# Schedules predict prices: microbatch schedules, and TeraPipe's token-sliced ones over
# the planner's slices of each microbatch.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "terapipe", "terapipe-interleaved")


@dataclass(frozen=True)
class MegatronRun:
    """One training run, as Megatron-LM's arguments give it (see the module docstring).
    ``schedule`` None: ``1f1b``, or ``interleaved-1f1b`` with ``interleave`` > 1;
    ``attention`` None: FlashAttention-2 where the cluster runs it, else the paper's."""

    cluster: str
    gpus: int
    layers: int
    hidden: int
    heads: int
    batch: int
    vocab: int = 51200
    seq_len: int = 2048
    tp: int = 1
    pp: int = 1
    cp: int = 1
    microbatch: int = 1
    interleave: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    schedule: str | None = None
    attention: Attention | None = None
    dropout: float = 0.1

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the value and the rule it breaks."""
        if self.cluster not in CLUSTERS:
            raise ValueError(f"cluster={self.cluster!r}: known clusters are {sorted(CLUSTERS)}")
        g = CLUSTERS[self.cluster].gpus_per_node
        for name in ("gpus", "layers", "hidden", "heads", "batch", "vocab", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        for name in ("tp", "pp", "cp", "microbatch", "interleave"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.gpus % g:
            raise ValueError(
                f"gpus={self.gpus} is not whole nodes: {self.cluster} nodes have {g} GPUs"
            )
        if g % self.tp:
            raise ValueError(
                f"tp={self.tp} must divide the {g} GPUs of a node (tensor parallelism stays "
                "inside a node)"
            )
        if self.cp == 1 and self.gpus % (self.tp * self.pp):
            raise ValueError(
                f"gpus={self.gpus} is not a multiple of tp x pp = {self.tp * self.pp}: "
                "#Data = gpus / (tp pp) replicas"
            )
        self._check_cp(g)
        if self.heads % self.tp:
            raise ValueError(f"heads={self.heads} is not divisible by tp={self.tp}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.layers % (self.pp * self.interleave):
            raise ValueError(
                f"layers={self.layers} is not divisible by pp x interleave = "
                f"{self.pp} x {self.interleave}: every model chunk gets as many layers"
            )
        per_step = self.microbatch * self.n_data
        if self.batch % per_step:
            raise ValueError(
                f"batch={self.batch} is not divisible by microbatch x #Data = "
                f"{self.microbatch} x {self.n_data}"
            )
        if self.recompute not in RECOMPUTES:
            raise ValueError(f"recompute={self.recompute!r}: choose one of {RECOMPUTES}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel with tp=1: sequence parallelism needs tp > 1")
        if self.sequence_parallel and self.seq_len % self.tp:
            raise ValueError(
                f"seq_len={self.seq_len} is not divisible by tp={self.tp}: sequence "
                "parallelism gives each GPU of the group an equal share of the tokens"
            )
        if self.schedule_name not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule_name!r}: choose one of {SCHEDULES}")
        chunked = registered(self.schedule_name).chunked
        if self.interleave > 1 and not chunked:
            raise ValueError(
                f"interleave={self.interleave} with schedule {self.schedule_name!r}, which "
                "has one model chunk per stage: use interleaved-1f1b"
            )
        if self.schedule_name == "interleaved-1f1b" and self.microbatches % self.pp:
            raise ValueError(
                f"interleaved 1F1B needs a multiple of pp={self.pp} microbatches per "
                f"pipeline (Megatron's rule); batch / (microbatch x #Data) = "
                f"{self.microbatches}"
            )
        if self.attention == "flash" and CALIBRATIONS[self.cluster].flash_efficiency is None:
            raise ValueError(f"attention='flash' on {self.cluster}: its GPUs do not run it")

    def _check_cp(self, g: int) -> None:
        """The rules context parallelism adds (nothing with ``cp=1``)."""
        if self.cp == 1:
            return
        group = self.tp * self.cp
        if self.gpus % (group * self.pp):
            raise ValueError(
                f"gpus={self.gpus} is not a multiple of tp x cp x pp = {group * self.pp}: "
                "#Data = gpus / (tp cp pp) replicas"
            )
        if group % g and g % group:
            raise ValueError(
                f"tp x cp = {group} must divide the {g} GPUs of a node or be whole nodes "
                "(a stage's GPUs sit together, tensor ranks innermost)"
            )
        if self.seq_len % (2 * self.cp):
            raise ValueError(
                f"seq_len={self.seq_len} is not divisible by 2 x cp = {2 * self.cp}: "
                "context parallelism cuts each sequence into 2 cp equal chunks"
            )
        if self.sequence_parallel and self.seq_len % (self.tp * self.cp):
            raise ValueError(
                f"seq_len={self.seq_len} is not divisible by tp x cp = {group}: sequence "
                "parallelism splits each CP rank's tokens over the tensor-parallel group"
            )
        if self.attention not in (None, "flash") or (
            CALIBRATIONS[self.cluster].flash_efficiency is None
        ):
            raise ValueError(
                f"cp={self.cp} on {self.cluster} with attention={self.attention!r}: context "
                "parallelism runs ring attention over FlashAttention kernels"
            )

    @property
    def granularity(self) -> int:
        """The planner's token grid for the TeraPipe schedules: 8 tokens, and a multiple
        of 2 cp (each token slice is cut into 2 cp chunks)."""
        return math.lcm(GRANULARITY, 2 * self.cp)

    @property
    def n_data(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline per iteration."""
        return self.batch // (self.microbatch * self.n_data)

    @property
    def schedule_name(self) -> str:
        if self.schedule is not None:
            return self.schedule
        return "interleaved-1f1b" if self.interleave > 1 else "1f1b"

    @property
    def config(self) -> GPTConfig:
        return GPTConfig(
            name=f"GPT l={self.layers} h={self.hidden}",
            n_layer=self.layers,
            hidden=self.hidden,
            n_head=self.heads,
            seq_len=self.seq_len,
            vocab_size=self.vocab,
            dropout=self.dropout,
        )

    @property
    def implementation(self) -> Implementation:
        flash = CALIBRATIONS[self.cluster].flash_efficiency is not None
        attention = self.attention or ("flash" if flash else "unfused")
        return Implementation(
            attention=attention,
            sequence_parallel=self.sequence_parallel,
            scatter_gather=not self.sequence_parallel,
            distributed_optimizer=self.distributed_optimizer,
            overlap_grad_reduce=self.overlap_grad_reduce,
            ends=True,
            layer_checkpoints=True,
        )


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` gives for a run (see the module docstring for the FLOPs)."""

    run: MegatronRun
    iteration_s: float
    tflops_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float
    memory_gib: float
    capacity_gib: float
    fits: bool
    bubble_fraction: float
    simulated_microbatches: int

    def as_dict(self) -> dict[str, object]:
        return {
            "iteration_s": self.iteration_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "memory_gib": self.memory_gib,
            "capacity_gib": self.capacity_gib,
            "fits": self.fits,
            "bubble_fraction": self.bubble_fraction,
            "n_data": self.run.n_data,
            "cp": self.run.cp,
            "microbatches": self.run.microbatches,
            "schedule": self.run.schedule_name,
            "attention": self.run.implementation.attention,
        }


def narayanan_flops(run: MegatronRun, *, recompute: bool) -> float:
    """FLOPs of one iteration by Narayanan et al. 2021's formula (module docstring)."""
    return model_flops(run.config, run.batch, recompute=recompute)


def model_flops(cfg: GPTConfig, batch: int, *, recompute: bool = False) -> float:
    """Narayanan et al. 2021's FLOPs of one iteration of ``batch`` sequences of
    ``cfg.seq_len`` tokens (module docstring), with full recomputation's extra forward
    when ``recompute``."""
    b, s, n, h, v = batch, cfg.seq_len, cfg.n_layer, cfg.hidden, cfg.vocab_size
    if recompute:
        return 96.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    return 72.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))


def cost_model(run: MegatronRun, calibration: Calibration | None = None) -> ClusterCostModel:
    """The cluster model of ``run``'s layout, placed on its schedule's chunks, under
    ``calibration`` (default: the cluster's)."""
    cost = ClusterCostModel(
        run.config,
        n_stages=run.pp,
        n_op=run.tp,
        n_data=run.n_data,
        seq_len=run.seq_len,
        calibration=calibration or CALIBRATIONS[run.cluster],
        hardware=CLUSTERS[run.cluster],
        recompute=run.recompute,
        implementation=run.implementation,
        overlap_unit=(run.microbatch, run.seq_len),
        n_cp=run.cp,
    )
    return cost.placed(interleaved(run.pp, run.interleave))


def _plan(run: MegatronRun, microbatches: int, cost: ClusterCostModel) -> Plan:
    if run.schedule_name.startswith("terapipe"):
        from tplib.planner import plan_slices  # the planner: only when asked

        return plan_slices(
            cost,
            seq_len=run.seq_len,
            batch=microbatches * run.microbatch,
            n_stages=run.pp,
            granularity=run.granularity,
            n_chunks=run.interleave,
        )
    return Plan.gpipe(microbatches * run.microbatch, run.seq_len, microbatch=run.microbatch)


def _simulate(
    run: MegatronRun, microbatches: int, cost: ClusterCostModel
) -> tuple[float, float, Schedule]:
    """(latency, busy stage-seconds, schedule) of ``microbatches`` microbatches."""
    schedule = make_schedule(
        run.schedule_name,
        run.pp,
        _plan(run, microbatches, cost),
        n_chunks=run.interleave if registered(run.schedule_name).chunked else None,
        validate=False,
    )
    result = simulate(schedule, cost)
    return result.latency, float(result.busy.sum()), schedule


def predict(run: MegatronRun, calibration: Calibration | None = None) -> Prediction:
    """Iteration time, TFLOPS, MFU and memory of ``run`` (see the module docstring),
    under ``calibration`` (default: the cluster's)."""
    m, p = run.microbatches, run.pp
    cost = cost_model(run, calibration)
    # Periodic: P and 2P microbatches give the time each further one adds.
    period = m if run.schedule_name.startswith("terapipe") else p
    latency, busy, schedule, simulated = periodic(m, period, lambda n: _simulate(run, n, cost))
    bubble = max(0.0, 1.0 - busy / (latency * p))  # 0, not -1e-16, without a bubble
    hw = cost.hw
    memory, _ = schedule_memory_per_gpu(
        run.config,
        schedule,
        n_op=run.tp,
        recompute=run.recompute,
        calibration=cost.cal,
        hardware=hw,
        implementation=run.implementation,
        n_data=run.n_data,
        stages=sorted({0, p - 1}),
        n_cp=run.cp,
    )
    counted = narayanan_flops(run, recompute=run.recompute == "full")
    model = narayanan_flops(run, recompute=False)
    per_gpu = latency * run.gpus
    return Prediction(
        run=run,
        iteration_s=latency,
        tflops_per_gpu=counted / per_gpu / 1e12,
        model_tflops_per_gpu=model / per_gpu / 1e12,
        mfu=model / per_gpu / hw.peak_fp16,
        memory_gib=memory.total / 2**30,
        capacity_gib=memory.capacity / 2**30,
        fits=memory.fits,
        bubble_fraction=bubble,
        simulated_microbatches=simulated,
    )
