"""What one training run is: :class:`RunConfig`, checked whole before any process starts.

A run names the model, the schedule and its slicing, recomputation and the precision,
and holds four parts, each a small frozen dataclass that checks its own fields:

=========================  ================================================================
part                       what it says
=========================  ================================================================
:class:`Parallelism`       the parallel layout: #Data replicas x #Pipe stages x #Op ranks,
                           the ranks per node, each stage's layers; where a rank sits
:class:`Data`              what each iteration trains on: B sequences of L tokens, their
                           source and seed
:class:`Optim`             the optimizer's recipe: AdamW's hyperparameters, gradient
                           clipping, the learning-rate schedule
:class:`Timing`            how long the run runs and waits: untimed and timed iterations,
                           the longest wait for a message, torch threads per process
=========================  ================================================================

What involves two parts, or a part and the model (the batch against #Data, the stages
against the model's layers, an asynchronous schedule against clipping), is checked by
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
    check_numbers,
    check_op,
    check_precision,
    check_recompute,
    get_config,
    is_finite,
    is_int_pair,
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
    "Data",
    "Hooks",
    "Optim",
    "Parallelism",
    "RunConfig",
    "Timing",
]

WEIGHT_DECAY_PARAMS = ("matrices", "all")
DATA_SOURCES = ("synthetic", "stdlib")
# The most (unit, stage) pairs a run's schedule may hold: every rank builds and validates
# the whole schedule (0.1-0.3 ms a pair on this machine), so batch=10**9 is refused at
# once, not after hours. Table 1's largest run holds a few ten thousand.
MAX_UNIT_STAGES = 1 << 18
SEEDS = (0, 2**63 - 1)  # what torch's generators take


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """The paper's layout of a run: ``n_data`` (#Data) replicas of a pipeline of
    ``n_stages`` (#Pipe) stages, each stage operation-partitioned over ``n_op`` (#Op) ranks.

    Ranks are numbered op innermost, then stage, then replica, so under torchrun's
    ``--nproc-per-node`` a stage's #Op ranks are consecutive and share a node. Give
    ``ranks_per_node`` (the processes per node) and the layout checks that they do.
    ``stage_ranges`` gives each stage's layers ``[lo, hi)`` (default: as equal as
    possible); whether they fit the model is the run's check, which knows the model.
    """

    n_stages: int = 1
    n_data: int = 1
    n_op: int = 1
    ranks_per_node: int = 0  # processes per node when the run spans nodes; 0: not said
    stage_ranges: tuple[StageRange, ...] | None = None

    def __post_init__(self) -> None:
        check_numbers(
            self,
            integers={
                **dict.fromkeys(("n_stages", "n_data", "n_op"), (1, None)),
                "ranks_per_node": (0, None),
            },
            reals={},
        )
        r = self.stage_ranges
        if r is not None and not (isinstance(r, tuple | list) and all(map(is_int_pair, r))):
            raise ValueError(
                f"Parallelism.stage_ranges={r!r} must be (lo, hi) integer pairs, one per stage"
            )
        if self.ranks_per_node % self.n_op:
            raise ValueError(
                f"n_op={self.n_op} with ranks_per_node={self.ranks_per_node}: a stage's #Op "
                "ranks must lie on one node (operation partitioning stays inside a node), so "
                "#Op must divide the ranks per node"
            )

    @property
    def world_size(self) -> int:
        """#Data x #Pipe x #Op processes."""
        return self.n_data * self.n_stages * self.n_op

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
        """Raise ``ValueError`` unless ``world_size`` processes are this layout."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} is not #Data x #Pipe x #Op = {self.n_data} x "
                f"{self.n_stages} x {self.n_op} = {self.world_size}"
            )


@dataclass(frozen=True, kw_only=True)
class Data:
    """What each iteration trains on: ``batch`` (B, the global batch of all replicas
    together) sequences of ``seq_len`` (L) tokens. Iteration i trains on the batch of seed
    ``seed + i`` from ``source``: "synthetic" (seeded random ids) or "stdlib" (byte-level
    text of the Python standard library, :mod:`tplib.nn.corpus`)."""

    batch: int = 1
    seq_len: int = 64
    source: str = "synthetic"
    seed: int = 1

    def __post_init__(self) -> None:
        check_numbers(
            self,
            integers={"batch": (1, None), "seq_len": (1, None), "seed": SEEDS},
            reals={},
        )
        if self.source not in DATA_SOURCES:
            raise ValueError(f"Data.source={self.source!r}: choose one of {DATA_SOURCES}")


@dataclass(frozen=True, kw_only=True)
class Optim:
    """The optimizer's recipe, GPT-3's (Brown et al., 2020, appendix B) by default: AdamW
    with betas (0.9, 0.95), eps 1e-8 and weight decay 0.1 on the matrices only
    (``weight_decay_params``), the gradient clipped to a global norm of ``grad_clip``
    (over the whole model, every stage, op rank and replica: what one device computes),
    and the learning rate warmed up linearly over ``lr_warmup_steps`` optimizer steps,
    then decayed with a cosine to ``min_lr_ratio * lr`` at step ``lr_decay_steps`` (by
    default the step after the run's last: :attr:`RunConfig.lr_schedule`) and held there;
    see :mod:`tplib.nn.lr` for the exact formula. Steps count every iteration, the untimed
    warm-up ones of :class:`Timing` included, and an fp16 step skipped on overflow still
    uses up its rate."""

    lr: float = 1e-3  # the peak learning rate, reached after the LR warm-up
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    adam_eps: float = 1e-8
    # Which parameters AdamW decays: "matrices" (ndim >= 2: product weights and the
    # embeddings; biases and LayerNorm gains and biases exempt, as GPT-3) | "all".
    weight_decay_params: str = "matrices"
    grad_clip: float = 1.0  # the global gradient norm is clipped to this; 0: no clipping
    # "cosine" (warm-up, cosine decay, floor) | "constant"; the schedule itself, which
    # needs the run's length, is RunConfig.lr_schedule.
    lr_schedule_name: str = "cosine"
    lr_warmup_steps: int = 2  # optimizer steps of linear LR warm-up (not Timing.warmup)
    lr_decay_steps: int | None = None  # the step the cosine ends; None: the run's end
    min_lr_ratio: float = 0.1  # the cosine's floor, a fraction of ``lr``

    def __post_init__(self) -> None:
        check_numbers(
            self,
            integers={"lr_warmup_steps": (0, None)},
            reals={
                "lr": (lambda x: x > 0, "be a finite positive learning rate"),
                "weight_decay": (lambda x: x >= 0, "be a finite weight decay >= 0"),
                "adam_eps": (lambda x: x > 0, "be a finite AdamW eps > 0"),
                "grad_clip": (lambda x: x >= 0, "be a finite norm >= 0 (0: no clipping)"),
                "min_lr_ratio": (
                    lambda x: 0 <= x <= 1,
                    "lie in [0, 1]: the cosine's floor, a share of lr",
                ),
            },
        )
        b = self.betas
        if not (
            isinstance(b, tuple | list)
            and len(b) == 2
            and all(is_finite(x) and 0 <= x < 1 for x in b)
        ):
            raise ValueError(f"Optim.betas={b!r} must be AdamW's two betas, each in [0, 1)")
        if self.weight_decay_params not in WEIGHT_DECAY_PARAMS:
            raise ValueError(
                f"Optim.weight_decay_params={self.weight_decay_params!r}: choose one of "
                f"{WEIGHT_DECAY_PARAMS} ('matrices': parameters with ndim >= 2, as GPT-3)"
            )
        if self.lr_schedule_name not in LR_SCHEDULES:
            raise ValueError(
                f"Optim.lr_schedule_name={self.lr_schedule_name!r}: choose one of {LR_SCHEDULES}"
            )
        w = self.lr_warmup_steps
        d = self.lr_decay_steps
        if d is not None:
            if self.lr_schedule_name != "cosine":
                raise ValueError(
                    f"Optim.lr_decay_steps={d!r} with lr_schedule_name="
                    f"{self.lr_schedule_name!r}: only the cosine schedule decays; leave it None"
                )
            if isinstance(d, bool) or not isinstance(d, int) or d < w:
                raise ValueError(
                    f"Optim.lr_decay_steps={d!r} must be an integer >= lr_warmup_steps={w}: "
                    "the cosine ends at that step, counted from the first, warm-up included"
                )


@dataclass(frozen=True, kw_only=True)
class Timing:
    """How long a run runs and waits: ``warmup`` untimed iterations, then ``steps`` timed
    ones (every one trains); ``timeout_s``, the longest any process waits for a message or
    a collective; ``threads``, torch's threads per process (0: this machine's cores split
    evenly between the run's processes)."""

    steps: int = 1
    warmup: int = 0  # iterations run before the timed ``steps``
    timeout_s: float = 180.0
    threads: int = 0

    def __post_init__(self) -> None:
        check_numbers(
            self,
            integers={"steps": (1, None), "warmup": (0, None), "threads": (0, None)},
            reals={"timeout_s": (lambda x: x > 0, "be positive seconds, finite")},
        )

    @property
    def iterations(self) -> int:
        """Every iteration the run trains: ``warmup + steps``."""
        return self.warmup + self.steps


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
    parallelism: Parallelism = Parallelism()
    data: Data = Data()
    optim: Optim = Optim()
    timing: Timing = Timing()
    seed: int = 0  # model initialisation
    device: str = "cpu"
    precision: str = "fp32"  # "fp32" | "bf16" (autocast) | "fp16" (CUDA: fp32 master weights)
    recompute: str = "none"  # "none" | "full" (keep only each unit's input; recompute)
    # What __post_init__ derives: the model, plan, layer ranges, schedule and (made once,
    # on first use) where each stage posts its messages.
    _derived: tuple[GPTConfig, Plan, tuple[StageRange, ...], Schedule, PostingPlan | None] = field(
        init=False, repr=False, compare=False
    )

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
        if ranges is None:
            ranges = balanced_stages(cfg.n_layer, parallelism.n_stages)
        check_stage_ranges(cfg, ranges, parallelism.n_stages)
        schedule = make_schedule(
            self.schedule_name,
            parallelism.n_stages,
            plan,
            n_iterations=self.timing.iterations,
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
        name = self.schedule_name
        if self.optim.grad_clip > 0:
            raise ValueError(
                f"schedule_name={name!r} with grad_clip={self.optim.grad_clip}: clipping to "
                "the global gradient norm makes every stage wait for every other at each "
                "update, the flush an asynchronous schedule exists to avoid; set "
                "Optim(grad_clip=0)"
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
        n_stages = self.parallelism.n_stages
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
        """Each stage's layer range ``[lo, hi)``."""
        return self._derived[2]

    @property
    def schedule(self) -> Schedule:
        """The validated schedule every stage interprets, built from ``schedule_name``."""
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


# A RunConfig's parts by field name: what its JSON nests (tplib.runtime.runfile).
PARTS: dict[str, type[Parallelism | Data | Optim | Timing]] = {
    "parallelism": Parallelism,
    "data": Data,
    "optim": Optim,
    "timing": Timing,
}


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
