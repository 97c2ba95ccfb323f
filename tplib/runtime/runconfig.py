"""What one training run is: :class:`RunConfig`, checked whole before any process starts.

A run names the model, the schedule and its slicing, recomputation and the precision,
and holds four parts, each a small frozen dataclass that checks its own fields
(:mod:`tplib.runtime.parts`): :class:`Parallelism`, :class:`Data`, :class:`Optim` and
:class:`Timing`.

What involves two parts, or a part and the model (the batch against #Data, the stages
against the model's layers, an asynchronous schedule against clipping, the token slices
against #CP), is checked by
:class:`RunConfig` itself, which also builds and validates the schedule. So bad input
fails here, with a message naming the value and the rule, not in a worker process
minutes later. It travels as JSON to torchrun jobs (:mod:`tplib.runtime.runfile`).

:class:`Hooks` are what tests and debugging add to a run (collecting gradients and
parameters, injecting a fault); they are not part of what the run trains, so they are
not a part of it either: they are passed beside it and never saved with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tplib.nn.configs import (
    GPTConfig,
    check_cp_length,
    check_numbers,
    check_op,
    check_precision,
    check_recompute,
    get_config,
    padded_vocab,
)
from tplib.nn.layer_ranges import StageRange, balanced_stages, check_stage_ranges
from tplib.nn.lr import LRSchedule
from tplib.plan import Plan
from tplib.runtime.parts import PARTS, SEEDS, Data, Optim, Parallelism, Timing
from tplib.schedule import Schedule, make_schedule, schedule_names
from tplib.schedule.nccl import PostingPlan, check_nccl, posting_plan

__all__ = ["Hooks", "RunConfig"]

# The most (unit, stage) pairs a run's schedule may hold: every rank builds and validates
# the whole schedule (0.1-0.3 ms a pair on this machine), so batch=10**9 is refused at
# once, not after hours. Table 1's largest run holds a few ten thousand.
MAX_UNIT_STAGES = 1 << 18


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run: the model, the schedule, and its :class:`Parallelism`,
    :class:`Data`, :class:`Optim` and :class:`Timing`.

    Each pipeline trains ``pipeline_batch = data.batch // parallelism.n_data`` sequences
    per iteration, cut into units by ``slicing``: a :class:`~tplib.plan.Plan` of
    ``pipeline_batch`` x ``data.seq_len``, or a number of equal token slices per sequence
    (batch slices of one sequence; 1 is GPipe's microbatches of one sequence).
    ``schedule_name`` names a registered schedule (:mod:`tplib.schedule.registry`);
    ``vertical_sync`` is PipeDream's option. The schedule, its option and the slicing
    stay here, not in a part: each is checked against the others' parts (the stages, the
    batch, the run's length), and the built :attr:`schedule` is the run's own.

    An asynchronous schedule ("pipedream", "2bw"; see :mod:`tplib.schedule.asynchronous`)
    spans the run's ``timing.iterations`` without a flush, one update per iteration; it
    needs ``optim.grad_clip=0``.

    The derived values are computed once, when the config is made: :attr:`cfg` (the
    model config with ``model_overrides``), :attr:`plan`, :attr:`ranges` and the
    validated :attr:`schedule`.
    """

    model: str = "tiny"
    model_overrides: tuple[tuple[str, object], ...] = ()
    schedule_name: str = "terapipe"
    vertical_sync: bool = False  # pipedream only: every stage uses the entry version
    slicing: Plan | int = 1
    parallelism: Parallelism = field(default_factory=Parallelism)
    data: Data = field(default_factory=Data)
    optim: Optim = field(default_factory=Optim)
    timing: Timing = field(default_factory=Timing)
    seed: int = 0  # model initialisation
    device: str = "cpu"
    precision: str = "fp32"  # "fp32" | "bf16" (autocast) | "fp16" (CUDA: fp32 master weights)
    # "none" | "selective" (recompute each attention core) | "full" (keep only each
    # unit's input; recompute its forward)
    recompute: str = "none"
    batch_plans: tuple[Plan, ...] = ()  # per-batch: iteration i runs batch_plans[i]
    # What __post_init__ derives: the model, plan, layer ranges, schedule and (made once,
    # on first use) where each stage posts its messages.
    _derived: tuple[GPTConfig, Plan, tuple[StageRange, ...], Schedule, PostingPlan | None] = field(
        init=False, repr=False, compare=False
    )
    _batch_schedules: tuple[Schedule, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, part in PARTS.items():
            if not isinstance(getattr(self, name), part):
                raise ValueError(
                    f"RunConfig.{name}={getattr(self, name)!r} must be a {part.__name__}"
                )
        check_numbers(self, integers={"seed": SEEDS}, reals={})
        if not isinstance(self.schedule_name, str):  # the registry is a dict: names must hash
            raise ValueError(
                f"unknown schedule {self.schedule_name!r}: RunConfig.schedule_name names one "
                f"of {list(schedule_names())}"
            )
        if not isinstance(self.vertical_sync, bool):
            raise ValueError(
                f"RunConfig.vertical_sync={self.vertical_sync!r} must be True or False"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"RunConfig.device={self.device!r}: choose 'cpu' or 'cuda'")
        check_precision(self.precision, self.device)
        check_recompute(self.recompute)
        cfg = get_config(self.model, self.model_overrides)
        parallelism, data = self.parallelism, self.data
        check_op(cfg, parallelism.n_op)
        if data.batch % parallelism.n_data:
            raise ValueError(
                f"batch={data.batch} is not divisible by n_data={parallelism.n_data}: "
                "every data-parallel replica trains the same number of sequences"
            )
        if data.seq_len > cfg.seq_len:
            raise ValueError(
                f"seq_len={data.seq_len} exceeds the model's context of {cfg.seq_len} tokens"
            )
        plan = self._resolve_plan()
        plan.check_covers(self.pipeline_batch, data.seq_len)
        ranges = parallelism.stage_ranges
        v = parallelism.n_chunks
        if ranges is None:
            per_stage = cfg.n_layer // parallelism.n_stages
            if v > 1 and (cfg.n_layer % parallelism.n_stages or per_stage % v):
                raise ValueError(
                    f"n_chunks={v} with {parallelism.n_stages} stages of model {cfg.name}'s "
                    f"{cfg.n_layer} layers: each stage's layers are cut into v equal chunks, "
                    "so v must divide the layers per stage (give Parallelism.stage_ranges "
                    "for an uneven cut)"
                )
            ranges = balanced_stages(cfg.n_layer, parallelism.n_parts)
        check_stage_ranges(cfg, ranges, parallelism.n_parts)
        schedule = self._make_schedule(plan)
        if schedule.asynchronous:
            self._check_asynchronous(cfg)
        if parallelism.sequence_parallel:
            self._check_sequence_parallel(plan, schedule)
        if parallelism.n_cp > 1:
            self._check_context_parallel(cfg, plan, schedule)
        object.__setattr__(self, "_batch_schedules", self._check_packed(plan, schedule))
        posting = None
        if self.device == "cuda":  # NCCL: a send waits for its receive (tplib.schedule.nccl)
            posting = posting_plan(schedule)
            check_nccl(schedule, posting)
        object.__setattr__(self, "_derived", (cfg, plan, tuple(ranges), schedule, posting))

    def _make_schedule(self, plan: Plan) -> Schedule:
        p = self.parallelism
        return make_schedule(
            self.schedule_name, p.n_stages, plan, n_iterations=self.timing.iterations,
            vertical_sync=self.vertical_sync, n_chunks=p.n_chunks,
        )  # fmt: skip

    def _check_packed(self, plan: Plan, schedule: Schedule) -> tuple[Schedule, ...]:
        """Refuse what packed rows or per-batch plans cannot run with; return each
        iteration's schedule under per-batch plans (one built per distinct plan)."""
        if self.data.packed and (schedule.asynchronous or self.parallelism.n_cp > 1):
            raise ValueError(
                f"data source {self.data.source!r} with schedule {self.schedule_name!r} and "
                f"#CP={self.parallelism.n_cp}: packed documents run under synchronous "
                "schedules, without context parallelism"
            )
        if not self.batch_plans:
            return ()
        if schedule.asynchronous:
            raise ValueError(
                f"batch_plans with schedule {self.schedule_name!r}: per-batch plans need a flush "
                "between iterations (a synchronous schedule)"
            )
        if len(self.batch_plans) != self.timing.iterations:
            raise ValueError(
                f"{len(self.batch_plans)} batch_plans for {self.timing.iterations} iterations: "
                "give one plan per iteration"
            )
        built: dict[Plan, Schedule] = {}
        for i, p in enumerate(self.batch_plans):
            if not isinstance(p, Plan) or p.batch_slices != plan.batch_slices:
                raise ValueError(
                    f"batch_plans[{i}]={p!r}: every per-batch plan keeps the run's batch split "
                    f"{plan.batch_slices} (the K/V contexts are kept); only token slices change"
                )
            p.check_covers(self.pipeline_batch, self.data.seq_len)
            if p not in built:  # validated here, before any process starts
                built[p] = self._make_schedule(p)
        return tuple(built[p] for p in self.batch_plans)

    def _check_asynchronous(self, cfg: GPTConfig) -> None:
        """What an asynchronous schedule cannot combine with, and why."""
        name = self.schedule_name
        if self.optim.grad_clip > 0:
            raise ValueError(
                f"schedule_name={name!r} with grad_clip={self.optim.grad_clip}: clipping to "
                "the global gradient norm makes every stage wait for every other at each "
                "update, the flush an asynchronous schedule exists to avoid; set "
                "Optim(grad_clip=0)"
            )
        if self.parallelism.distributed_optimizer:
            raise ValueError(
                f"schedule_name={name!r} with distributed_optimizer=True: an asynchronous "
                "schedule swaps each parameter's storage between weight versions, and the "
                "distributed optimizer keeps every parameter in the one flat buffer it steps "
                "and all-gathers; set Parallelism(distributed_optimizer=False)"
            )
        if self.precision == "fp16":
            raise ValueError(
                f"schedule_name={name!r} with precision='fp16': skipping an overflowing "
                "step needs every stage to agree at each update (a flush); use 'bf16' or "
                "'fp32'"
            )
        if cfg.dropout > 0:
            raise ValueError(
                f"schedule_name={name!r} with dropout={cfg.dropout}: the runtime keys "
                "dropout masks by iteration, which asynchronous schedules do not do yet; "
                "set model_overrides dropout=0"
            )

    def _check_sequence_parallel(self, plan: Plan, schedule: Schedule) -> None:
        """What sequence parallelism needs: every token slice split evenly over #Op (the
        shards of a slice), and a synchronous schedule."""
        n_op = self.parallelism.n_op
        if self.data.seq_len % n_op:
            raise ValueError(
                f"sequence_parallel with seq_len={self.data.seq_len} and n_op={n_op}: each "
                "op rank holds 1/#Op of every sequence's tokens, so #Op must divide L"
            )
        for b, lengths in enumerate(plan.token_slices):
            if odd := [n for n in lengths if n % n_op]:
                raise ValueError(
                    f"sequence_parallel with n_op={n_op}: token slices {odd} of batch slice "
                    f"{b} (plan {plan.to_paper()}) are not divisible by #Op; each op rank "
                    "holds 1/#Op of every slice's tokens"
                )
        if schedule.asynchronous:
            raise ValueError(
                f"schedule_name={self.schedule_name!r} with sequence_parallel: asynchronous "
                "schedules are not supported with sequence parallelism (its weight "
                "versions and their gradient sums are untested there); use a synchronous "
                "schedule"
            )

    def _check_context_parallel(self, cfg: GPTConfig, plan: Plan, schedule: Schedule) -> None:
        """What context parallelism (:mod:`tplib.nn.ring`) needs: L and every token slice
        cut into 2 x #CP equal chunks, and none of what its ring does not support."""
        n_cp, layout = self.parallelism.n_cp, self.parallelism
        check_cp_length(self.data.seq_len, n_cp, f"with n_cp={n_cp}, seq_len")
        for b, lengths in enumerate(plan.token_slices):
            for t, n in enumerate(lengths):
                where = f"token slice {t} of batch slice {b} (plan {plan.to_paper()})"
                check_cp_length(n, n_cp, f"with n_cp={n_cp}, {where}")
        refused = (  # (what, whether this run has it, why the ring refuses it)
            ("an asynchronous schedule", schedule.asynchronous, "its weight versions are"),
            ("sequence_parallel", layout.sequence_parallel, "splitting a slice twice is"),
            (f"dropout={cfg.dropout}", cfg.dropout > 0, "dropping probabilities is"),
            ("device='cuda'", self.device == "cuda", "NCCL's message ordering is"),
        )
        for what, bad, why in refused:
            if bad:
                raise ValueError(
                    f"n_cp={n_cp} with {what} (schedule {self.schedule_name!r}): context "
                    f"parallelism does not support it yet: {why} untested with the ring"
                )

    @property
    def lr_schedule(self) -> LRSchedule:
        """The learning rate of every optimizer step (see :mod:`tplib.nn.lr`), with the decay's
        end resolved: ``optim.lr_decay_steps``, by default the run's ``timing.iterations``."""
        optim = self.optim
        decay = None
        if optim.lr_schedule_name == "cosine":
            decay = optim.lr_decay_steps
            if decay is None:
                # A run shorter than its warm-up never decays: any end >= W will do.
                decay = max(self.timing.iterations, optim.lr_warmup_steps)
        return LRSchedule(
            optim.lr,
            kind=optim.lr_schedule_name,
            warmup_steps=optim.lr_warmup_steps,
            decay_steps=decay,
            min_ratio=optim.min_lr_ratio,
        )

    def _resolve_plan(self) -> Plan:
        if isinstance(self.slicing, Plan):
            self._check_size(self.slicing.n_units)
            return self.slicing
        if isinstance(self.slicing, bool) or not isinstance(self.slicing, int):
            raise ValueError(
                f"RunConfig.slicing={self.slicing!r}: give a Plan or a number of token "
                "slices per sequence"
            )
        seq_len = self.data.seq_len
        if not 1 <= self.slicing <= seq_len:
            raise ValueError(
                f"RunConfig.slicing={self.slicing} token slices per sequence is outside "
                f"[1, seq_len={seq_len}]"
            )
        self._check_size(self.pipeline_batch * self.slicing)  # before the plan is built
        return Plan.uniform(self.pipeline_batch, seq_len, n_token_slices=self.slicing)

    def _check_size(self, units: int) -> None:
        """Refuse a schedule too large to build (see :data:`MAX_UNIT_STAGES`)."""
        asynchronous = self.schedule_name in schedule_names(asynchronous=True)
        spans = self.timing.iterations if asynchronous else 1
        n_stages = self.parallelism.n_parts  # a chunk's actions count as a stage's
        if units * n_stages * spans > MAX_UNIT_STAGES:
            raise ValueError(
                f"{units} units per iteration x n_stages={n_stages}"
                + (f" x {spans} iterations" if spans > 1 else "")
                + f" make {units * n_stages * spans} (unit, stage) pairs, more than the "
                f"{MAX_UNIT_STAGES} a schedule may hold: use fewer, longer slices or a "
                "smaller batch"
            )

    @property
    def padded_vocab(self) -> int:
        """The vocabulary padded to a multiple of #Op (the embedding's and head's rows);
        padding rows are masked out of the loss, so the model computes the same."""
        return padded_vocab(self.cfg.vocab_size, self.parallelism.n_op)

    @property
    def pipeline_batch(self) -> int:
        """B / #Data: the sequences one pipeline trains per iteration."""
        return self.data.batch // self.parallelism.n_data

    @property
    def cfg(self) -> GPTConfig:
        return self._derived[0]

    @property
    def plan(self) -> Plan:
        return self._derived[1]

    @property
    def ranges(self) -> tuple[StageRange, ...]:
        """Each stage's layer range ``[lo, hi)``; with virtual stages, each part's (see
        :attr:`Schedule.placement <tplib.schedule.Schedule.placement>` for its stage)."""
        return self._derived[2]

    @property
    def schedule(self) -> Schedule:
        """The validated schedule every stage interprets, built from ``schedule_name``."""
        return self._derived[3]

    @property
    def batch_schedules(self) -> tuple[Schedule, ...]:
        """Iteration i's schedule under per-batch plans (:attr:`batch_plans`); () without."""
        return self._batch_schedules

    @property
    def posting(self) -> PostingPlan:
        """Where each stage posts its messages (:func:`tplib.schedule.nccl.posting_plan`),
        made once per process (a CUDA run's, to check it, when the config is made)."""
        if self._derived[4] is None:
            object.__setattr__(
                self, "_derived", (*self._derived[:4], posting_plan(self._derived[3]))
            )
        posting = self._derived[4]
        assert posting is not None
        return posting


# A RunConfig's parts by field name: what its JSON nests (tplib.runtime.runfile).


@dataclass(frozen=True)
class Hooks:
    """Test and debugging hooks for a run; they do not change what it trains.

    ``collect_grads``: return the first iteration's gradients; ``collect_params``: the
    parameters after the last step. ``fault``: "raise:RANK" makes that rank raise at its
    first action, "hang:RANK" makes it stall there until it is killed. ``count_memory``:
    on CPU, count each stage's memory through saved-tensor hooks (a Python call per saved
    tensor; turn it off for timings that must not include it).
    """

    collect_grads: bool = False
    collect_params: bool = False
    fault: str = ""
    count_memory: bool = True

    def __post_init__(self) -> None:
        if self.fault:
            what, _, rank = (
                self.fault.partition(":") if isinstance(self.fault, str) else ("", "", "")
            )
            if what not in ("raise", "hang") or not rank.isdigit():
                raise ValueError(f"fault={self.fault!r}: expected 'raise:RANK' or 'hang:RANK'")

    @property
    def fault_rank(self) -> int | None:
        return int(self.fault.partition(":")[2]) if self.fault else None
