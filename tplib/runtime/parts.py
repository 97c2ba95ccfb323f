"""The parts of a run (:class:`~tplib.runtime.runconfig.RunConfig`), each a small frozen
dataclass that checks its own fields when it is made:

=========================  ================================================================
part                       what it says
=========================  ================================================================
:class:`Parallelism`       the parallel layout: #Data replicas x #Pipe stages x #CP x #Op
                           ranks, the ranks per node, each stage's layers; where a rank sits
:class:`Data`              what each iteration trains on: B sequences of L tokens, their
                           source and seed
:class:`Optim`             the optimizer's recipe: AdamW's hyperparameters, gradient
                           clipping, the learning-rate schedule
:class:`Timing`            how long the run runs and waits: untimed and timed iterations,
                           the longest wait for a message, torch threads per process
=========================  ================================================================

:data:`PARTS` names them as a run holds them (``run.parallelism``, ...), as its JSON
does too (:mod:`tplib.runtime.runfile`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tplib.nn.configs import check_numbers, is_finite, is_int_pair
from tplib.nn.layer_ranges import StageRange
from tplib.nn.lr import LR_SCHEDULES
from tplib.packing import DOCUMENT_SOURCES, PACKINGS

__all__ = ["PARTS", "WEIGHT_DECAY_PARAMS", "Data", "Optim", "Parallelism", "Timing"]

WEIGHT_DECAY_PARAMS = ("matrices", "all")
_DATA_SOURCES = ("synthetic", "stdlib", *DOCUMENT_SOURCES)
SEEDS = (0, 2**63 - 1)  # what torch's generators take


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """The paper's layout of a run: ``n_data`` (#Data) replicas of a pipeline of
    ``n_stages`` (#Pipe) stages, each stage operation-partitioned over ``n_op`` (#Op) ranks,
    and with ``n_cp`` (#CP) > 1 each of those again over #CP ranks of context parallelism
    (:mod:`tplib.nn.ring`: each holds 2 of every token slice's 2 x #CP chunks).

    Ranks are numbered op innermost, then CP rank, then stage, then replica (Megatron's
    order: context parallelism between tensor and pipeline parallelism), so under
    torchrun's ``--nproc-per-node`` a stage's #Op ranks are consecutive and share a node.
    Give ``ranks_per_node`` (the processes per node) and the layout checks that they do.
    ``stage_ranges`` gives each stage's layers ``[lo, hi)`` (default: as equal as
    possible); whether they fit the model is the run's check, which knows the model.

    ``n_chunks`` (v) gives each stage v chunks of the model, virtual pipeline stages
    (:mod:`tplib.schedule.chunks`), for the schedules that place them: the model is cut
    into v x #Pipe parts, and ``stage_ranges`` then gives one range per part, in model
    order.

    ``sequence_parallel`` (Korthikanti et al., 2022) splits what lies between a stage's
    tensor-parallel products, the LayerNorms, dropouts and residual adds, along the
    tokens over its #Op ranks (:mod:`tplib.nn.oppart`): it needs #Op > 1, and every
    token slice's length divisible by #Op (the run's check, which knows the slicing).
    ``distributed_optimizer`` shards the optimizer state over the #Data replicas of each
    (stage, op rank), as Megatron's distributed optimizer (ZeRO stage 1,
    :mod:`tplib.nn.sharded_optimizer`): the gradients are reduce-scattered instead of
    all-reduced, each replica steps its shard, and the parameters are all-gathered.
    """

    n_stages: int = 1
    n_data: int = 1
    n_op: int = 1
    n_cp: int = 1
    ranks_per_node: int = 0  # processes per node when the run spans nodes; 0: not said
    stage_ranges: tuple[StageRange, ...] | None = None
    n_chunks: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        check_numbers(
            self,
            integers={
                **dict.fromkeys(("n_stages", "n_data", "n_op", "n_cp", "n_chunks"), (1, None)),
                "ranks_per_node": (0, None),
            },
            reals={},
        )
        r = self.stage_ranges
        if r is not None and not (isinstance(r, tuple | list) and all(map(is_int_pair, r))):
            raise ValueError(
                f"Parallelism.stage_ranges={r!r} must be (lo, hi) integer pairs, one per stage"
            )
        if not isinstance(self.distributed_optimizer, bool):
            raise ValueError(
                f"Parallelism.distributed_optimizer={self.distributed_optimizer!r} must be "
                "True or False"
            )
        if self.ranks_per_node % self.n_op:
            raise ValueError(
                f"n_op={self.n_op} with ranks_per_node={self.ranks_per_node}: a stage's #Op "
                "ranks must lie on one node (operation partitioning stays inside a node), so "
                "#Op must divide the ranks per node"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"Parallelism.sequence_parallel={self.sequence_parallel!r} must be True or False"
            )
        if self.sequence_parallel and self.n_op == 1:
            raise ValueError(
                "sequence_parallel=True with n_op=1: sequence parallelism splits the tokens "
                "over a stage's #Op ranks, so it needs #Op > 1"
            )

    @property
    def n_parts(self) -> int:
        """v x #Pipe: the parts the model is cut into."""
        return self.n_chunks * self.n_stages

    @property
    def world_size(self) -> int:
        """#Data x #Pipe x #CP x #Op processes."""
        return self.n_data * self.n_stages * self.n_cp * self.n_op

    def position(self, rank: int) -> tuple[int, int, int, int]:
        """(replica, stage, op rank, CP rank) of global ``rank``."""
        op_cp = self.n_op * self.n_cp
        return (
            rank // (self.n_stages * op_cp),
            rank // op_cp % self.n_stages,
            rank % self.n_op,
            rank // self.n_op % self.n_cp,
        )

    def rank_of(self, replica: int, stage: int, op_rank: int = 0, cp_rank: int = 0) -> int:
        """Global rank of (replica, stage, op rank, CP rank): op innermost, then CP rank,
        then stage, then replica."""
        return ((replica * self.n_stages + stage) * self.n_cp + cp_rank) * self.n_op + op_rank

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless ``world_size`` processes are this layout."""
        if world_size != self.world_size:
            cp = (" x #CP", f" x {self.n_cp}") if self.n_cp > 1 else ("", "")
            raise ValueError(
                f"world size {world_size} is not #Data x #Pipe{cp[0]} x #Op = {self.n_data} x "
                f"{self.n_stages}{cp[1]} x {self.n_op} = {self.world_size}"
            )


@dataclass(frozen=True, kw_only=True)
class Data:
    """What each iteration trains on: ``batch`` (B, the global batch of all replicas
    together) sequences of ``seq_len`` (L) tokens. Iteration i trains on the batch of seed
    ``seed + i`` from ``source``: "synthetic" (seeded random ids) or "stdlib" (byte-level
    text of the Python standard library, :mod:`tplib.nn.corpus`), or rows of whole
    documents (:data:`~tplib.packing.DOCUMENT_SOURCES`: each stdlib file, or seeded
    log-normal lengths) placed by ``packing`` (:data:`~tplib.packing.PACKINGS`: packed
    first-fit decreasing or greedily, or one document per row padded to L), attention
    kept within documents unless ``document_masking`` is off."""

    batch: int = 1
    seq_len: int = 64
    source: str = "synthetic"
    seed: int = 1
    packing: str = "ffd"
    document_masking: bool = True

    def __post_init__(self) -> None:
        check_numbers(
            self,
            integers={"batch": (1, None), "seq_len": (1, None), "seed": SEEDS},
            reals={},
        )
        if self.source not in _DATA_SOURCES:
            raise ValueError(f"Data.source={self.source!r}: choose one of {_DATA_SOURCES}")
        if self.packing not in PACKINGS:
            raise ValueError(f"Data.packing={self.packing!r}: choose one of {PACKINGS}")
        if not isinstance(self.document_masking, bool):
            raise ValueError(f"Data.document_masking={self.document_masking!r}: True or False")

    @property
    def packed(self) -> bool:
        """Rows of documents, with boundaries (:data:`~tplib.packing.DOCUMENT_SOURCES`)."""
        return self.source in DOCUMENT_SOURCES


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


PARTS: dict[str, type[Parallelism | Data | Optim | Timing]] = {
    "parallelism": Parallelism,
    "data": Data,
    "optim": Optim,
    "timing": Timing,
}
