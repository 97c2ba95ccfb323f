"""What one training run is: :class:`RunConfig`, checked whole before any process starts.

A run names the model, the parallel layout (#Data replicas x #Pipe stages x #Op ranks),
the schedule and its slicing, recomputation, the precision and the optimiser. Constructing a :class:`RunConfig` checks every field
and builds and validates the schedule, so bad input fails here, with a message naming
the value and the rule, not in a worker process minutes later. It travels as JSON to
torchrun jobs (:mod:`tplib.runtime.runfile`).

:class:`Hooks` are what tests and debugging add to a run (collecting gradients and
parameters, injecting a fault); they are not part of what the run trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tplib.nn.configs import (
    GPTConfig,
    check_op,
    check_precision,
    check_recompute,
    check_run_numbers,
    get_config,
    padded_vocab,
)
from tplib.nn.layer_ranges import StageRange, balanced_stages, check_stage_ranges
from tplib.nn.lr import LR_SCHEDULES, LRSchedule
from tplib.plan import Plan
from tplib.schedule import Schedule, make_schedule, schedule_names
from tplib.schedule.nccl import PostingPlan, check_nccl, posting_plan

__all__ = [
    "DATA_SOURCES",
    "WEIGHT_DECAY_PARAMS",
    "Hooks",
    "RunConfig",
]

WEIGHT_DECAY_PARAMS = ("matrices", "all")
DATA_SOURCES = ("synthetic", "stdlib")
# The most (unit, stage) pairs a run's schedule may hold: every rank builds and validates
# the whole schedule (0.1-0.3 ms a pair on this machine), so batch=10**9 is refused at
# once, not after hours. Table 1's largest run holds a few ten thousand.
MAX_UNIT_STAGES = 1 << 18


@dataclass(frozen=True)
class RunConfig:
    """One training run: the model, the parallel layout, the schedule and the optimiser.

    The layout is the paper's: ``n_data`` (#Data) replicas of a pipeline of ``n_stages``
    (#Pipe) stages, each stage operation-partitioned over ``n_op`` (#Op) ranks; ranks are
    numbered op innermost, then stage, then replica, so under torchrun's
    ``--nproc-per-node`` a stage's #Op ranks are consecutive and share a node. Give
    ``ranks_per_node`` (the processes per node) and the config checks that they do.

    ``batch`` is B, the global batch of all ``n_data`` data-parallel replicas together;
    each pipeline trains ``pipeline_batch = batch // n_data`` sequences per iteration, cut
    into units by ``slicing``: a :class:`~tplib.plan.Plan` of ``pipeline_batch`` x
    ``seq_len``, or a number of equal token slices per sequence (batch slices of one
    sequence; 1 is GPipe's microbatches of one sequence). ``stage_ranges`` gives each
    stage's layers ``[lo, hi)`` (default: as equal as possible).

    The optimiser is GPT-3's (Brown et al., 2020, appendix B) by default: AdamW with
    betas (0.9, 0.95), eps 1e-8 and weight decay 0.1 on the matrices only
    (``weight_decay_params``), the gradient clipped to a global norm of ``grad_clip``
    (over the whole model, every stage, op rank and replica: what one device computes),
    and the learning rate warmed up linearly over ``lr_warmup_steps`` optimizer steps,
    then decayed with a cosine to ``min_lr_ratio * lr`` at step ``lr_decay_steps`` (by
    default ``warmup + steps``, the step after the run's last) and held there; see
    :mod:`tplib.nn.lr` for the exact formula (:attr:`lr_schedule_data`). Steps count every
    iteration, the untimed ``warmup`` ones included (that ``warmup`` is about timing, not
    the learning rate), and an fp16 step skipped on overflow still uses up its rate.

    An asynchronous ``schedule`` ("pipedream", "2bw"; see
    :mod:`tplib.schedule.asynchronous`) spans the run's ``warmup + steps`` iterations
    without a flush, one update per iteration; it needs ``grad_clip=0``.

    The derived values are computed once, when the config is made: :attr:`cfg` (the
    model config with ``model_overrides``), :attr:`plan`, :attr:`ranges` and the
    validated :attr:`schedule_data`.
    """

    model: str = "tiny"
    schedule: str = "terapipe"
    vertical_sync: bool = False  # pipedream only: every stage uses the entry version
    n_stages: int = 1
    n_data: int = 1
    n_op: int = 1
    batch: int = 1
    seq_len: int = 64
    slicing: Plan | int = 1
    stage_ranges: tuple[StageRange, ...] | None = None
    steps: int = 1
    warmup: int = 0  # iterations run before the timed ``steps``
    lr: float = 1e-3  # the peak learning rate, reached after the LR warm-up
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    adam_eps: float = 1e-8
    # Which parameters AdamW decays: "matrices" (ndim >= 2: product weights and the
    # embeddings; biases and LayerNorm gains and biases exempt, as GPT-3) | "all".
    weight_decay_params: str = "matrices"
    grad_clip: float = 1.0  # the global gradient norm is clipped to this; 0: no clipping
    lr_schedule: str = "cosine"  # "cosine" (warm-up, cosine decay, floor) | "constant"
    lr_warmup_steps: int = 2  # optimizer steps of linear LR warm-up (not ``warmup``)
    lr_decay_steps: int | None = None  # the step the cosine ends; None: warmup + steps
    min_lr_ratio: float = 0.1  # the cosine's floor, a fraction of ``lr``
    seed: int = 0  # model initialisation
    data_seed: int = 1  # iteration i trains on batch(seed=data_seed + i)
    data: str = "synthetic"  # "synthetic" (seeded random ids) | "stdlib" (byte-level text)
    device: str = "cpu"
    precision: str = "fp32"  # "fp32" | "bf16" (autocast) | "fp16" (CUDA: fp32 master weights)
    recompute: str = "none"  # "none" | "full" (keep only each unit's input; recompute)
    ranks_per_node: int = 0  # processes per node when the run spans nodes; 0: not said
    timeout_s: float = 180.0  # longest wait for any message or collective
    threads: int = 0  # torch threads per process; 0: this machine's cores split evenly
    model_overrides: tuple[tuple[str, object], ...] = ()
    # What __post_init__ derives: the model, plan, layer ranges, schedule and (made once,
    # on first use) where each stage posts its messages.
    _derived: tuple[GPTConfig, Plan, tuple[StageRange, ...], Schedule, PostingPlan | None] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_run_numbers(self)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"RunConfig.device={self.device!r}: choose 'cpu' or 'cuda'")
        check_precision(self.precision, self.device)
        self._check_optimiser()
        check_recompute(self.recompute)
        cfg = get_config(self.model, self.model_overrides)
        check_op(cfg, self.n_op)
        if self.ranks_per_node % self.n_op:
            raise ValueError(
                f"n_op={self.n_op} with ranks_per_node={self.ranks_per_node}: a stage's #Op "
                "ranks must lie on one node (operation partitioning stays inside a node), so "
                "#Op must divide the ranks per node"
            )
        if self.batch % self.n_data:
            raise ValueError(
                f"batch={self.batch} is not divisible by n_data={self.n_data}: "
                "every data-parallel replica trains the same number of sequences"
            )
        if self.seq_len > cfg.seq_len:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds the model's context of {cfg.seq_len} tokens"
            )
        plan = self._resolve_plan()
        plan.check_covers(self.pipeline_batch, self.seq_len)
        ranges = self.stage_ranges
        if ranges is None:
            ranges = balanced_stages(cfg.n_layer, self.n_stages)
        check_stage_ranges(cfg, ranges, self.n_stages)
        if self.data not in DATA_SOURCES:
            raise ValueError(f"RunConfig.data={self.data!r}: choose one of {DATA_SOURCES}")
        schedule = make_schedule(
            self.schedule,
            self.n_stages,
            plan,
            n_iterations=self.warmup + self.steps,
            vertical_sync=self.vertical_sync,
        )
        if schedule.asynchronous:
            self._check_asynchronous(cfg)
        posting = None
        if self.device == "cuda":  # NCCL: a send waits for its receive (tplib.schedule.nccl)
            posting = posting_plan(schedule)
            check_nccl(schedule, posting)
        object.__setattr__(self, "_derived", (cfg, plan, tuple(ranges), schedule, posting))

    def _check_asynchronous(self, cfg: GPTConfig) -> None:
        """What an asynchronous schedule cannot combine with, and why."""
        if self.grad_clip > 0:
            raise ValueError(
                f"schedule={self.schedule!r} with grad_clip={self.grad_clip}: clipping to the "
                "global gradient norm makes every stage wait for every other at each update, "
                "the flush an asynchronous schedule exists to avoid; set grad_clip=0"
            )
        if self.precision == "fp16":
            raise ValueError(
                f"schedule={self.schedule!r} with precision='fp16': skipping an overflowing "
                "step needs every stage to agree at each update (a flush); use 'bf16' or "
                "'fp32'"
            )
        if cfg.dropout > 0:
            raise ValueError(
                f"schedule={self.schedule!r} with dropout={cfg.dropout}: the runtime keys "
                "dropout masks by iteration, which asynchronous schedules do not do yet; "
                "set model_overrides dropout=0"
            )

    def _check_optimiser(self) -> None:
        if self.weight_decay_params not in WEIGHT_DECAY_PARAMS:
            raise ValueError(
                f"RunConfig.weight_decay_params={self.weight_decay_params!r}: choose one of "
                f"{WEIGHT_DECAY_PARAMS} ('matrices': parameters with ndim >= 2, as GPT-3)"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"RunConfig.lr_schedule={self.lr_schedule!r}: choose one of {LR_SCHEDULES}"
            )
        w = self.lr_warmup_steps
        d = self.lr_decay_steps
        if d is not None:
            if self.lr_schedule != "cosine":
                raise ValueError(
                    f"RunConfig.lr_decay_steps={d!r} with lr_schedule={self.lr_schedule!r}: "
                    "only the cosine schedule decays; leave it None"
                )
            if isinstance(d, bool) or not isinstance(d, int) or d < w:
                raise ValueError(
                    f"RunConfig.lr_decay_steps={d!r} must be an integer >= lr_warmup_steps="
                    f"{w}: the cosine ends at that step, counted from the first, warm-up "
                    "included"
                )

    @property
    def lr_schedule_data(self) -> LRSchedule:
        """The learning rate of every optimizer step (see :mod:`tplib.nn.lr`), with the decay's
        end resolved: ``lr_decay_steps``, by default the run's ``warmup + steps``."""
        decay = None
        if self.lr_schedule == "cosine":
            decay = self.lr_decay_steps
            if decay is None:
                # A run shorter than its warm-up never decays: any end >= W will do.
                decay = max(self.warmup + self.steps, self.lr_warmup_steps)
        return LRSchedule(
            self.lr,
            kind=self.lr_schedule,
            warmup_steps=self.lr_warmup_steps,
            decay_steps=decay,
            min_ratio=self.min_lr_ratio,
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
        if not 1 <= self.slicing <= self.seq_len:
            raise ValueError(
                f"RunConfig.slicing={self.slicing} token slices per sequence is outside "
                f"[1, seq_len={self.seq_len}]"
            )
        self._check_size(self.pipeline_batch * self.slicing)  # before the plan is built
        return Plan.uniform(self.pipeline_batch, self.seq_len, n_token_slices=self.slicing)

    def _check_size(self, units: int) -> None:
        """Refuse a schedule too large to build (see :data:`MAX_UNIT_STAGES`)."""
        asynchronous = self.schedule in schedule_names(asynchronous=True)
        spans = self.warmup + self.steps if asynchronous else 1
        if units * self.n_stages * spans > MAX_UNIT_STAGES:
            raise ValueError(
                f"{units} units per iteration x n_stages={self.n_stages}"
                + (f" x {spans} iterations" if spans > 1 else "")
                + f" make {units * self.n_stages * spans} (unit, stage) pairs, more than the "
                f"{MAX_UNIT_STAGES} a schedule may hold: use fewer, longer slices or a "
                "smaller batch"
            )

    @property
    def world_size(self) -> int:
        """#Data x #Pipe x #Op processes."""
        return self.n_data * self.n_stages * self.n_op

    @property
    def padded_vocab(self) -> int:
        """The vocabulary padded to a multiple of #Op (the embedding's and head's rows);
        padding rows are masked out of the loss, so the model computes the same."""
        return padded_vocab(self.cfg.vocab_size, self.n_op)

    def position(self, rank: int) -> tuple[int, int, int]:
        """(replica, stage, op rank) of global ``rank``."""
        return (
            rank // (self.n_stages * self.n_op),
            rank // self.n_op % self.n_stages,
            rank % self.n_op,
        )

    def rank_of(self, replica: int, stage: int, op_rank: int = 0) -> int:
        """Global rank of (replica, stage, op rank): op innermost, then stage, then replica."""
        return (replica * self.n_stages + stage) * self.n_op + op_rank

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless ``world_size`` processes are this run's layout."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} is not #Data x #Pipe x #Op = {self.n_data} x "
                f"{self.n_stages} x {self.n_op} = {self.world_size}"
            )

    @property
    def pipeline_batch(self) -> int:
        """B / #Data: the sequences one pipeline trains per iteration."""
        return self.batch // self.n_data

    @property
    def cfg(self) -> GPTConfig:
        return self._derived[0]

    @property
    def plan(self) -> Plan:
        return self._derived[1]

    @property
    def ranges(self) -> tuple[StageRange, ...]:
        """Each stage's layer range ``[lo, hi)``."""
        return self._derived[2]

    @property
    def schedule_data(self) -> Schedule:
        """The validated schedule every stage interprets."""
        return self._derived[3]

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
