"""Which torch.distributed backend a run uses, and which GPU each rank makes current.

NCCL moves GPU tensors directly, but only between ranks on distinct GPUs: a communicator
with two ranks on one GPU fails. gloo works everywhere; with CUDA tensors the runtime
stages them through host memory (:mod:`tplib.runtime.groups`). So the rule is:

* device ``"cpu"``: gloo, always;
* device ``"cuda"``: NCCL when no two ranks share a physical GPU, gloo otherwise.

Locally, rank ``r`` takes GPU ``r % device_count``, so ranks share one exactly when the
machine has fewer GPUs than the run has ranks. Under torchrun a rank takes GPU
``LOCAL_RANK % device_count`` of those it sees, and what it sees is the scheduler's
business (SLURM's ``--gpus-per-task=1`` shows each process one device, its "GPU 0"): so
the ranks compare the UUIDs of their GPUs instead (:mod:`tplib.runtime.torchrun`).

A backend can be asked for (``--backend``, ``launch(..., backend=...)``); one that
cannot work is refused, naming the rule, before any process group starts. Everything
here is pure: the tests feed it fake UUIDs and GPU counts.

A rank makes a GPU current only when it will use CUDA (:func:`needs_gpu`): a CPU run on a
GPU node creates no CUDA context and takes no GPU memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BACKENDS",
    "RULE",
    "BackendChoice",
    "BackendError",
    "choose_backend",
    "gpu_index",
    "local_gpus",
    "needs_gpu",
]

BACKENDS = ("nccl", "gloo")
RULE = "gloo on CPU; on CUDA, NCCL when no two ranks share a GPU, else gloo (staged)"


class BackendError(ValueError):
    """A backend that cannot run the run: the message names the values and the rule."""


@dataclass(frozen=True)
class BackendChoice:
    """The backend a run uses and why, in words (what rank 0 prints)."""

    backend: str
    reason: str

    def __str__(self) -> str:
        return f"backend {self.backend}: {self.reason}"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:4])) + (
        f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
    )


def choose_backend(
    device: str, world_size: int, gpus: Sequence[str] = (), asked: str | None = None
) -> BackendChoice:
    """The backend of a run of ``world_size`` ranks on ``device``, where rank ``r`` uses
    GPU ``gpus[r]`` (any label naming one physical GPU: its UUID; unused on CPU), or
    ``asked`` if it can work (:class:`BackendError` if not)."""
    if asked is not None and asked not in BACKENDS:
        raise BackendError(
            f"backend={asked!r}: choose 'nccl' or 'gloo', or leave it out for the rule: {RULE}"
        )
    how = ", as asked" if asked else ""
    if device != "cuda":
        if asked == "nccl":
            raise BackendError(
                f"backend 'nccl' for a run on device {device!r}: NCCL moves GPU tensors only, "
                f"so a CPU run uses gloo (the rule: {RULE})"
            )
        return BackendChoice("gloo", f"{world_size} ranks on CPU{how}; NCCL moves GPU tensors only")
    if len(gpus) != world_size:
        raise ValueError(f"{len(gpus)} GPUs given for {world_size} ranks: one per rank")
    by_gpu: dict[str, list[int]] = {}
    for rank, gpu in enumerate(gpus):
        by_gpu.setdefault(gpu, []).append(rank)
    shared = [ranks for ranks in by_gpu.values() if len(ranks) > 1]
    if not shared:
        if asked == "gloo":
            return BackendChoice(
                "gloo",
                f"{world_size} ranks on GPUs of their own{how}, tensors staged through host memory",
            )
        return BackendChoice("nccl", f"{world_size} ranks, each with a GPU of its own{how}")
    first = shared[0]
    sharing = f"ranks {_ranks(first)} share GPU {gpus[first[0]]}" + (
        f" ({sum(map(len, shared))} ranks on {len(shared)} shared GPUs)" if len(shared) > 1 else ""
    )
    if asked == "nccl":
        raise BackendError(
            f"backend 'nccl' with {sharing}: NCCL refuses two ranks of a communicator on one "
            f"GPU (the rule: {RULE}). Give each rank a GPU of its own (no more processes per "
            "node than GPUs), or use gloo, which stages tensors through host memory"
        )
    return BackendChoice(
        "gloo", f"{sharing}{how}, which NCCL refuses; tensors staged through host memory"
    )


def gpu_index(local_rank: int, device_count: int) -> int:
    """The GPU, of those this process sees, that local rank ``local_rank`` makes
    current: one each in turn, as many ranks per GPU as it takes."""
    if device_count < 1:
        raise BackendError(
            f"device 'cuda', but this process sees {device_count} GPUs "
            "(torch.cuda.device_count()): run on device 'cpu', or check CUDA_VISIBLE_DEVICES"
        )
    return local_rank % device_count


def local_gpus(device: str, world_size: int, device_count: int) -> list[str]:
    """What each rank of a run on this machine uses: rank ``r`` GPU ``r % device_count``
    (no GPU on CPU). A machine's own device indices name distinct GPUs."""
    if device != "cuda":
        return []
    return [f"cuda:{gpu_index(rank, device_count)}" for rank in range(world_size)]


def needs_gpu(backend: str, device: str | None) -> bool:
    """Whether a rank must make a GPU current: NCCL binds its communicator to it when the
    group starts, and a run on device "cuda" computes there. ``device`` None: no run yet
    (a pool that has only started). Otherwise the rank stays off CUDA altogether."""
    return backend == "nccl" or device == "cuda"
